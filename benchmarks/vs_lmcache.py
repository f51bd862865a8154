"""tiercache beside LMCache 0.5.6, in one process, on the same workload (shared/reference: lmcache-bench.md).

Workload: Llama-8B shape (32 layers, 8 KV heads, head_dim 128, bf16, block 16), 256-token chunks; medians of
interleaved rounds (A, B, B, A, ...), every transfer checked bit-exact against the other contender.

``gpu`` (a CUDA machine): LMCache's ``csrc/cuda/mem_kernels.cu`` is compiled at run time, unmodified, from
the unpacked LMCache 0.5.6 source the user names (``--lmcache-src``; ``pip download --no-deps --no-binary
:all: --no-clean lmcache==0.5.6`` leaves it in pip's temporary folder), with ``torch.utils.cpp_extension``
and a one-function binding written here; nothing of LMCache is part of this repository. Its
``multi_layer_kv_transfer`` (paged format 1 = per-layer ``[2, NB, BS, H, D]``, objects ``[2, L, T, H*D]``)
runs beside tiercache's ``dispatch`` calls on the same paged KV (tiercache's VLLM_LEGACY layout is that
format, its KV_2LTD objects those bytes): at 256, 1024 and 4096 tokens, gather and scatter (device objects)
and to / from pinned host memory (LMCache: its kernel reading/writing a pinned tensor in place; tiercache:
the staged pipeline into L1 objects), each by device time (CUDA events, a GPU sleep queued first) and by
whole-call wall time. LMCache moves one contiguous object per call (its best case); tiercache one object per
256-token chunk, as its engine stores them.

Usage: ``python benchmarks/vs_lmcache.py gpu --lmcache-src DIR > benchmarks/results/vs_lmcache_gpu.json``.

``cpu``: L1 store / retrieve through tiercache's engine (native CPU row kernel, ``gpu/_rowcopy.c``) beside
LMCache's standalone engine, in a venv that has both (``pip install -e '.[vs-lmcache]'``; LMCache keeps the
CPU torch). Run here from a separate venv holding LMCache, with the working tree on ``PYTHONPATH`` as a
package tree: ``PYTHONPATH=TREE [OMP_NUM_THREADS=1] python benchmarks/vs_lmcache.py cpu [--tokens 256]
[--layout cpu_blocks] [--lookup-tokens 0] > benchmarks/results/vs_lmcache_cpu*.json``, where
``TREE/tiercache`` holds links to ``tiercache/*`` plus ``gpu``, ``serde`` and ``adapters`` (the ``_rowcopy``
library built in place by the editable install sits in ``gpu/``). ``--store-kinds 1,0`` adds tiercache with
the kernel's other store kinds (``cpu_rows.STORES``) as contenders of the same rounds; ``--l1 same`` gives
tiercache's L1 LMCache's capacity (default: one request and two chunks), ``--peer evict`` leaves LMCache full
(default: cleared after each round). Before every timed op 600 MiB of scratch memory is read (untimed), so
that every op starts from the same memory state (``--settle MiB`` to change it, 0 for none: then an op's
time depends on the op before it, see the option's help); ``--own-source`` adds a bare copy from a source no
other contender reads, as no other reads tiercache's paged KV. ``--peer-kernel tiercache`` gives LMCache's
stand-in connector tiercache's row kernel on the same paged KV, by the same slot mapping, in the same calls
(``--peer-kv contiguous``: over a contiguous copy of the KV instead): equal copy work, and each op's time is
split into the copy and the engine's own work (``split_ms``). Each result also carries every round's ratio,
each op's minor page faults and where each engine's objects lie (``memory``: the mapping's size and huge-page
MiB, the offset in a 2 MiB page); ``--l1-huge off`` puts L1's pool on a plain 4 KiB-page allocation (the A/B
of its transparent huge pages).

``cpu --tiny``: each engine's own per-call host cost: store, lookup and retrieve of one 256-token chunk of
tiny KV (``TINY_SHAPE``: 8 KiB a chunk, so the copies cost next to nothing), ``--calls`` calls of each op per
round, contenders alternating; tiercache awaited in a running loop (as the vLLM connector's loop thread runs
it) and as a sync caller pays it (``run_until_complete`` per store and retrieve, ``lookup_hit_now`` for a
lookup), LMCache's sync engine called directly (its per-call INFO log
off). ``PYTHONHASHSEED=0 python benchmarks/vs_lmcache.py cpu --tiny [--rounds 7] [--calls 300]
> benchmarks/results/vs_lmcache_cpu_tiny.json`` (a venv holding LMCache 0.5.6 and tiercache; PYTHONPATH as
above works too).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from _common import contiguous_geometry, flash_kv

_BINDING = r"""
#include <torch/extension.h>
#include "mem_kernels.cuh"

void transfer(torch::Tensor key_value, const torch::Tensor& ptrs, const torch::Tensor& slots,
              int64_t page_buffer_size, int64_t direction, int64_t fmt, int64_t block_size,
              int64_t head_size) {
  multi_layer_kv_transfer(key_value, ptrs, slots, ptrs.device(), (int)page_buffer_size,
                          static_cast<TransferDirection>(direction), static_cast<EngineKVFormat>(fmt),
                          (int)block_size, (int)head_size);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("multi_layer_kv_transfer", &transfer); }
