"""What the scripts in ``benchmarks/`` share: the repository root, the test harness's server launchers
(``tiercache.testing.harness``) and tiercache.cli.bench's measuring helpers (timing, GB/s, ratios, host info).
"""

from __future__ import annotations

from pathlib import Path

from tiercache.cli.bench.measure import best, best_median, gbps, host_info, paired, percentiles, ratio
from tiercache.testing.harness.processes import ServerProcess, free_port, port_open, start_process
from tiercache.testing.harness.s3 import TEST_ENV as S3_TEST_ENV
from tiercache.testing.harness.s3 import MotoServer
from tiercache.testing.harness.scripts import load_by_path

ROOT = Path(__file__).resolve().parent.parent

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
