"""Server mode on CPU: control-plane round trips and the engine's data path through the shared L1.

    python benchmarks/server_bench.py [--samples 2000] [--repeats 7] [--clients-repeats 5] [--rounds 4]
                                         [--out benchmarks/results]

A ``python -m tiercache.server`` child process serves the shared L1; measured in the same run:

- ``lookup_100``: one LOOKUP of 100 published keys (no pin), round trip p50/p99 (µs);
- ``lookup_100_pinned``: the same with leases, followed (untimed) by the RELEASE of those leases;
- ``alloc_32``: one ALLOC of 32 new keys (untimed ABORT after each);
- ``raw_roundtrip``: the floor: a request of the LOOKUP's size echoed by a bare SEQPACKET child process;
- ``store`` / ``retrieve``: ``CacheEngine.store`` and ``lookup_hit`` + ``retrieve_result`` of a prompt
  (8 chunks of 256 tokens, 16 layers x 8 heads x 128 bf16: 16 MiB per chunk) on the shared L1 and on the
  in-process ``L1Cache`` (both 16 slots, warmed, so every store evicts), interleaved, alternating which
  goes first; ``ratio`` = in-process time / shared time (goal >= 0.9), of the medians and (``paired``) the
  median of each round's ratio (the two engines of a round run back to back, under the same load);
- ``round_trips``: requests to the server per engine call of that 8-chunk prompt (store, deduplicated store,
  lookup, retrieve): one per batch, not one per chunk;
- ``clients``: one vs two concurrent client processes on one server, each storing then retrieving its own
  prompts (8 chunks, 16 MiB each) in a loop: aggregate GB/s (bytes stored + retrieved by all clients / wall
  time from a common start to the last client's end), the runs interleaved (1, 2, 1, 2, ...), medians;
  ``scaling`` = two-client aggregate / one-client aggregate.

Prints JSON, writes ``server_bench_cpu.json`` and ``server_bench_cpu.png`` (the figures of that JSON) to
``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import NodeServer, host_info, percentiles

from tiercache.cli.bench.report import print_json
from tiercache.config import ManagerConfig
from tiercache.gpu.layouts import LayoutKind, PagedLayout, object_spec
from tiercache.keys import KeySpace
from tiercache.server.client import ServerConnection, SharedL1
from tiercache.server.protocol import Op
from tiercache.store.engine import CacheEngine
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager

CHUNK, BLOCK, CHUNKS = 256, 16, 8
ECHO = r"""
import socket, sys
srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
srv.bind(sys.argv[1]); srv.listen(1); print("ready", flush=True)
conn, _ = srv.accept()
while True:
    data = conn.recv(1 << 18)
    if not data:
        break
    conn.send(data)