"""

H2D, D2H, FORMAT_LAYER_2_NB_BS_H_D = 0, 1, 1


def build_lmcache_kernels(src: Path) -> Any:
    """Compile LMCache's mem_kernels.cu (unmodified) plus the binding above; returns the module."""
    from torch.utils.cpp_extension import load

    cuda = src / "csrc" / "cuda"
    if not (cuda / "mem_kernels.cu").is_file():
        raise SystemExit(f"{cuda / 'mem_kernels.cu'} not found: --lmcache-src must be LMCache 0.5.6's source")
    kept = os.environ.get("LMCACHE_BUILD_DIR")  # one build for several scripts of a run
    work = Path(kept) if kept else Path(tempfile.mkdtemp(prefix="lmc_build_"))
    work.mkdir(parents=True, exist_ok=True)
    binding = work / "binding.cpp"
    binding.write_text(_BINDING)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    return load(
        name="lmc_mem_kernels",
        sources=[str(binding), str(cuda / "mem_kernels.cu")],
        extra_include_paths=[str(src / "csrc"), str(cuda)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"],
        build_directory=str(work),
        verbose=False,
    )


# the contenders whose calls wait for their own device work (tiercache's checked moves read their kernels'
# slot flags; its pinned moves wait for the copies): timed until they return, the device checked idle then.
# LMCache's and tiercache's trusted calls are asynchronous: timed until a torch.cuda.synchronize() after them.
WAITS_ITSELF = frozenset({"tiercache"})


def gpu(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_bench as gb  # the device timers and the engine maker of the GPU benchmark

    from tiercache.gpu import LayoutKind, Move, dispatch, object_spec, reference
    from tiercache.store.l1 import L1Cache

    lmc = build_lmcache_kernels(Path(args.lmcache_src))
    gb.log("LMCache mem_kernels built")
    L, H, D, CH, BS = gb.L, gb.H, gb.D, gb.CHUNK, gb.BS
    layout, kv, slots, _ = gb.make_engine(LayoutKind.VLLM_LEGACY, L, H, D, seed=11)
    _, kv_t, slots_b, _ = gb.make_engine(LayoutKind.VLLM_LEGACY, L, H, D, seed=12)
    _, kv_l, _, _ = gb.make_engine(LayoutKind.VLLM_LEGACY, L, H, D, seed=13)
    ptrs_src = torch.tensor([t.data_ptr() for t in kv], dtype=torch.int64, device=gb.DEV)
    ptrs_l = torch.tensor([t.data_ptr() for t in kv_l], dtype=torch.int64, device=gb.DEV)
    n_slots = gb.NB * gb.BS
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "lmcache": "0.5.6 csrc/cuda/mem_kernels.cu (multi_layer_kv_transfer, format 1), built here",
        "shape": {"layers": L, "kv_heads": H, "head_dim": D, "dtype": "bfloat16", "block_size": gb.BS},
        "rounds": args.rounds,
        "sizes": {},
    }
    bits = gb.bits
    for n in gb.SIZES:
        sp = [(s, s + CH) for s in range(0, n, CH)]
        sl, slb = slots[:n], slots_b[:n]
        nbytes = object_spec(layout, n).nbytes
        objs = [torch.empty(object_spec(layout, CH).shape, dtype=torch.bfloat16, device=gb.DEV) for _ in sp]
        lobj = torch.empty((2, L, n, H * D), dtype=torch.bfloat16, device=gb.DEV)
        chunk_bytes = object_spec(layout, CH).nbytes
        l1 = L1Cache(len(sp) * chunk_bytes, chunk_bytes, pinned=True)
        reserved = [l1.reserve_write(f"v{i}", object_spec(layout, CH)) for i in range(len(sp))]
        houts = [o.tensor() for o in reserved if o is not None]
        lhost = torch.empty((2, L, n, H * D), dtype=torch.bfloat16, pin_memory=True)
        hbuf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dbuf = torch.empty(nbytes, dtype=torch.uint8, device=gb.DEV).random_(1, 255)

        g_dev, s_dev = Move.gather(layout, sl, sp, objs), Move.scatter(layout, slb, sp, objs)
        g_host, s_host = Move.gather(layout, sl, sp, houts), Move.scatter(layout, slb, sp, houts)
        # trusted moves check no slot, as LMCache's kernel checks none
        tg_dev, ts_dev = (
            Move.gather(layout, sl, sp, objs, trusted=True),
            Move.scatter(layout, slb, sp, objs, trusted=True),
        )
        contenders = {
            "gather": {
                "tiercache": lambda: dispatch.gather(kv, g_dev),  # noqa: B023
                "tiercache_trusted": lambda: dispatch.gather(kv, tg_dev),  # noqa: B023
                "lmcache": lambda: lmc.multi_layer_kv_transfer(lobj, ptrs_src, sl, n_slots, D2H, 1, BS, D),  # noqa: B023
            },
            "scatter": {
                "tiercache": lambda: dispatch.scatter(kv_t, s_dev),  # noqa: B023
                "tiercache_trusted": lambda: dispatch.scatter(kv_t, ts_dev),  # noqa: B023
                "lmcache": lambda: lmc.multi_layer_kv_transfer(lobj, ptrs_l, slb, n_slots, H2D, 1, BS, D),  # noqa: B023
            },
            "to_pinned": {
                "tiercache": lambda: dispatch.gather(kv, g_host),  # noqa: B023
                "lmcache": lambda: lmc.multi_layer_kv_transfer(lhost, ptrs_src, sl, n_slots, D2H, 1, BS, D),  # noqa: B023
            },
            "from_pinned": {
                "tiercache": lambda: dispatch.scatter(kv_t, s_host),  # noqa: B023
                "lmcache": lambda: lmc.multi_layer_kv_transfer(lhost, ptrs_l, slb, n_slots, H2D, 1, BS, D),  # noqa: B023
            },
        }
        ceilings = {
            "to_pinned": gb.cuda_time(lambda: hbuf.copy_(dbuf, non_blocking=True), reps=20),  # noqa: B023
            "from_pinned": gb.cuda_time(lambda: dbuf.copy_(hbuf, non_blocking=True), reps=20),  # noqa: B023
        }
        row: dict[str, Any] = {"bytes": nbytes}
        for path, fns in contenders.items():
            for c, fn in fns.items():  # one untimed call each: compiles, and a crash names its path
                gb.log(f"first call: {n} tokens {path} {c}")
                fn()
                torch.cuda.synchronize()
            kinds = ("device", "wall", "back_to_back", "extra_sync", "stream_wait")
            times: dict[str, dict[str, list[float]]] = {c: {k: [] for k in kinds} for c in fns}
            order = list(fns)
            for r in range(args.rounds):
                for c in order if r % 2 == 0 else order[::-1]:
                    times[c]["device"].append(gb.cuda_time(fns[c], reps=20))
                    if c in WAITS_ITSELF:  # ready when it returns; also timed with a redundant sync after it
                        times[c]["wall"].append(gb.returns_time(fns[c], reps=51, warmup=3))
                        times[c]["extra_sync"].append(gb.wall_time(fns[c], reps=51, warmup=3))
                    else:  # asynchronous: until a synchronize; also until a wait on the stream alone
                        times[c]["wall"].append(gb.wall_time(fns[c], reps=51, warmup=3))
                        waited = gb.wall_time(fns[c], reps=51, warmup=3, wait=gb.stream_wait)
                        times[c]["stream_wait"].append(waited)
                    if path not in ceilings:  # device moves: also a step's calls made back to back
                        times[c]["back_to_back"].append(gb.back_to_back_time(fns[c], reps=3))
            entry: dict[str, Any] = {}
            for c, t in times.items():
                dev_t, wall_t = statistics.median(t["device"]), statistics.median(t["wall"])
                entry[c] = {
                    "device_GBps": nbytes / dev_t / gb.GB,
                    "call_wall_GBps": nbytes / wall_t / gb.GB,
                    "call_wall_worst_round_GBps": nbytes / max(t["wall"]) / gb.GB,
                    "host_cost_us": (wall_t - dev_t) * 1e6,
                }
                if t["extra_sync"]:
                    extra = statistics.median(t["extra_sync"])
                    entry[c]["call_with_extra_sync_GBps"] = nbytes / extra / gb.GB
                if t["stream_wait"]:
                    entry[c]["call_stream_wait_GBps"] = nbytes / statistics.median(t["stream_wait"]) / gb.GB
                if t["back_to_back"]:
                    entry[c]["back_to_back_GBps"] = nbytes / statistics.median(t["back_to_back"]) / gb.GB
                if path in ceilings:
                    entry[c]["call_vs_pinned_ceiling"] = ceilings[path] / wall_t
                    entry[c]["worst_round_vs_pinned_ceiling"] = ceilings[path] / max(t["wall"])
            entry["tiercache_vs_lmcache_call"] = (
                entry["tiercache"]["call_wall_GBps"] / entry["lmcache"]["call_wall_GBps"]
            )
            entry["tiercache_vs_lmcache_device"] = (
                entry["tiercache"]["device_GBps"] / entry["lmcache"]["device_GBps"]
            )
            if "tiercache_trusted" in entry:
                trusted, lmcache = entry["tiercache_trusted"], entry["lmcache"]
                entry["tiercache_trusted_vs_lmcache_stream_wait"] = (
                    trusted["call_stream_wait_GBps"] / lmcache["call_stream_wait_GBps"]
                )
                entry["tiercache_trusted_vs_lmcache_call"] = (
                    entry["tiercache_trusted"]["call_wall_GBps"] / entry["lmcache"]["call_wall_GBps"]
                )
                entry["tiercache_trusted_vs_lmcache_back_to_back"] = (
                    entry["tiercache_trusted"]["back_to_back_GBps"] / entry["lmcache"]["back_to_back_GBps"]
                )
            if path in ceilings:
                entry["pinned_ceiling_GBps"] = nbytes / ceilings[path] / gb.GB
            row[path] = entry
        # bit-exact: tiercache's chunk objects == LMCache's object; both scatters leave the same KV
        want = torch.empty((2, L, n, H * D), dtype=torch.bfloat16, device=gb.DEV)
        dispatch.gather(kv, g_dev)
        lmc.multi_layer_kv_transfer(lobj, ptrs_src, sl, n_slots, D2H, 1, BS, D)
        torch.cuda.synchronize()
        torch.cat(objs, dim=2, out=want)
        ok_g = torch.equal(bits(want), bits(lobj))
        dispatch.gather(kv, g_host)
        lmc.multi_layer_kv_transfer(lhost, ptrs_src, sl, n_slots, D2H, 1, BS, D)
        torch.cuda.synchronize()
        ok_p = torch.equal(bits(torch.cat([h.cpu() for h in houts], dim=2)), bits(lhost))
        a = [torch.empty_like(o) for o in objs]
        b = [torch.empty_like(o) for o in objs]
        reference.gather(kv_t, Move.gather(layout, slb, sp, a))
        lmc.multi_layer_kv_transfer(lobj, ptrs_l, slb, n_slots, H2D, 1, BS, D)
        torch.cuda.synchronize()
        reference.gather(kv_l, Move.gather(layout, slb, sp, b))
        ok_s = all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))
        row["bit_exact"] = {"gather": ok_g, "to_pinned": ok_p, "scatter_same_kv": ok_s}
        res["sizes"][f"{n}_tokens"] = row
        gb.log(f"vs_lmcache {n}", json.dumps(row))
    return res


