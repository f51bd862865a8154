"""Fuzzing: the frame parser and codec pipelines, the config loader, the vLLM connector's settings decoding.

The harness is ``tiercache.testing.harness.fuzz`` (the tests run it briefly); this script runs it in full:
``python benchmarks/fuzz.py --help``.
"""

import sys

from tiercache.testing.harness.fuzz import main

if __name__ == "__main__":
    sys.exit(main())
