"""PosixAdapter vs raw ``os.write``/``os.read`` on the same directory: put/get GB/s and their ratios.

Both sides write fresh files of the same sizes with the same crash-safety (a temp file renamed over the name;
with ``--fsync`` the file and its directory fsynced) and read them back from the page cache. Two modes: one
key per call, and batched (one batched_put/get of all objects, as the storage manager calls it, against the
same raw sequential loop).

Per-key puts, five kinds interleaved object by object in a shuffled order (so a shared machine's drift hits
all alike, and no kind always follows the same other): ``raw_put`` (the raw write inline into one flat
directory made at the start of the round: the baseline, what a program writing its own files does),
``raw_put_sharded`` (the same raw write into the directory where the adapter puts the same key, under
another name: like for like, the same directories and so the same inode groups of the filesystem, which is
where a create's cost varies most),
``posix_put`` (the adapter into a store opened at the start of the round, as a user's first puts),
``posix_put_warm_tree`` (the adapter for keys whose directories were written to before, as in a store that
has been running), ``raw_put_thread`` (the raw write through one thread hop, what an event loop caller that
hands every write to a thread pays). ``put_ratio*`` are adapter / raw speeds from totals over all rounds;
``*_median`` from the median durations; ``put_p50_us`` the median durations; ``inline_put_share`` the share
of adapter puts written on the loop thread. ``--shard-depth`` sets the adapter's (default: its own).

Run: ``python benchmarks/posix_bench.py [--sizes 1MiB,4MiB,32MiB] [--repeats N] [--rounds R] [--fsync]
[--dir PATH] [--runs K] [--shard-depth D]`` prints JSON (with ``--runs``: the last run, plus each ratio's
value per run and its median over runs).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from _common import load_fields, parse_sizes, sizes_parser

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


_PER_KEY = ("raw_put", "posix_put", "raw_put_thread", "posix_put_warm_tree", "raw_put_sharded")


def _median(samples: Sequence[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


async def _per_key_puts(
    adapter: Any,
    hop: ThreadPoolExecutor,
    data: bytes,
    keys: Sequence[str],
    warm_keys: Sequence[str],
    raw_dir: str,
    fsync: bool,
    totals: dict[str, float],
    samples: dict[str, list[float]],
    order: random.Random,
) -> None:
    """One put per key of each ``_PER_KEY`` kind, object by object; adds each duration to ``totals`` and
    ``samples``. The order of the kinds is shuffled per object, so the (often large) drift of a shared
    machine's page cache and writeback hits every side alike."""
    loop = asyncio.get_running_loop()

    async def raw_put(i: int) -> None:
        _raw_write(os.path.join(raw_dir, f"f{i}"), data, fsync)

    async def raw_put_sharded(i: int) -> None:  # next to the adapter's object of the same key
        directory = os.path.dirname(adapter._path(keys[i]))
        try:
            _raw_write(os.path.join(directory, f"raw-{i}"), data, fsync)
        except FileNotFoundError:  # a deeper layout's leaf not made yet: made here, as the adapter does
            os.makedirs(directory, exist_ok=True)
            _raw_write(os.path.join(directory, f"raw-{i}"), data, fsync)

    async def posix_put(i: int) -> None:
        if await adapter.batched_put([keys[i]], [data]) != [True]:
            raise RuntimeError(f"put of {keys[i]} failed")

    async def raw_put_thread(i: int) -> None:
        await loop.run_in_executor(hop, _raw_write, os.path.join(raw_dir, f"t{i}"), data, fsync)

    async def posix_put_warm_tree(i: int) -> None:
        if await adapter.batched_put([warm_keys[i]], [data]) != [True]:
            raise RuntimeError(f"put of {warm_keys[i]} failed")

    ops = [raw_put, posix_put, raw_put_thread, posix_put_warm_tree, raw_put_sharded]
    clock = time.perf_counter
    for i in range(len(keys)):
        for op in order.sample(ops, len(ops)):
            t0 = clock()
            await op(i)
            took = clock() - t0
            totals[op.__name__] += took
            samples[op.__name__].append(took)


