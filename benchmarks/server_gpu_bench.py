"""Server mode on a CUDA machine: GPU <-> shared L1 (the server's memfd slots, mapped by this client and
registered with ``cudaHostRegister``) against the same moves into ``torch.empty(pin_memory=True)`` objects,
and the cost of the registration itself, all in one run.

A ``python -m tiercache.server`` child serves the shared L1 (no CUDA in it). Shape: Llama-8B (32 layers, 8 KV
heads, head_dim 128, bf16, block 16, vLLM FLASH), 4096 tokens in 16 chunks of 256 (512 MiB). Whole public
``dispatch`` calls with kept moves (wall clock from a synchronized device, medians of interleaved rounds);
bit-exact check between the two destinations. Registration: seconds per GiB for the whole mapping, beside
``torch.empty(pin_memory=True)`` of the same size (cudaHostAlloc) and cudaHostRegister of anonymous memory.

    python benchmarks/server_gpu_bench.py > benchmarks/results/server_gpu_h200.json
"""

from __future__ import annotations

import json
import mmap
import os
import statistics
import subprocess
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

CHUNKS = gb.T // gb.CHUNK
GIB = 1 << 30


def _serve(path: str, slot_bytes: int, slots: int, cwd: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tiercache.server", "--socket", path, "--slot-bytes", str(slot_bytes)]
    proc = subprocess.Popen([*cmd, "--slots", str(slots)], stdout=subprocess.PIPE, text=True, cwd=cwd)
    assert proc.stdout is not None
    if not proc.stdout.readline():
        raise SystemExit("the server did not start")
    return proc


def _register_anonymous(nbytes: int) -> float:
    """Seconds to cudaHostRegister ``nbytes`` of fresh anonymous memory (touched first, as the slots are)."""
    m = mmap.mmap(-1, nbytes)
    m.write(b"\1" * nbytes)
    seconds = cuda.register(m)
    assert seconds is not None
    cuda.unregister(m)
    return seconds


def main() -> None:
    layout, kv, slots, _ = gb.make_engine(LayoutKind.VLLM_FLASH, gb.L, gb.H, gb.D, seed=41)
    _, kv2, slots2, _ = gb.make_engine(LayoutKind.VLLM_FLASH, gb.L, gb.H, gb.D, seed=42)
    spec = object_spec(layout, gb.CHUNK)
    sp = [(s, s + gb.CHUNK) for s in range(0, gb.T, gb.CHUNK)]
    nbytes = spec.nbytes * CHUNKS
    with tempfile.TemporaryDirectory(prefix="tc-gpu-") as tmp:
        path = os.path.join(tmp, "l1.sock")
        server = _serve(path, spec.nbytes, 2 * CHUNKS, tmp)
        try:
            l1 = SharedL1(path)
            objs = l1.batched_reserve_write([f"gpu/{i}" for i in range(CHUNKS)], [spec] * CHUNKS)
            assert all(o is not None for o in objs), "the server refused the slots"
            segment = objs[0].seg  # type: ignore[union-attr]
            touched = time.perf_counter()
            for o in objs:  # first writes into the (registered, so already resident) slots
                o.buffer()[:] = b"\0" * spec.nbytes  # type: ignore[union-attr]
            touch_s = time.perf_counter() - touched
            reg_s = segment.cuda_register_s  # the client registered its mapping when it connected
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
            server.terminate()
            server.wait(timeout=60)
    seg_gib = segment.data_bytes / GIB
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
        "goal": "shared / pinned >= 0.95 both ways",
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
