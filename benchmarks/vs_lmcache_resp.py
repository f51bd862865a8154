"""tiercache's Redis adapter beside LMCache 0.5.6's native RESP client, and both beside ``redis-benchmark``.

The peer is the C++ client LMCache's multi-process mode reads and writes Redis with (``lmcache_redis``
``LMCacheRedisClient`` behind its asyncio ``RESPClient``, the ``resp`` L2 adapter; ``--workers`` C++ threads,
8 as that adapter's default). Both contenders run in one process on one event loop against one redis-server
started here: batches of values (``--sizes`` MiB each, ``--batch-mib`` MiB per batch) and one request of
``--request-mib`` MiB in 32 MiB values (a Llama-8B 4096-token request: 16 chunks of 256 tokens), writes
(``batched_put`` / ``batch_set``) then reads (``batched_get`` / ``batch_get`` into buffers allocated once),
each op's contenders in a freshly shuffled order every round, every value read back checked byte for byte.
Many short rounds: each contender's GB/s as quartiles (median and IQR), tiercache against LMCache as the ratio
of the two times within each round (quartiles and p10/p90), the 1-minute load at every round, and ``noisy``
where LMCache's own p90 time was over 1.5x its p10 (the machine's load moved under the run).
tiercache runs with its defaults (values over 4 MiB stored as 4 MiB parts). The server's own ceiling:
``redis-benchmark`` GET and SET of 4 MiB values at several client counts, before and after the cases, on the
same server (the better of the two runs), and the same work as one of its runs, ``--round-bench-requests``
4 MiB values in one batch, timed against a run of it after every round (``--round-bench-clients`` clients,
its best count here; each round's GB/s over that run's: a ratio the load moves less).

Usage (a venv holding LMCache 0.5.6 and tiercache): ``python benchmarks/vs_lmcache_resp.py
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
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port, start_redis_process

from tiercache.cli.bench.measure import spread

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


def _same(got: Any, want: Any, step: int = 1 << 20) -> bool:
    """Whether the bytes of ``got`` equal the array ``want``'s, compared in pieces of ``step`` bytes: no copy
    of either (a fresh copy per value would churn the memory the timed reads take pages from)."""
    import numpy as np

    have = np.frombuffer(got, dtype=np.uint8)
    return have.size == want.size and all(
        np.array_equal(have[i : i + step], want[i : i + step]) for i in range(0, want.size, step)
    )


def _check_reads(got: dict[str, list[Any]], values: list[Any], lmc_dst: list[Any], keys: list[str]) -> None:
    """Every value read back as written (each tiercache setting's reads, LMCache's buffers, which are zeroed
    for the next round); the reads are dropped. A function of its own: a loop variable left holding one
    setting's reads would keep its receive buffers busy, and its next read would take fresh memory."""
    for i, want in enumerate(values):
        for who in got:
            if not _same(got[who][i], want):
                raise SystemExit(f"{who} read back a wrong value for {keys[i]}")
        if not _same(lmc_dst[i], want):
            raise SystemExit(f"LMCache read back a wrong value for {keys[i]}")
        lmc_dst[i].fill(0)
    got.clear()


def _quartiles(samples: list[float]) -> dict[str, float]:
    """p25, median and p75 of ``samples`` (the middle half: the IQR)."""
    q1, q2, q3 = statistics.quantiles(samples, n=4) if len(samples) > 1 else samples * 3
    return {"p25": q1, "median": q2, "p75": q3}


