"""The model's view on a CUDA machine: what KV moving to and from pinned host memory costs a forward pass
running at the same time, per transfer path, and how fast the KV moves meanwhile.

Model: the bf16 matrix products of one Llama-8B decoder layer (hidden 4096, q/k/v 6144, MLP 14336) on
``--model-tokens`` tokens, ``--layers`` of them per forward, captured once as a CUDA graph and replayed on
its own stream (so the host's work for the transfers cannot starve its launches). KV: Llama-8B shape (32
layers, 8 KV heads, head_dim 128, bf16, block 16), vLLM's per-layer ``[2, NB, BS, H, D]`` layout
(``VLLM_LEGACY``, LMCache's format 1), a shuffled block table and, for the copy-engine paths, a sequential
one (long contiguous block runs); objects ``[2, L, T, H*D]`` in pinned host memory.

Transfer paths, each run back to back on another stream from a second thread (at most two moves queued):
``tiercache`` (``dispatch.gather`` / ``scatter`` into L1 objects, the path dispatch picks for the size),
its ``over_the_bus`` kernel (SMs read / write host memory in place) and ``object_pipeline`` (kernel into
device staging, copy engine to host) forced; ``lmcache`` (LMCache 0.5.6's ``multi_layer_kv_transfer`` on a
pinned object, SMs over the bus; ``--lmcache-src`` as for ``vs_lmcache.py gpu``); ``copy_engine_batch``
(one ``cudaMemcpyBatchAsync`` per move, one copy per contiguous block run, ``ce_batch.cu``) and
``copy_engine_loop`` (one ``cudaMemcpyAsync`` per run); ``pinned_copy`` (one contiguous copy of the same
bytes: the ceiling). Per path and direction: its rate alone, its rate while the model runs, the model's
time with it against alone (rounds interleaved: alone, path, alone, ...; medians). Bit-exact checks: every
path's stored object equals LMCache's, and a retrieve of it gives back the KV.

Usage: ``python benchmarks/gpu_overlap.py --lmcache-src DIR > benchmarks/results/gpu_overlap_<device>.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as gb

from tiercache.gpu import LayoutKind, Move, dispatch, layer_pieces, object_spec, reference

L, H, D, BS = gb.L, gb.H, gb.D, gb.BS
HD = H * D
ELEM = 2  # bf16
D2H, H2D = 1, 0  # LMCache's directions


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


class Model:
    """One forward: ``layers`` x the four matrix products of a Llama-8B layer, as a CUDA graph."""

    def __init__(self, tokens: int, layers: int) -> None:
        g = torch.Generator(device=gb.DEV).manual_seed(3)

        def rand(*shape: int) -> torch.Tensor:
            return (torch.randn(shape, generator=g, device=gb.DEV) * 0.02).bfloat16()

        self.x = rand(tokens, 4096)
        self.w = [rand(4096, 6144), rand(4096, 4096), rand(4096, 28672), rand(14336, 4096)]
        self.q = torch.empty(tokens, 6144, dtype=torch.bfloat16, device=gb.DEV)
        self.o = torch.empty(tokens, 4096, dtype=torch.bfloat16, device=gb.DEV)
        self.gu = torch.empty(tokens, 28672, dtype=torch.bfloat16, device=gb.DEV)
        self.h = torch.empty(tokens, 4096, dtype=torch.bfloat16, device=gb.DEV)
        self.flops = 2 * tokens * (4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096) * layers
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            for _ in range(3):
                self._layers(layers)
        self.stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            self._layers(layers)
        torch.cuda.synchronize()

    def _layers(self, n: int) -> None:
        for _ in range(n):
            torch.matmul(self.x, self.w[0], out=self.q)
            torch.matmul(self.q[:, :4096], self.w[1], out=self.o)
            torch.matmul(self.o, self.w[2], out=self.gu)
            torch.matmul(self.gu[:, :14336], self.w[3], out=self.h)

    def forward_s(self, reps: int = 3) -> float:
        """Device seconds of one forward (median of ``reps`` replays, each between events on its stream)."""
        out = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                a.record()
                self.graph.replay()
                b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        return statistics.median(out)


class Mover:
    """Runs ``fn`` back to back on a side stream in a thread (two moves queued at most), counting moves."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn, self.done, self.stop = fn, 0, threading.Event()
        self.error: BaseException | None = None
        self.stream = torch.cuda.Stream()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            queued: deque[torch.cuda.Event] = deque()
            with torch.cuda.stream(self.stream):
                while not self.stop.is_set():
                    self.fn()
                    ev = torch.cuda.Event()
                    ev.record()
                    queued.append(ev)
                    if len(queued) >= 2:
                        queued.popleft().synchronize()
                        self.done += 1
                while queued:
                    queued.popleft().synchronize()
        except BaseException as exc:  # reported by the caller
            self.error = exc

    def __enter__(self) -> Mover:
        self.thread.start()
        time.sleep(0.05)  # running before the window opens
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        torch.cuda.synchronize()
        if self.error is not None:
            raise self.error


