"""Server mode on CPU: control-plane round trips and the engine's data path through the shared L1.

    python benchmarks/server_bench.py [--samples 2000] [--repeats 7] [--out benchmarks/results]

A ``python -m tiercache.server`` child process serves the shared L1; measured in the same run:

- ``lookup_100``: one LOOKUP of 100 published keys (no pin), round trip p50/p99 (µs);
- ``lookup_100_pinned``: the same with leases, followed (untimed) by the RELEASE of those leases;
- ``alloc_32``: one ALLOC of 32 new keys (untimed ABORT after each);
- ``raw_roundtrip``: the floor: a request of the LOOKUP's size echoed by a bare SEQPACKET child process;
- ``store`` / ``retrieve``: ``CacheEngine.store`` and ``lookup_hit`` + ``retrieve_result`` of a prompt
  (8 chunks of 256 tokens, 16 layers x 8 heads x 128 bf16: 16 MiB per chunk) on the shared L1 and on the
  in-process ``L1Cache`` (both 16 slots, warmed, so every store evicts), interleaved, alternating which
  goes first; ``ratio`` = in-process time / shared time (goal >= 0.9).

Prints JSON and writes ``server_bench_cpu.json`` to ``--out``.
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
from _common import host_info, percentiles

from tiercache.config import ManagerConfig
from tiercache.engine import CacheEngine
from tiercache.gpu.layouts import LayoutKind, PagedLayout, object_spec
from tiercache.keys import KeySpace
from tiercache.l1 import L1Cache
from tiercache.manager import StorageManager
from tiercache.server.client import ServerConnection, SharedL1
from tiercache.server.protocol import Op

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
    conn.request(Op.COMMIT, {"slots": body["slots"]})
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
        conn.request(Op.ABORT, {"slots": [s for s in got if isinstance(s, list)]})
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
    for engine in engines.values():
        await engine.aclose()
    nbytes = object_spec(layout, CHUNK).nbytes * CHUNKS
    out: dict[str, Any] = {"bytes_per_op": nbytes, "repeats": repeats, "correct": correct, "ms": {}}
    for name, ops in times.items():
        out["ms"][name] = {op: round(statistics.median(v) * 1e3, 2) for op, v in ops.items()}
    out["ratio_in_process_time_over_shared_time"] = {
        op: round(statistics.median(times["in_process"][op]) / statistics.median(times["shared"][op]), 3)
        for op in ("store", "retrieve")
    }
    out["goal_ratio"] = 0.9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    layout = _layout()
    slot_bytes = CacheEngine.slot_bytes(layout, CHUNK)
    with tempfile.TemporaryDirectory(prefix="tc-bench-") as tmp:
        small, big = os.path.join(tmp, "small.sock"), os.path.join(tmp, "big.sock")
        serve = [sys.executable, "-m", "tiercache.server", "--socket"]
        servers = [
            _start([*serve, small, "--slot-bytes", "64", "--slots", "256"], tmp),
            _start([*serve, big, "--slot-bytes", str(slot_bytes), "--slots", str(CHUNKS * 2)], tmp),
        ]
        try:
            result = {
                "control_plane": control_plane(small, tmp, args.samples),
                "data_path": asyncio.run(data_path(big, args.repeats)),
                "host": host_info(),
            }
        finally:
            for server in servers:
                server.terminate()
                server.wait(timeout=60)
    text = json.dumps(result, indent=2)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "server_bench_cpu.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
