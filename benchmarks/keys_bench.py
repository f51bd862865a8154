"""Key hashing and POSIX tier speed against the raw library calls, measured side by side in one run.

    python benchmarks/keys_bench.py [--tokens 131072] [--repeats 20]

Prints JSON. The hashing measurement is ``tiercache.cli.bench.keys.hashing``
(``tiercache bench keys`` plots it).
Goals: hashing >= 80 % of raw hashlib.sha256 over the same bytes; POSIX put/get
>= 90 % of raw os.write/os.read of the same sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tiercache.cli.bench.keys import hashing

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-posix", action="store_true")
    args = parser.parse_args()
    result: dict[str, Any] = {"hashing": hashing(args.tokens, args.chunk_size, args.repeats)}
    if not args.skip_posix:
        from posix_bench import posix_vs_raw

        result["posix"] = posix_vs_raw()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