def _lmcache_engine(
    cpu_gib: float,
    src: Any,
    dst: Any,
    remote_url: str | None = None,
    shape: tuple[int, int, int] | None = None,
    kernel: str = "torch",
    rows: Callable[[bool, list[Any], list[int]], None] | None = None,
) -> Any:
    """LMCache 0.5.6's engine without vLLM or a GPU: the standalone starter with a connector that copies
    between the CPU KV and the memory objects: ``rows(gather, objects, starts)`` when given
    (``_paged_rows``: tiercache's row kernel on tiercache's own paged KV, by the same slot mapping); else
    between contiguous ``[2, L, T, H*D]`` tensors ``src`` / ``dst`` and the objects (``kernel="torch"``: one
    torch copy per chunk; ``"tiercache"``: tiercache's row kernel over the same rows, ``_row_kernel``).
    LMCache has no paged CPU copy routine of its own. ``shape``: (layers, kv heads, head dim), the Llama-8B
    shape by default."""
    layers, heads, head_dim = shape or (LAYERS, HEADS, HEAD_DIM)
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.standalone import __main__ as standalone

    if rows is None and kernel == "tiercache":
        rows = _row_kernel(src, dst, heads, head_dim)

    class CopyConnector(MockGPUConnector):  # type: ignore[misc]
        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            t0 = time.perf_counter()
            if rows is not None:
                views = [
                    m.tensor.view(2, layers, b - a, heads * head_dim)
                    for m, a, b in zip(memory_objs, starts, ends, strict=True)
                ]
                rows(True, views, starts)
            else:
                for m, a, b in zip(memory_objs, starts, ends, strict=True):
                    m.tensor.view(2, layers, b - a, heads * head_dim).copy_(src[:, :, a:b])
            KV_COPY_S["lmcache"] += time.perf_counter() - t0

        def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            t0 = time.perf_counter()
            if rows is not None:
                got = [(m, a, b) for m, a, b in zip(memory_objs, starts, ends, strict=True) if m is not None]
                rows(
                    False,
                    [m.tensor.view(2, layers, b - a, heads * head_dim) for m, a, b in got],
                    [a for _, a, _ in got],
                )
            else:
                for m, a, b in zip(memory_objs, starts, ends, strict=True):
                    if m is not None:
                        dst[:, :, a:b].copy_(m.tensor.view(2, layers, b - a, heads * head_dim))
            KV_COPY_S["lmcache"] += time.perf_counter() - t0

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            self.batched_from_gpu([memory_obj], [start], [end])

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            self.batched_to_gpu([memory_obj], [start], [end])

    standalone.CreateGPUConnector = lambda config, metadata, engine_type: CopyConnector(metadata.kv_shape)
    if remote_url is None:
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=cpu_gib, internal_api_server_enabled=False
        )
    else:  # Redis only: the CPU backend is just LMCache's allocator
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK,
            local_cpu=False,
            max_local_cpu_size=cpu_gib,
            internal_api_server_enabled=False,
            remote_url=remote_url,
            remote_serde="naive",
        )
    meta = LMCacheMetadata(
        model_name="bench/llama-8b-shape",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(layers, 2, CHUNK, heads, head_dim),
        role="worker",
    )
    groups = [standalone.LayerGroupSpec(layers, (2, 1, 16, heads, head_dim), torch.bfloat16)]
    starter = standalone.LMCacheStandaloneStarter(config, meta, groups, device="cpu")
    return starter.start()


def _row_kernel(
    src: Any, dst: Any, heads: int, head_dim: int
) -> Callable[[bool, list[Any], list[int]], None]:
    """Copies between LMCache's contiguous KV (``src`` read by stores, ``dst`` written by retrieves, each
    ``[2, L, T, H*D]``) and its chunk objects with tiercache's row kernel: each KV seen as one paged block of
    ``T`` tokens, so the kernel walks the same (span, layer, token, head, plane) rows, on the same threads,
    with the same stores as for tiercache's own paged KV."""
    import torch

    from tiercache.gpu import cpu_rows

    tokens = src.shape[2]
    geos = {True: contiguous_geometry(src, heads, head_dim), False: contiguous_geometry(dst, heads, head_dim)}
    slots = torch.arange(tokens, dtype=torch.int64)

    def copy(gather: bool, objs: list[Any], starts: list[int]) -> None:
        geo = geos[gather]
        jobs = [
            cpu_rows.token_job(geo, o, 2, slots, int(a), o.shape[2], 0)
            for o, a in zip(objs, starts, strict=True)
        ]
        if not jobs or any(j is None for j in jobs):
            raise RuntimeError("an LMCache object the row kernel cannot address")
        if cpu_rows.copy(gather, geo, [j for j in jobs if j is not None], False) < 0:
            raise RuntimeError("the row kernel refused LMCache's slots")

    return copy


