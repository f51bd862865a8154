"""The CPU copy kernel (``gpu/_rowcopy.c``) against a bare copy of the same bytes, on one and on two threads.

Llama-8B shape (32 layers, 8 KV heads, head_dim 128, bf16, block 16), vLLM FLASH KV through a shuffled block
table; at each ``--tokens`` size: the kernel's gather (paged KV -> one object, as a store copies) and scatter
(object -> paged KV, as a retrieve copies), and three bare copies of the same bytes between two contiguous
buffers: ``memcpy`` (libc, on one thread), torch ``copy_`` (torch's threads) and the kernel itself over a
contiguous KV (the rows it would copy for LMCache's contiguous layout). Each on 1 thread and on 2
(``torch.set_num_threads``; the kernel takes torch's count, at most one thread per 64 MiB: a 256-token
copy runs on one either way). Rounds in a freshly shuffled order, ``--settle`` MiB of scratch memory read
(untimed) before every timed copy, medians and spread, each copy also against the same round's memcpy;
bit-exact checks; the load average after each size.
Then what a second thread costs a call before it copies anything (``team_start_us``: a 128 KiB gather on
two threads less on one, with torch's workers spinning and parked).

Usage: ``.venv/bin/python benchmarks/cpu_copy_bench.py > benchmarks/results/cpu_copy_bench_cpu.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from _common import contiguous_geometry, flash_kv

from tiercache.gpu import Move, cpu_rows, reference
from tiercache.gpu.layouts import LayoutKind, PagedLayout

L, H, D, BS = 32, 8, 128, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="256,4096")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--settle", type=int, default=600)
    args = ap.parse_args()
    if cpu_rows.native() is None:
        raise SystemExit("the native row kernel is not built (pip install -e . builds gpu/_rowcopy.c)")
    libc = ctypes.CDLL(None)
    libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    scratch = torch.ones(args.settle << 20 >> 3, dtype=torch.int64) if args.settle else None
    res: dict[str, Any] = {
        "benchmark": "cpu_copy_bench",
        "command": "python benchmarks/cpu_copy_bench.py " + " ".join(sys.argv[1:]),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
        "kernel_stores": cpu_rows.STORES,
        "sizes": {},
    }
    for n in (int(x) for x in args.tokens.split(",")):
        torch.manual_seed(n)
        layout, kv, kv_back, slots = flash_kv(L, H, D, BS, n)
        obj = torch.empty(2, L, n, H * D, dtype=torch.bfloat16)
        want = torch.empty_like(obj)
        gather = Move.gather(layout, slots, [(0, n)], [obj])
        scatter = Move.scatter(layout, slots, [(0, n)], [obj])
        reference.gather(kv, gather)  # the kernel's path, checked against the torch path
        os.environ["TIERCACHE_CPU_KERNELS"] = "0"
        try:
            reference.gather(kv, Move.gather(layout, slots, [(0, n)], [want]))
        finally:
            del os.environ["TIERCACHE_CPU_KERNELS"]
        exact_gather = torch.equal(obj.view(torch.int16), want.view(torch.int16))
        reference.scatter(kv_back, scatter)
        back = torch.empty_like(obj)
        reference.gather(kv_back, Move.gather(layout, slots, [(0, n)], [back]))
        exact_scatter = torch.equal(back.view(torch.int16), want.view(torch.int16))
        nbytes = obj.numel() * obj.element_size()
        src, dst = want.clone(), torch.empty_like(want)
        # the kernel over a contiguous [2, L, T, H*D] KV: one block of n tokens, as LMCache's KV would be
        geo = contiguous_geometry(src, H, D)
        job = cpu_rows.token_job(geo, dst, 2, torch.arange(n, dtype=torch.int64), 0, n, 0)
        assert job is not None

        def contiguous_kernel(geo: cpu_rows.Geometry = geo, job: cpu_rows.RowJob = job) -> None:
            if cpu_rows.copy(True, geo, [job], False) < 0:
                raise RuntimeError("row kernel refused")

        ops: dict[str, Callable[[], object]] = {
            "kernel_gather_paged": lambda: reference.gather(kv, gather),  # noqa: B023
            "kernel_scatter_paged": lambda: reference.scatter(kv_back, scatter),  # noqa: B023
            "kernel_contiguous": contiguous_kernel,
            "memcpy": lambda: libc.memcpy(dst.data_ptr(), src.data_ptr(), nbytes),  # noqa: B023
            "torch_copy": lambda: dst.copy_(src),  # noqa: B023
        }
        times: dict[str, list[float]] = {f"{k}@{t}": [] for k in ops for t in (1, 2)}
        order = np.random.default_rng(n)
        for _ in range(2):  # warm-up
            for fn in ops.values():
                fn()
        for _ in range(args.rounds):
            for key in order.permutation(list(times)):
                name, threads = str(key).split("@")
                torch.set_num_threads(int(threads))
                if scratch is not None:
                    scratch.max()
                t0 = time.perf_counter()
                ops[name]()
                times[str(key)].append(time.perf_counter() - t0)
        torch.set_num_threads(2)
        contiguous_ok = torch.equal(dst.view(torch.int16), src.view(torch.int16))
        row: dict[str, Any] = {
            "load_after": os.getloadavg(),
            "bytes": nbytes,
            "bit_exact": {"gather": exact_gather, "scatter": exact_scatter, "contiguous": contiguous_ok},
        }
        for key, ts in times.items():
            rates = [nbytes / t / 1e9 for t in ts]
            row[key] = {
                "GBps_median": statistics.median(rates),
                "GBps_min": min(rates),
                "GBps_max": max(rates),
            }
        for t in (1, 2):
            mc = row[f"memcpy@{t}"]["GBps_median"] if t == 1 else row["memcpy@1"]["GBps_median"]
            tc = row[f"torch_copy@{t}"]["GBps_median"]
            for k in ("kernel_gather_paged", "kernel_scatter_paged", "kernel_contiguous"):
                row[f"{k}@{t}"]["vs_memcpy_1_thread"] = row[f"{k}@{t}"]["GBps_median"] / mc
                row[f"{k}@{t}"]["vs_torch_copy_same_threads"] = row[f"{k}@{t}"]["GBps_median"] / tc
                # per round against that round's one-thread memcpy, then the median: a burst of other work
                # on the box slows both of a round's copies, which the ratio of medians does not cancel
                paired = [m / x for m, x in zip(times["memcpy@1"], times[f"{k}@{t}"], strict=True)]
                row[f"{k}@{t}"]["vs_memcpy_1_thread_per_round"] = statistics.median(paired)
        res["sizes"][f"{n}_tokens"] = row
        shown = [
            f"{k} {v['GBps_median']:.2f}"
            for k, v in row.items()
            if isinstance(v, dict) and "GBps_median" in v
        ]
        print(f"{n}: " + ", ".join(shown), file=sys.stderr)
    res["team_start_us"] = team_start(args.rounds * 4, scratch)
    res["load_after"] = os.getloadavg()
    print(json.dumps(res, indent=2))


def team_start(rounds: int, scratch: torch.Tensor | None) -> dict[str, Any]:
    """What a second thread costs a call before it copies anything: a gather of one 16-token block of every
    layer (4 KiB a task, 128 KiB in all) on two threads less the same call on one, medians in microseconds;
    ``spinning``: right after a torch op on both threads (torch's OpenMP workers still spin, as after the
    settle read before every timed copy); ``parked``: after 20 ms idle (the workers sleep and must be woken,
    as before a store that follows the engine's own work or a pause)."""
    n = BS
    layout = PagedLayout(LayoutKind.VLLM_FLASH, L, H, D, BS, "bfloat16")
    kv = [torch.randn(4, BS, H, 2 * D).bfloat16().permute(0, 2, 1, 3) for _ in range(L)]
    slots = torch.arange(n) + 2 * BS
    move = Move.gather(layout, slots, [(0, n)], [torch.empty(2, L, n, H * D, dtype=torch.bfloat16)])
    pick = cpu_rows.threads
    warm = scratch if scratch is not None else torch.ones(1 << 20)
    out: dict[str, Any] = {}
    torch.set_num_threads(2)
    try:
        for state in ("spinning", "parked"):
            ts: dict[int, list[float]] = {1: [], 2: []}
            for r in range(rounds):
                for k in (1, 2) if r % 2 == 0 else (2, 1):
                    cpu_rows.threads = lambda nbytes, k=k: k  # type: ignore[misc]
                    warm.max()
                    if state == "parked":
                        time.sleep(0.02)
                    t0 = time.perf_counter()
                    reference.gather(kv, move)
                    ts[k].append(time.perf_counter() - t0)
            one, two = (statistics.median(ts[k]) * 1e6 for k in (1, 2))
            out[state] = {"one_thread_us": one, "two_threads_us": two, "second_thread_costs_us": two - one}
    finally:
        cpu_rows.threads = pick
    return out


if __name__ == "__main__":
    main()
