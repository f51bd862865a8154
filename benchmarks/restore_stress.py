"""Restores under stress: every restored token bit-exact whatever the timing (hits may shrink, never err).

The harness is ``tiercache.testing.harness.restore_stress`` (the tests run it briefly); this script runs it
in full: ``python benchmarks/restore_stress.py --help``.
"""

import sys

from tiercache.testing.harness.restore_stress import main

if __name__ == "__main__":
    sys.exit(main())
