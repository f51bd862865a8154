"""The fp8 L1 over the staging pipeline: quantize into device staging, one large copy per object to host.

The fused kernels can read / write pinned host memory in place (``triton_kernels.gather_fp8`` with pinned
outputs), but then every program stores small pieces across PCIe and the link runs well below its copy
speed (80.8 / 76.2 GB/s of bf16 KV at 4096 tokens on the H200, where the pinned copy alone moves 55 GB/s of
payload, i.e. 108 GB/s of bf16). Here a store plans one fused-fp8 gather over every span, whose outputs are
views of the two staging buffers of ``transfer.Transfer`` (``Transfer.stage``: group g in buffer g % 2,
groups as the bf16 pipeline cuts them), and hands ``Transfer.run_store`` (the bf16 pipeline's loop) one
launch per group (``Fp8Plan.launch_rows``): each group is quantized on the current stream while the side
stream copies the previous group's payloads to their host objects. A retrieve mirrors it
(``Transfer.run_load``): host-to-device copies on the side stream, one dequantize-scatter launch per group.

Both run an fp8 ``Move`` (``Move.gather_fp8`` / ``Move.scatter_fp8``) whose payloads are in host memory;
contracts are ``reference.gather`` / ``reference.scatter`` of such a move (``ValueError`` for bad slots,
and for non-finite input on a store); both return after host memory is no longer touched (the side stream is
synchronized), so L1 leases may be released at once. ``triton_kernels.Unsupported``: use the reference.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from tiercache.gpu import transfer
from tiercache.gpu import triton_kernels as tk
from tiercache.gpu.layouts import layer_tensors
from tiercache.gpu.move import Move

if TYPE_CHECKING:
    from tiercache.gpu.layouts import KVCaches

__all__ = ["FP8_COALESCE", "load_fp8_from_host", "store_fp8_to_host"]

FP8_COALESCE = True
"""Payloads that lie back to back in host memory (L1 slots handed out in order) and in staging move as one
copy per run instead of one per object."""


def _stages(
    groups: list[list[int]], copies: list[list[tuple[torch.Tensor, torch.Tensor]]], plan: tk.Fp8Plan
) -> list[transfer.Stage]:
    """The pipeline stages of a fused-fp8 ``plan`` over every payload: group g launches its spans only."""
    return [
        transfer.Stage(g % 2, functools.partial(plan.launch_rows, idx[0], idx[-1] + 1), copies[g])
        for g, idx in enumerate(groups)
    ]


def store_fp8_to_host(
    kv_caches: KVCaches,
    move: Move,
    *,
    check_finite: bool = True,
    xfer: transfer.Transfer | None = None,
    coalesce: bool = FP8_COALESCE,
) -> None:
    """Run a gather ``move`` (``Move.gather_fp8``) from CUDA paged KV into host payloads through the staging
    pipeline; ``xfer``: the staging to use (default: the device's ``transfer.transfer_for``)."""
    if not move.objects:
        return
    t = xfer or transfer.transfer_for(layer_tensors(kv_caches)[0].device)
    with t.lock:
        groups, views, copies = t.stage(move.objects, coalesce)
        plan = tk.plan_fp8(kv_caches, move.with_objects(views), check_finite=check_finite)
        t.run_store(_stages(groups, copies, plan), plan.queue_checks)
    plan.finish()


def load_fp8_from_host(
    kv_caches: KVCaches,
    move: Move,
    *,
    xfer: transfer.Transfer | None = None,
    coalesce: bool = FP8_COALESCE,
) -> int:
    """Run a scatter ``move`` (``Move.scatter_fp8``) from host payloads into CUDA paged KV through the
    staging pipeline; returns the tokens written (``xfer``: as ``store_fp8_to_host``)."""
    if not move.objects:
        return tk.scatter_fp8(kv_caches, move)
    t = xfer or transfer.transfer_for(layer_tensors(kv_caches)[0].device)
    with t.lock:
        groups, views, copies = t.stage(move.objects, coalesce)
        plan, mv = tk.plan_fp8_scatter(kv_caches, move.with_objects(views))
        t.run_load(_stages(groups, copies, plan), plan.queue_checks)
    return mv.finish()
