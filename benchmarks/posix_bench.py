"""PosixAdapter vs raw ``os.write``/``os.read`` on the same directory: put/get GB/s and their ratios.

Both sides write fresh files of the same sizes with the same crash-safety (a temp file renamed over the name;
with ``--fsync`` the file and its directory fsynced) and read them back from the page cache. Two modes: one
key per call (sequential like the raw loop, so it pays one thread hop per object; ``raw_put_thread`` is the
raw write called through one thread hop, what any caller on an event loop pays), and batched (one
batched_put/get of all objects, as the storage manager calls it, against the same raw loop). Per-key
operations alternate raw/adapter object by object, so drift in a shared machine hits both
alike; the figures are totals over all rounds.

Run: ``python benchmarks/posix_bench.py [--sizes 1MiB,4MiB,32MiB] [--repeats N] [--rounds R] [--fsync]
[--dir PATH]`` prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["posix_vs_raw"]


def _raw_write(path: str, data: bytes, fsync: bool) -> None:
    """What a crash-safe put must do at least, as the adapter does: a temp file, its fsync (with ``fsync``),
    a rename over the final name and the directory's fsync (with ``fsync``)."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _raw_read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, size)
        if len(data) < size:  # large reads may come back short
            rest = [data]
            got = len(data)
            while got < size:
                part = os.read(fd, size - got)
                if not part:
                    break
                rest.append(part)
                got += len(part)
            data = b"".join(rest)
        return data
    finally:
        os.close(fd)


def _clear(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)


