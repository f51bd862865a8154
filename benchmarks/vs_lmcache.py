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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

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
    work = Path(tempfile.mkdtemp(prefix="lmc_build_"))
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


def gpu(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_bench as gb  # the device timers and the engine maker of the GPU benchmark

    from tiercache.gpu import LayoutKind, dispatch, object_spec, reference
    from tiercache.l1 import L1Cache

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

        contenders = {
            "gather": {
                "tiercache": lambda: dispatch.gather(kv, layout, sl, sp, objs),  # noqa: B023
                "lmcache": lambda: lmc.multi_layer_kv_transfer(lobj, ptrs_src, sl, n_slots, D2H, 1, BS, D),  # noqa: B023
            },
            "scatter": {
                "tiercache": lambda: dispatch.scatter(objs, kv_t, layout, slb, sp),  # noqa: B023
                "lmcache": lambda: lmc.multi_layer_kv_transfer(lobj, ptrs_l, slb, n_slots, H2D, 1, BS, D),  # noqa: B023
            },
            "to_pinned": {
                "tiercache": lambda: dispatch.gather(kv, layout, sl, sp, houts),  # noqa: B023
                "lmcache": lambda: lmc.multi_layer_kv_transfer(lhost, ptrs_src, sl, n_slots, D2H, 1, BS, D),  # noqa: B023
            },
            "from_pinned": {
                "tiercache": lambda: dispatch.scatter(houts, kv_t, layout, slb, sp),  # noqa: B023
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
            times: dict[str, dict[str, list[float]]] = {c: {"device": [], "wall": []} for c in fns}
            order = list(fns)
            for r in range(args.rounds):
                for c in order if r % 2 == 0 else order[::-1]:
                    times[c]["device"].append(gb.cuda_time(fns[c], reps=20))
                    times[c]["wall"].append(gb.wall_time(fns[c], reps=51, warmup=3))
            entry: dict[str, Any] = {}
            for c, t in times.items():
                dev_t, wall_t = statistics.median(t["device"]), statistics.median(t["wall"])
                entry[c] = {
                    "device_GBps": nbytes / dev_t / gb.GB,
                    "call_wall_GBps": nbytes / wall_t / gb.GB,
                    "call_wall_worst_round_GBps": nbytes / max(t["wall"]) / gb.GB,
                    "host_cost_us": (wall_t - dev_t) * 1e6,
                }
                if path in ceilings:
                    entry[c]["call_vs_pinned_ceiling"] = ceilings[path] / wall_t
                    entry[c]["worst_round_vs_pinned_ceiling"] = ceilings[path] / max(t["wall"])
            entry["tiercache_vs_lmcache_call"] = (
                entry["tiercache"]["call_wall_GBps"] / entry["lmcache"]["call_wall_GBps"]
            )
            entry["tiercache_vs_lmcache_device"] = (
                entry["tiercache"]["device_GBps"] / entry["lmcache"]["device_GBps"]
            )
            if path in ceilings:
                entry["pinned_ceiling_GBps"] = nbytes / ceilings[path] / gb.GB
            row[path] = entry
        # bit-exact: tiercache's chunk objects == LMCache's object; both scatters leave the same KV
        want = torch.empty((2, L, n, H * D), dtype=torch.bfloat16, device=gb.DEV)
        dispatch.gather(kv, layout, sl, sp, objs)
        lmc.multi_layer_kv_transfer(lobj, ptrs_src, sl, n_slots, D2H, 1, BS, D)
        torch.cuda.synchronize()
        torch.cat(objs, dim=2, out=want)
        ok_g = torch.equal(bits(want), bits(lobj))
        dispatch.gather(kv, layout, sl, sp, houts)
        lmc.multi_layer_kv_transfer(lhost, ptrs_src, sl, n_slots, D2H, 1, BS, D)
        torch.cuda.synchronize()
        ok_p = torch.equal(bits(torch.cat([h.cpu() for h in houts], dim=2)), bits(lhost))
        a = [torch.empty_like(o) for o in objs]
        b = [torch.empty_like(o) for o in objs]
        reference.gather(kv_t, layout, slb, sp, a)
        lmc.multi_layer_kv_transfer(lobj, ptrs_l, slb, n_slots, H2D, 1, BS, D)
        torch.cuda.synchronize()
        reference.gather(kv_l, layout, slb, sp, b)
        ok_s = all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))
        row["bit_exact"] = {"gather": ok_g, "to_pinned": ok_p, "scatter_same_kv": ok_s}
        res["sizes"][f"{n}_tokens"] = row
        gb.log(f"vs_lmcache {n}", json.dumps(row))
    return res


def main() -> None:
    import faulthandler

    faulthandler.enable()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="part", required=True)
    g = sub.add_parser("gpu", help="GPU kernels, device time and whole calls (needs CUDA)")
    g.add_argument("--lmcache-src", required=True, help="unpacked LMCache 0.5.6 source (has csrc/cuda)")
    g.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.part == "gpu":
        print(json.dumps(gpu(args), indent=2))


if __name__ == "__main__":
    main()
