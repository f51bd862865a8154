"""What the scripts in ``benchmarks/`` share: the integration tests' server launchers and
tiercache.cli.bench's measuring helpers (timing, GB/s, ratios, host info). Importing it puts
``tests/integration`` on the path.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_SERVERS = str(ROOT / "tests" / "integration")
if _SERVERS not in sys.path:
    sys.path.insert(0, _SERVERS)

from s3_servers import TEST_ENV as S3_TEST_ENV  # noqa: E402
from s3_servers import MotoServer  # noqa: E402
from servers import ServerProcess, free_port, load_by_path, port_open, start_process  # noqa: E402

from tiercache.cli.bench.measure import best, best_median, gbps, host_info, paired, percentiles, ratio  # noqa: E402

__all__ = [
    "ROOT",
    "S3_TEST_ENV",
    "MotoServer",
    "ServerProcess",
    "best",
    "best_median",
    "free_port",
    "gbps",
    "host_info",
    "load_by_path",
    "paired",
    "percentiles",
    "port_open",
    "ratio",
    "start_process",
]
