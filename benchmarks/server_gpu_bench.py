"""Server mode on a CUDA machine: GPU <-> shared L1 (the server's memfd slots, mapped by this client and
registered with ``cudaHostRegister``) against the same moves into ``torch.empty(pin_memory=True)`` objects,
the cost of the registration itself, and how it stays off the request path, all in one run.

A ``python -m tiercache.server`` child serves the shared L1 (no CUDA in it). Shape: Llama-8B (32 layers, 8 KV
heads, head_dim 128, bf16, block 16, vLLM FLASH), 4096 tokens in 16 chunks of 256 (512 MiB). Whole public
``dispatch`` calls with kept moves (wall clock from a synchronized device, medians of interleaved rounds);
bit-exact check between the two destinations. Registration: seconds per GiB for the whole mapping, beside
``torch.empty(pin_memory=True)`` of the same size (cudaHostAlloc) and cudaHostRegister of anonymous memory.

Registration sweep (``--sizes``, GiB; a size that would leave less than ``--spare-gib`` of the host's
available memory is skipped and listed): a server per size with a fresh segment of that capacity; a worker
client is made in this CUDA process and called (contains, reserve_write, acquire; every ``--poll-ms``) until
its first served request. Reported per size: the registration's seconds (and per GiB) on the fresh segment
(its pages are first allocated by the registration) and, by a second client of the same process, on the now
resident pages; the constructor's seconds (the HELLO alone); construction to the end of the first served call
against the registration; the latencies of the calls made while the registration ran (misses, no request).

    python benchmarks/server_gpu_bench.py > benchmarks/results/server_gpu_<device>.json   (now: _h100)
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as gb

from tiercache.gpu import LayoutKind, Move, dispatch, object_spec
from tiercache.server import cuda
from tiercache.server.client import SharedL1
from tiercache.testing.harness.processes import NodeServer

CHUNKS = gb.T // gb.CHUNK
GIB = 1 << 30


def _serve(path: str, slot_bytes: int, slots: int, capacity: int = 0) -> NodeServer:
    """A server child on ``path``: ``slots`` slots of ``slot_bytes``, or a segment of ``capacity`` bytes."""
    if capacity:
        server = NodeServer(path, "--capacity", str(capacity), slot_bytes=slot_bytes, slots=None)
    else:
        server = NodeServer(path, slot_bytes=slot_bytes, slots=slots)
    if not server.ready:
        raise SystemExit(f"the server did not start: {server.log()}")
    return server


def _register_anonymous(nbytes: int) -> float:
    """Seconds to cudaHostRegister ``nbytes`` of fresh anonymous memory (touched first, as the slots are)."""
    m = mmap.mmap(-1, nbytes)
    m.write(b"\1" * nbytes)
    seconds = cuda.register(m)
    assert seconds is not None
    cuda.unregister(m)
    return seconds


def _meminfo_gib() -> dict[str, float]:
    """MemTotal and MemAvailable of this host, GiB (what ``free -g`` shows)."""
    out: dict[str, float] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("MemTotal", "MemAvailable"):
            out[name] = round(int(rest.split()[0]) / (1 << 20), 1)
    return out


def _us(seconds: list[float]) -> dict[str, float]:
    """Count, median, p99 and max of ``seconds`` in microseconds."""
    if not seconds:
        return {"calls": 0}
    ordered = sorted(seconds)
    return {
        "calls": len(ordered),
        "median_us": round(statistics.median(ordered) * 1e6, 1),
        "p99_us": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6, 1),
        "max_us": round(ordered[-1] * 1e6, 1),
    }


def _until_served(
    l1: SharedL1, spec: Any, made: float, poll_s: float
) -> tuple[float, dict[str, list[float]]]:
    """Call ``l1`` (contains, reserve_write, acquire, one after another, then ``poll_s`` of sleep) until a
    call is served (a request was sent); the seconds from ``made`` to the end of that call, and the seconds
    of each call before it, by op (each one a miss with no request sent)."""
    calls: dict[str, Any] = {
        "contains": lambda: l1.contains("bench/miss"),
        "reserve_write": lambda: l1.reserve_write("bench/miss", spec),
        "acquire": lambda: l1.acquire("bench/miss"),
    }
    took: dict[str, list[float]] = {k: [] for k in calls}
    deadline = time.perf_counter() + 600
    while time.perf_counter() < deadline:
        for name, call in calls.items():
            start = time.perf_counter()
            got = call()
            end = time.perf_counter()
            if l1.requests.total():
                if name == "reserve_write" and got is not None:
                    l1.abort_write(got)
                return end - made, took
            assert not got, f"{name} answered while the client was not connected"
            took[name].append(end - start)
        time.sleep(poll_s)
    raise SystemExit("no request was served within 600 s")


def _registration_run(size_gib: int, spec: Any, tmp: str, poll_s: float) -> dict[str, Any]:
    """One fresh server segment of ``size_gib``: a worker client's background registration against its
    calls, then a second client's registration of the now resident pages."""
    path = os.path.join(tmp, f"reg{size_gib}.sock")
    server = _serve(path, spec.nbytes, 0, capacity=size_gib * GIB)
    try:
        made = time.perf_counter()
        l1 = SharedL1(path, slot_bytes=[spec.nbytes])
        ctor_s = time.perf_counter() - made
        asked_in_ctor = l1.requests.total()
        first_served_s, took = _until_served(l1, spec, made, poll_s)
        assert l1.wait_connected(60)
        conn = l1._connection()
        assert conn is not None
        seg = conn.seg
        reg_s = seg.cuda_register_s
        assert reg_s is not None, "the client did not register the shared L1 with CUDA"
        obj = l1.reserve_write("bench/pinned", spec)
        assert obj is not None, "the server refused a slot"
        pinned = obj.tensor().is_pinned()
        l1.abort_write(obj)
        del obj, conn
        second = SharedL1(path, slot_bytes=[spec.nbytes])  # the same segment, its pages resident now
        assert second.wait_connected(600)
        conn2 = second._connection()
        assert conn2 is not None
        resident_s = conn2.seg.cuda_register_s  # None: the driver refused it (recorded, not fatal)
        del conn2, seg
        closed = time.perf_counter()
        second.close()
        l1.close()
        del second, l1
        gc.collect()  # the segments are unregistered and unmapped as they are collected
        teardown_s = time.perf_counter() - closed
    finally:
        server.stop(timeout=120)
    seg_gib = size_gib  # the server's --capacity; the segment is whole regions of it
    every = [t for v in took.values() for t in v]
    return {
        "segment_GiB": seg_gib,
        "constructor_s": round(ctor_s, 4),
        "requests_in_constructor": asked_in_ctor,
        "cudaHostRegister_s": round(reg_s, 3),
        "cudaHostRegister_s_per_GiB": round(reg_s / seg_gib, 4),
        "cudaHostRegister_resident_s": None if resident_s is None else round(resident_s, 3),
        "cudaHostRegister_resident_s_per_GiB": None if resident_s is None else round(resident_s / seg_gib, 4),
        "construction_to_first_served_s": round(first_served_s, 3),
        "first_served_minus_registration_s": round(first_served_s - reg_s, 4),
        "slots_pinned": pinned,
        "calls_while_registering": _us(every),
        "calls_while_registering_by_op": {k: _us(v) for k, v in took.items()},
        "teardown_s": round(teardown_s, 2),
    }


