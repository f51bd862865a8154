"""Paged-KV layouts and gather/scatter between vLLM's paged KV and contiguous KV objects.

Importing this package does not import torch: layouts, read plans and ``Move`` (one gather or scatter,
validated once: layout, slots, spans, objects, skips, layers, checks) are plain data. ``gather`` and
``scatter`` (``tiercache.gpu.dispatch``: the Triton kernels on CUDA, the torch reference of
``tiercache.gpu.reference`` elsewhere) run a ``Move`` (bf16, or fp8: ``Move.gather_fp8`` quantizes while
gathering into ``fp8_payload_nbytes``-byte payloads, ``Move.scatter_fp8`` dequantizes) and load torch on
first attribute access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tiercache.gpu.layouts import (
    LayoutKind,
    PagedLayout,
    ReadPlan,
    detect_layout,
    fp8_payload_nbytes,
    layer_tensors,
    object_spec,
    plan_read,
    skip_prefix_for,
)
from tiercache.gpu.move import Checks, Move

if TYPE_CHECKING:
    from tiercache.gpu.dispatch import gather, scatter

__all__ = [
    "Checks",
    "LayoutKind",
    "Move",
    "PagedLayout",
    "ReadPlan",
    "detect_layout",
    "fp8_payload_nbytes",
    "gather",
    "layer_tensors",
    "object_spec",
    "plan_read",
    "scatter",
    "skip_prefix_for",
]

_LAZY = {
    "gather": "tiercache.gpu.dispatch",
    "scatter": "tiercache.gpu.dispatch",
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