def alone_rate(fn: Callable[[], object], nbytes: int, seconds: float = 0.3) -> float:
    """GB/s of ``fn`` run back to back by a ``Mover`` for about ``seconds``, nothing else on the device."""
    with Mover(fn) as m:
        d0, t0 = m.done, time.perf_counter()
        time.sleep(seconds)
        d1, t1 = m.done, time.perf_counter()
    return (d1 - d0) * nbytes / (t1 - t0) / gb.GB


def together(model: Model, fn: Callable[[], object], nbytes: int, forwards: int) -> tuple[float, float]:
    """(seconds per forward, GB/s of ``fn``) with ``fn`` moving back to back while the model runs."""
    with Mover(fn) as m:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        d0, t0 = m.done, time.perf_counter()
        with torch.cuda.stream(model.stream):
            a.record()
            for _ in range(forwards):
                model.graph.replay()
            b.record()
        b.synchronize()
        d1, t1 = m.done, time.perf_counter()
    return a.elapsed_time(b) / 1e3 / forwards, (d1 - d0) * nbytes / (t1 - t0) / gb.GB


def build_ce(work: Path) -> ctypes.CDLL:
    """Compile ``ce_batch.cu`` with nvcc into a shared library and load it."""
    so = work / "ce_batch.so"
    src = Path(__file__).resolve().parent / "ce_batch.cu"
    subprocess.run(["nvcc", "-O2", "-shared", "-Xcompiler", "-fPIC", "-o", str(so), str(src)], check=True)
    lib = ctypes.CDLL(str(so))
    ptr, size = ctypes.c_void_p, ctypes.c_size_t
    lib.ce_batch.argtypes = [ptr, ptr, ptr, size, ctypes.c_int, ptr]
    lib.ce_loop.argtypes = [ptr, ptr, ptr, size, ptr]
    return lib


