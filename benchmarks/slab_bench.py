"""SlabAdapter (``nvme+slab``) against raw aligned O_DIRECT I/O and against the POSIX file-per-object adapter.

Large frames: N frames of 32 MiB, put then get, through the adapter (values are ordinary ``bytes``, as frames
from the codec pipeline are: not aligned) and through a raw loop of ``os.pwrite``/``os.preadv`` on an
O_DIRECT descriptor of another preallocated file in the same directory, from/into one reused aligned buffer.
One warm-up round of each (not counted) first writes the fallocated extents and fills the adapter's
recycled read buffers. Raw and adapter rounds alternate, so drift on a shared machine hits both alike;
figures are totals over all rounds. The adapter is measured one key per call (sequential like the raw
loop) and as one batch.

Small objects: ``--small-count`` puts (then gets) of ``--small-size`` bytes as one batch, slab against
``PosixAdapter`` (default options: no fsync, page cache) on the same filesystem, fresh keys each round.

Run: ``python benchmarks/slab_bench.py [--dir PATH] [--frames 16] [--rounds 3] [--json PATH]`` prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import platform
import shutil
import tempfile
import time
from typing import Any

from tiercache.adapters.nvme_slab import SlabAdapter
from tiercache.adapters.posix import PosixAdapter
from tiercache.cli.bench.measure import gbps
from tiercache.cli.bench.report import print_json

MiB = 1 << 20


def _gbps(nbytes: int, seconds: float) -> float:
    return round(gbps(nbytes, seconds), 3) if seconds > 0 else 0.0


async def _large(root: str, frames: int, size: int, rounds: int, direct: str) -> dict[str, Any]:
    raw_path = os.path.join(root, "raw.bin")
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if direct != "false" else 0)
    fd = os.open(raw_path, flags, 0o644)
    os.posix_fallocate(fd, 0, frames * size)
    buf = mmap.mmap(-1, size)
    buf.write(os.urandom(size))
    values = [os.urandom(size) for _ in range(frames)]
    keys = [f"frame-{i}" for i in range(frames)]
    capacity = 3 * frames * size + 256 * MiB
    slab = await SlabAdapter.open(
        f"nvme+slab://{root}/bench.slab", capacity=capacity, max_object=64 * MiB, direct=direct
    )
    t = dict.fromkeys(("raw_put", "raw_get", "put_1", "get_1", "put_batch", "get_batch"), 0.0)
    try:
        mode = slab.describe()
        # warm-up (not counted): first writes into fallocated extents and first read buffers, on both sides
        for i in range(frames):
            os.pwrite(fd, buf, i * size)
        assert await slab.batched_put(keys, values) == [True] * frames
        warm = await slab.batched_get(keys)
        del warm
        for _ in range(rounds):
            s = time.perf_counter()
            for i in range(frames):
                os.pwrite(fd, buf, i * size)
            t["raw_put"] += time.perf_counter() - s
            s = time.perf_counter()
            for k, v in zip(keys, values, strict=True):
                assert await slab.batched_put([k], [v]) == [True]
            t["put_1"] += time.perf_counter() - s
            s = time.perf_counter()
            for i in range(frames):
                os.preadv(fd, [buf], i * size)
            t["raw_get"] += time.perf_counter() - s
            s = time.perf_counter()
            for k in keys:
                (got,) = await slab.batched_get([k])
                assert got is not None
                assert len(got) == size
                del got
            t["get_1"] += time.perf_counter() - s
            s = time.perf_counter()
            assert await slab.batched_put(keys, values) == [True] * frames
            t["put_batch"] += time.perf_counter() - s
            s = time.perf_counter()
            got_all = await slab.batched_get(keys)
            assert all(g is not None for g in got_all)
            del got_all
            t["get_batch"] += time.perf_counter() - s
        check = await slab.batched_get(keys[:1])
        assert check[0] is not None
        assert bytes(check[0]) == values[0]
        del check
    finally:
        await slab.aclose()
        os.close(fd)
    total = frames * size * rounds
    g = {k: _gbps(total, v) for k, v in t.items()}
    return {
        "frame_bytes": size,
        "frames": frames,
        "rounds": rounds,
        "slab_mode": mode,
        "raw_mode": "O_DIRECT pwrite/preadv, one reused aligned buffer" if direct != "false" else "buffered",
        "GBps": g,
        "ratio_vs_raw": {
            "put_1": round(g["put_1"] / g["raw_put"], 3),
            "put_batch": round(g["put_batch"] / g["raw_put"], 3),
            "get_1": round(g["get_1"] / g["raw_get"], 3),
            "get_batch": round(g["get_batch"] / g["raw_get"], 3),
        },
    }


async def _small(root: str, count: int, size: int, rounds: int, direct: str) -> dict[str, Any]:
    slab = await SlabAdapter.open(
        f"nvme+slab://{root}/small.slab",
        capacity=4 * count * size + 512 * MiB,
        max_object=8 * MiB,
        direct=direct,
    )
    posix = await PosixAdapter.open(f"file://{root}/posix")
    values = [os.urandom(size) for _ in range(count)]
    t = dict.fromkeys(("slab_put", "posix_put", "slab_get", "posix_get"), 0.0)
    try:
        for r in range(rounds):
            keys = [f"small-{r}-{i}" for i in range(count)]
            for name, adapter in (("posix", posix), ("slab", slab)):
                s = time.perf_counter()
                assert await adapter.batched_put(keys, values) == [True] * count
                t[f"{name}_put"] += time.perf_counter() - s
                s = time.perf_counter()
                got = await adapter.batched_get(keys)
                t[f"{name}_get"] += time.perf_counter() - s
                assert all(g is not None for g in got)
    finally:
        await slab.aclose()
        await posix.aclose()
    total = count * size * rounds
    ops = count * rounds
    return {
        "object_bytes": size,
        "objects_per_batch": count,
        "rounds": rounds,
        "posix_mode": "PosixAdapter defaults (temp file + rename, no fsync)",
        "GBps": {k: _gbps(total, v) for k, v in t.items()},
        "puts_per_s": {
            "slab": round(ops / t["slab_put"]),
            "posix": round(ops / t["posix_put"]),
        },
        "slab_put_speedup_vs_posix": round(t["posix_put"] / t["slab_put"], 3),
        "slab_get_speedup_vs_posix": round(t["posix_get"] / t["slab_get"], 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--dir", default=None, help="directory on the filesystem to test (default: a temp dir)")
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--frame-mib", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--small-count", type=int, default=256)
    p.add_argument("--small-size", type=int, default=64 << 10)
    p.add_argument("--direct", default="auto", choices=["auto", "true", "false"])
    p.add_argument("--json", default=None, help="also write the JSON here")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="slab-bench-", dir=args.dir)
    try:
        large = asyncio.run(_large(root, args.frames, args.frame_mib * MiB, args.rounds, args.direct))
        small = asyncio.run(_small(root, args.small_count, args.small_size, args.rounds, args.direct))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "bench": "slab_bench",
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "dir_fs_note": "ext4 on virtio (reference CPU box)" if args.dir is None else args.dir,
        "large_frames": large,
        "small_objects": small,
        "goals": {
            "large_put_and_get_ge_90pct_of_raw": min(
                large["ratio_vs_raw"]["put_batch"], large["ratio_vs_raw"]["get_batch"]
            )
            >= 0.9,
            "small_puts_faster_than_posix": small["slab_put_speedup_vs_posix"] > 1.0,
        },
    }
    print_json(out, args.json)


if __name__ == "__main__":
    main()
