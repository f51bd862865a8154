"""S3Adapter vs raw aioboto3 calls on the same moto server: put/get GB/s per object size and their ratios.

The raw side uses the adapter's own aioboto3 client (so the same botocore config, connection pool and
server, in the same run): ``put_object(Body=bytes)`` and ``get_object`` + ``Body.read()``. Per-key
operations alternate raw/adapter object by object, so drift on a shared machine hits both alike; figures
are totals over all rounds. A second part times one ``batched_get`` of 16 x 4 MiB objects (concurrent
requests inside the adapter) against a raw sequential loop and a raw ``asyncio.gather``.

The benchmark starts its own ``moto_server`` on a free 127.0.0.1 port and stops it by PID. moto is a
single Python process sharing the CPUs with the client: its ceiling here is ~0.2 GB/s PUT and ~0.4-0.5 GB/s
GET (see reference/backends.md), so only the ratios say something about the adapter.

Run: ``python benchmarks/s3_bench.py [--sizes 1MiB,4MiB,32MiB] [--repeats N] [--rounds R]`` prints JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling bench modules
from _common import MotoServer, aws_test_env, load_fields, parse_sizes, sizes_parser

__all__ = ["s3_vs_raw"]

_BUCKET = "tc-bench"


@contextlib.contextmanager
def _moto() -> Iterator[str]:
    """A moto server on 127.0.0.1 (the integration tests' launcher) for the block; yields its endpoint."""
    server = MotoServer().start()
    try:
        yield server.endpoint
    finally:
        server.stop()


async def _measure(endpoint: str, sizes: Sequence[int], repeats: int | None, rounds: int) -> dict[str, Any]:
    from tiercache.adapters.s3 import S3Adapter, object_name

    adapter = await S3Adapter.open(
        f"s3://{_BUCKET}/bench", endpoint_url=endpoint, create_bucket=True, addressing_style="path"
    )
    client = adapter._client  # the raw side: same client, same config, same connection pool

    async def raw_put(key: str, data: bytes) -> None:
        await client.put_object(Bucket=_BUCKET, Key=f"raw/{key}", Body=data)

    async def raw_get(key: str) -> bytes:
        response = await client.get_object(Bucket=_BUCKET, Key=f"raw/{key}")
        async with response["Body"] as body:
            data: bytes = await body.read()
        return data

    results: dict[str, Any] = {}
    try:
        for size in sizes:
            n = repeats or max(4, min(64, (128 << 20) // size))
            data = [os.urandom(size) for _ in range(n)]
            t = {"raw_put": 0.0, "s3_put": 0.0, "raw_get": 0.0, "s3_get": 0.0}
            for r in range(rounds):
                keys = [f"s{size}-r{r}-{i}" for i in range(n)]
                for key, value in zip(keys, data, strict=True):
                    t0 = time.perf_counter()
                    await raw_put(key, value)
                    t1 = time.perf_counter()
                    ok = await adapter.batched_put([key], [value])
                    t2 = time.perf_counter()
                    assert ok == [True]
                    t["raw_put"] += t1 - t0
                    t["s3_put"] += t2 - t1
                for key, value in zip(keys, data, strict=True):
                    t0 = time.perf_counter()
                    got_raw = await raw_get(key)
                    t1 = time.perf_counter()
                    (got,) = await adapter.batched_get([key])
                    t2 = time.perf_counter()
                    assert got_raw == value
                    assert got is not None
                    assert len(got) == size
                    t["raw_get"] += t1 - t0
                    t["s3_get"] += t2 - t1
                await adapter.batched_delete(keys)
                await client.delete_objects(
                    Bucket=_BUCKET, Delete={"Objects": [{"Key": f"raw/{k}"} for k in keys], "Quiet": True}
                )
            total = size * n * rounds
            gbps = {k: total / v / 1e9 for k, v in t.items()}
            results[f"{size >> 20}MiB" if size % (1 << 20) == 0 else str(size)] = {
                "objects": n * rounds,
                "raw_put_GBps": round(gbps["raw_put"], 3),
                "s3_put_GBps": round(gbps["s3_put"], 3),
                "put_ratio": round(gbps["s3_put"] / gbps["raw_put"], 3),
                "raw_get_GBps": round(gbps["raw_get"], 3),
                "s3_get_GBps": round(gbps["s3_get"], 3),
                "get_ratio": round(gbps["s3_get"] / gbps["raw_get"], 3),
            }

        # batched get of 16 x 4 MiB: one adapter call (concurrent inside) vs raw sequential / raw gather
        size, n = 4 << 20, 16
        keys = [f"batch-{i}" for i in range(n)]
        data = [os.urandom(size) for _ in range(n)]
        assert await adapter.batched_put(keys, data) == [True] * n
        for key, value in zip(keys, data, strict=True):
            await client.put_object(Bucket=_BUCKET, Key=f"raw/{key}", Body=value)
        times: dict[str, list[float]] = {"s3_batched": [], "raw_sequential": [], "raw_gather": []}
        for _ in range(rounds):
            t0 = time.perf_counter()
            got_all = await adapter.batched_get(keys)
            t1 = time.perf_counter()
            seq = [await raw_get(k) for k in keys]
            t2 = time.perf_counter()
            gat = await asyncio.gather(*(raw_get(k) for k in keys))
            t3 = time.perf_counter()
            assert [bytes(g) for g in got_all if g is not None] == data
            assert seq == data
            assert list(gat) == data
            times["s3_batched"].append(t1 - t0)
            times["raw_sequential"].append(t2 - t1)
            times["raw_gather"].append(t3 - t2)
        med = {k: size * n / statistics.median(v) / 1e9 for k, v in times.items()}
        results["batched_get_16x4MiB"] = {
            "s3_batched_GBps": round(med["s3_batched"], 3),
            "raw_sequential_GBps": round(med["raw_sequential"], 3),
            "raw_gather_GBps": round(med["raw_gather"], 3),
            "ratio_vs_sequential": round(med["s3_batched"] / med["raw_sequential"], 3),
            "ratio_vs_gather": round(med["s3_batched"] / med["raw_gather"], 3),
            "max_concurrency": adapter.max_concurrency,
        }
        await adapter.batched_delete(keys)
        assert object_name("bench", keys[0]).endswith(f"/{keys[0]}")
    finally:
        await adapter.aclose()
    return results


def s3_vs_raw(
    sizes: Sequence[int] = (1 << 20, 4 << 20, 32 << 20),
    repeats: int | None = None,
    *,
    rounds: int = 2,
) -> dict[str, Any]:
    """Put/get GB/s of S3Adapter and of raw aioboto3 calls per object size on a fresh moto server.

    ``repeats`` objects per size and round (default: about 128 MiB per round, 4..64 objects), ``rounds``
    rounds (throughput = total bytes / total time). Also ``batched_get_16x4MiB`` (median over rounds).
    """
    import moto

    load_before = round(os.getloadavg()[0], 2)
    with aws_test_env(), _moto() as endpoint:
        per_size = asyncio.run(_measure(endpoint, sizes, repeats, rounds))
    return {
        "benchmark": "s3_vs_raw",
        "server": f"moto {moto.__version__} (in-memory, same host)",
        **load_fields(load_before),
        "sizes": per_size,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: print the JSON of ``s3_vs_raw``."""
    args = sizes_parser(__doc__, rounds=2).parse_args(argv)
    sizes = parse_sizes(args.sizes)
    print(json.dumps(s3_vs_raw(sizes, args.repeats, rounds=args.rounds), indent=2))


if __name__ == "__main__":
    main()