"""


def _layout() -> PagedLayout:
    return PagedLayout(
        LayoutKind.VLLM_FLASH, num_layers=16, num_kv_heads=8, head_dim=128, block_size=BLOCK, dtype="bfloat16"
    )


def _us(samples: list[float]) -> dict[str, float]:
    return {k: round(v * 1e6, 1) for k, v in percentiles(samples).items()}


def _start(cmd: list[str], cwd: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=cwd)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{cmd} did not start")
    return proc


def control_plane(path: str, tmp: str, samples: int) -> dict[str, Any]:
    conn = ServerConnection(path)
    spec_meta = b"\x90"
    keys = [f"bench/{i:064d}" for i in range(100)]
    body = conn.request(Op.ALLOC, {"keys": keys, "nbytes": [64] * 100, "meta": [spec_meta] * 100})
    conn.request(Op.COMMIT, {"slots": [ref[:2] for ref in body["slots"]]})  # refs: [slot, gen, offset]
    lookup = {"keys": keys, "pin": False, "prefix": True}
    pinned = {"keys": keys, "pin": True, "prefix": True}
    t_lookup, t_pinned, t_alloc = [], [], []
    for i in range(samples):
        t0 = time.perf_counter()
        conn.request(Op.LOOKUP, lookup)
        t_lookup.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hits = conn.request(Op.LOOKUP, pinned)["hits"]
        t_pinned.append(time.perf_counter() - t0)
        conn.request(Op.RELEASE, {"leases": [h[4] for h in hits]})
        new = [f"new/{i}/{j:060d}" for j in range(32)]
        t0 = time.perf_counter()
        got = conn.request(Op.ALLOC, {"keys": new, "nbytes": [64] * 32, "meta": [spec_meta] * 32})["slots"]
        t_alloc.append(time.perf_counter() - t0)
        conn.request(Op.ABORT, {"slots": [s[:2] for s in got if isinstance(s, list)]})
    assert len(conn.request(Op.LOOKUP, lookup)["hits"]) == 100
    conn.close()

    echo_path = os.path.join(tmp, "echo.sock")
    echo = _start([sys.executable, "-c", ECHO, echo_path], tmp)
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    raw.connect(echo_path)
    from tiercache.server.protocol import encode

    payload = encode(Op.LOOKUP, 1, 1, lookup)
    t_raw = []
    for _ in range(samples):
        t0 = time.perf_counter()
        raw.send(payload)
        raw.recv(1 << 18)
        t_raw.append(time.perf_counter() - t0)
    raw.close()
    echo.wait(timeout=60)
    p50_raw = percentiles(t_raw)["p50"]
    return {
        "samples": samples,
        "lookup_100_us": _us(t_lookup),
        "lookup_100_pinned_us": _us(t_pinned),
        "alloc_32_us": _us(t_alloc),
        "raw_roundtrip_same_bytes_us": _us(t_raw),
        "lookup_100_p50_vs_raw_p50": round(percentiles(t_lookup)["p50"] / p50_raw, 2),
    }


async def data_path(path: str, repeats: int) -> dict[str, Any]:
    layout = _layout()
    keyspace = KeySpace("bench/model", layout.dtype, layout.num_layers, layout.num_kv_heads, layout.head_dim)
    slot_bytes = CacheEngine.slot_bytes(layout, CHUNK)
    tokens_n = CHUNK * CHUNKS
    num_blocks = tokens_n // BLOCK
    kv = [torch.randn(layout.layer_shape(num_blocks)).to(torch.bfloat16) for _ in range(layout.num_layers)]
    slots = torch.arange(tokens_n)
    engines = {
        "in_process": CacheEngine(
            StorageManager(L1Cache(slot_bytes * CHUNKS * 2, slot_bytes, pinned=False), [], ManagerConfig()),
            layout,
            keyspace,
            chunk_size=CHUNK,
        ),
        "shared": CacheEngine(
            StorageManager(SharedL1(path), [], ManagerConfig()),  # type: ignore[arg-type]
            layout,
            keyspace,
            chunk_size=CHUNK,
        ),
    }
    times: dict[str, dict[str, list[float]]] = {n: {"store": [], "retrieve": []} for n in engines}
    correct = True
    for rep in range(-1, repeats + 1):  # two warm-up rounds touch every slot of both L1s (2 x CHUNKS slots)
        tokens = list(range((rep + 1) * tokens_n, (rep + 2) * tokens_n))  # new keys: a real store, evicting
        order = list(engines.items()) if rep % 2 else list(engines.items())[::-1]  # neither always goes first
        for name, engine in order:
            t0 = time.perf_counter()
            stored = await engine.store(tokens, kv, slots)
            t_store = time.perf_counter() - t0
            out = [torch.empty_like(t) for t in kv]
            t0 = time.perf_counter()
            hit = await engine.lookup_hit(tokens)
            result = await engine.retrieve_result(tokens, out, slots)
            t_retrieve = time.perf_counter() - t0
            correct &= stored == hit.tokens == result.tokens_read == tokens_n
            correct &= all(
                torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(out, kv, strict=True)
            )
            if rep > 0:
                times[name]["store"].append(t_store)
                times[name]["retrieve"].append(t_retrieve)
    trips = await round_trips(engines["shared"], kv, slots, (repeats + 3) * tokens_n)
    for engine in engines.values():
        await engine.aclose()
    nbytes = object_spec(layout, CHUNK).nbytes * CHUNKS
    out: dict[str, Any] = {"bytes_per_op": nbytes, "repeats": repeats, "correct": correct, "ms": {}}
    out["round_trips"] = trips
    for name, ops in times.items():
        out["ms"][name] = {op: round(statistics.median(v) * 1e3, 2) for op, v in ops.items()}
    out["ratio_in_process_time_over_shared_time"] = {
        op: round(statistics.median(times["in_process"][op]) / statistics.median(times["shared"][op]), 3)
        for op in ("store", "retrieve")
    }
    out["ratio_paired_rounds_median"] = {  # robust to load that changes between rounds on a shared box
        op: round(
            statistics.median(
                a / b for a, b in zip(times["in_process"][op], times["shared"][op], strict=True)
            ),
            3,
        )
        for op in ("store", "retrieve")
    }
    out["goal_ratio"] = 0.9
    return out


async def round_trips(
    engine: CacheEngine, kv: list[torch.Tensor], slots: torch.Tensor, first: int
) -> dict[str, Any]:
    """Requests to the server per engine call of one CHUNKS-chunk prompt on the shared L1."""
    l1 = engine.manager.l1
    assert isinstance(l1, SharedL1)
    tokens = list(range(first, first + CHUNK * CHUNKS))
    out: dict[str, Any] = {"chunks": CHUNKS}

    async def count(name: str, call: Any) -> None:
        l1.requests.clear()
        await call()
        out[name] = dict(l1.requests)

    await count("store", lambda: engine.store(tokens, kv, slots))
    await count("store_again_deduplicated", lambda: engine.store(tokens, kv, slots))
    await count("lookup", lambda: engine.lookup_hit(tokens))
    dst = [torch.empty_like(t) for t in kv]
    await count("retrieve", lambda: engine.retrieve_result(tokens, dst, slots))
    return out


def worker(path: str, seed: int, rounds: int) -> None:
    """One client process of ``clients``: waits for "go" on stdin, then stores and retrieves ``rounds``
    prompts of its own; prints {"bytes": ..., "correct": ...}."""
    layout = _layout()
    keyspace = KeySpace("bench/model", layout.dtype, layout.num_layers, layout.num_kv_heads, layout.head_dim)
    tokens_n = CHUNK * CHUNKS
    kv = [
        torch.randn(layout.layer_shape(tokens_n // BLOCK)).to(torch.bfloat16)
        for _ in range(layout.num_layers)
    ]
    slots = torch.arange(tokens_n)
    out = [torch.empty_like(t) for t in kv]
    engine = CacheEngine(
        StorageManager(SharedL1(path), [], ManagerConfig()), layout, keyspace, chunk_size=CHUNK
    )
    nbytes = object_spec(layout, CHUNK).nbytes * CHUNKS

    async def run() -> tuple[int, bool]:
        done, correct = 0, True
        for r in range(rounds):
            base = (seed * 1000 + r + 1) * tokens_n
            tokens = list(range(base, base + tokens_n))
            stored = await engine.store(tokens, kv, slots)
            result = await engine.retrieve_result(tokens, out, slots)
            correct &= stored == result.tokens_read == tokens_n
            done += 2 * nbytes
        await engine.aclose()
        return done, correct

    print("ready", flush=True)
    sys.stdin.readline()
    done, correct = asyncio.run(run())
    print(json.dumps({"bytes": done, "correct": correct}), flush=True)


def clients(path: str, repeats: int, rounds: int) -> dict[str, Any]:
    """Aggregate store+retrieve GB/s of one and of two concurrent client processes (interleaved runs)."""
    gbps: dict[str, list[float]] = {"1": [], "2": []}
    correct = True
    for rep in range(repeats + 1):  # the first round warms both (touches the segment)
        for n in (1, 2) if rep % 2 else (2, 1):
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        path,
                        "--seed",
                        str(rep * 100 + n * 10 + i),
                        "--rounds",
                        str(rounds),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for i in range(n)
            ]
            for proc in procs:
                assert proc.stdout is not None
                assert proc.stdout.readline().strip() == "ready"
            t0 = time.perf_counter()
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            results = []
            for proc in procs:
                assert proc.stdout is not None
                results.append(json.loads(proc.stdout.readline()))
            elapsed = time.perf_counter() - t0
            for proc in procs:
                proc.wait(timeout=120)
            correct &= all(r["correct"] for r in results)
            if rep > 0:
                gbps[str(n)].append(sum(r["bytes"] for r in results) / elapsed / 1e9)
    med = {n: round(statistics.median(v), 3) for n, v in gbps.items()}
    return {
        "repeats": repeats,
        "rounds_per_client": rounds,
        "correct": correct,
        "aggregate_GBps": med,
        "all_GBps": {n: [round(x, 3) for x in v] for n, v in gbps.items()},
        "scaling_two_over_one": round(med["2"] / med["1"], 3),
        "cpu_count": os.cpu_count(),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """Three panels: control-plane round trips, shared vs in-process L1, one vs two clients."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cp, dp, cl = result["control_plane"], result["data_path"], result["clients"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.5))
    names = ["lookup_100_us", "lookup_100_pinned_us", "alloc_32_us", "raw_roundtrip_same_bytes_us"]
    labels = ["LOOKUP 100", "LOOKUP 100\npinned", "ALLOC 32", "raw echo\n(same bytes)"]
    xs = range(len(names))
    ax1.bar([x - 0.2 for x in xs], [cp[n]["p50"] for n in names], 0.4, label="p50")
    ax1.bar([x + 0.2 for x in xs], [cp[n]["p99"] for n in names], 0.4, label="p99")
    ax1.set_xticks(list(xs), labels)
    ax1.set_ylabel("round trip (µs)")
    ax1.set_title("control plane (Unix SEQPACKET, msgpack)")
    ax1.legend()
    ops = ["store", "retrieve"]
    ms = dp["ms"]
    gb = dp["bytes_per_op"] / 1e9
    ax2.bar(
        [x - 0.2 for x in range(2)],
        [gb / (ms["in_process"][o] / 1e3) for o in ops],
        0.4,
        label="in-process L1",
    )
    ax2.bar(
        [x + 0.2 for x in range(2)],
        [gb / (ms["shared"][o] / 1e3) for o in ops],
        0.4,
        label="shared L1 (server)",
    )
    ratio = dp["ratio_in_process_time_over_shared_time"]
    paired = dp["ratio_paired_rounds_median"]
    ax2.set_xticks([0, 1], [f"{o}\nratio {ratio[o]} (paired {paired[o]})" for o in ops])
    ax2.set_ylabel("GB/s (8 chunks x 16 MiB)")
    ax2.set_title("engine data path, goal ratio >= 0.9")
    ax2.legend()
    agg = cl["aggregate_GBps"]
    ax3.bar(["1 client", "2 clients"], [agg["1"], agg["2"]], color=["tab:blue", "tab:orange"])
    ax3.set_ylabel("aggregate store+retrieve GB/s")
    ax3.set_title(f"one server, concurrent clients (x{cl['scaling_two_over_one']}, {cl['cpu_count']} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--clients-repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4, help="prompts per client and run (clients)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one client process of `clients`
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.seed, args.rounds)
        return
    layout = _layout()
    slot_bytes = CacheEngine.slot_bytes(layout, CHUNK)
    with tempfile.TemporaryDirectory(prefix="tc-bench-") as tmp:
        small, big = os.path.join(tmp, "small.sock"), os.path.join(tmp, "big.sock")
        two = os.path.join(tmp, "two.sock")
        servers = [
            NodeServer(small, slot_bytes=64, slots=256),
            NodeServer(big, slot_bytes=slot_bytes, slots=CHUNKS * 2),
            NodeServer(two, slot_bytes=slot_bytes, slots=CHUNKS * 4),
        ]
        try:
            for server in servers:
                if not server.ready:
                    raise RuntimeError(f"the server on {server.path} did not start: {server.log()}")
            result = {
                "control_plane": control_plane(small, tmp, args.samples),
                "data_path": asyncio.run(data_path(big, args.repeats)),
                "clients": clients(two, args.clients_repeats, args.rounds),
                "host": host_info(),
            }
        finally:
            for server in servers:
                server.stop()
    print_json(result, args.out / "server_bench_cpu.json")
    plot(result, args.out / "server_bench_cpu.png")


if __name__ == "__main__":
    main()