def _best_ceiling(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The better of several ``_redis_benchmark`` runs per test, every run's rates kept."""
    out: dict[str, Any] = {}
    for test in ("set", "get"):
        out[test] = {
            "GBps": max(r[test]["GBps"] for r in runs),
            "GBps_by_clients_per_run": [r[test]["GBps_by_clients"] for r in runs],
        }
    return out


def _server_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds (user, system) the process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


class _Sample(NamedTuple):
    """One timed op: wall seconds, then CPU seconds of this process (every thread; its system part; the
    event loop's thread alone) and of the server (all; its system part)."""

    t: float
    cpu: float
    sys: float
    loop: float
    server: float
    server_sys: float


async def _time(fn: Callable[[], Awaitable[Any]], server_pid: int) -> _Sample:
    """Time ``fn`` (see ``_Sample``)."""
    (su, ss), c, loop0, t0 = _server_cpu(server_pid), os.times(), time.thread_time(), time.perf_counter()
    await fn()
    t = time.perf_counter() - t0
    loop, c1, (su1, ss1) = time.thread_time() - loop0, os.times(), _server_cpu(server_pid)
    cpu = c1.user + c1.system - c.user - c.system
    return _Sample(t, cpu, c1.system - c.system, loop, su1 + ss1 - su - ss, ss1 - ss)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from lmcache.v1.storage_backend.native_clients.resp_client import RESPClient

    from tiercache.adapters._resp import new_buffer
    from tiercache.adapters.redis import RedisAdapter

    port = free_port()
    workdir = tempfile.mkdtemp(prefix="vs-lmc-resp-")
    server = start_redis_process(
        "redis-server",
        port,
        Path(workdir),
        ["--maxmemory", "6gb", "--proto-max-bulk-len", "1gb", *args.server_args],
    )
    version = subprocess.run(  # noqa: ASYNC221 (before any timing)
        ["redis-server", "--version"], capture_output=True, text=True
    ).stdout.strip()
    rng = np.random.default_rng(0)
    order_rng = np.random.default_rng(1)
    cases: list[tuple[str, int, int]] = [
        (f"{s}MiB", s * MiB, max(1, args.batch_mib // s)) for s in args.sizes
    ]
    cases.append((f"request_{args.request_mib}MiB", 32 * MiB, args.request_mib // 32))
    beside_case = f"4MiB_x{args.round_bench_requests}"  # redis-benchmark's work, timed beside its runs
    if args.round_bench_requests:
        cases.append((beside_case, 4 * MiB, args.round_bench_requests))
    res: dict[str, Any] = {
        "benchmark": "vs_lmcache_resp",
        "command": "python benchmarks/vs_lmcache_resp.py " + " ".join(sys.argv[1:]),
        "server": version,
        "server_args": args.server_args,
        "server_io_threads": subprocess.run(  # noqa: ASYNC221 (before any timing)
            ["redis-cli", "-p", str(port), "CONFIG", "GET", "io-threads"], capture_output=True, text=True
        ).stdout.split()[-1:],
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "peer": f"LMCache 0.5.6 lmcache_redis.LMCacheRedisClient via RESPClient, {args.workers} threads",
        "tiercache": "RedisAdapter defaults (pool_size 16, part_size 4 MiB)",
        "rounds": args.rounds,
        "load_before": _load(),
        "cases": {},
    }
    ceilings = [_redis_benchmark(port, 4 * MiB, args.bench_clients, args.bench_requests)]
    tc = await RedisAdapter.open(f"redis://127.0.0.1:{port}/0")
    lmc = RESPClient("127.0.0.1", port, args.workers, loop=asyncio.get_running_loop())
    variants: dict[str, RedisAdapter] = {}
    lanes_of = {"tc_get_1_in_flight": 1, "tc_put_1_in_flight": 1, "tc_put_16_in_flight": 16}
    if args.variants:  # tiercache with other numbers of large GETs / SETs in flight, reads into new buffers,
        # every transfer on the event loop (no worker threads)
        for label, lanes in lanes_of.items():
            adapter = await RedisAdapter.open(f"redis://127.0.0.1:{port}/0")
            setattr(adapter, "_value_lanes" if "get" in label else "_put_lanes", asyncio.Semaphore(lanes))
            if "put" in label:
                adapter._put_lane_count = lanes
            variants[label] = adapter
        label = "tc_put_call_per_lane" if tc._lane_threads else "tc_put_lanes_together"
        variants[label] = adapter = await RedisAdapter.open(f"redis://127.0.0.1:{port}/0")
        adapter._lane_threads = not tc._lane_threads  # the batch's put lanes to the threads together, or not
        for label in ("tc_get_new_buffers", "tc_get_2m_pieces", "tc_put_no_threads"):
            variants[label] = adapter = await RedisAdapter.open(f"redis://127.0.0.1:{port}/0")
            assert adapter._resp is not None
            if label == "tc_get_new_buffers":
                adapter._resp.alloc = new_buffer  # before its first connection
            elif label == "tc_get_2m_pieces":
                adapter._resp.recv_lowat = 2 << 20  # before its first connection: large replies received
                # in pieces of 2 MiB per loop wakeup instead of RECV_LOWAT's
            else:
                adapter._resp._threads = None  # before its first connection: every send on the loop
    if args.only:  # just these variants beside the default
        for label in [label for label in variants if label not in args.only]:
            await variants.pop(label).aclose()
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
            for who, adapter in variants.items():  # redis-benchmark's work: only the other receive piece
                if name != beside_case or who == "tc_get_2m_pieces":
                    ops[who] = tc_get(who, adapter) if "get" in who else tc_put_with(adapter)
            samples: dict[str, list[_Sample]] = {k: [] for k in ops}
            loads: list[float] = []
            beside: list[dict[str, Any]] = []  # redis-benchmark in each round of the 4 MiB case
            for fn in ops.values():  # warm-up: connections, the server's allocations
                await fn()
            got.clear()
            for _ in range(args.rounds):
                loads.append(os.getloadavg()[0])
                for op in ("put", "get"):  # every contender of the op in a freshly shuffled order
                    names = [f"tc_{op}", f"lmc_{op}"]
                    names += [who for who in variants if op in who and who in ops]
                    for i in order_rng.permutation(len(names)):
                        samples[names[i]].append(await _time(ops[names[i]], server.pid))
                if name == beside_case:
                    beside.append(
                        _redis_benchmark(port, size, [args.round_bench_clients], args.round_bench_requests)
                    )
                _check_reads(got, values, lmc_dst, tc_keys)  # untimed; drops the reads
            case: dict[str, Any] = {
                "value_bytes": size,
                "values": count,
                "batch_bytes": nbytes,
                "load_per_round": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
            }
            for key, ss in samples.items():
                rates = [nbytes / x.t / 1e9 for x in ss]
                per_gb = 1e9 / (nbytes * len(ss))
                q = _quartiles(rates)
                case[key] = {
                    "GBps_median": q["median"],
                    "GBps_p25": q["p25"],
                    "GBps_p75": q["p75"],
                    "GBps_min": min(rates),
                    "GBps_max": max(rates),
                    "ms": [round(x.t * 1e3, 2) for x in ss],
                    "client_cpu_s_per_GB": sum(x.cpu for x in ss) * per_gb,
                    "client_kernel_cpu_s_per_GB": sum(x.sys for x in ss) * per_gb,
                    "client_loop_thread_cpu_s_per_GB": sum(x.loop for x in ss) * per_gb,
                    "server_cpu_s_per_GB": sum(x.server for x in ss) * per_gb,
                    "server_kernel_cpu_s_per_GB": sum(x.server_sys for x in ss) * per_gb,
                    "client_cores_median": statistics.median(x.cpu / x.t for x in ss),
                    "server_cores_median": statistics.median(x.server / x.t for x in ss),
                }
            for op in ("put", "get"):
                tc_s = [x.t for x in samples[f"tc_{op}"]]
                lmc_s = [x.t for x in samples[f"lmc_{op}"]]
                paired = [lt / tt for tt, lt in zip(tc_s, lmc_s, strict=True)]
                moved = spread(tc_s, lmc_s)
                case[f"{op}_vs_lmcache"] = {
                    **_quartiles(paired),
                    "p10": moved.get("ratio_p10"),
                    "p90": moved.get("ratio_p90"),
                    "min": min(paired),
                    "max": max(paired),
                    "rounds_tiercache_faster": sum(r > 1 for r in paired),
                    "lmcache_p90_over_p10": moved.get("raw_p90_over_p10"),
                    "noisy": moved["noisy"],
                    "of": "LMCache's time / tiercache's time, per round (above 1: tiercache faster)",
                }
                for who in (w for w in variants if op in w and w in samples):
                    v_s = [x.t for x in samples[who]]
                    ratios = [lt / vt for vt, lt in zip(v_s, lmc_s, strict=True)]
                    case[f"{who}_vs_lmcache"] = _quartiles(ratios)
                    case[f"{who}_vs_default"] = {  # the A/B of the setting against tiercache's default
                        **_quartiles([tt / vt for vt, tt in zip(v_s, tc_s, strict=True)]),
                        "rounds_faster": sum(vt < tt for vt, tt in zip(v_s, tc_s, strict=True)),
                        "of": "tiercache default's time / this setting's time, per round",
                    }
            if beside:  # each round's GB/s over that round's redis-benchmark GB/s
                case["vs_redis_benchmark"] = {
                    test: {
                        "redis_benchmark_GBps": _quartiles([b[test]["GBps"] for b in beside]),
                        **{
                            who: _quartiles(
                                [
                                    nbytes / x.t / 1e9 / b[test]["GBps"]
                                    for x, b in zip(ss, beside, strict=True)
                                ]
                            )
                            for who, ss in (
                                ("tiercache", samples[f"tc_{op}"]),
                                ("lmcache", samples[f"lmc_{op}"]),
                            )
                        },
                        "of": f"{test.upper()} by redis-benchmark after each round "
                        f"({args.round_bench_clients} clients, {args.round_bench_requests} requests)",
                    }
                    for op, test in (("put", "set"), ("get", "get"))
                }
            res["cases"][name] = case
            line = " ".join(f"{k} {case[k]['GBps_median']:.2f}" for k in samples)
            px, gx = case["put_vs_lmcache"], case["get_vs_lmcache"]
            print(
                f"{name}: put {px['median']:.2f}x [{px['p25']:.2f}-{px['p75']:.2f}] "
                f"get {gx['median']:.2f}x [{gx['p25']:.2f}-{gx['p75']:.2f}] ({line} GB/s) load "
                f"{case['load_per_round']['median']:.1f}",
                file=sys.stderr,
            )
            await tc.batched_delete(tc_keys)
            await lmc.batch_set(lmc_keys, [memoryview(b"") for _ in lmc_keys])  # the server's memory back
        ceilings.append(_redis_benchmark(port, 4 * MiB, args.bench_clients, args.bench_requests))
        ceiling = _best_ceiling(ceilings)
        four = res["cases"].get(beside_case) or res["cases"].get("4MiB")
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
    ap.add_argument("--batch-mib", type=int, default=64, help="MiB per batch of --sizes values")
    ap.add_argument("--request-mib", type=int, default=512, help="the request case, in 32 MiB values")
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--workers", type=int, default=8, help="LMCache's C++ worker threads")
    ap.add_argument("--bench-clients", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--bench-requests", type=int, default=400)
    ap.add_argument(
        "--round-bench-requests",
        type=int,
        default=128,
        help="redis-benchmark SET and GET requests after every round of the 4 MiB case (0: none)",
    )
    ap.add_argument(
        "--round-bench-clients",
        type=int,
        default=2,
        help="its clients (2: its best for 4 MiB values here)",
    )
    ap.add_argument(
        "--variants",
        action="store_true",
        help="also time tiercache with 1 large GET in flight, 1 and 16 put lanes, reads into new buffers, "
        "reads in 2 MiB pieces, "
        "and every send on the event loop (no worker threads); the put lanes handed to the RESP client's "
        "threads one call each (tc_put_call_per_lane) or together (tc_put_lanes_together): not the default",
    )
    ap.add_argument(
        "--only",
        type=lambda v: v.split(","),
        default=[],
        help="with --variants: just these (a, b)",
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
