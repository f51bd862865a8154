"""Paged-KV layouts and gather/scatter between vLLM's paged KV and contiguous KV objects.

Importing this package does not import torch: layouts and read plans are plain data; the torch reference
(``gather``, ``scatter``, ``gather_layer``, ``scatter_layer``) loads on first attribute access, as do the GPU
paths: ``store_to_host``/``load_from_host`` (the staged GPU<->L1 pipeline) and ``gather_fp8`` (fused fp8
quantize-on-gather). ``tiercache.gpu.dispatch`` has the reference's gather/scatter signatures and picks the
Triton kernels for CUDA tensors (what the cache engine calls).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tiercache.gpu.layouts import (
    LayoutKind,
    PagedLayout,
    ReadPlan,
    detect_layout,
    layer_tensors,
    object_spec,
    plan_read,
    skip_prefix_for,
)

if TYPE_CHECKING:
    from tiercache.gpu.reference import gather, gather_layer, scatter, scatter_layer
    from tiercache.gpu.transfer import load_from_host, store_to_host
    from tiercache.gpu.triton_kernels import fp8_payload_nbytes, gather_fp8

__all__ = [
    "LayoutKind",
    "PagedLayout",
    "ReadPlan",
    "detect_layout",
    "fp8_payload_nbytes",
    "gather",
    "gather_fp8",
    "gather_layer",
    "layer_tensors",
    "load_from_host",
    "object_spec",
    "plan_read",
    "scatter",
    "scatter_layer",
    "skip_prefix_for",
    "store_to_host",
]

_LAZY = {
    "gather": "tiercache.gpu.reference",
    "gather_layer": "tiercache.gpu.reference",
    "scatter": "tiercache.gpu.reference",
    "scatter_layer": "tiercache.gpu.reference",
    "store_to_host": "tiercache.gpu.transfer",
    "load_from_host": "tiercache.gpu.transfer",
    "gather_fp8": "tiercache.gpu.triton_kernels",
    "fp8_payload_nbytes": "tiercache.gpu.triton_kernels",
}


def __getattr__(name: str) -> Any:
    """Load torch-backed names on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """Public names, including the lazy ones."""
    return sorted(__all__)
