# mypy: disable-error-code="no-untyped-call"
"""The model's view on a CUDA machine: what KV moving to and from pinned host memory costs a forward pass
running at the same time, per transfer path, and how fast the KV moves meanwhile.

Model: the bf16 matrix products of one Llama-8B decoder layer (hidden 4096, q/k/v 6144, MLP 14336) on
``--model-tokens`` tokens, ``--layers`` of them per forward, captured once as a CUDA graph and replayed on
its own stream (so the host's work for the transfers cannot starve its launches). KV: Llama-8B shape (32
layers, 8 KV heads, head_dim 128, bf16, block 16), vLLM's per-layer ``[2, NB, BS, H, D]`` layout
(``VLLM_LEGACY``, LMCache's format 1) in one allocation per layer as vLLM makes them, a shuffled block table
and, for some paths, a sequential one (long runs of blocks in order); objects ``[2, L, T, H*D]`` in pinned
host memory (L1 objects for tiercache's paths).

Transfer paths, each run back to back on another stream from a second thread (a library path seen done when
its call returns, which is when its copies are done; the raw copies and LMCache's kernel, which return at
once, followed by an event each and at most two moves queued): ``tiercache`` (``dispatch.gather`` /
``scatter`` with the slots on the host, as the vLLM connector passes them: the path dispatch picks;
``tiercache_kernels``: its kernel paths only), ``tiercache_device_slots`` (the same with the slot mapping on
the device: layer pieces or the object pipeline), its ``over_the_bus`` kernel (SMs read / write host memory in
place) and ``object_pipeline`` (kernel into device staging, copy engine to host) forced; ``copy_engine``
(``tiercache.gpu.copy_engine``: one 2D copy per block run and plane, the layers as rows, on KV whose layers
lie at one pitch), the same with runs of 8 and 4 blocks in order (``copy_engine_runs8`` / ``_runs4``) and a
sequential table (``copy_engine_sequential``); its batched 1D copies instead (a copy per block run, plane and
layer, in sub-batches of ``cuMemcpyBatchAsync``: ``copy_engine_batched``, ``_batched_runs8``,
``_batched_sequential``) and ``copy_engine_per_layer`` (one 2D copy per block run and layer, for layers
anywhere); vLLM's own ``[NB, H, BS, K|V]`` layout on NHD allocations through ``copy_engine_flash`` (a copy per
block run, plane and layer) and through dispatch (``tiercache_flash``); vLLM's block-outermost ``BLNHC``
allocation (the connector's ``kv_layout = "blocks"``: every layer's page of a block in one run) through
dispatch (``tiercache_blocks``: objects of whole blocks, one copy per run of consecutive blocks on the copy
engines, in one batch; ``copy_engine_blocks_2d``: the same copies issued one by one); ``lmcache`` (LMCache
0.5.6's ``multi_layer_kv_transfer`` on a pinned object, SMs over the bus, on the mover's stream;
``--lmcache-src`` as for ``vs_lmcache.py gpu``); ``copy_engine_batch`` (one ``cudaMemcpyBatchAsync`` per move,
one copy per contiguous block run and layer, ``ce_batch.cu``) and ``copy_engine_loop`` (one
``cudaMemcpyAsync`` per run; up to 1024 tokens), shuffled and sequential, and the batch cut into
``--ce-streams`` batches on as many streams (``copy_engine_batch_streams<k>``, and the library's batch so cut:
``copy_engine_batched_streams<k>``); ``--green-paths`` with the mover's stream in a CUDA green context of each
``--mover-sms`` count (``<path>_sms<k>``: their kernels on those SMs only); ``pinned_copy`` (one contiguous
copy of the same bytes: the ceiling). Per path, direction and round: the path's rate alone, then the model's
time for ``--forwards`` forwards back to back with the path moving against the mean of a window alone just
before and one just after (so the device's drift cancels; how far those two differ is the round's noise,
``model_alone_spread_percent``), and the path's rate meanwhile (rates from the moves' completion times;
medians over rounds; the SM-over-the-bus paths, which slow the model several times, with the model in the
first round only). ``pinned_copy``'s own cost to the model is the least any path that moves the same bytes can
cost it. Bit-exact checks: every path's stored object equals the reference gather, and a retrieve of it gives
back the KV.

Every size runs in a child process that reports each sample as it ends; a sample that outlasts
``--sample-budget`` has every thread's stack dumped to stderr and ends the child, which is started again
without that path while the size's ``--size-budget`` lasts. So the run always finishes, and the JSON (written
to ``--out`` after each size, else printed at the end) holds what was measured and what hung.

Usage: ``python benchmarks/gpu_overlap.py --lmcache-src DIR --out benchmarks/results/gpu_overlap_<dev>.json``.
The paths in ``EXPLORATION_PATHS`` (block runs of 4 / 8, per-layer copies, vLLM's layout, the loops, the
kernel over the bus, dispatch's kernel paths forced) run only with ``--every-path``.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import MatmulModel  # noqa: E402

L, H, D, BS, CHUNK = 32, 8, 128, 16, 256
HD = H * D
ELEM = 2  # bf16
D2H, H2D = 1, 0  # LMCache's directions
SLOW_PATHS = ("lmcache", "over_the_bus")  # SMs over the bus: the model runs several times slower beside them
# left out unless --every-path: 2D runs of 4/8 blocks, per-layer and per-run copies, the library's batched
# 1D copies, vLLM's [NB, H, BS, K|V] layout, the forced kernel over the bus (none a path dispatch picks for
# pinned L1 or a goal is read from), and dispatch's kernel paths forced (the same moves as tiercache wherever
# auto picks them, as for this table)
EXPLORATION_PATHS = (
    "tiercache_kernels",
    "copy_engine_batched",
    "copy_engine_batched_sequential",
    "copy_engine_per_layer",
    "copy_engine_runs8",
    "copy_engine_runs4",
    "copy_engine_batched_runs8",
    "copy_engine_flash",
    "tiercache_flash",
    "copy_engine_loop",
    "copy_engine_loop_sequential",
    "over_the_bus",
)


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ the child


def child(args: argparse.Namespace) -> None:
    """Measure one size (``args.size``), every path not in ``args.skip``; a JSON line per event on stdout."""
    import gpu_bench as gb
    import torch

    from tiercache.gpu import (
        LayoutKind,
        Move,
        PagedLayout,
        block_pages,
        copy_engine,
        dispatch,
        layer_pieces,
        object_spec,
        reference,
    )
    from tiercache.store.l1 import L1Cache

    def emit(**ev: Any) -> None:
        sys.stdout.write(json.dumps(ev) + "\n")
        sys.stdout.flush()

    skip = set(filter(None, args.skip.split(",")))
    n = args.size

    class Mover:
        """Runs ``fn`` back to back on a side stream in a thread, counting: a move that returns once its work
        is done (``waits``) is seen done when it returns; any other is followed by an event, two moves queued
        at most, and seen done when its event is."""

        def __init__(
            self, fn: Callable[[], object], stream: torch.cuda.Stream | None = None, waits: bool = False
        ) -> None:
            self.fn, self.done, self.stop, self.waits = fn, 0, threading.Event(), waits
            self.times: list[float] = []  # when each move was seen done
            self.error: BaseException | None = None
            self.stream = stream if stream is not None else torch.cuda.Stream()
            self.thread = threading.Thread(target=self._run, daemon=True)

        def _run(self) -> None:
            try:
                queued: deque[torch.cuda.Event] = deque()
                with torch.cuda.stream(self.stream):
                    while self.waits and not self.stop.is_set():
                        self.fn()
                        self.times.append(time.perf_counter())
                        self.done += 1
                    while not self.stop.is_set():
                        self.fn()
                        ev = torch.cuda.Event()
                        ev.record()
                        queued.append(ev)
                        if len(queued) >= 2:
                            queued.popleft().synchronize()
                            self.times.append(time.perf_counter())
                            self.done += 1
                    while queued:
                        queued.popleft().synchronize()
            except BaseException as exc:  # reported by the caller
                self.error = exc

        def __enter__(self) -> Mover:
            self.thread.start()
            time.sleep(0.03)  # running before the window opens
            return self

        def __exit__(self, *exc: object) -> None:
            self.stop.set()
            self.thread.join()
            torch.cuda.synchronize()
            if self.error is not None:
                raise self.error

    def rate(m: Mover, t0: float, t1: float, nbytes: int) -> float:
        """GB/s of the moves ``m`` finished between ``t0`` and ``t1``, from the first one seen done to the
        last (whole moves: a window of a few large moves is not rounded to a move count), else 0."""
        ts = [t for t in m.times if t0 <= t <= t1]
        return (len(ts) - 1) * nbytes / (ts[-1] - ts[0]) / gb.GB if len(ts) > 2 else 0.0

    def alone_rate(
        fn: Callable[[], object],
        nbytes: int,
        seconds: float,
        stream: torch.cuda.Stream | None = None,
        waits: bool = False,
    ) -> float:
        with Mover(fn, stream, waits) as m:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds or (len(m.times) < 4 and m.thread.is_alive()):
                time.sleep(0.005)
            t1 = time.perf_counter()
        return rate(m, t0, t1, nbytes)

    def together(
        model: MatmulModel,
        fn: Callable[[], object],
        nbytes: int,
        k: int,
        stream: torch.cuda.Stream | None = None,
        waits: bool = False,
    ) -> tuple[float, float]:
        with Mover(fn, stream, waits) as m:
            t0 = time.perf_counter()
            fwd = model.forwards_s(k)
            t1 = time.perf_counter()
        return fwd, rate(m, t0, t1, nbytes)

    lmc = None
    if args.lmcache_src and "lmcache" not in skip:
        from vs_lmcache import build_lmcache_kernels

        try:
            lmc = build_lmcache_kernels(Path(args.lmcache_src))
        except Exception as exc:  # recorded; the other paths still run
            emit(event="error", key="lmcache_build", error=repr(exc))
    ce = ctypes.CDLL(args.ce_lib)
    ptr_t, size_t = ctypes.c_void_p, ctypes.c_size_t
    ce.ce_batch.argtypes = [ptr_t, ptr_t, ptr_t, size_t, ctypes.c_int, ptr_t]
    ce.ce_loop.argtypes = [ptr_t, ptr_t, ptr_t, size_t, ptr_t]

    model = MatmulModel(args.model_tokens, args.layers)
    fwd0 = model.forwards_s(args.forwards)
    emit(event="model", forward_ms=fwd0 * 1e3, TFLOPs=model.flops / fwd0 / 1e12)

    layout, kv, slots, _ = gb.make_engine(LayoutKind.VLLM_LEGACY, L, H, D, seed=21)  # one allocation a layer
    _, kv_t, _, _ = gb.make_engine(LayoutKind.VLLM_LEGACY, L, H, D, seed=22)
    nb = kv[0].shape[1]
    n_slots = nb * BS

    def one_buffer(layers: list[torch.Tensor]) -> list[torch.Tensor]:
        """The same KV with every layer in one allocation, at one pitch."""
        buf = torch.empty((len(layers), *layers[0].shape), dtype=layers[0].dtype, device=gb.DEV)
        for i, t in enumerate(layers):
            buf[i].copy_(t)
        return list(buf.unbind(0))

    kv1, kv1_t = one_buffer(kv), one_buffer(kv_t)
    ptrs = torch.tensor([t.data_ptr() for t in kv], dtype=torch.int64, device=gb.DEV)
    ptrs_t = torch.tensor([t.data_ptr() for t in kv_t], dtype=torch.int64, device=gb.DEV)

    sp = [(s, min(s + CHUNK, n)) for s in range(0, n, CHUNK)]
    sl = slots[:n].contiguous()
    sl_host = sl.cpu()
    seq_sl_host = torch.arange(n) + BS  # blocks 1, 2, 3 ... in order
    nbytes = object_spec(layout, n).nbytes

    def reference_object(s_: torch.Tensor) -> torch.Tensor:
        out = torch.empty((2, L, n, HD), dtype=torch.bfloat16, device=gb.DEV)
        reference.gather(kv, Move.gather(layout, s_.to(gb.DEV), [(0, n)], [out]))
        return gb.bits(out.cpu())

    want_h, want_seq_h = reference_object(sl), reference_object(seq_sl_host)

    def runs_of(r: int) -> torch.Tensor:
        """Slots through runs of ``r`` blocks in order, the runs shuffled (distinct, never block 0)."""
        g = torch.Generator().manual_seed(r)
        firsts = torch.randperm((nb - 1) // r, generator=g)[: -(-n // (BS * r))] * r + 1
        blocks = (firsts[:, None] + torch.arange(r)).reshape(-1)
        pos = torch.arange(n)
        return blocks[pos // BS] * BS + pos % BS

    runs_sl = {r: runs_of(r) for r in (4, 8)}
    want_runs = {r: reference_object(x) for r, x in runs_sl.items()}

    def retrieved(kvx: list[torch.Tensor], s_: torch.Tensor, lay: Any = layout) -> torch.Tensor:
        back = torch.empty((2, L, n, HD), dtype=torch.bfloat16, device=gb.DEV)
        reference.gather(kvx, Move.gather(lay, s_.to(gb.DEV), [(0, n)], [back]))
        return gb.bits(back.cpu())

    chunk_spec = object_spec(layout, sp[0][1] - sp[0][0])
    paths: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
    keep: list[Any] = []  # the L1 caches whose objects the paths move
    side = torch.cuda.Stream()
    checks: dict[str, bool] = {}
    queued_paths: set[str] = set()  # paths that return before their copies are done (the rest wait for them)
    meta: dict[str, Any] = {}

    def l1_objects(name: str) -> list[torch.Tensor]:
        l1 = L1Cache(len(sp) * chunk_spec.nbytes, chunk_spec.nbytes, pinned=True)
        keep.append(l1)
        reserved = [l1.reserve_write(f"{name}{i}", object_spec(layout, e - s)) for i, (s, e) in enumerate(sp)]
        return [o.tensor() for o in reserved if o is not None]

    def check(
        name: str,
        houts: list[torch.Tensor],
        ref: torch.Tensor,
        kvx_t: list[torch.Tensor],
        s_: torch.Tensor,
        store: Callable[[], object],
        load: Callable[[], object],
        lay: Any = layout,
        ref_back: torch.Tensor | None = None,
    ) -> bool:
        """Run ``store`` then ``load`` once (a hang ends the child like a sample's); record whether both are
        bit-exact (the retrieve against ``ref_back``, default ``ref``); True if they ran."""
        emit(event="start", key=f"{name}:setup")
        faulthandler.dump_traceback_later(args.sample_budget, exit=True)
        try:
            for o in houts:
                gb.bits(o).fill_(-1)
            with torch.cuda.stream(side):  # as the mover runs them (batched copies refuse the legacy stream)
                store()
            torch.cuda.synchronize()
            checks[f"{name}_store"] = torch.equal(gb.bits(torch.cat(houts, dim=2)), ref)
            for t in kvx_t:
                t.zero_()
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                load()
            torch.cuda.synchronize()
            checks[f"{name}_retrieve"] = torch.equal(
                retrieved(kvx_t, s_, lay), ref if ref_back is None else ref_back
            )
        except Exception as exc:  # recorded; the other paths still run
            emit(event="error", key=f"{name}:setup", error=repr(exc))
            return False
        finally:
            faulthandler.cancel_dump_traceback_later()
        emit(event="ready", key=f"{name}:setup")
        return True

    # tiercache through dispatch: slots on the host (the connector's case) and on the device
    def add_dispatch(
        name: str,
        kvx: list[torch.Tensor],
        kvx_t: list[torch.Tensor],
        s_: torch.Tensor,
        setting: dict[str, Any] | None = None,
        lay: Any = layout,
        ref: torch.Tensor | None = None,
        ref_back: torch.Tensor | None = None,
    ) -> None:
        """Measure ``name``: dispatch's gather / scatter of ``lay`` (slots ``s_``) into L1 objects, with
        ``setting``'s module attributes set while it is prepared; ``ref`` / ``ref_back``: the bytes it must
        store and give back (default: the per-layer KV's)."""
        if name in skip:
            return
        houts = l1_objects(name)
        g, s = Move.gather(lay, s_, sp, houts), Move.scatter(lay, s_, sp, houts)
        saved = {k: getattr(mod, k) for mod, k in (setting or {}).get("attrs", [])}
        for (mod, k), v in zip(
            (setting or {}).get("attrs", []), (setting or {}).get("values", []), strict=True
        ):
            setattr(mod, k, v)
        try:
            ok = check(
                name,
                houts,
                want_h if ref is None else ref,
                kvx_t,
                sl,
                lambda: dispatch.gather(kvx, g),
                lambda: dispatch.scatter(kvx_t, s),
                lay,
                ref_back,
            )
        finally:
            for mod, k in (setting or {}).get("attrs", []):
                setattr(mod, k, saved[k])
        if ok:  # prepared under those settings: later runs keep to them
            ran = block_pages.as_pages(kvx, g)[1]
            taken = [p[2] for p in ran.prepared.values() if isinstance(p, tuple) and len(p) > 2]
            meta.setdefault("dispatch_picked", {})[name] = [type(t).__name__ for t in taken] or [
                type(p).__name__ for p in ran.prepared.values()
            ]
            for t in taken:
                if isinstance(t, copy_engine.CopyMove):
                    meta.setdefault("copies_per_move", {})[name] = t.issued
                    meta.setdefault("mean_row_bytes", {})[name] = t.mean_row_bytes
                    meta.setdefault("batched", {})[name] = t.batched
            paths[name] = (lambda: dispatch.gather(kvx, g), lambda: dispatch.scatter(kvx_t, s))

    big = 1 << 62
    zc_attrs = [
        (dispatch, "PIECED_MIN_BYTES"),
        (dispatch, "PIECED_MAX_BYTES"),
        (layer_pieces, "PIECES"),
        (dispatch, "ZERO_COPY_BYTES"),
        (dispatch, "HOST_PATH"),
    ]
    add_dispatch("tiercache", kv, kv_t, sl_host)
    add_dispatch(
        "tiercache_kernels", kv, kv_t, sl_host, {"attrs": [(dispatch, "HOST_PATH")], "values": ["kernel"]}
    )
    probe = torch.empty((2, L, n, HD), dtype=torch.bfloat16, device="meta")

    def layer_pitch(layers: list[torch.Tensor]) -> int | None:
        """The one pitch these layer tensors lie at, None where they lie apart."""
        geo = copy_engine.geometry(layers, Move.gather(layout, sl_host, [(0, n)], [probe]))
        return None if geo is None else geo.layer_pitch

    meta["vllm_like_allocations_layer_pitch"] = layer_pitch(kv)
    # vLLM's own allocation, one int8 torch.zeros per layer back to back at start-up: at one pitch?
    zeros = [torch.zeros(kv[0].numel() * ELEM, dtype=torch.int8, device=gb.DEV) for _ in range(L)]
    meta["vllm_zeros_allocations_layer_pitch"] = layer_pitch(
        [z.view(torch.bfloat16).view(kv[0].shape) for z in zeros]
    )
    del zeros

    # the copy-engine path of the library, forced
    ce_paths = [
        ("copy_engine", kv1, kv1_t, sl_host, want_h, True, False),
        ("copy_engine_per_layer", kv, kv_t, sl_host, want_h, False, False),
        ("copy_engine_sequential", kv1, kv1_t, seq_sl_host, want_seq_h, True, False),
        ("copy_engine_runs8", kv1, kv1_t, runs_sl[8], want_runs[8], True, False),
        ("copy_engine_runs4", kv1, kv1_t, runs_sl[4], want_runs[4], True, False),
        ("copy_engine_batched", kv1, kv1_t, sl_host, want_h, True, True),
        ("copy_engine_batched_runs8", kv1, kv1_t, runs_sl[8], want_runs[8], True, True),
        ("copy_engine_batched_sequential", kv1, kv1_t, seq_sl_host, want_seq_h, True, True),
    ]
    ce_streams_ks = [int(x) for x in args.ce_streams.split(",") if x]
    streams_of = {f"copy_engine_batched_streams{k}": k for k in ce_streams_ks}
    ce_paths += [(name, kv1, kv1_t, sl_host, want_h, True, True) for name in streams_of]
    for name, kvx, kvx_t, s_, ref, rows, batched in ce_paths:
        if name in skip:
            continue
        houts = l1_objects(name)
        try:
            kw: dict[str, Any] = {"layer_rows": rows, "batched": batched, "streams": streams_of.get(name, 1)}
            cg = copy_engine.prepare(kvx, Move.gather(layout, s_, sp, houts), **kw)
            cs = copy_engine.prepare(kvx_t, Move.scatter(layout, s_, sp, houts), **kw)
        except Exception as exc:
            emit(event="error", key=f"{name}:setup", error=repr(exc))
            continue
        if cg is None or cs is None:
            emit(event="error", key=f"{name}:setup", error="copy_engine.prepare: not applicable")
            continue
        meta.setdefault("copies_per_move", {})[name] = cg.issued
        meta.setdefault("batched", {})[name] = cg.batched
        meta.setdefault("mean_row_bytes", {})[name] = cg.mean_row_bytes
        if check(name, houts, ref, kvx_t, s_, cg.run, cs.run):
            paths[name] = (cg.run, cs.run)

    # vLLM's own layout since its layout standardization: [NB, H, BS, K|V] views of NHD allocations
    flay, kvf, _, rawf = gb.make_engine(LayoutKind.VLLM_FLASH, L, H, D, seed=23)
    _, kvf_t, _, rawf_t = gb.make_engine(LayoutKind.VLLM_FLASH, L, H, D, seed=24)

    def flash_one_buffer(raw: list[torch.Tensor]) -> list[torch.Tensor]:
        buf = torch.empty((len(raw), *raw[0].shape), dtype=raw[0].dtype, device=gb.DEV)
        for i, t in enumerate(raw):
            buf[i].copy_(t)
        return [b.permute(0, 2, 1, 3) for b in buf.unbind(0)]

    kvf1, kvf1_t = flash_one_buffer(rawf), flash_one_buffer(rawf_t)
    out_f = torch.empty((2, L, n, HD), dtype=torch.bfloat16, device=gb.DEV)
    reference.gather(kvf, Move.gather(flay, sl.to(gb.DEV), [(0, n)], [out_f]))
    want_f = gb.bits(out_f.cpu())
    del out_f
    if "copy_engine_flash" not in skip:
        houts = l1_objects("copy_engine_flash")
        cg = copy_engine.prepare(kvf1, Move.gather(flay, sl_host, sp, houts))
        cs = copy_engine.prepare(kvf1_t, Move.scatter(flay, sl_host, sp, houts))
        if cg is None or cs is None:
            emit(event="error", key="copy_engine_flash:setup", error="copy_engine.prepare: not applicable")
        else:
            meta.setdefault("copies_per_move", {})["copy_engine_flash"] = cg.issued
            meta.setdefault("batched", {})["copy_engine_flash"] = cg.batched
            meta.setdefault("mean_row_bytes", {})["copy_engine_flash"] = cg.mean_row_bytes
            if check("copy_engine_flash", houts, want_f, kvf1_t, sl, cg.run, cs.run, flay):
                paths["copy_engine_flash"] = (cg.run, cs.run)
    add_dispatch("tiercache_flash", kvf, kvf_t, sl_host, lay=flay, ref=want_f)

    # vLLM's block-outermost BLNHC allocation (the connector's kv_layout = "blocks"): objects of whole blocks
    if "tiercache_blocks" not in skip:
        blay = PagedLayout(LayoutKind.VLLM_BLOCKS, L, H, D, BS, "bfloat16")
        page = BS * HD * 2  # elements of one layer's page of a block

        def blnhc(seed: int) -> list[torch.Tensor]:
            g = torch.Generator(device=gb.DEV).manual_seed(seed)
            buf = torch.randint(
                -30000, 30000, (nb * L * page,), generator=g, device=gb.DEV, dtype=torch.int16
            )
            flat = buf.view(torch.bfloat16)
            return [
                flat.as_strided((nb, H, BS, 2 * D), (L * page, 2 * D, H * 2 * D, 1), i * page)
                for i in range(L)
            ]

        kvb, kvb_t = blnhc(25), blnhc(26)
        outs_b = [torch.empty((2, L, e - s, HD), dtype=torch.bfloat16, device=gb.DEV) for s, e in sp]
        reference.gather(kvb, Move.gather(blay, sl.to(gb.DEV), sp, outs_b))
        want_b = gb.bits(torch.cat(outs_b, dim=2).cpu())  # the objects side by side, as check compares them
        want_b_back = retrieved(kvb, sl, blay)
        del outs_b
        add_dispatch("tiercache_blocks", kvb, kvb_t, sl_host, lay=blay, ref=want_b, ref_back=want_b_back)
    if "tiercache_blocks" not in skip and "copy_engine_blocks_2d" not in skip:  # the same copies one by one
        houts = l1_objects("copy_engine_blocks_2d")
        view, pg = block_pages.as_pages(kvb, Move.gather(blay, sl_host, sp, houts))
        view_t, ps = block_pages.as_pages(kvb_t, Move.scatter(blay, sl_host, sp, houts))
        cg, cs = copy_engine.prepare(view, pg), copy_engine.prepare(view_t, ps)
        if cg is None or cs is None:
            emit(
                event="error", key="copy_engine_blocks_2d:setup", error="copy_engine.prepare: not applicable"
            )
        else:
            meta.setdefault("copies_per_move", {})["copy_engine_blocks_2d"] = cg.issued
            meta.setdefault("batched", {})["copy_engine_blocks_2d"] = cg.batched
            if check("copy_engine_blocks_2d", houts, want_b, kvb_t, sl, cg.run, cs.run, blay, want_b_back):
                paths["copy_engine_blocks_2d"] = (cg.run, cs.run)

    if lmc is not None and "lmcache" not in skip:
        lhost = torch.empty((2, L, n, HD), dtype=torch.bfloat16, pin_memory=True)
        sl_dev = sl.to(gb.DEV)

        def lstore() -> None:
            lmc.multi_layer_kv_transfer(lhost, ptrs, sl_dev, n_slots, D2H, 1, BS, D)

        def lload() -> None:
            lmc.multi_layer_kv_transfer(lhost, ptrs_t, sl_dev, n_slots, H2D, 1, BS, D)

        if check("lmcache", [lhost], want_h, kv_t, sl, lstore, lload):
            paths["lmcache"] = (lstore, lload)
            queued_paths.add("lmcache")

    # cudaMemcpyBatchAsync / cudaMemcpyAsync per contiguous block run and layer and plane
    def block_runs(kvx: list[torch.Tensor], table: np.ndarray, obj: torch.Tensor) -> tuple[np.ndarray, ...]:
        starts = [0] + [j for j in range(1, len(table)) if table[j] != table[j - 1] + 1]
        ends = [*starts[1:], len(table)]
        block = BS * HD * ELEM
        kv_at, obj_at, size = [], [], []
        base = obj.data_ptr()
        for plane in range(2):
            for layer in range(L):
                lb = kvx[layer].data_ptr()
                for s0, e0 in zip(starts, ends, strict=True):
                    kv_at.append(lb + (plane * nb + int(table[s0])) * block)
                    obj_at.append(base + ((plane * L + layer) * n + s0 * BS) * HD * ELEM)
                    size.append((e0 - s0) * block)
        return tuple(np.array(x, dtype=np.uint64) for x in (kv_at, obj_at, size))

    def ce_call(batch: bool, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> Callable[[], None]:
        cnt = len(size)
        dp, spp, zp = dst.ctypes.data, src.ctypes.data, size.ctypes.data
        kept = (dst, src, size)

        def run() -> None:
            assert kept
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            rc = ce.ce_batch(dp, spp, zp, cnt, 1, stream) if batch else ce.ce_loop(dp, spp, zp, cnt, stream)
            if rc:
                raise RuntimeError(f"copy-engine move failed: cudaError {rc}")

        return run

    def ce_streams(k: int, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> Callable[[], None]:
        """The copies cut into ``k`` batches in a row, each on its own stream after the current one's work,
        the current stream waiting for all of them."""
        cuts = np.array_split(np.arange(len(size)), k)
        parts = [(dst[c].copy(), src[c].copy(), size[c].copy()) for c in cuts if len(c)]
        streams = [torch.cuda.Stream() for _ in parts]
        calls = [ce_call(True, *p) for p in parts]

        def run() -> None:
            cur = torch.cuda.current_stream()
            for st, call in zip(streams, calls, strict=True):
                st.wait_stream(cur)
                with torch.cuda.stream(st):
                    call()
            for st in streams:
                cur.wait_stream(st)

        return run

    for tname, s_, ref in (("", sl_host, want_h), ("_sequential", seq_sl_host, want_seq_h)):
        tab = (s_[::BS] // BS).numpy()
        host = torch.empty((2, L, n, HD), dtype=torch.bfloat16, pin_memory=True)
        kv_at, obj_at, size = block_runs(kv, tab, host)
        kvt_at, _, _ = block_runs(kv_t, tab, host)
        for batch in (True, False):
            name = ("copy_engine_batch" if batch else "copy_engine_loop") + tname
            if name in skip or (not batch and n > 1024):
                continue
            meta.setdefault("copies_per_move", {})[name] = len(size)
            st, ld = ce_call(batch, obj_at, kv_at, size), ce_call(batch, kvt_at, obj_at, size)
            if check(name, [host], ref, kv_t, s_, st, ld):
                paths[name] = (st, ld)
                queued_paths.add(name)
        for k in ce_streams_ks:
            name = f"copy_engine_batch{tname}_streams{k}"
            if name in skip:
                continue
            meta.setdefault("copies_per_move", {})[name] = len(size)
            st, ld = ce_streams(k, obj_at, kv_at, size), ce_streams(k, kvt_at, obj_at, size)
            if check(name, [host], ref, kv_t, s_, st, ld):
                paths[name] = (st, ld)
                queued_paths.add(name)

    if "pinned_copy" not in skip:
        hbuf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dbuf = torch.empty(nbytes, dtype=torch.uint8, device=gb.DEV).random_(1, 255)
        queued_paths.add("pinned_copy")
        paths["pinned_copy"] = (
            lambda: hbuf.copy_(dbuf, non_blocking=True),
            lambda: dbuf.copy_(hbuf, non_blocking=True),
        )

    # the device-slot paths last (the object pipeline is where a 4096-token run stopped before)
    add_dispatch("tiercache_device_slots", kv, kv_t, sl)
    add_dispatch("over_the_bus", kv, kv_t, sl, {"attrs": zc_attrs, "values": [big, big, 2, big, "kernel"]})
    add_dispatch("object_pipeline", kv, kv_t, sl, {"attrs": zc_attrs, "values": [big, big, 2, 0, "kernel"]})
    # the same paths with the mover's stream in a green context of K SMs: their kernels run on those SMs only
    mover_streams: dict[str, torch.cuda.Stream] = {}
    for k in (int(x) for x in args.mover_sms.split(",") if x):
        try:
            green = green_stream(k)
        except Exception as exc:  # recorded; the other paths still run
            emit(event="error", key=f"sms{k}:setup", error=repr(exc))
            continue
        for base in filter(None, args.green_paths.split(",")):
            name = f"{base}_sms{k}"
            if base in paths and name not in skip:
                paths[name] = paths[base]
                if base in queued_paths:
                    queued_paths.add(name)
                mover_streams[name] = green
    paths = {k: v for k, v in paths.items() if k not in SLOW_PATHS} | {
        k: v for k, v in paths.items() if k in SLOW_PATHS
    }  # the slow ones last: a size's budget ends there if anywhere
    meta["queued_paths"] = sorted(queued_paths)
    emit(event="meta", bytes=nbytes, bit_exact=checks, **meta)

    for r in range(args.rounds):
        for name in paths:
            for d, fn in zip(("store", "retrieve"), paths[name], strict=True):
                key = f"{name}:{d}"
                emit(event="start", key=key, round=r)
                faulthandler.dump_traceback_later(args.sample_budget, exit=True)
                try:
                    waits = name not in queued_paths
                    alone = alone_rate(fn, nbytes, args.alone_seconds, mover_streams.get(name), waits)
                    emit(event="alone", key=key, round=r, alone_GBps=alone)
                    if r and name in SLOW_PATHS:  # one round with the model: it starves the model for seconds
                        emit(event="ready", key=key)
                        continue
                    before = model.forwards_s(args.forwards)
                    fwd, with_rate = together(
                        model, fn, nbytes, args.forwards, mover_streams.get(name), waits
                    )
                    after = model.forwards_s(args.forwards)  # drift between the windows cancels
                    base = (before + after) / 2
                except Exception as exc:  # recorded; the other paths still run
                    emit(event="error", key=key, error=repr(exc))
                    continue
                finally:
                    faulthandler.cancel_dump_traceback_later()
                emit(
                    event="sample",
                    key=key,
                    round=r,
                    forward_alone_s=base,
                    forward_alone_spread=abs(after - before) / base,
                    forward_s=fwd,
                    with_model_GBps=with_rate,
                )
                log(
                    f"{n} {key} round {r}: model {100 * (fwd / base - 1):+.1f} %, alone {alone:.1f} GB/s, "
                    f"with model {with_rate:.1f} GB/s"
                )
    emit(event="done")


_GREEN: list[Any] = []  # the green contexts of the child's mover streams, alive as long as it runs


def green_stream(sms: int) -> Any:
    """A stream of a new CUDA green context of ``sms`` SMs: kernels issued on it run on those SMs only."""
    import torch
    from torch.cuda import green_contexts

    api: Any = green_contexts  # its signature changed between torch releases
    try:
        ctx = api.GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())
    except TypeError:
        ctx = api.GreenContext.create(sms, torch.cuda.current_device())
    _GREEN.append(ctx)
    if hasattr(ctx, "Stream"):
        return ctx.Stream()
    ctx.set_context()
    try:
        return torch.cuda.current_stream()
    finally:
        ctx.pop_context()


# ------------------------------------------------------------------------------------------ the parent


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """One size's row from its children's events: medians per path and direction, ratios to the pinned
    copy's rates and the model's time alone in the same rounds."""
    row: dict[str, Any] = {}
    samples: dict[str, list[dict[str, Any]]] = {}
    alones: dict[str, list[float]] = {}
    for ev in events:
        if ev["event"] == "meta":
            for k, v in ev.items():
                if k == "bit_exact":
                    row.setdefault("bit_exact", {}).update(v)
                elif k != "event":
                    row[k] = v
        elif ev["event"] == "sample":
            samples.setdefault(ev["key"], []).append(ev)
        elif ev["event"] == "alone":
            alones.setdefault(ev["key"], []).append(ev["alone_GBps"])
        elif ev["event"] == "error":
            row.setdefault("errors", {})[ev["key"]] = ev["error"]
        elif ev["event"] == "model":
            row["model_forward_ms"] = ev["forward_ms"]
            row["model_TFLOPs"] = ev["TFLOPs"]
        elif ev["event"] == "hung":
            row.setdefault("hung", []).append(ev["key"])
    ceil = {}
    for d in ("store", "retrieve"):
        if alones.get(f"pinned_copy:{d}"):
            ceil[d] = statistics.median(alones[f"pinned_copy:{d}"])
    row["pinned_ceiling_GBps"] = ceil
    for key in sorted(set(alones) | set(samples), key=lambda k: list(alones).index(k) if k in alones else 0):
        name, d = key.split(":")
        cell: dict[str, Any] = {}
        if alones.get(key):
            alone = statistics.median(alones[key])
            cell["alone_GBps"] = round(alone, 2)
            if d in ceil:
                cell["alone_vs_pinned_ceiling"] = round(alone / ceil[d], 3)
        smp = samples.get(key, [])
        if smp:
            with_m = statistics.median(s["with_model_GBps"] for s in smp)
            slow = [s["forward_s"] / s["forward_alone_s"] - 1 for s in smp]
            cell["with_model_GBps"] = round(with_m, 2)
            if d in ceil:
                cell["with_model_vs_pinned_ceiling"] = round(with_m / ceil[d], 3)
            cell["model_slowdown_percent"] = round(100 * statistics.median(slow), 2)
            cell["model_slowdown_rounds_percent"] = [round(100 * x, 2) for x in slow]
            spread = statistics.median(s["forward_alone_spread"] for s in smp)
            cell["model_alone_spread_percent"] = round(100 * spread, 2)
        cell["rounds"] = {"alone": len(alones.get(key, [])), "with_model": len(smp)}
        row.setdefault("paths", {}).setdefault(name, {})[d] = cell
    return row


def run_size(args: argparse.Namespace, n: int, ce_lib: str) -> dict[str, Any]:
    """Children for size ``n`` until one finishes or the size's budget is spent; each restart skips the
    paths that hung and those already measured in every round."""
    deadline = time.monotonic() + args.size_budget
    events: list[dict[str, Any]] = []
    skip: list[str] = [p for p in args.skip_paths.split(",") if p]
    if not args.every_path:
        skip += [p for p in EXPLORATION_PATHS if p not in skip]
    for attempt in range(4):
        left = deadline - time.monotonic()
        if left < 20:
            break
        counts: dict[str, int] = {}
        for ev in events:
            if ev["event"] == "alone":
                counts[ev["key"]] = counts.get(ev["key"], 0) + 1
        done_paths = {k.split(":")[0] for k in counts}
        done_paths = {
            p
            for p in done_paths
            if min(counts.get(f"{p}:{d}", 0) for d in ("store", "retrieve")) >= args.rounds
        }
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--size",
            str(n),
            "--ce-lib",
            ce_lib,
            "--skip",
            ",".join([*skip, *sorted(done_paths)]),
            "--model-tokens",
            str(args.model_tokens),
            "--layers",
            str(args.layers),
            "--forwards",
            str(args.forwards),
            "--rounds",
            str(args.rounds),
            "--sample-budget",
            str(args.sample_budget),
            "--alone-seconds",
            str(args.alone_seconds),
        ]
        if args.lmcache_src:
            cmd += ["--lmcache-src", args.lmcache_src]
        cmd += [
            "--mover-sms",
            args.mover_sms,
            "--green-paths",
            args.green_paths,
            "--ce-streams",
            args.ce_streams,
        ]
        log(f"=== {n} tokens, attempt {attempt}, skipping {skip or 'nothing'}, {left:.0f} s left")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        started: str | None = None
        done = False
        timer = threading.Timer(left, proc.kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev["event"] == "start":
                    started = ev["key"]
                    continue
                if ev["event"] in ("sample", "error", "ready") and ev.get("key") == started:
                    started = None
                if ev["event"] == "done":
                    done = True
                if attempt and ev["event"] in ("meta", "model"):
                    continue  # the first child's
                events.append(ev)
            rc = proc.wait()
        finally:
            timer.cancel()
        if done:
            break
        if started is None:
            events.append({"event": "error", "key": f"child{attempt}", "error": f"exit status {rc}"})
            break
        path = started.split(":")[0]
        events.append({"event": "hung", "key": started})
        log(f"=== {n} tokens: {started} outlasted its budget or the size's (exit {rc}); skipping {path}")
        skip.append(path)
    return summarize(events)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--lmcache-src", default=None, help="unpacked LMCache 0.5.6 source (csrc/cuda)")
    ap.add_argument("--sizes", default="256,4096", help="tokens per move")
    ap.add_argument("--model-tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--forwards", type=int, default=8, help="forwards per timed window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--alone-seconds", type=float, default=0.15, help="window of a path's rate alone")
    ap.add_argument("--sample-budget", type=float, default=20.0, help="seconds one sample may take")
    ap.add_argument(
        "--size-budget", type=float, default=150.0, help="seconds for one size, restarts included"
    )
    ap.add_argument("--skip-paths", default="", help="paths not to measure (comma-separated)")
    ap.add_argument("--every-path", action="store_true", help="also measure EXPLORATION_PATHS")
    ap.add_argument(
        "--mover-sms", default="", help="also run --green-paths on a green context of each of these SM counts"
    )
    ap.add_argument("--green-paths", default="tiercache,tiercache_device_slots,object_pipeline")
    ap.add_argument(
        "--ce-streams",
        default="",
        help="copy_engine_batch cut into each of these batch counts, on as many streams",
    )
    ap.add_argument("--out", default=None, help="write the JSON here after every size (else print it)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--skip", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ce-lib", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        faulthandler.enable()
        child(args)
        return
    import torch

    work = Path(tempfile.mkdtemp(prefix="gpu_overlap_"))
    os.environ.setdefault("LMCACHE_BUILD_DIR", str(work / "lmc"))
    so = work / "ce_batch.so"
    subprocess.run(
        ["nvcc", "-O2", "-shared", "-Xcompiler", "-fPIC", "-o", str(so), str(HERE / "ce_batch.cu")],
        check=True,
    )
    if args.lmcache_src:  # built once here; every child loads the same build
        from vs_lmcache import build_lmcache_kernels

        build_lmcache_kernels(Path(args.lmcache_src))
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
            "forwards_per_window": args.forwards,
        },
        "sizes": {},
    }
    for n in (int(x) for x in args.sizes.split(",")):
        t0 = time.monotonic()
        res["sizes"][f"{n}_tokens"] = run_size(args, n, str(so))
        res["sizes"][f"{n}_tokens"]["seconds"] = round(time.monotonic() - t0, 1)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    if not args.out:
        print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
