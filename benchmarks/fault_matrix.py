"""Fault matrix: every backend x fault on the real vLLM path (prefill and decode vLLM processes).

The harness is ``tiercache.testing.harness.fault_matrix`` (the tests run a few cells); this script runs it on
this checkout's e2e scripts (``tests/e2e``): ``python benchmarks/fault_matrix.py --help``.
"""

import sys
from pathlib import Path

from tiercache.testing.harness.fault_matrix import main

E2E = Path(__file__).resolve().parent.parent / "tests" / "e2e"

if __name__ == "__main__":
    sys.exit(main(["--e2e", str(E2E), *sys.argv[1:]]))
