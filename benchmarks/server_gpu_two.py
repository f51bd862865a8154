"""Server mode on one GPU, several processes at once: each moves a request's KV to and from the shared L1
(the server's memfd slots, registered with CUDA by each client) at the same time as the others; their
aggregate bandwidth against one process alone and against the pinned copy ceiling, in one run.

A ``python -m tiercache.server`` child serves the shared L1. Shape: Llama-8B (32 layers, 8 KV heads,
head_dim 128, bf16, block 16, vLLM FLASH), 4096 tokens in 16 chunks of 256 (512 MiB) per process. Each
worker process (spawned; ``--procs`` of them, then one alone) makes its own KV on the GPU, reserves its own
slots, waits for the others at a barrier, then runs ``--reps`` whole ``dispatch.gather`` calls into its slots
(store) and ``--reps`` ``dispatch.scatter`` calls out of them (retrieve), back to back; every worker checks
its retrieve bit-exact. Aggregate GB/s: all workers' bytes over the span from the first start to the last
end (each direction timed on its own, the workers meeting at a barrier before each). Ceiling: one pinned
copy of 512 MiB each way (CUDA events) in the parent before the workers start.

    python benchmarks/server_gpu_two.py > benchmarks/results/server_gpu_two_<device>.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _worker(rank: int, path: str, reps: int, barrier: Any, out: Any) -> None:
    import gpu_bench as gb
    import torch

    from tiercache.gpu import LayoutKind, Move, dispatch, object_spec
    from tiercache.server.client import SharedL1

    chunks = gb.T // gb.CHUNK
    layout, kv, slots, _ = gb.make_engine(LayoutKind.VLLM_FLASH, gb.L, gb.H, gb.D, seed=50 + rank)
    _, kv2, _, _ = gb.make_engine(LayoutKind.VLLM_FLASH, gb.L, gb.H, gb.D, seed=60 + rank)
    spec = object_spec(layout, gb.CHUNK)
    sp = [(s, s + gb.CHUNK) for s in range(0, gb.T, gb.CHUNK)]
    made = time.perf_counter()
    l1 = SharedL1(path)
    assert l1.wait_connected(300), "the client did not connect"
    connected_s = time.perf_counter() - made
    objs = l1.batched_reserve_write([f"w{rank}/{i}" for i in range(chunks)], [spec] * chunks)
    assert all(o is not None for o in objs), "the server refused the slots"
    shared = [o.tensor() for o in objs]  # type: ignore[union-attr]
    store, load = Move.gather(layout, slots, sp, shared), Move.scatter(layout, slots, sp, shared)
    dispatch.gather(kv, store)  # prepared, and the reference for the check below
    dispatch.scatter(kv2, load)
    torch.cuda.synchronize()
    spans: dict[str, tuple[float, float]] = {}
    for name, fn in (
        ("store", lambda: dispatch.gather(kv, store)),
        ("retrieve", lambda: dispatch.scatter(kv2, load)),
    ):
        barrier.wait()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        spans[name] = (t0, time.perf_counter())
    exact = all(
        torch.equal(kv[i].view(torch.int16)[slots // gb.BS], kv2[i].view(torch.int16)[slots // gb.BS])
        for i in range(len(kv))
    )
    reg = objs[0].seg.cuda_register_s  # type: ignore[union-attr]
    l1.batched_abort_write([o for o in objs if o is not None])
    l1.close()
    out.put({"rank": rank, "spans": spans, "bit_exact": exact, "connect_s": connected_s, "register_s": reg})


def _run(procs: int, path: str, reps: int, nbytes: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(r, path, reps, barrier, out)) for r in range(procs)]
    for w in workers:
        w.start()
    got = [out.get(timeout=600) for _ in workers]
    for w in workers:
        w.join(timeout=120)
    row: dict[str, Any] = {"processes": procs, "bit_exact": all(g["bit_exact"] for g in got)}
    for name in ("store", "retrieve"):
        starts = [g["spans"][name][0] for g in got]
        ends = [g["spans"][name][1] for g in got]
        row[name] = {
            "aggregate_GBps": procs * reps * nbytes / (max(ends) - min(starts)) / 1e9,
            "per_process_GBps": [reps * nbytes / (e - s) / 1e9 for s, e in zip(starts, ends, strict=True)],
            "start_spread_ms": (max(starts) - min(starts)) * 1e3,
        }
    row["client_connect_s"] = [round(g["connect_s"], 3) for g in got]
    row["cudaHostRegister_s"] = [g["register_s"] for g in got]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import gpu_bench as gb
    import torch

    from tiercache.gpu import LayoutKind, object_spec
    from tiercache.testing.harness.processes import NodeServer

    layout = gb.make_engine(LayoutKind.VLLM_FLASH, gb.L, gb.H, gb.D, seed=1)[0]
    spec = object_spec(layout, gb.CHUNK)
    chunks = gb.T // gb.CHUNK
    nbytes = spec.nbytes * chunks
    hbuf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dbuf = torch.empty(nbytes, dtype=torch.uint8, device=gb.DEV)
    ceiling = {
        "store": nbytes / gb.cuda_time(lambda: hbuf.copy_(dbuf, non_blocking=True), reps=20) / gb.GB,
        "retrieve": nbytes / gb.cuda_time(lambda: dbuf.copy_(hbuf, non_blocking=True), reps=20) / gb.GB,
    }
    runs: dict[str, list[dict[str, Any]]] = {"one": [], "several": []}
    with tempfile.TemporaryDirectory(prefix="tc-two-") as tmp:
        path = os.path.join(tmp, "l1.sock")
        server = NodeServer(path, slot_bytes=spec.nbytes, slots=2 * args.procs * chunks)
        if not server.ready:
            raise SystemExit(f"the server did not start: {server.log()}")
        try:
            for r in range(args.rounds):  # interleaved: several, one, several, one ...
                for kind in ("several", "one") if r % 2 == 0 else ("one", "several"):
                    row = _run(args.procs if kind == "several" else 1, path, args.reps, nbytes)
                    print(f"{kind}: {json.dumps(row)}", file=sys.stderr, flush=True)
                    runs[kind].append(row)
        finally:
            server.stop()
    summary: dict[str, Any] = {}
    for name in ("store", "retrieve"):
        one = statistics.median(r[name]["aggregate_GBps"] for r in runs["one"])
        several = statistics.median(r[name]["aggregate_GBps"] for r in runs["several"])
        summary[name] = {
            "one_process_GBps": one,
            f"{args.procs}_processes_aggregate_GBps": several,
            "aggregate_over_one": several / one,
            "aggregate_over_pinned_ceiling": several / ceiling[name],
            "one_over_pinned_ceiling": one / ceiling[name],
        }
    result = {
        "benchmark": "server_gpu_two",
        "command": "python benchmarks/server_gpu_two.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": "Llama-8B: 32 layers, 8 KV heads, head_dim 128, bf16, block 16, FLASH; 16 x 256 tokens",
        "bytes_per_process_move": nbytes,
        "pinned_copy_ceiling_GBps": ceiling,
        "summary": summary,
        "bit_exact": all(r["bit_exact"] for v in runs.values() for r in v),
        "runs": runs,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