def _paged_rows(
    layout: Any, kv_from: Any, kv_to: Any, slots: Any
) -> Callable[[bool, list[Any], list[int]], None]:
    """LMCache's stand-in connector on tiercache's own paged KV: gathers from ``kv_from`` and scatters into
    ``kv_to`` (same layout, same block table) by the slot mapping ``slots`` with tiercache's row kernel, the
    calls tiercache's engine makes for the same chunks (token layouts: one row job per object from its
    first token's slot; CPU_BLOCKS: the object holds its chunk's raw pages): both engines do the same copy
    work."""
    from tiercache.gpu import cpu_rows, reference

    n_slots = layout.num_blocks_of(kv_from[0]) * layout.block_size
    every = range(len(kv_from))
    g_from = reference._native_geometry(kv_from, every, layout, n_slots)
    g_to = reference._native_geometry(kv_to, every, layout, n_slots)
    if g_from is None or g_to is None:
        raise SystemExit("the row kernel cannot address this paged KV (not built, or rows not dense)")
    geos = {True: g_from, False: g_to}
    host = cpu_rows.host_slots(slots)
    bs = layout.block_size
    blocks = (host[::bs] // bs).contiguous()  # CPU_BLOCKS: chunk-aligned starts, one block per bs tokens

    def copy(gather: bool, objs: list[Any], starts: list[int]) -> None:
        geo = geos[gather]
        jobs: list[Any] = []
        for o, a in zip(objs, starts, strict=True):
            if layout.block_aligned:
                pages = o.shape[2] // bs
                jobs.append(
                    cpu_rows.RowJob(
                        o.data_ptr(), 0, pages * geo.row_bytes, geo.row_bytes, blocks, int(a) // bs, pages, 0
                    )
                )
            else:
                jobs.append(cpu_rows.token_job(geo, o, layout.planes, host, int(a), o.shape[2], 0))
        if not jobs or any(j is None for j in jobs):
            raise RuntimeError("an LMCache object the row kernel cannot address")
        if cpu_rows.copy(gather, geo, jobs, False) < 0:
            raise RuntimeError("the row kernel refused LMCache's slots")

    return copy


LAYERS, HEADS, HEAD_DIM, CHUNK, BLOCK = 32, 8, 128, 256, 16
KV_COPY_S = {"lmcache": 0.0, "tiercache": 0.0}
"""Seconds each contender spent copying between its KV and its objects (the Redis part's breakdown)."""


def _timed_kv_copies() -> None:
    """Count the time tiercache's engine spends in its KV gather/scatter calls into ``KV_COPY_S``."""
    from tiercache.gpu import dispatch

    for name in ("gather", "scatter"):
        fn = getattr(dispatch, name)

        def timed(*a: Any, _fn: Any = fn, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                KV_COPY_S["tiercache"] += time.perf_counter() - t0

        setattr(dispatch, name, timed)


def _sys_text(path: str) -> str | None:
    """A sysfs file's text, stripped (None where it cannot be read)."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _mapping_of(ptr: int) -> dict[str, int] | None:
    """The MiB and the transparent-huge-page MiB (``AnonHugePages``) of this process's mapping holding
    ``ptr``, from ``/proc/self/smaps`` (None where there is none)."""
    inside = False
    size = 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside, size = lo <= ptr < hi, hi - lo
                elif inside and head == "AnonHugePages:":
                    return {"MiB": size >> 20, "huge_MiB": int(line.split()[1]) >> 10}
    except OSError:
        return None
    return None


def _minflt() -> int:
    """Minor page faults this process has taken so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def cpu(args: argparse.Namespace) -> dict[str, Any]:
    """L1 store / retrieve of the same KV, tiercache (paged FLASH or CPU_BLOCKS KV, the engine's CPU copies)
    beside LMCache (contiguous KV) and a bare copy of the same bytes, each round in a fresh seeded order,
    bit-exact; lookup of a long prompt."""
    import asyncio

    import numpy as np
    import torch

    from tiercache.config import ManagerConfig
    from tiercache.gpu import Move, cpu_rows, reference
    from tiercache.gpu.layouts import LayoutKind, PagedLayout, object_spec
    from tiercache.keys import KeySpace
    from tiercache.store.engine import CacheEngine
    from tiercache.store.l1 import L1Cache
    from tiercache.store.manager import StorageManager

    torch.manual_seed(0)
    tokens_n = args.tokens
    nb = tokens_n // BLOCK + 8
    pages = args.layout == "cpu_blocks"
    kind = LayoutKind.CPU_BLOCKS if pages else LayoutKind.VLLM_FLASH
    layout = PagedLayout(kind, LAYERS, HEADS, HEAD_DIM, BLOCK, "bfloat16")
    table = torch.randperm(nb - 1)[: tokens_n // BLOCK] + 1  # a shuffled block table: no two blocks adjacent
    pos = torch.arange(tokens_n)
    slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
    # LMCache's side: the same KV as one contiguous [2, L, T, H*D] tensor
    src = torch.empty(2, LAYERS, tokens_n, HEADS * HEAD_DIM, dtype=torch.bfloat16)
    if pages:  # vLLM's CPU attention backend: contiguous [NB, H, BS, 2D], opaque pages (random bytes here)
        kv = [torch.randn(nb, HEADS, BLOCK, 2 * HEAD_DIM).bfloat16() for _ in range(LAYERS)]
        kv_back = [torch.empty_like(t) for t in kv]
        src.copy_(torch.randn(src.shape))
    else:
        raw = [torch.randn(nb, BLOCK, HEADS, 2 * HEAD_DIM).bfloat16() for _ in range(LAYERS)]
        kv = [r.permute(0, 2, 1, 3) for r in raw]  # vLLM's NHD allocation seen as [NB, H, BS, 2D]
        kv_back = [torch.empty_like(r).permute(0, 2, 1, 3) for r in raw]
        reference.gather(kv, Move.gather(layout, slots, [(0, tokens_n)], [src]))
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    gib = 2 * nbytes / 2**30 + 1
    peer_kv = args.peer_kv or ("paged" if args.peer_kernel == "tiercache" else "contiguous")
    if peer_kv == "paged" and args.peer_kernel != "tiercache":
        raise SystemExit("--peer-kv paged copies with tiercache's row kernel: add --peer-kernel tiercache")
    kv_back_l = [torch.empty_like(t) for t in kv_back]  # LMCache's retrieves, same block table
    rows = _paged_rows(layout, kv, kv_back_l, slots) if peer_kv == "paged" else None
    peer_objs: list[int] = []  # where LMCache's objects lie (its first object of the last copy)
    seen = rows
    if rows is not None:
        paged = rows

        def seen(gather: bool, objs: list[Any], starts: list[int]) -> None:
            peer_objs[:] = [objs[0].data_ptr()] if objs else peer_objs
            paged(gather, objs, starts)

    lmc = _lmcache_engine(gib, src, dst, kernel=args.peer_kernel, rows=seen)
    _timed_kv_copies()
    rng = np.random.default_rng(1)
    copy_s: dict[str, list[float]] = {k: [] for k in ("tc_store", "tc_retrieve", "lmc_store", "lmc_retrieve")}
    faults: dict[str, list[int]] = {k: [] for k in copy_s}  # minor page faults of each timed op

    def prompt() -> list[int]:
        return [int(x) for x in rng.integers(0, 128_000, tokens_n)]

    keyspace = KeySpace("bench/llama-8b-shape", "bfloat16", LAYERS, HEADS, HEAD_DIM)
    chunk_bytes = object_spec(layout, CHUNK).nbytes
    # one request and two chunks (each slot is written again a few rounds after it was read back), or
    # ``--l1 same``: LMCache's local CPU size (each store writes memory untouched for ~30 rounds)
    if args.l1_huge == "off":  # the A/B of L1's transparent huge pages: a plain allocation (4 KiB pages)
        import tiercache.store.l1 as l1_module

        def plain_pool(nbytes: int, pinned: bool) -> Any:
            return torch.empty(nbytes, dtype=torch.uint8)

        l1_module._host_pool = plain_pool
    l1 = L1Cache(int(gib * 2**30) if args.l1 == "same" else nbytes + 2 * chunk_bytes, chunk_bytes)
    engine = CacheEngine(StorageManager(l1, [], ManagerConfig()), layout, keyspace, chunk_size=CHUNK)
    loop = asyncio.new_event_loop()

    # ``--settle MiB``: between timed ops (untimed) read that much scratch memory, so that every op starts
    # from the same state: the dirty lines of the ops before it written back (without it a cached-store copy
    # leaves its write-back to whichever op runs next; a streaming-store op pays its own writes at once, plus
    # those) and no source hotter than another (without it the bare copies read ``src``, which LMCache and
    # the other bare copy read moments before, while tiercache's paged KV was last read a round ago)
    scratch = torch.ones(args.settle << 20 >> 3, dtype=torch.int64) if args.settle else None

    def settle() -> None:
        if scratch is not None:
            scratch.max()

    def t_store(stores: int, rets: list[float]) -> float:
        toks = prompt()
        cpu_rows.STORES = stores
        KV_COPY_S["tiercache"] = 0.0
        f0 = _minflt()
        t0 = time.perf_counter()
        loop.run_until_complete(engine.store(toks, kv, slots))
        dt = time.perf_counter() - t0
        f1 = _minflt()
        stored_copy = KV_COPY_S["tiercache"]
        settle()
        KV_COPY_S["tiercache"] = 0.0
        f2 = _minflt()
        t1 = time.perf_counter()
        loop.run_until_complete(engine.retrieve(toks, kv_back, slots))
        rets.append(time.perf_counter() - t1)
        f3 = _minflt()
        if stores == default_stores:
            copy_s["tc_store"].append(stored_copy)
            copy_s["tc_retrieve"].append(KV_COPY_S["tiercache"])
            faults["tc_store"].append(f1 - f0)
            faults["tc_retrieve"].append(f3 - f2)
        cpu_rows.STORES = default_stores
        return dt  # the next round's prompt evicts this one (L1 holds one request)

    default_stores = cpu_rows.STORES
    t_ret: list[float] = []
    kind_ret: dict[int, list[float]] = {k: [] for k in args.store_kinds if k != default_stores}
    lmc_ret: list[float] = []

    def l_store() -> float:
        toks = torch.tensor(prompt())
        KV_COPY_S["lmcache"] = 0.0
        f0 = _minflt()
        t0 = time.perf_counter()
        lmc.store(toks)
        dt = time.perf_counter() - t0
        f1 = _minflt()
        copy_s["lmc_store"].append(KV_COPY_S["lmcache"])
        settle()
        KV_COPY_S["lmcache"] = 0.0
        f2 = _minflt()
        t1 = time.perf_counter()
        lmc.retrieve(toks)
        lmc_ret.append(time.perf_counter() - t1)
        f3 = _minflt()
        copy_s["lmc_retrieve"].append(KV_COPY_S["lmcache"])
        faults["lmc_store"].append(f1 - f0)
        faults["lmc_retrieve"].append(f3 - f2)
        if args.peer == "clear":
            lmc.clear()  # the next round stores into the buffer just freed
        return dt

    bare_dst = torch.empty_like(src)
    load_before = os.getloadavg()  # a shared box: how busy it was while the rounds ran
    times: dict[str, list[float]] = {"tiercache": [], "lmcache": [], "bare_copy": [], "bare_copy_ring": []}
    fns: dict[str, Callable[[], float]] = {"tiercache": partial(t_store, default_stores, t_ret)}
    fns["lmcache"] = l_store
    for k, rets in kind_ret.items():  # the kernel's other store kinds as extra contenders (same L1)
        fns[f"tiercache_stores{k}"] = partial(t_store, k, rets)
    times.update({c: [] for c in fns if c not in times})
    chunks = -(-tokens_n // CHUNK)
    for _ in range(-(-l1.num_slots // chunks) + 1):  # warm-up: every L1 slot written once (first touch of
        for fn in fns.values():  # the pool's pages; steady state = a full L1), pools, lazy imports
            fn()
    bare_dst.copy_(src)
    t_ret.clear()
    lmc_ret.clear()
    for v in copy_s.values():
        v.clear()
    for f in faults.values():
        f.clear()
    for rets in kind_ret.values():
        rets.clear()

    def bare_copy() -> float:
        t0 = time.perf_counter()
        bare_dst.copy_(src)
        return time.perf_counter() - t0

    # The same copy into the next of as many buffers as L1 holds requests: L1 writes each store into
    # another slot, which a box with a large last-level cache may no longer hold (the bare copy's one
    # buffer it may); LMCache's allocator hands back the buffer it just freed.
    ring = [torch.empty_like(src) for _ in range(-(-l1.capacity // nbytes))]
    for buf in ring:
        buf.copy_(src)
    turn = [0]

    def bare_copy_ring() -> float:
        turn[0] += 1
        buf = ring[turn[0] % len(ring)]
        t0 = time.perf_counter()
        buf.copy_(src)
        return time.perf_counter() - t0

    # Each round in a fresh seeded order, the bare copy included: an op's time depends on the one before
    # it (streaming stores leave no dirty lines behind, cached ones do), so no contender may always follow
    # the same one (a fixed order had tiercache's store always after a cached-store copy).
    fns["bare_copy"] = bare_copy
    fns["bare_copy_ring"] = bare_copy_ring
    if args.own_source:  # the bare copy from a source only it reads (as only tiercache reads its paged KV)
        own_src, own_dst = src.clone(), torch.empty_like(src)

        def bare_copy_own_source() -> float:
            t0 = time.perf_counter()
            own_dst.copy_(own_src)
            return time.perf_counter() - t0

        fns["bare_copy_own_source"] = bare_copy_own_source
        times["bare_copy_own_source"] = []
    order_rng = np.random.default_rng(2)
    for _ in range(args.rounds):
        for c in order_rng.permutation(list(fns)):
            settle()
            times[str(c)].append(fns[str(c)]())
    load_after = os.getloadavg()

    def paged_exact(got: list[Any]) -> bool:  # ``got`` holds ``kv``'s bytes at every slot of the request
        if pages:
            return all(
                torch.equal(b[table].view(torch.int16), a[table].view(torch.int16))
                for a, b in zip(kv, got, strict=True)
            )
        back = torch.empty_like(src)
        reference.gather(got, Move.gather(layout, slots, [(0, tokens_n)], [back]))
        return torch.equal(back.view(torch.int16), src.view(torch.int16))

    ok_tc = paged_exact(kv_back)
    ok_lmc = (
        paged_exact(kv_back_l)
        if peer_kv == "paged"
        else torch.equal(dst.view(torch.int16), src.view(torch.int16))
    )

    def gbps(ts: list[float]) -> float:
        return nbytes / statistics.median(ts) / 1e9

    res: dict[str, Any] = {
        "workload": f"{tokens_n} tokens, Llama-8B shape, bf16, {CHUNK}-token chunks, {nbytes} bytes",
        "layout": kind.name,
        "torch_threads": torch.get_num_threads(),
        "native_cpu_kernel": cpu_rows.native() is not None,
        "kernel_stores": cpu_rows.STORES,
        "load_average_before_after": [load_before, load_after],
        "rounds": args.rounds,
        "l1_slots": l1.num_slots,
        "lmcache_after_round": args.peer,
        "settle_MiB": args.settle,
        "lmcache_local_cpu_GiB": gib,
        "bare_copy_GBps": gbps(times["bare_copy"]),
        "tiercache": {
            "store_GBps": gbps(times["tiercache"]),
            "retrieve_GBps": gbps(t_ret),
            "bit_exact": ok_tc,
        },
        "lmcache": {
            "store_GBps": gbps(times["lmcache"]),
            "retrieve_GBps": gbps(lmc_ret),
            "bit_exact": ok_lmc,
        },
        "lmcache_copy_kernel": args.peer_kernel,
        "lmcache_kv": peer_kv,
        "note": f"tiercache gathers from / scatters to paged {kind.name} KV (a shuffled block table); "
        + (
            "LMCache's stand-in connector gathers from / scatters to the same paged KV by the same slot "
            "mapping with the same row kernel in the same calls: equal copy work"
            if peer_kv == "paged"
            else f"LMCache copies contiguous token ranges with {args.peer_kernel}: not the same copy work"
        ),
    }
    # each op split into the copy between KV and objects and the rest (the engine's own work), medians in ms
    ops = {"tc_store": times["tiercache"], "tc_retrieve": t_ret, "lmc_store": times["lmcache"]}
    ops["lmc_retrieve"] = lmc_ret
    res["split_ms"] = {
        k: {
            "whole": statistics.median(ops[k]) * 1e3,
            "copy": statistics.median(copy_s[k]) * 1e3,
            "engine": statistics.median(w - c for w, c in zip(ops[k], copy_s[k], strict=True)) * 1e3,
        }
        for k in ops
    }
    res["minor_faults_per_op"] = {k: statistics.median(v) for k, v in faults.items()}
    res["memory"] = {
        "transparent_hugepage": _sys_text("/sys/kernel/mm/transparent_hugepage/enabled"),
        "l1_huge_pages": args.l1_huge,
        "tiercache_l1_pool": _mapping_of(l1._pool.data_ptr()),
        "lmcache_objects": _mapping_of(peer_objs[0]) if peer_objs else None,
        "object_offset_in_2MiB_page": {
            "tiercache": l1._pool.data_ptr() % (2 << 20),
            "lmcache": peer_objs[0] % (2 << 20) if peer_objs else None,
        },
    }
    # every round's LMCache time over tiercache's, whole op and copy: the spread behind the medians below
    res["each_round_tiercache_vs_lmcache"] = {
        f"{op}{part}": [round(lm / tc, 3) for lm, tc in zip(pair[f"lmc_{op}"], pair[f"tc_{op}"], strict=True)]
        for part, pair in (("", ops), ("_copy", copy_s))
        for op in ("store", "retrieve")
    }
    # each round's LMCache time over the same round's tiercache time, then the median: the contenders of a
    # round run one after another, so a burst of other work on a shared box tends to slow both
    res["per_round_tiercache_vs_lmcache"] = {
        f"{op}{part}": statistics.median(
            lm / tc for lm, tc in zip(pair[f"lmc_{op}"], pair[f"tc_{op}"], strict=True)
        )
        for part, pair in (("", ops), ("_copy", copy_s))
        for op in ("store", "retrieve")
    }
    for op in ("store", "retrieve"):
        tc, lm = res["split_ms"][f"tc_{op}"], res["split_ms"][f"lmc_{op}"]
        res[f"{op}_tiercache_vs_lmcache_copy"] = lm["copy"] / tc["copy"]
        res[f"{op}_tiercache_vs_lmcache_engine"] = lm["engine"] / tc["engine"] if tc["engine"] > 0 else None
    for k, rets in kind_ret.items():
        store = gbps(times[f"tiercache_stores{k}"])
        res[f"tiercache_stores{k}"] = {
            "store_GBps": store,
            "retrieve_GBps": gbps(rets),
            "store_vs_bare_copy": store / res["bare_copy_GBps"],
            "retrieve_vs_bare_copy": gbps(rets) / res["bare_copy_GBps"],
        }
    res["store_tiercache_vs_lmcache"] = res["tiercache"]["store_GBps"] / res["lmcache"]["store_GBps"]
    res["retrieve_tiercache_vs_lmcache"] = res["tiercache"]["retrieve_GBps"] / res["lmcache"]["retrieve_GBps"]
    res["bare_copy_ring"] = {"buffers": len(ring), "GBps": gbps(times["bare_copy_ring"])}
    res["store_tiercache_vs_bare_copy_ring"] = res["tiercache"]["store_GBps"] / res["bare_copy_ring"]["GBps"]
    if args.own_source:
        own = gbps(times["bare_copy_own_source"])
        res["bare_copy_own_source_GBps"] = own
        res["store_tiercache_vs_bare_copy_own_source"] = res["tiercache"]["store_GBps"] / own
        res["retrieve_tiercache_vs_bare_copy_own_source"] = res["tiercache"]["retrieve_GBps"] / own
    res["store_tiercache_vs_bare_copy"] = res["tiercache"]["store_GBps"] / res["bare_copy_GBps"]
    res["retrieve_tiercache_vs_bare_copy"] = res["tiercache"]["retrieve_GBps"] / res["bare_copy_GBps"]
    if args.lookup_tokens:
        res["lookup"] = _lookup(args.lookup_tokens, args.rounds * 4, engine, lmc, loop, rng)
    return res


TINY_SHAPE = (1, 1, 8)
"""``cpu --tiny``: (layers, kv heads, head dim): one 256-token bf16 chunk is 8 KiB, so its copies cost next to
nothing and a call's time is the engine's own per-call host cost."""


def cpu_tiny(args: argparse.Namespace) -> dict[str, Any]:
    """Per-call host cost of each engine (``cpu --tiny``): store, lookup and retrieve of ONE 256-token chunk
    of tiny KV (``TINY_SHAPE``), so the copies cost next to nothing and what is timed is each engine's own
    work per call (keys, index, allocation, leases, masks, dispatch).

    Each round runs ``--calls`` calls of every op for every contender, the contenders in alternating order;
    an op's figure is the median over rounds of each round's median call. tiercache's engine is async: it is
    timed awaited inside a running event loop (``tiercache``: how the vLLM connector's loop thread runs it)
    and, apart, as a sync caller pays it (``tiercache_sync``): store and retrieve through
    ``loop.run_until_complete`` per call (plus the ~6 us of asyncio's start and stop of the loop), lookup
    through ``lookup_hit_now`` (the connector scheduler's path: no loop when L1 decides). LMCache's
    engine is sync, called directly. Store: a fresh prompt per call (both evict once full; same capacity).
    Lookup and retrieve: a prompt stored before the round (a hit; retrieve writes all 256 tokens back)."""
    import asyncio
    import gc

    import numpy as np
    import torch

    # LMCache logs a line at INFO per store and retrieve: off, as a deployment timing its calls would have it
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

    from tiercache.config import ManagerConfig
    from tiercache.gpu import Move, reference
    from tiercache.gpu.layouts import object_spec
    from tiercache.keys import KeySpace
    from tiercache.store.engine import CacheEngine
    from tiercache.store.l1 import L1Cache
    from tiercache.store.manager import StorageManager

    torch.manual_seed(0)
    layers, heads, head_dim = TINY_SHAPE
    layout, kv, kv_back, slots = flash_kv(layers, heads, head_dim, BLOCK, CHUNK)
    src = torch.empty(2, layers, CHUNK, heads * head_dim, dtype=torch.bfloat16)
    reference.gather(kv, Move.gather(layout, slots, [(0, CHUNK)], [src]))
    dst = torch.zeros_like(src)
    chunk_bytes = object_spec(layout, CHUNK).nbytes
    capacity = args.tiny_chunks * chunk_bytes
    lmc = _lmcache_engine(capacity / 2**30, src, dst, shape=TINY_SHAPE)
    keyspace = KeySpace("bench/tiny", "bfloat16", layers, heads, head_dim)
    l1 = L1Cache(capacity, chunk_bytes)
    engine = CacheEngine(StorageManager(l1, [], ManagerConfig()), layout, keyspace, chunk_size=CHUNK)
    loop = asyncio.new_event_loop()
    rng = np.random.default_rng(1)
    calls = args.calls

    def prompts(n: int) -> list[list[int]]:
        return [[int(x) for x in rng.integers(0, 128_000, CHUNK)] for _ in range(n)]

    # what each engine is handed: vLLM's token lists for tiercache; LMCache gets a tensor for store and
    # retrieve (what its vLLM adapter passes) and the list for lookup (as the long-prompt lookup part does)
    stored = prompts(1)[0]
    stored_t = torch.tensor(stored)
    loop.run_until_complete(engine.store(stored, kv, slots))
    lmc.store(stored_t)

    short_stores = {"tiercache": 0, "lmcache": 0}  # stores that did not keep the whole chunk

    async def in_loop(op: str, todo: list[list[int]]) -> list[float]:
        out: list[float] = []
        clock = time.perf_counter
        if op == "store":
            for toks in todo:
                t0 = clock()
                n = await engine.store(toks, kv, slots)
                out.append(clock() - t0)
                short_stores["tiercache"] += n != CHUNK
        elif op == "lookup":
            for _ in range(calls):
                t0 = clock()
                await engine.lookup(stored)
                out.append(clock() - t0)
        else:
            for _ in range(calls):
                t0 = clock()
                await engine.retrieve(stored, kv_back, slots)
                out.append(clock() - t0)
        return out

    def tc(op: str) -> list[float]:
        todo = prompts(calls) if op == "store" else []
        return loop.run_until_complete(in_loop(op, todo))

    def tc_sync(op: str) -> list[float]:
        out: list[float] = []
        clock = time.perf_counter
        run = loop.run_until_complete
        if op == "store":
            for toks in prompts(calls):
                t0 = clock()
                n = run(engine.store(toks, kv, slots))
                out.append(clock() - t0)
                short_stores["tiercache"] += n != CHUNK
        elif op == "lookup":  # the sync answer the connector's scheduler takes when L1 decides
            now = engine.lookup_hit_now
            for _ in range(calls):
                t0 = clock()
                now(stored)
                out.append(clock() - t0)
        else:
            for _ in range(calls):
                t0 = clock()
                run(engine.retrieve(stored, kv_back, slots))
                out.append(clock() - t0)
        return out

    def lm(op: str) -> list[float]:
        out: list[float] = []
        clock = time.perf_counter
        if op == "store":
            todo = [torch.tensor(p) for p in prompts(calls)]
            for toks in todo:
                t0 = clock()
                lmc.store(toks)
                out.append(clock() - t0)
            short_stores["lmcache"] += lmc.lookup(tokens=todo[-1].tolist()) != CHUNK  # the last one kept
        elif op == "lookup":
            for _ in range(calls):
                t0 = clock()
                lmc.lookup(tokens=stored)
                out.append(clock() - t0)
        else:
            for _ in range(calls):
                t0 = clock()
                lmc.retrieve(stored_t)
                out.append(clock() - t0)
        return out

    contenders: dict[str, Callable[[str], list[float]]] = {
        "tiercache": tc,
        "tiercache_sync": tc_sync,
        "lmcache": lm,
    }
    ops = ("store", "lookup", "retrieve")
    for op in ops:  # warm-up: both stores fill their capacity once (steady state: every store evicts)
        for fn in contenders.values():
            for _ in range(-(-args.tiny_chunks // calls) + 1 if op == "store" else 1):
                fn(op)
    # the stored prompt may have been evicted by the warm-up's stores: store it again, hit it every round
    loop.run_until_complete(engine.store(stored, kv, slots))
    lmc.store(stored_t)
    load_before = os.getloadavg()
    per_round: dict[str, dict[str, list[float]]] = {op: {c: [] for c in contenders} for op in ops}
    names = list(contenders)
    gc.collect()
    for r in range(args.rounds):
        for op in ops:
            if op != "store":  # a hit every time, in both (re-stored after the round's stores evicted it)
                loop.run_until_complete(engine.store(stored, kv, slots))
                lmc.store(stored_t)
            for c in names if r % 2 == 0 else names[::-1]:
                per_round[op][c].append(statistics.median(contenders[c](op)) * 1e6)
    load_after = os.getloadavg()
    # every contender really hit and restored the whole chunk, bit-exact
    lookups = {
        "tiercache": loop.run_until_complete(engine.lookup(stored)),
        "lmcache": lmc.lookup(tokens=stored),
    }
    kv_back[0].zero_()
    dst.zero_()
    mask_tc = loop.run_until_complete(engine.retrieve(stored, kv_back, slots))
    mask_lm = lmc.retrieve(stored_t)
    back = torch.empty_like(src)
    reference.gather(kv_back, Move.gather(layout, slots, [(0, CHUNK)], [back]))
    res: dict[str, Any] = {
        "workload": f"one {CHUNK}-token chunk per call, tiny KV {TINY_SHAPE} (layers, kv heads, head dim), "
        f"bf16, {chunk_bytes} bytes a chunk",
        "what": "per-call host cost (us): median over rounds of each round's median call; spread_us: the "
        "fastest and slowest round; *_rounds_at_or_below_lmcache: rounds where that contender's median call "
        "took no longer than LMCache's of the same round",
        "calls_per_round": calls,
        "rounds": args.rounds,
        "capacity_chunks": args.tiny_chunks,
        "load_average_before_after": [load_before, load_after],
        "torch_threads": torch.get_num_threads(),
        "checks": {
            "short_stores": short_stores,
            "lookup_tokens": lookups,
            "retrieved_tokens": {"tiercache": int(mask_tc.sum()), "lmcache": int(mask_lm.sum())},
            "bit_exact": {
                "tiercache": torch.equal(back.view(torch.int16), src.view(torch.int16)),
                "lmcache": torch.equal(dst.view(torch.int16), src.view(torch.int16)),
            },
        },
        "note": "tiercache: awaited in a running loop (as the vLLM connector's loop thread runs it); "
        "tiercache_sync: as a sync caller pays it: store and retrieve through one loop.run_until_complete "
        "per call (adds asyncio's loop start and stop), lookup through lookup_hit_now (answered in the "
        "caller's thread when L1 decides, as the connector's scheduler does); LMCache: its sync engine "
        "called directly. tiercache gathers from / scatters to paged VLLM_FLASH KV, LMCache copies a "
        "contiguous token range",
    }
    for op in ops:
        row: dict[str, Any] = {c: statistics.median(v) for c, v in per_round[op].items()}
        row["rounds_us"] = per_round[op]
        row["spread_us"] = {c: [min(v), max(v)] for c, v in per_round[op].items()}
        lm_rounds = per_round[op]["lmcache"]
        for c in ("tiercache", "tiercache_sync"):
            row[f"{c}_vs_lmcache_time"] = row[c] / row["lmcache"]
            row[f"{c}_rounds_at_or_below_lmcache"] = sum(
                t <= lm for t, lm in zip(per_round[op][c], lm_rounds, strict=True)
            )
        res[op] = row
    return res


COUNT_OBJECTS = (
    "local n = 0 for _, k in ipairs(redis.call('KEYS', '*')) do "
    "if not string.find(k, '#', 1, true) then n = n + 1 end end return n"
)
"""Lua: the keys without a ``#`` (object heads and plain values; not the parts of a parted value)."""


def redis_part(args: argparse.Namespace) -> dict[str, Any]:
    """Redis only (no L1 hit): write-through (time until every chunk of the request is readable in Redis;
    each contender stores through its one long-lived engine, warmed up first) and cold retrieve into the KV
    (tiercache: its one long-lived reader engine, each round's keys new to it, or with ``--reader fresh`` a
    fresh engine each round; LMCache: ``local_cpu=False``, so every retrieve reads Redis), both contenders on
    one redis-server started here, interleaved, bit-exact."""
    import asyncio

    import numpy as np
    import redis as redis_sync
    import torch

    from tiercache.config import config_from_dict
    from tiercache.gpu import Move, reference
    from tiercache.store.engine import CacheEngine
    from tiercache.testing.harness.backends import start_redis_process
    from tiercache.testing.harness.processes import free_port

    torch.manual_seed(0)
    tokens_n = args.tokens
    layout, kv, kv_back, slots = flash_kv(LAYERS, HEADS, HEAD_DIM, BLOCK, tokens_n)
    src = torch.empty(2, LAYERS, tokens_n, HEADS * HEAD_DIM, dtype=torch.bfloat16)
    reference.gather(kv, Move.gather(layout, slots, [(0, tokens_n)], [src]))
    dst = torch.empty_like(src)
    back = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    chunks = tokens_n // CHUNK
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="vs-lmc-redis-")
    server = start_redis_process(
        "redis-server", port, Path(workdir), ["--maxmemory", "3gb", "--proto-max-bulk-len", "1gb"]
    )
    url = f"redis://127.0.0.1:{port}/0"
    probe = redis_sync.Redis(host="127.0.0.1", port=port)
    lmc = _lmcache_engine(2 * nbytes / 2**30 + 1, src, dst, remote_url=url)
    tier_url = url if args.part_size is None else f"{url}?part_size={args.part_size}"
    config = config_from_dict({"l1": {"capacity": "1GiB"}, "tiers": [{"name": "redis", "url": tier_url}]})
    rng = np.random.default_rng(1)
    loop = asyncio.new_event_loop()
    times: dict[str, list[float]] = {
        f"{c}_{op}{part}": [] for c in ("tc", "lmc") for op in ("write", "read") for part in ("", "_kv_copy")
    }
    _timed_kv_copies()
    exact = {"tiercache": True, "lmcache": True}
    stored: dict[str, list[int]] = {"tiercache": [], "lmcache": []}

    def objects() -> int:
        """Keys naming objects: not tiercache's part keys (``<head>#<i>``, written before their head)."""
        return int(probe.eval(COUNT_OBJECTS, 0))

    def wait_keys(n: int, limit_s: float = 60.0) -> int:
        """Poll until ``n`` objects are readable (or ``limit_s`` passed: a store dropped); the count seen."""
        end = time.perf_counter() + limit_s
        while (have := objects()) < n and time.perf_counter() < end:
            time.sleep(0.001)
        return have

    # One long-lived engine stores, as LMCache's one engine does (a fresh engine per write round measured the
    # first touch of its L1 pool: 131072 page faults for 512 MiB, 250-350 ms of the gather); the two warm-up
    # rounds touch all of its 1 GiB L1 (a round's 16 chunks take the least recently used half).
    writer = loop.run_until_complete(CacheEngine.open(config, layout, model="bench/llama-8b-shape"))
    # The reader: with ``--reader kept`` one long-lived engine, as LMCache's one engine (every round's keys
    # are new, so nothing hits its L1; its pool's pages were touched in the warm-up rounds); with ``fresh`` a
    # new engine per round, whose retrieve also pays the first touch of 512 MiB of its pool (on this VM that
    # is 0.05-1.2 s, by whether the host still backs the pages: clear_page_erms took half of a slow round).
    kept = None
    if args.reader == "kept":
        kept = loop.run_until_complete(CacheEngine.open(config, layout, model="bench/llama-8b-shape"))

    def tiercache_round(record: bool) -> None:
        probe.flushall()
        toks = [int(x) for x in rng.integers(0, 128_000, tokens_n)]
        KV_COPY_S["tiercache"] = 0.0
        t0 = time.perf_counter()
        loop.run_until_complete(writer.store(toks, kv, slots))
        loop.run_until_complete(writer.drain())
        stored["tiercache"].append(wait_keys(chunks))
        t_write = time.perf_counter() - t0
        c_write = KV_COPY_S["tiercache"]
        reader = kept or loop.run_until_complete(
            CacheEngine.open(config, layout, model="bench/llama-8b-shape")
        )
        for t in kv_back:
            t.zero_()
        KV_COPY_S["tiercache"] = 0.0
        t1 = time.perf_counter()
        mask = loop.run_until_complete(reader.retrieve(toks, kv_back, slots))
        t_read = time.perf_counter() - t1
        c_read = KV_COPY_S["tiercache"]
        if kept is None:
            loop.run_until_complete(reader.aclose())
        reference.gather(kv_back, Move.gather(layout, slots, [(0, tokens_n)], [back]))
        ok = int(mask.sum()) == tokens_n and torch.equal(back.view(torch.int16), src.view(torch.int16))
        if record:  # a warm-up round that lost chunks shows in chunks_stored, not here
            exact["tiercache"] &= ok
            times["tc_write"].append(t_write)
            times["tc_read"].append(t_read)
            times["tc_write_kv_copy"].append(c_write)
            times["tc_read_kv_copy"].append(c_read)

    def lmcache_round(record: bool) -> None:
        probe.flushall()
        toks = torch.tensor([int(x) for x in rng.integers(0, 128_000, tokens_n)])
        KV_COPY_S["lmcache"] = 0.0
        t0 = time.perf_counter()
        lmc.store(toks)
        stored["lmcache"].append(wait_keys(2 * chunks) // 2)  # LMCache: kv_bytes and metadata per chunk
        t_write = time.perf_counter() - t0
        c_write = KV_COPY_S["lmcache"]
        dst.zero_()
        KV_COPY_S["lmcache"] = 0.0
        t1 = time.perf_counter()
        got = lmc.retrieve(toks)
        t_read = time.perf_counter() - t1
        c_read = KV_COPY_S["lmcache"]
        ok = int(got.sum()) == tokens_n and torch.equal(dst.view(torch.int16), src.view(torch.int16))
        if record:
            exact["lmcache"] &= ok
            times["lmc_write"].append(t_write)
            times["lmc_read"].append(t_read)
            times["lmc_write_kv_copy"].append(c_write)
            times["lmc_read_kv_copy"].append(c_read)

    try:
        tiercache_round(False)  # warm-up: connections, pools, first touch (tiercache: both halves of L1)
        tiercache_round(False)
        lmcache_round(False)
        for r in range(args.rounds):
            order = [tiercache_round, lmcache_round] if r % 2 == 0 else [lmcache_round, tiercache_round]
            for fn in order:
                fn(True)
    finally:
        loop.run_until_complete(writer.aclose())
        if kept is not None:
            loop.run_until_complete(kept.aclose())
        probe.close()
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    def ms(ts: list[float]) -> float:
        return statistics.median(ts) * 1e3

    res: dict[str, Any] = {
        "workload": f"{tokens_n} tokens, Llama-8B shape, bf16, {CHUNK}-token chunks, {nbytes} bytes; Redis",
        "rounds": args.rounds,
        "part_size": args.part_size or "default",
        "tiercache_reader": args.reader,
        "tiercache": {
            "write_through_ms": ms(times["tc_write"]),
            "cold_retrieve_ms": ms(times["tc_read"]),
            "write_kv_copy_ms": ms(times["tc_write_kv_copy"]),
            "read_kv_copy_ms": ms(times["tc_read_kv_copy"]),
            "bit_exact": exact["tiercache"],
        },
        "lmcache": {
            "write_through_ms": ms(times["lmc_write"]),
            "cold_retrieve_ms": ms(times["lmc_read"]),
            "write_kv_copy_ms": ms(times["lmc_write_kv_copy"]),
            "read_kv_copy_ms": ms(times["lmc_read_kv_copy"]),
            "bit_exact": exact["lmcache"],
        },
        "chunks_stored": stored,  # the warm-up round first
        "samples_ms": {k: [round(t * 1e3, 1) for t in v] for k, v in times.items()},
        "note": "kv_copy: time in the contender's copies between its KV and its objects (tiercache: paged "
        "gather/scatter; LMCache: contiguous torch copies); write-through: store() "
        "until every chunk is readable (tiercache: drain + DBSIZE, LMCache: DBSIZE polled, 2 keys per "
        "chunk; each contender's one engine, warmed up); cold retrieve: tiercache its reader engine "
        f"({args.reader}: "
        + (
            "long-lived, each round's keys new to its L1"
            if args.reader == "kept"
            else "a fresh engine per round"
        )
        + "), LMCache local_cpu=False (every retrieve reads Redis)",
    }
    res["write_through_tiercache_vs_lmcache_speed"] = ms(times["lmc_write"]) / ms(times["tc_write"])
    res["cold_retrieve_tiercache_vs_lmcache_speed"] = ms(times["lmc_read"]) / ms(times["tc_read"])

    def net(c: str, op: str) -> float:  # the Redis part: the whole call less the contender's KV copies
        return statistics.median(
            a - b for a, b in zip(times[f"{c}_{op}"], times[f"{c}_{op}_kv_copy"], strict=True)
        )

    for op, label in (("write", "write_through"), ("read", "cold_retrieve")):
        res[f"{label}_without_kv_copies_ms"] = {
            "tiercache": net("tc", op) * 1e3,
            "lmcache": net("lmc", op) * 1e3,
        }
        res[f"{label}_without_kv_copies_tiercache_vs_lmcache_speed"] = net("lmc", op) / net("tc", op)
    return res


def _lookup(num_tokens: int, rounds: int, engine: Any, lmc: Any, loop: Any, rng: Any) -> dict[str, Any]:
    """Lookup of a long prompt, nothing stored (every chunk hashed, the first L1 probe misses), interleaved:
    tiercache on the Python list vLLM hands over, tiercache on vLLM-style sha256 block hashes (what the
    connector uses when vLLM's hashes are stable), and LMCache on the list."""
    import hashlib

    from tiercache.keys import BlockHashes

    prompt = [int(x) for x in rng.integers(0, 128_000, num_tokens)]
    token_bytes = memoryview(bytes(b"".join(t.to_bytes(4, "little") for t in prompt)))
    hashes: list[bytes] = []
    parent = b"\0" * 32
    for o in range(0, num_tokens // BLOCK * BLOCK * 4, BLOCK * 4):  # vLLM chains each block on its parent
        parent = hashlib.sha256(parent + token_bytes[o : o + BLOCK * 4]).digest()
        hashes.append(parent)
    block_hashes = BlockHashes(hashes, BLOCK)
    runs = {
        "tiercache": lambda: loop.run_until_complete(engine.lookup_hit(prompt, prefetch=False)),
        "tiercache_block_hashes": lambda: loop.run_until_complete(
            engine.lookup_hit(prompt, prefetch=False, block_hashes=block_hashes)
        ),
        "lmcache": lambda: lmc.lookup(tokens=prompt),
    }
    lk: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            t0 = time.perf_counter()
            runs[name]()
            lk[name].append(time.perf_counter() - t0)
    ms = {name: statistics.median(v) * 1e3 for name, v in lk.items()}
    return {
        "tokens": num_tokens,
        "tiercache_ms": ms["tiercache"],
        "tiercache_block_hashes_ms": ms["tiercache_block_hashes"],
        "lmcache_ms": ms["lmcache"],
        "tiercache_vs_lmcache_speed": ms["lmcache"] / ms["tiercache"],
        "tiercache_block_hashes_vs_lmcache_speed": ms["lmcache"] / ms["tiercache_block_hashes"],
    }


def main() -> None:
    import faulthandler

    faulthandler.enable()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="part", required=True)
    g = sub.add_parser("gpu", help="GPU kernels, device time and whole calls (needs CUDA)")
    g.add_argument("--lmcache-src", required=True, help="unpacked LMCache 0.5.6 source (has csrc/cuda)")
    g.add_argument("--rounds", type=int, default=5)
    c = sub.add_parser(
        "cpu", help="L1 store/retrieve and lookup beside LMCache (its venv: the vs-lmcache extra)"
    )
    c.add_argument("--tokens", type=int, default=4096)
    c.add_argument("--layout", choices=["flash", "cpu_blocks"], default="flash", help="tiercache's paged KV")
    c.add_argument("--lookup-tokens", type=int, default=131072, help="0: no lookup part")
    c.add_argument("--rounds", type=int, default=7)
    c.add_argument(
        "--l1",
        choices=["small", "same"],
        default="small",
        help="tiercache's L1: one request and two chunks (small) or LMCache's local CPU size (same)",
    )
    c.add_argument(
        "--settle",
        type=int,
        default=600,
        help="MiB of scratch memory read (untimed) before every timed op: each op starts from the same "
        "state, the writes of the ops before it written back and every source cold (0: none; then a "
        "cached-store op leaves its write-back to the next, and the bare copies read a source LMCache just "
        "read)",
    )
    c.add_argument(
        "--own-source",
        action="store_true",
        help="also time a bare copy from a source no other contender reads (tiercache's paged KV is read by "
        "nothing else)",
    )
    c.add_argument(
        "--peer",
        choices=["clear", "evict"],
        default="clear",
        help="LMCache after each round: cleared (its next store reuses the buffer just freed, read moments "
        "ago) or left full like tiercache's L1 (each store evicts its least recently used chunk)",
    )
    c.add_argument(
        "--store-kinds",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[],
        help="also run tiercache with these cpu_rows.STORES kinds (0 cached, 1 16-byte streaming, 2 widest)",
    )
    c.add_argument(
        "--tiny",
        action="store_true",
        help="per-call host cost instead: store / lookup / retrieve of one 256-token chunk of tiny KV "
        "(TINY_SHAPE; the copies cost next to nothing), tiercache awaited in a loop and through "
        "run_until_complete, beside LMCache",
    )
    c.add_argument(
        "--peer-kernel",
        choices=["torch", "tiercache"],
        default="torch",
        help="LMCache's stand-in connector copies with torch copy_ or with tiercache's own row kernel",
    )
    c.add_argument(
        "--peer-kv",
        choices=["paged", "contiguous"],
        default=None,
        help="the KV LMCache's stand-in connector copies: tiercache's own paged KV by the same slot mapping "
        "(equal copy work; the default with --peer-kernel tiercache) or a contiguous [2, L, T, H*D] tensor "
        "(the default with torch)",
    )
    c.add_argument(
        "--l1-huge",
        choices=["on", "off"],
        default="on",
        help="off: L1's pool from a plain allocation (4 KiB pages), not its transparent-huge-page mapping",
    )
    c.add_argument("--calls", type=int, default=300, help="--tiny: calls of each op per round")
    c.add_argument("--tiny-chunks", type=int, default=1024, help="--tiny: each engine's capacity in chunks")
    rd = sub.add_parser("redis", help="Redis only: write-through and cold retrieve beside LMCache (its venv)")
    rd.add_argument("--tokens", type=int, default=4096)
    rd.add_argument("--rounds", type=int, default=5)
    rd.add_argument("--part-size", default=None, help="tiercache's Redis part_size (default: its own)")
    rd.add_argument(
        "--reader",
        choices=("kept", "fresh"),
        default="kept",
        help="tiercache's retrieves: one long-lived engine, as LMCache's (each round's new keys miss its "
        "L1), or a fresh engine per round (its L1 pool's first touch included)",
    )
    args = ap.parse_args()
    # LMCache hashes with hash()
    if args.part in ("cpu", "redis") and os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        os.execv(sys.executable, [sys.executable, *sys.argv])
    if args.part == "gpu":
        print(json.dumps(gpu(args), indent=2))
    else:
        res = (cpu_tiny(args) if args.tiny else cpu(args)) if args.part == "cpu" else redis_part(args)
        res["command"] = "python benchmarks/vs_lmcache.py " + " ".join(sys.argv[1:])
        print(json.dumps(res, indent=2))
        sys.stdout.flush()
        os._exit(0)  # LMCache's shutdown can wait for its threads


if __name__ == "__main__":
    main()
