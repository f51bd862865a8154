"""Moves on vLLM's block-outermost allocation (``VLLM_BLOCKS``) as moves of whole blocks.

In ``BLNHC`` memory every layer's page of a block lies in one run of bytes, so a block of every layer is one
page of ``num_layers`` times the bytes, and the paged KV is one tensor of such pages. ``as_pages`` turns a
``VLLM_BLOCKS`` move into that move: a ``CPU_BLOCKS`` layout of one layer whose page is a whole block, on one
``[NB, L*H, BS, 2*D]`` view of the allocation, with the objects viewed to match (the same bytes: objects are
block runs in block order). The page move then runs where page moves run: the copy engines between CUDA KV
and pinned host objects (``tiercache.gpu.copy_engine``: one copy per run of consecutive blocks), the torch
reference (or the CPU row kernel) elsewhere. Only moves of every layer apply (``ValueError`` otherwise).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from tiercache.gpu.layouts import LayoutKind, PagedLayout, block_pages_problem, layer_tensors
from tiercache.gpu.move import Move

if TYPE_CHECKING:
    import torch

    from tiercache.gpu.layouts import KVCaches

__all__ = ["as_pages", "page_layout"]

# id(first layer tensor) -> (a weak reference to it, every layer's id and address, the whole-block view): the
# entry goes when that tensor does, so a view never outlives the KV it was made of
_VIEWS: dict[int, tuple[weakref.ref[torch.Tensor], tuple[tuple[int, int], ...], list[torch.Tensor]]] = {}


def page_layout(layout: PagedLayout) -> PagedLayout:
    """The ``CPU_BLOCKS`` layout of one layer whose page is a whole block of ``layout`` (every layer)."""
    return PagedLayout(
        LayoutKind.CPU_BLOCKS,
        num_layers=1,
        num_kv_heads=layout.num_layers * layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=layout.dtype,
    )


def _whole_blocks(kv_caches: KVCaches, layout: PagedLayout) -> list[torch.Tensor]:
    """One ``[NB, L*H, BS, 2*D]`` view of the allocation behind ``kv_caches``, the same list while they hold
    the same layer tensors at the same addresses (so what a path prepared on it is found again);
    ``ValueError`` unless they are ``BLNHC``."""
    layers = layer_tensors(kv_caches)
    if len(layers) != layout.num_layers:
        raise ValueError(f"{len(layers)} KV cache tensors for a layout of {layout.num_layers} layers")
    first = layers[0]
    signature = tuple((id(t), t.data_ptr()) for t in layers)
    kept = _VIEWS.get(id(first))
    if kept is not None and kept[0]() is first and kept[1] == signature:
        return kept[2]
    problem = block_pages_problem(layers, layout.num_kv_heads, layout.head_dim)
    if problem is not None:
        raise ValueError(f"KV cache tensors are not vLLM's BLNHC allocation: {problem}")
    nb, h, bs, c = first.shape
    view = [
        first.as_strided(
            (nb, layout.num_layers * h, bs, c), (first.stride(0), bs * c, c, 1), first.storage_offset()
        )
    ]
    key = id(first)
    _VIEWS[key] = (weakref.ref(first, lambda _: _VIEWS.pop(key, None)), signature, view)
    return view


def as_pages(kv_caches: KVCaches, move: Move) -> tuple[KVCaches, Move]:
    """What runs ``move`` on ``kv_caches``: for a ``VLLM_BLOCKS`` move its page move and the view it runs on
    (made once per move and allocation, kept on the move, so a run again finds what its path prepared on the
    view; made again where ``kv_caches`` now holds other tensors), any other move as it is. ``ValueError``
    for a ``VLLM_BLOCKS`` move of some layers only or tensors that are not one ``BLNHC`` allocation."""
    if move.layout.kind is not LayoutKind.VLLM_BLOCKS:
        return kv_caches, move
    if len(move.layers) != move.layout.num_layers:
        raise ValueError(
            f"a VLLM_BLOCKS move carries whole blocks of every layer, not layers {move.layers.start}-"
            f"{move.layers.stop - 1} of {move.layout.num_layers}"
        )
    view = _whole_blocks(kv_caches, move.layout)
    key = ("pages", id(kv_caches))
    kept = move.prepared.get(key)
    if kept is not None and kept[0] is view:
        return view, kept[1]
    pages = page_layout(move.layout)
    objects = move.objects
    if not move.fp8:  # a payload is bytes already; an object [2, L, T, H*D] becomes [2, 1, T, L*H*D]
        if any(not o.is_contiguous() for o in objects):
            raise ValueError("VLLM_BLOCKS objects hold raw pages and must be contiguous")
        objects = tuple(o.view(2, 1, o.shape[2], -1) for o in objects)
    paged = Move(
        pages,
        move.slot_mapping,
        move.spans,
        objects,
        move.skips,
        range(1),
        move.checks,
        move.host_slots,
        move.fp8,
    )
    move.prepared[key] = (view, paged)
    return view, paged
