"""gather/scatter entry points that pick the Triton kernels or the torch reference at run time.

Same signatures and semantics as ``tiercache.gpu.reference`` (bit-exact, ``ValueError`` on bad input):

- KV on CUDA, objects on the same device: one Triton launch (``triton_kernels``).
- KV on CUDA, objects in host memory (L1 views of the pinned pool): the staged, double-buffered pipeline of
  ``tiercache.gpu.transfer`` (kernel into device staging, copies on a side stream).
- Anything else (CPU tensors, CPU_BLOCKS, triton missing, layers with different strides, misaligned
  pointers) or ``TIERCACHE_GPU_KERNELS=0``: the torch reference.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from tiercache.gpu import reference
from tiercache.gpu.layouts import LayoutKind, PagedLayout, layer_tensors

if TYPE_CHECKING:
    KVCaches = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]

__all__ = [
    "gather",
    "gather_fp8",
    "gather_layer",
    "kernels_enabled",
    "scatter",
    "scatter_fp8",
    "scatter_layer",
]

_TRITON_OK: bool | None = None


def kernels_enabled(kv_caches: KVCaches, layout: PagedLayout) -> bool:
    """True when this call would try the Triton path (CUDA tensors, a token layout, triton importable)."""
    global _TRITON_OK
    if os.environ.get("TIERCACHE_GPU_KERNELS", "1") == "0" or layout.kind is LayoutKind.CPU_BLOCKS:
        return False
    layers = layer_tensors(kv_caches)
    if not layers or layers[0].device.type != "cuda":
        return False
    if _TRITON_OK is None:
        from tiercache.gpu import triton_kernels

        _TRITON_OK = triton_kernels.available()
    return _TRITON_OK


def _where(objs: Sequence[torch.Tensor], device: torch.device) -> str:
    """'device' if every object is on ``device``, 'host' if every one is on the CPU, else 'mixed'."""
    if all(o.device == device for o in objs):
        return "device"
    if all(o.device.type == "cpu" for o in objs):
        return "host"
    return "mixed"


def _gather(
    layers: range,
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    out: Sequence[torch.Tensor],
    trusted: bool = False,
    host_slots: torch.Tensor | None = None,
) -> bool:
    """Try the kernel paths; False when the reference must do it."""
    if not out or not kernels_enabled(kv_caches, layout):
        return False
    from tiercache.gpu import transfer, triton_kernels

    device = layer_tensors(kv_caches)[0].device
    where = _where(out, device)
    try:
        if where == "device":
            triton_kernels.gather(
                kv_caches, layout, slot_mapping, spans, out, layers, trusted=trusted, host_slots=host_slots
            )
            return True
        if where == "host":
            transfer.store_to_host(
                kv_caches,
                layout,
                slot_mapping,
                spans,
                list(out),
                layers=layers,
                trusted=trusted,
                host_slots=host_slots,
            )
            return True
    except triton_kernels.Unsupported:
        return False
    return False


def _scatter(
    layers: range,
    objects: Sequence[torch.Tensor],
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    skip_prefix: int | Sequence[int],
    trusted: bool = False,
    host_slots: torch.Tensor | None = None,
) -> int | None:
    """Try the kernel paths; None when the reference must do it."""
    if not objects or not kernels_enabled(kv_caches, layout):
        return None
    from tiercache.gpu import transfer, triton_kernels

    device = layer_tensors(kv_caches)[0].device
    where = _where(objects, device)
    try:
        if where == "device":
            return triton_kernels.scatter(
                objects,
                kv_caches,
                layout,
                slot_mapping,
                spans,
                skip_prefix,
                layers,
                trusted=trusted,
                host_slots=host_slots,
            )
        if where == "host":
            return transfer.load_from_host(
                list(objects),
                kv_caches,
                layout,
                slot_mapping,
                spans,
                skip_prefix,
                layers=layers,
                trusted=trusted,
                host_slots=host_slots,
            )
    except triton_kernels.Unsupported:
        return None
    return None


def gather(
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    out: Sequence[torch.Tensor],
    *,
    trusted: bool = False,
    host_slots: torch.Tensor | None = None,
) -> None:
    """``reference.gather`` contract; one Triton launch (or the staged pipeline) on CUDA.

    ``host_slots``: a CPU copy of a device ``slot_mapping``; the slot checks then run on the host (no device
    reductions). ``trusted``: the caller vouches for every slot, no checks at all (kernel paths only; the
    reference always checks)."""
    layers = range(layout.num_layers)
    if not _gather(layers, kv_caches, layout, slot_mapping, spans, out, trusted, host_slots):
        reference.gather(kv_caches, layout, slot_mapping, spans, out)


def gather_layer(
    layer_idx: int,
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    out: Sequence[torch.Tensor],
) -> None:
    """``reference.gather_layer`` contract."""
    if not 0 <= layer_idx < layout.num_layers:
        raise ValueError(f"layer {layer_idx} out of range for {layout.num_layers} layers")
    if not _gather(range(layer_idx, layer_idx + 1), kv_caches, layout, slot_mapping, spans, out):
        reference.gather_layer(layer_idx, kv_caches, layout, slot_mapping, spans, out)


def scatter(
    objects: Sequence[torch.Tensor],
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    skip_prefix: int | Sequence[int] = 0,
    *,
    trusted: bool = False,
    host_slots: torch.Tensor | None = None,
) -> int:
    """``reference.scatter`` contract; returns the tokens written (``trusted``/``host_slots``: as ``gather``;
    a trusted scatter counts every token past the skips)."""
    layers = range(layout.num_layers)
    n = _scatter(layers, objects, kv_caches, layout, slot_mapping, spans, skip_prefix, trusted, host_slots)
    if n is None:
        return reference.scatter(objects, kv_caches, layout, slot_mapping, spans, skip_prefix)
    return n


def scatter_layer(
    layer_idx: int,
    objects: Sequence[torch.Tensor],
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    skip_prefix: int | Sequence[int] = 0,
) -> int:
    """``reference.scatter_layer`` contract."""
    if not 0 <= layer_idx < layout.num_layers:
        raise ValueError(f"layer {layer_idx} out of range for {layout.num_layers} layers")
    layers = range(layer_idx, layer_idx + 1)
    n = _scatter(layers, objects, kv_caches, layout, slot_mapping, spans, skip_prefix)
    if n is None:
        return reference.scatter_layer(
            layer_idx, objects, kv_caches, layout, slot_mapping, spans, skip_prefix
        )
    return n


def gather_fp8(
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    out: Sequence[torch.Tensor],
    *,
    trusted: bool = False,
    host_slots: torch.Tensor | None = None,
) -> None:
    """``reference.gather_fp8`` contract (``out[i]``: span i's fp8 codec payload); on CUDA the fused kernel
    into device outputs, or, for host outputs (an fp8 L1), the staged pipeline of
    ``tiercache.gpu.fp8_transfer`` (quantize into device staging, large copies to host)."""
    if out and kernels_enabled(kv_caches, layout):
        from tiercache.gpu import fp8_transfer, triton_kernels

        where = _where(out, layer_tensors(kv_caches)[0].device)
        try:
            if where == "device":
                triton_kernels.gather_fp8(
                    kv_caches, layout, slot_mapping, spans, out, trusted=trusted, host_slots=host_slots
                )
                return
            if where == "host":
                fp8_transfer.store_fp8_to_host(
                    kv_caches, layout, slot_mapping, spans, out, trusted=trusted, host_slots=host_slots
                )
                return
        except triton_kernels.Unsupported:
            pass
    reference.gather_fp8(kv_caches, layout, slot_mapping, spans, out)


def scatter_fp8(
    payloads: Sequence[torch.Tensor],
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    skip_prefix: int | Sequence[int] = 0,
    *,
    trusted: bool = False,
    host_slots: torch.Tensor | None = None,
) -> int:
    """``reference.scatter_fp8`` contract; on CUDA the fused dequantize-scatter kernel from device payloads,
    or the staged pipeline (large copies to device staging, then the kernel) from host payloads."""
    if payloads and kernels_enabled(kv_caches, layout):
        from tiercache.gpu import fp8_transfer, triton_kernels

        where = _where(payloads, layer_tensors(kv_caches)[0].device)
        try:
            if where == "device":
                return triton_kernels.scatter_fp8(
                    payloads,
                    kv_caches,
                    layout,
                    slot_mapping,
                    spans,
                    skip_prefix,
                    trusted=trusted,
                    host_slots=host_slots,
                )
            if where == "host":
                return fp8_transfer.load_fp8_from_host(
                    payloads,
                    kv_caches,
                    layout,
                    slot_mapping,
                    spans,
                    skip_prefix,
                    trusted=trusted,
                    host_slots=host_slots,
                )
        except triton_kernels.Unsupported:
            pass
    return reference.scatter_fp8(payloads, kv_caches, layout, slot_mapping, spans, skip_prefix)