async def _measure(
    sizes: Sequence[int], repeats: int | None, rounds: int, fsync: bool, base: str, shard_depth: int | None
) -> dict[str, Any]:
    from tiercache.adapters.posix import PosixAdapter

    raw_dir = os.path.join(base, "raw")
    store_dir = os.path.join(base, "store")
    results: dict[str, Any] = {}
    order = random.Random(0)
    depth = {} if shard_depth is None else {"shard_depth": shard_depth}
    for size in sizes:
        n = repeats or max(4, min(64, (512 << 20) // size))
        data = os.urandom(size)
        keys = [f"bench-{size}-{i}" for i in range(n)]
        warm_keys = [f"warm-{size}-{i}" for i in range(n)]
        totals = dict.fromkeys(
            (
                *_PER_KEY,
                "raw_get",
                "posix_get",
                "raw_get_batch",
                "posix_get_batch",
                "raw_put_batch",
                "posix_put_batch",
            ),
            0.0,
        )
        samples: dict[str, list[float]] = {name: [] for name in _PER_KEY}
        clock = time.perf_counter
        inline_puts = 0
        for _ in range(rounds):
            _clear(raw_dir)
            _clear(store_dir)
            adapter = await PosixAdapter.open(f"file://{store_dir}", fsync=fsync, **depth)
            hop = ThreadPoolExecutor(1)  # the same raw write from a thread, as any async caller must
            # The warm keys' shard directories have been written to (as in a store that has been running): a
            # tiny object put and deleted (with two levels it leaves their leaf directories behind).
            await adapter.batched_put(warm_keys, [b"x"] * n)
            await adapter.batched_delete(warm_keys)
            inline_before = adapter.stats["inline_puts"]
            try:
                await _per_key_puts(
                    adapter, hop, data, keys, warm_keys, raw_dir, fsync, totals, samples, order
                )
                inline_puts += adapter.stats["inline_puts"] - inline_before
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
        p50 = {name: _median(samples[name]) for name in _PER_KEY}
        results[str(size)] = {
            "objects": n,
            "rounds": rounds,
            "raw_put_GBps": round(med["raw_put"], 3),
            "posix_put_GBps": round(med["posix_put"], 3),
            "put_ratio": round(med["posix_put"] / med["raw_put"], 3),
            "put_ratio_warm_tree": round(med["posix_put_warm_tree"] / med["raw_put"], 3),
            "put_ratio_median": round(p50["raw_put"] / p50["posix_put"], 3),
            "put_ratio_warm_tree_median": round(p50["raw_put"] / p50["posix_put_warm_tree"], 3),
            "put_ratio_vs_raw_sharded": round(med["posix_put"] / med["raw_put_sharded"], 3),
            "raw_sharded_vs_flat": round(med["raw_put_sharded"] / med["raw_put"], 3),
            "put_p50_us": {name: round(p50[name] * 1e6, 1) for name in _PER_KEY},
            "inline_put_share": round(inline_puts / (2 * n * rounds), 3),
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
    shard_depth: int | None = None,
) -> dict[str, Any]:
    """Put/get GB/s of PosixAdapter and of raw os.write/os.read per object size, with posix/raw ratios.

    ``repeats`` objects per size and round (default: about 512 MiB per round, 4..64 objects), ``rounds``
    rounds (throughput = total bytes / total time). Files go to a fresh temp directory under ``directory``;
    ``shard_depth`` is the adapter's (None: its default).
    """
    load_before = round(os.getloadavg()[0], 2)  # ratios are unreliable on a machine busy with other work
    base = tempfile.mkdtemp(prefix="tiercache-posix-bench-", dir=directory)
    try:
        per_size = asyncio.run(_measure(sizes, repeats, rounds, fsync, base, shard_depth))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {
        "benchmark": "posix_vs_raw",
        "fsync": fsync,
        "shard_depth": shard_depth,
        "directory": directory or tempfile.gettempdir(),
        **load_fields(load_before),
        "sizes": per_size,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: print the JSON of ``posix_vs_raw``."""
    parser = sizes_parser(__doc__, rounds=5)
    parser.add_argument("--fsync", action="store_true", help="fsync every object (both sides)")
    parser.add_argument("--dir", default=None, help="parent directory for the temp files")
    parser.add_argument("--runs", type=int, default=1, help="whole runs; the ratios' medians over runs too")
    parser.add_argument("--shard-depth", type=int, default=None, help="the adapter's (default: its own)")
    args = parser.parse_args(argv)
    sizes = parse_sizes(args.sizes)
    runs = [
        posix_vs_raw(
            sizes,
            args.repeats,
            rounds=args.rounds,
            fsync=args.fsync,
            directory=args.dir,
            shard_depth=args.shard_depth,
        )
        for _ in range(max(1, args.runs))
    ]
    result = runs[-1]
    if len(runs) > 1:
        result["runs"] = len(runs)
        result["loadavg_1m_per_run"] = [[r["loadavg_1m_before"], r["loadavg_1m_after"]] for r in runs]
        result["ratios_over_runs"] = _ratios_over_runs(runs)
    print(json.dumps(result, indent=2))


def _ratios_over_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per size and ratio: each run's value and their median."""
    out: dict[str, Any] = {}
    for size, last in runs[-1]["sizes"].items():
        out[size] = {}
        for name in last:
            if "ratio" in name or name in ("inline_put_share", "raw_sharded_vs_flat"):
                values = [r["sizes"][size][name] for r in runs]
                out[size][name] = {"median": round(statistics.median(values), 3), "runs": values}
    return out


if __name__ == "__main__":
    main()