def block_runs(
    kv: list[torch.Tensor], table: np.ndarray, obj: torch.Tensor, nb: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(KV addresses, object addresses, sizes) of every contiguous block run of ``table`` (block ids of the
    object's tokens in order), per K/V plane and layer: KV ``[2, NB, BS, H, D]`` per layer, object
    ``[2, L, T, H*D]``."""
    n = len(table) * BS
    starts = [0] + [j for j in range(1, len(table)) if table[j] != table[j - 1] + 1]
    ends = [*starts[1:], len(table)]
    block = BS * HD * ELEM
    kv_at, obj_at, size = [], [], []
    base = obj.data_ptr()
    for plane in range(2):
        for layer in range(L):
            lb = kv[layer].data_ptr()
            for s, e in zip(starts, ends, strict=True):
                kv_at.append(lb + (plane * nb + int(table[s])) * block)
                obj_at.append(base + ((plane * L + layer) * n + s * BS) * HD * ELEM)
                size.append((e - s) * block)
    return (
        np.array(kv_at, dtype=np.uint64),
        np.array(obj_at, dtype=np.uint64),
        np.array(size, dtype=np.uint64),
    )


def ce_call(
    lib: ctypes.CDLL, batch: bool, dst: np.ndarray, src: np.ndarray, size: np.ndarray
) -> Callable[[], None]:
    """One copy-engine move: the runs' copies on the current stream (batched or one call each)."""
    n = len(size)
    dp, sp, zp = dst.ctypes.data, src.ctypes.data, size.ctypes.data
    kept = (dst, src, size)  # the address arrays live as long as the call

    def run() -> None:
        assert kept
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        rc = lib.ce_batch(dp, sp, zp, n, 1, stream) if batch else lib.ce_loop(dp, sp, zp, n, stream)
        if rc:
            raise RuntimeError(f"copy-engine move failed: cudaError {rc}")

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--lmcache-src", default=None, help="unpacked LMCache 0.5.6 source (csrc/cuda); none: no peer"
    )
    ap.add_argument("--sizes", default="256,4096", help="tokens per move")
    ap.add_argument("--model-tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--forwards", type=int, default=8, help="forwards per timed window")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu_overlap_"))
    res: dict[str, Any] = {
        "benchmark": "gpu_overlap",
        "command": "python benchmarks/gpu_overlap.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {"layers": L, "kv_heads": H, "head_dim": D, "dtype": "bfloat16", "block_size": BS},
        "model": {
            "tokens": args.model_tokens,
            "layers": args.layers,
            "shape": "Llama-8B decoder layer matmuls",
        },
        "sizes": {},
    }
    lmc = None
    if args.lmcache_src:
        from vs_lmcache import build_lmcache_kernels

        try:
            lmc = build_lmcache_kernels(Path(args.lmcache_src))
            log("LMCache mem_kernels built")
        except Exception as exc:  # recorded; the other paths still run
            res.setdefault("errors", {})["lmcache_build"] = repr(exc)
            log(f"LMCache build: {exc!r}")
    ce = build_ce(work)
    log("ce_batch built")
    model = Model(args.model_tokens, args.layers)
    alone = model.forward_s()
    res["model"]["forward_ms"] = alone * 1e3
    res["model"]["TFLOPs"] = model.flops / alone / 1e12
    log(f"model: {alone * 1e3:.2f} ms per forward, {model.flops / alone / 1e12:.0f} TFLOP/s")

    layout, kv, slots, _ = gb.make_engine(LayoutKind.VLLM_LEGACY, L, H, D, seed=21)
    _, kv_t, _, _ = gb.make_engine(LayoutKind.VLLM_LEGACY, L, H, D, seed=22)
    nb = kv[0].shape[1]
    n_slots = nb * BS
    ptrs = torch.tensor([t.data_ptr() for t in kv], dtype=torch.int64, device=gb.DEV)
    ptrs_t = torch.tensor([t.data_ptr() for t in kv_t], dtype=torch.int64, device=gb.DEV)
    from tiercache.store.l1 import L1Cache

    big = 1 << 62
    forced = {"over_the_bus": (big, big, 2, big), "object_pipeline": (big, big, 2, 0)}
    saved = (
        dispatch.PIECED_MIN_BYTES,
        dispatch.PIECED_MAX_BYTES,
        layer_pieces.PIECES,
        dispatch.ZERO_COPY_BYTES,
    )
    for n in (int(x) for x in args.sizes.split(",")):
        sp = [(s, s + gb.CHUNK) for s in range(0, n, gb.CHUNK)] if n >= gb.CHUNK else [(0, n)]
        sl = slots[:n]
        seq_sl = torch.arange(n, device=gb.DEV) + BS  # blocks 1, 2, 3 ... in order
        nbytes = object_spec(layout, n).nbytes
        want = torch.empty((2, L, n, HD), dtype=torch.bfloat16, device=gb.DEV)
        reference.gather(kv, Move.gather(layout, sl, [(0, n)], [want]))
        want_seq = torch.empty_like(want)
        reference.gather(kv, Move.gather(layout, seq_sl, [(0, n)], [want_seq]))
        want_h, want_seq_h = gb.bits(want.cpu()), gb.bits(want_seq.cpu())
        paths: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
        checks: dict[str, bool] = {}
        errors = res.setdefault("errors", {})
        # tiercache into L1 objects, by the path dispatch picks and by the two forced paths
        chunk_spec = object_spec(layout, sp[0][1] - sp[0][0])
        for name in ("tiercache", *forced):
            l1 = L1Cache(len(sp) * chunk_spec.nbytes, chunk_spec.nbytes, pinned=True)
            reserved = [l1.reserve_write(f"{name}{i}", chunk_spec) for i in range(len(sp))]
            houts = [o.tensor() for o in reserved if o is not None]
            if name in forced:
                lo, hi, pieces, zc = forced[name]
                dispatch.PIECED_MIN_BYTES, dispatch.PIECED_MAX_BYTES = lo, hi
                layer_pieces.PIECES, dispatch.ZERO_COPY_BYTES = pieces, zc
            try:
                g, s = Move.gather(layout, sl, sp, houts), Move.scatter(layout, sl, sp, houts)
                dispatch.gather(kv, g)  # prepared under these settings; later calls keep to them
                checks[f"{name}_store"] = torch.equal(gb.bits(torch.cat(houts, dim=2)), want_h)
                dispatch.scatter(kv_t, s)
                back = torch.empty_like(want)
                reference.gather(kv_t, Move.gather(layout, sl, [(0, n)], [back]))
                checks[f"{name}_retrieve"] = torch.equal(gb.bits(back.cpu()), want_h)
            except Exception as exc:  # recorded; the other paths still run
                errors[f"{n}:{name}"] = repr(exc)
                log(f"{n} {name}: {exc!r}")
                continue
            finally:
                dispatch.PIECED_MIN_BYTES, dispatch.PIECED_MAX_BYTES = saved[0], saved[1]
                layer_pieces.PIECES, dispatch.ZERO_COPY_BYTES = saved[2], saved[3]
            paths[name] = (
                lambda g=g: dispatch.gather(kv, g),  # type: ignore[misc]
                lambda s=s: dispatch.scatter(kv_t, s),  # type: ignore[misc]
            )
            paths[name][0]()
            paths[name][1]()
            torch.cuda.synchronize()
        if lmc is not None:
            lhost = torch.empty((2, L, n, HD), dtype=torch.bfloat16, pin_memory=True)
            lmc.multi_layer_kv_transfer(lhost, ptrs, sl, n_slots, D2H, 1, BS, D)
            torch.cuda.synchronize()
            checks["lmcache_store"] = torch.equal(gb.bits(lhost), want_h)
            paths["lmcache"] = (
                lambda lh=lhost, s_=sl: lmc.multi_layer_kv_transfer(lh, ptrs, s_, n_slots, D2H, 1, BS, D),  # type: ignore[misc]
                lambda lh=lhost, s_=sl: lmc.multi_layer_kv_transfer(lh, ptrs_t, s_, n_slots, H2D, 1, BS, D),  # type: ignore[misc]
            )
        # the copy engines: a copy per contiguous block run, shuffled and sequential block tables
        table = (sl[::BS] // BS).cpu().numpy()
        seq_table = (seq_sl[::BS] // BS).cpu().numpy()
        for tname, tab, ref_h, sls in (
            ("", table, want_h, sl),
            ("_sequential", seq_table, want_seq_h, seq_sl),
        ):
            host = torch.empty((2, L, n, HD), dtype=torch.bfloat16, pin_memory=True)
            kv_at, obj_at, size = block_runs(kv, tab, host, nb)
            kvt_at, _, _ = block_runs(kv_t, tab, host, nb)
            for batch in (True, False):
                name = ("copy_engine_batch" if batch else "copy_engine_loop") + tname
                store = ce_call(ce, batch, obj_at, kv_at, size)
                load = ce_call(ce, batch, kvt_at, obj_at, size)
                side = torch.cuda.Stream()
                try:
                    with torch.cuda.stream(side):
                        host.zero_()
                        store()
                    side.synchronize()
                    checks[f"{name}_store"] = torch.equal(gb.bits(host), ref_h)
                    with torch.cuda.stream(side):
                        load()
                    side.synchronize()
                    back = torch.empty_like(want)
                    reference.gather(kv_t, Move.gather(layout, sls, [(0, n)], [back]))
                    checks[f"{name}_retrieve"] = torch.equal(gb.bits(back.cpu()), ref_h)
                except Exception as exc:  # recorded; the other paths still run
                    errors[f"{n}:{name}"] = repr(exc)
                    log(f"{n} {name}: {exc!r}")
                    continue
                paths[name] = (store, load)
            res.setdefault("copies_per_move", {})[f"{n}{tname}"] = len(size)
        hbuf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dbuf = torch.empty(nbytes, dtype=torch.uint8, device=gb.DEV).random_(1, 255)
        paths["pinned_copy"] = (
            lambda h=hbuf, d=dbuf: h.copy_(d, non_blocking=True),  # type: ignore[misc]
            lambda h=hbuf, d=dbuf: d.copy_(h, non_blocking=True),  # type: ignore[misc]
        )
        log(f"{n} tokens: checks {checks}")
        row: dict[str, Any] = {"bytes": nbytes, "bit_exact": checks}
        samples: dict[str, dict[str, list[float]]] = {}
        base: list[float] = []
        for r in range(args.rounds):
            names = list(paths) if r % 2 == 0 else list(paths)[::-1]
            for name in names:
                for d, fn in zip(("store", "retrieve"), paths[name], strict=True):
                    key = f"{name}:{d}"
                    if f"{n}:{key}" in errors:
                        continue
                    try:
                        base.append(model.forward_s())
                        alone_gbps = alone_rate(fn, nbytes)
                        fwd, rate = together(model, fn, nbytes, args.forwards)
                    except Exception as exc:  # recorded; the other paths still run
                        errors[f"{n}:{key}"] = repr(exc)
                        log(f"{n} {key}: {exc!r}")
                        continue
                    smp = samples.setdefault(key, {"alone": [], "together": [], "forward": []})
                    smp["alone"].append(alone_gbps)
                    smp["forward"].append(fwd)
                    smp["together"].append(rate)
                    log(f"{n} {key} round {r}: alone {alone_gbps:.1f} GB/s, with model {rate:.1f} GB/s")
        fwd_alone = statistics.median(base)
        ceil = {
            "store": statistics.median(samples["pinned_copy:store"]["alone"]),
            "retrieve": statistics.median(samples["pinned_copy:retrieve"]["alone"]),
        }
        row["model_forward_alone_ms"] = fwd_alone * 1e3
        row["pinned_ceiling_GBps"] = ceil
        for key, smp in samples.items():
            name, d = key.split(":")
            alone_gbps = statistics.median(smp["alone"])
            with_gbps = statistics.median(smp["together"])
            fwd = statistics.median(smp["forward"])
            row.setdefault(name, {})[d] = {
                "alone_GBps": alone_gbps,
                "alone_vs_pinned_ceiling": alone_gbps / ceil[d],
                "with_model_GBps": with_gbps,
                "with_model_vs_pinned_ceiling": with_gbps / ceil[d],
                "model_slowdown": fwd / fwd_alone - 1,
                "model_slowdown_rounds": [f / fwd_alone - 1 for f in smp["forward"]],
            }
            log(
                f"{n} {key}: alone {alone_gbps:.1f} GB/s, with model {with_gbps:.1f} GB/s "
                f"({with_gbps / ceil[d]:.2f} of ceiling), model slowdown {100 * (fwd / fwd_alone - 1):.1f} %"
            )
        res["sizes"][f"{n}_tokens"] = row
        log(f"{n} tokens row: {json.dumps(row)}")  # each size's row as soon as it is done
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    import faulthandler

    faulthandler.enable()
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    main()
