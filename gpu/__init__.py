"""Paged-KV layouts and gather/scatter between vLLM's paged KV and contiguous KV objects.

Importing this package does not import torch: layouts and read plans are plain data; the torch reference
(``gather``, ``scatter``, ``gather_layer``, ``scatter_layer``) loads on first attribute access.
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

__all__ = [
    "LayoutKind",
    "PagedLayout",
    "ReadPlan",
    "detect_layout",
    "gather",
    "gather_layer",
    "layer_tensors",
    "object_spec",
    "plan_read",
    "scatter",
    "scatter_layer",
    "skip_prefix_for",
]

_LAZY = {
    "gather": "tiercache.gpu.reference",
    "gather_layer": "tiercache.gpu.reference",
    "scatter": "tiercache.gpu.reference",
    "scatter_layer": "tiercache.gpu.reference",
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
