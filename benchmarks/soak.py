"""Soak: a store/lookup/retrieve loop through L1 + a Redis tier + a POSIX tier, with faults injected.

The harness is ``tiercache.testing.harness.soak`` (the tests run it briefly); this script runs it in full:
``python benchmarks/soak.py --help``.
"""

import sys

from tiercache.testing.harness.soak import main

if __name__ == "__main__":
    sys.exit(main())