async def _measure(
    sizes: Sequence[int], repeats: int | None, rounds: int, fsync: bool, base: str
) -> dict[str, Any]:
    from tiercache.adapters.posix import PosixAdapter

    raw_dir = os.path.join(base, "raw")
    store_dir = os.path.join(base, "store")
    results: dict[str, Any] = {}
    for size in sizes:
        n = repeats or max(4, min(64, (512 << 20) // size))
        data = os.urandom(size)
        keys = [f"bench-{size}-{i}" for i in range(n)]
        totals = {
            name: 0.0
            for name in (
                "raw_put",
                "raw_put_thread",
                "posix_put",
                "raw_get",
                "posix_get",
                "raw_get_batch",
                "posix_get_batch",
                "raw_put_batch",
                "posix_put_batch",
            )
        }
        clock = time.perf_counter
        for _ in range(rounds):
            _clear(raw_dir)
            _clear(store_dir)
            adapter = await PosixAdapter.open(f"file://{store_dir}", fsync=fsync)
            hop = ThreadPoolExecutor(1)  # the same raw write from a thread, as any async caller must
            loop = asyncio.get_running_loop()
            try:
                # Operations alternate raw / adapter one object at a time, so the (often large) drift of a
                # shared machine's page cache and writeback hits both sides alike.
                for i, key in enumerate(keys):
                    t0 = clock()
                    _raw_write(os.path.join(raw_dir, f"f{i}"), data, fsync)
                    t1 = clock()
                    ok = await adapter.batched_put([key], [data])
                    t2 = clock()
                    await loop.run_in_executor(hop, _raw_write, os.path.join(raw_dir, f"t{i}"), data, fsync)
                    t3 = clock()
                    if ok != [True]:
                        raise RuntimeError(f"put of {key} failed")
                    totals["raw_put"] += t1 - t0
                    totals["posix_put"] += t2 - t1
                    totals["raw_put_thread"] += t3 - t2
                await adapter.batched_get(keys)  # warm the page cache for both sides
                for i in range(n):
                    _raw_read(os.path.join(raw_dir, f"f{i}"))
                for i, key in enumerate(keys):
                    t0 = clock()
                    raw = _raw_read(os.path.join(raw_dir, f"f{i}"))
                    t1 = clock()
                    (value,) = await adapter.batched_get([key])
                    t2 = clock()
                    if value is None or len(value) != size or len(raw) != size:
                        raise RuntimeError(f"get of {key} failed")
                    del raw, value
                    totals["raw_get"] += t1 - t0
                    totals["posix_get"] += t2 - t1
                # Batched, as the storage manager calls it: one batched_put/get of all objects against a raw
                # sequential loop over the same objects (the adapter may overlap I/O on its threads).
                t0 = clock()
                raw_values = [_raw_read(os.path.join(raw_dir, f"f{i}")) for i in range(n)]  # kept, as a
                t1 = clock()  # batch's results are kept until decoded (same memory footprint as the adapter)
                del raw_values
                values = await adapter.batched_get(keys)
                t2 = clock()
                if any(v is None or len(v) != size for v in values):
                    raise RuntimeError("batched get failed")
                del values
                totals["raw_get_batch"] += t1 - t0
                totals["posix_get_batch"] += t2 - t1
                t0 = clock()
                for i in range(n):
                    _raw_write(os.path.join(raw_dir, f"b{i}"), data, fsync)
                t1 = clock()
                ok_all = await adapter.batched_put([f"{k}-b" for k in keys], [data] * n)
                t2 = clock()
                if not all(ok_all):
                    raise RuntimeError("batched put failed")
                totals["raw_put_batch"] += t1 - t0
                totals["posix_put_batch"] += t2 - t1
            finally:
                hop.shutdown()
                await adapter.aclose()
        volume = size * n * rounds / 1e9
        med = {name: volume / seconds for name, seconds in totals.items()}
        results[str(size)] = {
            "objects": n,
            "rounds": rounds,
            "raw_put_GBps": round(med["raw_put"], 3),
            "posix_put_GBps": round(med["posix_put"], 3),
            "put_ratio": round(med["posix_put"] / med["raw_put"], 3),
            "raw_put_thread_GBps": round(med["raw_put_thread"], 3),
            "put_ratio_vs_raw_in_a_thread": round(med["posix_put"] / med["raw_put_thread"], 3),
            "raw_get_GBps": round(med["raw_get"], 3),
            "posix_get_GBps": round(med["posix_get"], 3),
            "get_ratio": round(med["posix_get"] / med["raw_get"], 3),
            "batched_put_ratio": round(med["posix_put_batch"] / med["raw_put_batch"], 3),
            "batched_get_ratio": round(med["posix_get_batch"] / med["raw_get_batch"], 3),
            "batched_posix_get_GBps": round(med["posix_get_batch"], 3),
            "batched_posix_put_GBps": round(med["posix_put_batch"], 3),
        }
    _clear(raw_dir)
    _clear(store_dir)
    return results


def posix_vs_raw(
    sizes: Sequence[int] = (1 << 20, 4 << 20, 32 << 20),
    repeats: int | None = None,
    *,
    rounds: int = 5,
    fsync: bool = False,
    directory: str | None = None,
) -> dict[str, Any]:
    """Put/get GB/s of PosixAdapter and of raw os.write/os.read per object size, with posix/raw ratios.

    ``repeats`` objects per size and round (default: about 512 MiB per round, 4..64 objects), ``rounds``
    rounds (throughput = total bytes / total time). Files go to a fresh temp directory under ``directory``.
    """
    load_before = round(os.getloadavg()[0], 2)  # ratios are unreliable on a machine busy with other work
    base = tempfile.mkdtemp(prefix="tiercache-posix-bench-", dir=directory)
    try:
        per_size = asyncio.run(_measure(sizes, repeats, rounds, fsync, base))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {
        "benchmark": "posix_vs_raw",
        "fsync": fsync,
        "directory": directory or tempfile.gettempdir(),
        "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "sizes": per_size,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: print the JSON of ``posix_vs_raw``."""
    from tiercache.adapters.options import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", default="1MiB,4MiB,32MiB", help="comma-separated sizes (e.g. 1MiB,4MiB)")
    parser.add_argument("--repeats", type=int, default=None, help="objects per size and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per size (totals reported)")
    parser.add_argument("--fsync", action="store_true", help="fsync every object (both sides)")
    parser.add_argument("--dir", default=None, help="parent directory for the temp files")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    result = posix_vs_raw(sizes, args.repeats, rounds=args.rounds, fsync=args.fsync, directory=args.dir)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
