"""Interleaved A/B of the gather/scatter kernels against a baseline copy of ``triton_kernels.py``.

Usage: ``python benchmarks/gpu_ab.py BASELINE.py > ab.json`` where BASELINE.py is an older
``tiercache/gpu/triton_kernels.py`` (e.g. ``git show 2bb636a:gpu/triton_kernels.py > /tmp/old_tk.py``).
Same shape, data and timing as ``gpu_bench.py``; each round times the device-copy ceiling, then every
variant, in turn, so drift on a shared machine hits all of them alike. Prints JSON: per variant the median
GB/s over the rounds (GPU time), and the whole ``gather``/``scatter`` call's wall time per variant.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from gpu_bench import CHUNK, DEV, GB, H, L, T, bits, cuda_time, log, make_engine, spans, wall_time

from tiercache.gpu import LayoutKind, Move, object_spec, reference
from tiercache.gpu import triton_kernels as tk

ROUNDS = 5


def load_baseline(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("baseline_triton_kernels", path)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    base = load_baseline(sys.argv[1]) if len(sys.argv) > 1 else None
    layout, kv, slots, _ = make_engine(LayoutKind.VLLM_FLASH, L, H, 128, seed=1)
    _, kv2, slots2, _ = make_engine(LayoutKind.VLLM_FLASH, L, H, 128, seed=2)
    sp = spans()
    payload = object_spec(layout, T).nbytes
    objs = [torch.empty(object_spec(layout, e - s).shape, dtype=torch.bfloat16, device=DEV) for s, e in sp]
    want = [torch.empty_like(o) for o in objs]
    reference.gather(kv, Move.gather(layout, slots, sp, want))
    a = torch.empty(2 << 30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)

    variants: dict[str, Callable[[], object]] = {"copy_ceiling": lambda: b.copy_(a)}
    exact: dict[str, bool] = {}
    for tb in (4096, 8192, 16384, 32768):
        for nw in (4, 8):
            cfg = tk.TileConfig(tb, 0, nw)
            g = tk.plan(kv, Move.gather(layout, slots, sp, objs, trusted=True))
            s = tk.plan(kv2, Move.scatter(layout, slots2, sp, want, trusted=True))
            variants[f"gather_t{tb}_w{nw}"] = lambda g=g, cfg=cfg: g.launch(cfg)
            variants[f"scatter_t{tb}_w{nw}"] = lambda s=s, cfg=cfg: s.launch(cfg)
    if base is not None:
        bg = base.plan_gather(kv, layout, slots, sp, objs, check=False)
        bs = base.plan_scatter(want, kv2, layout, slots2, sp, check=False)
        variants["baseline_gather_default"] = lambda: bg.launch(base.DEFAULT_CONFIG)
        variants["baseline_scatter_default"] = lambda: bs.launch(base.DEFAULT_CONFIG)
    for name, fn in variants.items():
        if name.startswith(("gather", "baseline_gather")):
            for o in objs:
                bits(o).fill_(-1)
            fn()
            exact[name] = all(torch.equal(bits(x), bits(y)) for x, y in zip(objs, want, strict=True))
    times: dict[str, list[float]] = {n: [] for n in variants}
    for r in range(ROUNDS):
        for name, fn in variants.items():
            nbytes = a.numel() if name == "copy_ceiling" else payload
            times[name].append(nbytes / cuda_time(fn, reps=10) / GB)
        log(f"round {r}: " + " ".join(f"{n}={v[-1]:.0f}" for n, v in times.items()))
    res: dict[str, Any] = {
        "rounds": ROUNDS,
        "chunk": CHUNK,
        "GBps_median": {n: statistics.median(v) for n, v in times.items()},
        "bit_exact": exact,
    }
    calls: dict[str, Callable[[], object]] = {
        "gather": lambda: tk.gather(kv, Move.gather(layout, slots, sp, objs)),
        "scatter": lambda: tk.scatter(kv2, Move.scatter(layout, slots2, sp, want)),
    }
    if base is not None:
        calls["baseline_gather"] = lambda: base.gather(kv, layout, slots, sp, objs)
        calls["baseline_scatter"] = lambda: base.scatter(want, kv2, layout, slots2, sp)
    res["call_wall_GBps"] = {n: payload / wall_time(fn, reps=30) / GB for n, fn in calls.items()}
    res["gpu_l1"] = gpu_l1(kv, kv2, layout, slots, slots2, want)
    print(json.dumps(res, indent=2))


def gpu_l1(
    kv: list[torch.Tensor],
    kv2: list[torch.Tensor],
    layout: Any,
    slots: torch.Tensor,
    slots2: torch.Tensor,
    want: list[torch.Tensor],
) -> dict[str, Any]:
    """GPU <-> pinned L1 through the staged pipeline: staging size x coalescing, interleaved,
    with the pinned-copy ceilings in each round. (Zero-copy, the kernel writing the pinned L1 objects in
    place, was tried too: 51.1 GB/s store and 49.7 retrieve against the pipeline's 52.7 and 53.7.)"""
    from tiercache.gpu import transfer as tr
    from tiercache.store.l1 import L1Cache

    sp = spans()
    payload = object_spec(layout, T).nbytes
    chunk_bytes = object_spec(layout, CHUNK).nbytes
    l1 = L1Cache(len(sp) * chunk_bytes, chunk_bytes, pinned=True)
    outs = []
    for i, (s, e) in enumerate(sp):
        w = l1.reserve_write(f"c{i}", object_spec(layout, e - s))
        assert w is not None
        outs.append(w.tensor())
    host = torch.empty(payload, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(payload, dtype=torch.uint8, device=DEV)
    xfer = tr.transfer_for(DEV)

    def pipe(staging: int, co: bool, store: bool) -> Callable[[], object]:
        def run() -> object:
            xfer.staging_bytes, xfer.coalesce = staging, co
            if store:  # a fresh move each run: the staging settings apply
                return tr.store_to_host(kv, Move.gather(layout, slots, sp, outs))
            return tr.load_from_host(kv2, Move.scatter(layout, slots2, sp, outs))

        return run

    walls: dict[str, Callable[[], object]] = {}
    for staging, co in ((32 << 20, False), (64 << 20, False), (128 << 20, True)):
        tag = f"{staging >> 20}MiB{'_coalesced' if co else ''}"
        walls[f"store_{tag}"] = pipe(staging, co, True)
        walls[f"retrieve_{tag}"] = pipe(staging, co, False)
    exact: dict[str, bool] = {}
    for name, fn in walls.items():
        if name.startswith("store"):
            for o in outs:
                bits(o).fill_(-1)
            fn()
            torch.cuda.synchronize()
            exact[name] = all(torch.equal(bits(x.cpu()), bits(y)) for x, y in zip(want, outs, strict=True))
    got: dict[str, list[float]] = {n: [] for n in ["D2H_ceiling", "H2D_ceiling", *walls]}
    for r in range(3):
        got["D2H_ceiling"].append(
            payload / cuda_time(lambda: host.copy_(dev, non_blocking=True), reps=5) / GB
        )
        got["H2D_ceiling"].append(
            payload / cuda_time(lambda: dev.copy_(host, non_blocking=True), reps=5) / GB
        )
        for name, fn in walls.items():
            got[name].append(payload / wall_time(fn, reps=9) / GB)
        log(f"gpu_l1 round {r}: " + " ".join(f"{n}={v[-1]:.1f}" for n, v in got.items()))
    xfer.staging_bytes, xfer.coalesce = tr.DEFAULT_STAGING_BYTES, tr.DEFAULT_COALESCE
    return {"GBps_median": {n: statistics.median(v) for n, v in got.items()}, "store_bit_exact": exact}


if __name__ == "__main__":
    main()
