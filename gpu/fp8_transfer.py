"""The fp8 L1 over the staging pipeline: quantize into device staging, one large copy per object to host.

The fused kernels can read / write pinned host memory in place (``triton_kernels.gather_fp8`` with pinned
outputs), but then every program stores small pieces across PCIe and the link runs well below its copy
speed (80.8 / 76.2 GB/s of bf16 KV at 4096 tokens on the H200, where the pinned copy alone moves 55 GB/s of
payload, i.e. 108 GB/s of bf16). Here a store plans one fused-fp8 gather over every span, whose outputs are
views of the two staging buffers of ``transfer.Transfer`` (group g in buffer g % 2, groups as the bf16
pipeline cuts them), launches it group by group (``Fp8Plan.launch_rows``) on the current stream, and copies
each group's payloads to their host objects on the side stream while the next group is quantized. A
retrieve mirrors it: host-to-device copies on the side stream, one dequantize-scatter launch per group.

Both run an fp8 ``Move`` (``Move.gather_fp8`` / ``Move.scatter_fp8``) whose payloads are in host memory;
contracts are ``reference.gather`` / ``reference.scatter`` of such a move (``ValueError`` for bad slots,
and for non-finite input on a store); both return after host memory is no longer touched (the side stream is
synchronized), so L1 leases may be released at once. ``triton_kernels.Unsupported``: use the reference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from tiercache.gpu import transfer
from tiercache.gpu import triton_kernels as tk
from tiercache.gpu.layouts import layer_tensors
from tiercache.gpu.move import Move

if TYPE_CHECKING:
    KVCaches = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]

__all__ = ["FP8_COALESCE", "load_fp8_from_host", "store_fp8_to_host"]

FP8_COALESCE = True
"""Payloads that lie back to back in host memory (L1 slots handed out in order) and in staging move as one
copy per run (``transfer._runs``) instead of one per object."""


def _staging_views(
    t: transfer.Transfer, host: Sequence[torch.Tensor]
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The pipeline groups of ``host`` (payloads) and, per payload, its device view in staging buffer
    ``group % 2``."""
    groups = transfer._groups([o.numel() * o.element_size() for o in host], t.staging_bytes)
    views: list[torch.Tensor] = [host[0]] * len(host)
    for g, idx in enumerate(groups):
        for i, v in zip(idx, t._views(g % 2, [host[i] for i in idx]), strict=True):
            views[i] = v
    return groups, views


def _pairs(
    idx: Sequence[int], host: Sequence[torch.Tensor], views: Sequence[torch.Tensor], coalesce: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(host, staging) pairs to copy for payloads ``idx`` of one group: one per object, or one per run of
    back-to-back payloads with ``coalesce``."""
    objs = [host[i] for i in idx]
    vs = [views[i] for i in idx]
    if not coalesce or len(idx) < 2:
        return list(zip(objs, vs, strict=True))
    base = vs[0].data_ptr()
    pairs = []
    for a, z, n in transfer._runs(objs, [v.data_ptr() - base for v in vs]):
        pairs.append(
            (objs[a], vs[a]) if z - a == 1 else (transfer._flat(objs[a], n), transfer._flat(vs[a], n))
        )
    return pairs


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
    host_outs = move.objects
    if not host_outs:
        return
    device = layer_tensors(kv_caches)[0].device
    t = xfer or transfer.transfer_for(device)
    cur = torch.cuda.current_stream(device)
    with t.lock:
        groups, views = _staging_views(t, host_outs)
        plan = tk.plan_fp8(kv_caches, move.with_objects(views), check_finite=check_finite)
        for g, idx in enumerate(groups):
            b = g % 2
            cur.wait_event(t.free[b])
            plan.launch_rows(idx[0], idx[-1] + 1)
            t.ready[b].record(cur)
            t.stream.wait_event(t.ready[b])
            with torch.cuda.stream(t.stream):
                for h, v in _pairs(idx, host_outs, views, coalesce):
                    h.copy_(v, non_blocking=True)
            t.free[b].record(t.stream)
        plan.queue_checks()  # after the last launch: the next group's quantize never waits for them
        t.stream.synchronize()
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
    host_payloads = move.objects
    device = layer_tensors(kv_caches)[0].device
    t = xfer or transfer.transfer_for(device)
    cur = torch.cuda.current_stream(device)
    if not host_payloads:
        return tk.scatter_fp8(kv_caches, move)
    with t.lock:
        groups, views = _staging_views(t, host_payloads)
        plan, mv = tk.plan_fp8_scatter(kv_caches, move.with_objects(views))
        for g, idx in enumerate(groups):
            b = g % 2
            t.stream.wait_event(t.free[b])
            with torch.cuda.stream(t.stream):
                for h, v in _pairs(idx, host_payloads, views, coalesce):
                    v.copy_(h, non_blocking=True)
            t.ready[b].record(t.stream)
            if g == 0:
                plan.queue_checks()  # while the first copy runs, ahead of the scatters
            cur.wait_event(t.ready[b])
            plan.launch_rows(idx[0], idx[-1] + 1)
            t.free[b].record(cur)
        t.stream.synchronize()  # host memory is no longer read: leases may be released
    return mv.finish()
