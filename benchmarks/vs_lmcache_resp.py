"""tiercache's Redis adapter beside LMCache 0.5.6's native RESP client, and both beside ``redis-benchmark``.

The peer is the C++ client LMCache's multi-process mode reads and writes Redis with (``lmcache_redis``
``LMCacheRedisClient`` behind its asyncio ``RESPClient``, the ``resp`` L2 adapter; ``--workers`` C++ threads,
8 as that adapter's default). Both contenders run in one process on one event loop against one redis-server
started here: batches of values (``--sizes`` MiB each, ``--batch-mib`` MiB per batch) and one request of
``--request-mib`` MiB in 32 MiB values (a Llama-8B 4096-token request: 16 chunks of 256 tokens), writes
(``batched_put`` / ``batch_set``) then reads (``batched_get`` / ``batch_get`` into buffers allocated once),
each op's contenders in a freshly shuffled order every round, every value read back checked byte for byte.
tiercache runs with its defaults (values over 4 MiB stored as 4 MiB parts). The server's own ceiling:
``redis-benchmark`` GET and SET of 4 MiB values at several client counts, in the same run, on the same server.

Usage (a venv holding LMCache 0.5.6 and tiercache): ``/work/lmc/bin/python benchmarks/vs_lmcache_resp.py
> benchmarks/results/vs_lmcache_resp_cpu.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port, port_open, start_process

MiB = 1 << 20


def _load() -> str:
    """The 1-minute load average and the CPU count, as one line for the results."""
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} (5 min {five:.2f}) on {os.cpu_count()} CPUs"


def _redis_benchmark(port: int, size: int, clients: list[int], requests: int) -> dict[str, Any]:
    """``redis-benchmark`` SET and GET of ``size``-byte values: GB/s per client count and the best."""
    out: dict[str, Any] = {}
    for test in ("set", "get"):
        rates: dict[str, float] = {}
        for c in clients:
            cmd = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", test, "-d", str(size), "-n",
                   str(requests), "-c", str(c), "-r", "64", "--csv"]  # fmt: skip
            text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            row = next(ln for ln in text.splitlines() if ln.startswith('"' + test.upper()))
            rps = float(row.split(",")[1].strip('"'))
            rates[str(c)] = rps * size / 1e9
        out[test] = {"GBps_by_clients": rates, "GBps": max(rates.values())}
    return out


def _server_cpu(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _time(fn: Callable[[], Awaitable[Any]], server_pid: int) -> tuple[float, float, float]:
    """Wall seconds of ``fn``, and the CPU seconds this process (every thread) and the server used."""
    s0, c0, t0 = _server_cpu(server_pid), time.process_time(), time.perf_counter()
    await fn()
    t = time.perf_counter() - t0
    return t, time.process_time() - c0, _server_cpu(server_pid) - s0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from lmcache.v1.storage_backend.native_clients.resp_client import RESPClient

    from tiercache.adapters._resp import new_buffer
    from tiercache.adapters.redis import RedisAdapter

    port = free_port()
    workdir = tempfile.mkdtemp(prefix="vs-lmc-resp-")
    server = start_process(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, "--maxmemory", "6gb", "--proto-max-bulk-len", "1gb", *args.server_args],
        ready=lambda: port_open("127.0.0.1", port),
    )  # fmt: skip
    version = subprocess.run(  # noqa: ASYNC221 (before any timing)
        ["redis-server", "--version"], capture_output=True, text=True
    ).stdout.strip()
    rng = np.random.default_rng(0)
    order_rng = np.random.default_rng(1)
    cases: list[tuple[str, int, int]] = [
        (f"{s}MiB", s * MiB, max(1, args.batch_mib // s)) for s in args.sizes
    ]
    cases.append((f"request_{args.request_mib}MiB", 32 * MiB, args.request_mib // 32))
    res: dict[str, Any] = {
        "benchmark": "vs_lmcache_resp",
        "command": "python benchmarks/vs_lmcache_resp.py " + " ".join(sys.argv[1:]),
        "server": version,
        "server_args": args.server_args,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "peer": f"LMCache 0.5.6 lmcache_redis.LMCacheRedisClient via RESPClient, {args.workers} threads",
        "tiercache": "RedisAdapter defaults (pool_size 16, part_size 4 MiB)",
        "rounds": args.rounds,
        "load_before": _load(),
        "cases": {},
    }
    tc = await RedisAdapter.open(f"redis://127.0.0.1:{port}/0")
    lmc = RESPClient("127.0.0.1", port, args.workers, loop=asyncio.get_running_loop())
    variants: dict[str, RedisAdapter] = {}
    lanes_of = {"tc_get_1_in_flight": 1, "tc_put_1_in_flight": 1, "tc_put_16_in_flight": 16}
    if args.variants:  # tiercache with other numbers of large GETs / SETs in flight, reads into new buffers
        for label, lanes in lanes_of.items():
            adapter = await RedisAdapter.open(f"redis://127.0.0.1:{port}/0")
            setattr(adapter, "_value_lanes" if "get" in label else "_put_lanes", asyncio.Semaphore(lanes))
            variants[label] = adapter
        variants["tc_get_new_buffers"] = await RedisAdapter.open(f"redis://127.0.0.1:{port}/0")
        assert variants["tc_get_new_buffers"]._resp is not None
        variants["tc_get_new_buffers"]._resp.alloc = new_buffer  # before its first connection
    try:
        for name, size, count in cases:
            values = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]
            views = [memoryview(v) for v in values]
            lmc_dst = [np.empty(size, dtype=np.uint8) for _ in range(count)]
            lmc_dst_views = [memoryview(d) for d in lmc_dst]
            tc_keys = [f"{name}-{i}" for i in range(count)]
            lmc_keys = [f"lmc:{name}-{i}" for i in range(count)]
            nbytes = size * count
            got: dict[str, list[Any]] = {}

            def tc_get(who: str, adapter: RedisAdapter) -> Callable[[], Awaitable[None]]:
                async def read() -> None:
                    got[who] = await adapter.batched_get(tc_keys)  # noqa: B023

                return read

            async def tc_put() -> None:
                ok = await tc.batched_put(tc_keys, views)  # noqa: B023
                assert all(ok), "tiercache put refused"

            def tc_put_with(adapter: RedisAdapter) -> Callable[[], Awaitable[None]]:
                async def write() -> None:
                    ok = await adapter.batched_put(tc_keys, views)  # noqa: B023
                    assert all(ok), "tiercache put refused"

                return write

            async def lmc_put() -> None:
                await lmc.batch_set(lmc_keys, views)  # noqa: B023

            async def lmc_get() -> None:
                await lmc.batch_get(lmc_keys, lmc_dst_views)  # noqa: B023

            ops: dict[str, Callable[[], Awaitable[None]]] = {
                "tc_put": tc_put,
                "lmc_put": lmc_put,
                "tc_get": tc_get("tc", tc),
                "lmc_get": lmc_get,
            }
            for who, adapter in variants.items():
                ops[who] = tc_get(who, adapter) if "get" in who else tc_put_with(adapter)
            samples: dict[str, list[tuple[float, float, float]]] = {k: [] for k in ops}
            for fn in ops.values():  # warm-up: connections, the server's allocations
                await fn()
            got.clear()
            for _ in range(args.rounds):
                for op in ("put", "get"):  # every contender of the op in a freshly shuffled order
                    names = [f"tc_{op}", f"lmc_{op}", *(who for who in variants if op in who)]
                    for i in order_rng.permutation(len(names)):
                        samples[names[i]].append(await _time(ops[names[i]], server.pid))
                for i in range(count):  # untimed: every byte back as written
                    for who, vals in got.items():
                        if bytes(vals[i]) != values[i].tobytes():
                            raise SystemExit(f"{who} read back a wrong value for {tc_keys[i]}")
                    if not np.array_equal(lmc_dst[i], values[i]):
                        raise SystemExit(f"LMCache read back a wrong value for {lmc_keys[i]}")
                    lmc_dst[i].fill(0)
                got.clear()
            case: dict[str, Any] = {"value_bytes": size, "values": count, "batch_bytes": nbytes}
            for key, ss in samples.items():
                rates = [nbytes / t / 1e9 for t, _, _ in ss]
                case[key] = {
                    "GBps_median": statistics.median(rates),
                    "GBps_min": min(rates),
                    "GBps_max": max(rates),
                    "ms": [round(t * 1e3, 2) for t, _, _ in ss],
                    "client_cpu_s_per_GB": sum(c for _, c, _ in ss) / (nbytes * len(ss)) * 1e9,
                    "server_cpu_s_per_GB": sum(v for _, _, v in ss) / (nbytes * len(ss)) * 1e9,
                }
            for op in ("put", "get"):
                paired = [
                    lt / tt
                    for (tt, _, _), (lt, _, _) in zip(samples[f"tc_{op}"], samples[f"lmc_{op}"], strict=True)
                ]
                case[f"{op}_vs_lmcache"] = {
                    "median": statistics.median(paired),
                    "min": min(paired),
                    "max": max(paired),
                    "of": "LMCache's time / tiercache's time, per round (above 1: tiercache faster)",
                }
            res["cases"][name] = case
            line = " ".join(f"{k} {case[k]['GBps_median']:.2f}" for k in samples)
            put_x, get_x = case["put_vs_lmcache"]["median"], case["get_vs_lmcache"]["median"]
            print(
                f"{name}: put {put_x:.2f}x get {get_x:.2f}x ({line} GB/s)",
                file=sys.stderr,
            )
            await tc.batched_delete(tc_keys)
            await lmc.batch_set(lmc_keys, [memoryview(b"") for _ in lmc_keys])  # the server's memory back
        ceiling = _redis_benchmark(port, 4 * MiB, args.bench_clients, args.bench_requests)
        four = res["cases"].get("4MiB")
        if four is not None:
            for op, test in (("put", "set"), ("get", "get")):
                ceiling[test]["tiercache_vs_ceiling"] = (
                    four[f"tc_{op}"]["GBps_median"] / ceiling[test]["GBps"]
                )
                ceiling[test]["lmcache_vs_ceiling"] = four[f"lmc_{op}"]["GBps_median"] / ceiling[test]["GBps"]
        res["redis_benchmark_4MiB"] = ceiling
        res["load_after"] = _load()
    finally:
        lmc.close()
        for adapter in (tc, *variants.values()):
            await adapter.aclose()
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4, 32])
    ap.add_argument("--batch-mib", type=int, default=128, help="MiB per batch of --sizes values")
    ap.add_argument("--request-mib", type=int, default=512, help="the request case, in 32 MiB values")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--workers", type=int, default=8, help="LMCache's C++ worker threads")
    ap.add_argument("--bench-clients", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--bench-requests", type=int, default=400)
    ap.add_argument(
        "--variants",
        action="store_true",
        help="also time tiercache with 1 large GET in flight, 1 and 16 large SETs in flight, and reads into "
        "new buffers",
    )
    ap.add_argument("--server-args", nargs="*", default=[], help="more redis-server arguments")
    args = ap.parse_args()
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    res = asyncio.run(run(args))
    print(json.dumps(res, indent=2))
    sys.stdout.flush()
    os._exit(0)  # LMCache's native client threads


if __name__ == "__main__":
    main()