def registration_sweep(
    sizes: list[int], spec: Any, poll_s: float, spare_gib: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """:func:`_registration_run` for each size that leaves ``spare_gib`` of available memory; the runs and the
    skipped sizes (with why)."""
    runs: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tc-reg-") as tmp:
        for size in sizes:
            mem = _meminfo_gib()
            if size > mem.get("MemAvailable", 0.0) - spare_gib:
                skipped.append({"segment_GiB": size, "why": f"{mem} leaves less than {spare_gib} GiB spare"})
                print(f"registration sweep: {size} GiB skipped ({mem})", file=sys.stderr, flush=True)
                continue
            run = _registration_run(size, spec, tmp, poll_s)
            print(f"registration sweep: {json.dumps(run)}", file=sys.stderr, flush=True)
            runs.append(run)
    return runs, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,8,32,64", help="registration sweep: segment GiB, comma-listed")
    parser.add_argument("--spare-gib", type=float, default=24.0, help="host memory a sweep size must leave")
    parser.add_argument("--poll-ms", type=float, default=1.0, help="sleep between rounds of calls")
    args = parser.parse_args()
    memory_at_start = _meminfo_gib()
    layout, kv, slots, _ = gb.make_engine(LayoutKind.VLLM_FLASH, gb.L, gb.H, gb.D, seed=41)
    _, kv2, slots2, _ = gb.make_engine(LayoutKind.VLLM_FLASH, gb.L, gb.H, gb.D, seed=42)
    spec = object_spec(layout, gb.CHUNK)
    sp = [(s, s + gb.CHUNK) for s in range(0, gb.T, gb.CHUNK)]
    nbytes = spec.nbytes * CHUNKS
    with tempfile.TemporaryDirectory(prefix="tc-gpu-") as tmp:
        path = os.path.join(tmp, "l1.sock")
        server = _serve(path, spec.nbytes, 2 * CHUNKS)
        try:
            l1 = SharedL1(path)
            assert l1.wait_connected(120), "the client did not connect"  # registered in the background
            objs = l1.batched_reserve_write([f"gpu/{i}" for i in range(CHUNKS)], [spec] * CHUNKS)
            assert all(o is not None for o in objs), "the server refused the slots"
            segment = objs[0].seg  # type: ignore[union-attr]
            touched = time.perf_counter()
            for o in objs:  # first writes into the (registered, so already resident) slots
                o.buffer()[:] = b"\0" * spec.nbytes  # type: ignore[union-attr]
            touch_s = time.perf_counter() - touched
            reg_s = segment.cuda_register_s  # the client registered its mapping before it installed it
            assert reg_s is not None, "the client did not register the shared L1 with CUDA"
            shared = [o.tensor() for o in objs]  # type: ignore[union-attr]
            assert shared[0].is_pinned(), "torch does not see the registered slots as pinned"
            pool = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            cb = spec.nbytes
            pinned = [
                pool[i * cb : (i + 1) * cb].view(torch.bfloat16).view(spec.shape) for i in range(CHUNKS)
            ]
            alloc = time.perf_counter()
            extra = torch.empty(segment.data_bytes, dtype=torch.uint8, pin_memory=True)
            alloc_s = time.perf_counter() - alloc
            del extra
            anon_s = _register_anonymous(segment.data_bytes)
            moves = {
                "shared_store": (kv, Move.gather(layout, slots, sp, shared), dispatch.gather),
                "pinned_store": (kv, Move.gather(layout, slots, sp, pinned), dispatch.gather),
                "shared_retrieve": (kv2, Move.scatter(layout, slots2, sp, shared), dispatch.scatter),
                "pinned_retrieve": (kv2, Move.scatter(layout, slots2, sp, pinned), dispatch.scatter),
            }
            times: dict[str, list[float]] = {k: [] for k in moves}
            for r in range(7):
                for k in list(moves) if r % 2 == 0 else list(moves)[::-1]:
                    caches, move, fn = moves[k]
                    times[k].append(gb.wall_time(lambda c=caches, m=move, f=fn: f(c, m), reps=11, warmup=2))
            torch.cuda.synchronize()
            exact = all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(shared, pinned, strict=True)
            )
            hbuf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            dbuf = torch.empty(nbytes, dtype=torch.uint8, device=gb.DEV)
            d2h = gb.cuda_time(lambda: hbuf.copy_(dbuf, non_blocking=True), reps=20)
            h2d = gb.cuda_time(lambda: dbuf.copy_(hbuf, non_blocking=True), reps=20)
            gbps = {k: nbytes / statistics.median(v) / gb.GB for k, v in times.items()}
            worst = {k: nbytes / max(v) / gb.GB for k, v in times.items()}
            l1.batched_abort_write([o for o in objs if o is not None])
            l1.close()
        finally:
            server.stop()
    seg_gib = segment.data_bytes / GIB
    sizes = [int(x) for x in args.sizes.split(",") if x]
    sweep, skipped = registration_sweep(sizes, spec, args.poll_ms / 1000, args.spare_gib)
    result: dict[str, Any] = {
        "benchmark": "server_gpu",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": "Llama-8B: 32 layers, 8 KV heads, head_dim 128, bf16, block 16, FLASH; 16 x 256 tokens",
        "bytes": nbytes,
        "GBps": {k: round(v, 2) for k, v in gbps.items()},
        "worst_round_GBps": {k: round(v, 2) for k, v in worst.items()},
        "store_shared_over_pinned": round(gbps["shared_store"] / gbps["pinned_store"], 4),
        "retrieve_shared_over_pinned": round(gbps["shared_retrieve"] / gbps["pinned_retrieve"], 4),
        "pinned_copy_ceiling_GBps": {
            "D2H": round(nbytes / d2h / gb.GB, 2),
            "H2D": round(nbytes / h2d / gb.GB, 2),
        },
        "bit_exact": exact,
        "registration": {
            "segment_GiB": round(seg_gib, 3),
            "cudaHostRegister_s_per_GiB": round(reg_s / seg_gib, 4),
            "first_write_s_per_GiB": round(touch_s / (nbytes / GIB), 4),
            "pin_memory_alloc_s_per_GiB": round(alloc_s / seg_gib, 4),
            "anonymous_register_s_per_GiB": round(anon_s / seg_gib, 4),
        },
        "registration_sweep": sweep,
        "registration_sweep_skipped": skipped,
        "host_memory_GiB_at_start": memory_at_start,
        "goal": "shared / pinned >= 0.95 both ways; calls while registering return in microseconds",
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
