"""vLLM's KV cache groups as the connector sees them: which layers, what attention, which tokens a page needs.

A model with attention of several kinds (sliding window beside full attention, chunked local attention)
runs, under vLLM's hybrid memory allocator, with one KV cache group per kind and layer set. Each group has
its own block ids; the blocks a windowed group no longer attends are vLLM's null block (id 0). The connector
stores one object per group per chunk, keyed with the group's spec (``GroupSpec.tag``), restores only the
pages a group's window needs, and counts a hit only when every group can be restored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["NULL_BLOCK", "GroupSpec", "check_layerwise", "kv_groups", "live_slots", "slot_mapping"]

NULL_BLOCK = 0
"""vLLM's null block: stands for a page a windowed group no longer holds (never written by a load)."""


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV cache group: its index, layers and attention ``kind`` (``full``, ``sliding_window`` or
    ``chunked_local``) with ``window`` tokens (the sliding window or the local-attention chunk; 0: full)."""

    index: int
    layer_names: tuple[str, ...]
    kind: str = "full"
    window: int = 0
    extra_retained: int = 0
    """Tokens vLLM keeps behind a sliding window (speculative decoding): their pages stay live."""
    hybrid: bool = False
    """True when the model has several groups or a windowed one: ``tag`` then names the group."""

    @property
    def windowed(self) -> bool:
        """True when vLLM frees this group's out-of-window pages while the request runs."""
        return self.kind != "full"

    @property
    def tag(self) -> str:
        """The group's part of the keyspace (``KeySpace.kv_group``): empty for a model of one plain
        full-attention group (its keys stay those of any full-attention model)."""
        if not self.hybrid:
            return ""
        layers = hashlib.sha256("\n".join(self.layer_names).encode()).hexdigest()[:16]
        return f"{self.kind}:{self.window}:{layers}"

    def first_needed(self, end: int) -> int:
        """The first token whose KV this group still attends after ``end`` computed tokens (vLLM's
        ``get_num_skipped_tokens``): pages wholly before it are the null block."""
        if self.kind == "sliding_window":
            return max(0, end - self.window + 1 - self.extra_retained)
        if self.kind == "chunked_local":
            return end // self.window * self.window
        return 0


def kv_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> list[GroupSpec]:
    """The model's KV cache groups, each checked (``NotImplementedError`` with one line naming what cannot
    be cached: recurrent state, cross attention, inline quantization scales ...)."""
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        raise ValueError("tiercache needs vLLM's kv_cache_config (a KV connector with 3-argument __init__)")
    found = [
        _group(vllm_config, i, g.kv_cache_spec, g.layer_names)
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
    ]
    hybrid = len(found) > 1 or any(g.windowed for g in found)
    if hybrid:
        found = [GroupSpec(g.index, g.layer_names, g.kind, g.window, g.extra_retained, True) for g in found]
    return found


def _group(vllm_config: VllmConfig, index: int, spec: Any, layer_names: Sequence[str]) -> GroupSpec:
    """One group's spec (``NotImplementedError`` naming the reason when its KV cannot be cached)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    kind = type(spec).__name__
    names = tuple(layer_names)
    problem = ""
    if "Mamba" in kind or hasattr(spec, "mamba_type"):
        problem = (
            f"group {index} holds recurrent state ({kind}: Mamba/GDN layers), which vLLM keeps outside the "
            "paged KV and whose reuse cannot be restored exactly here"
        )
    elif getattr(spec, "state_content_bytes", None) is not None:
        problem = "its KV pages carry inline quantization scales"
    elif getattr(vllm_config.cache_config, "kv_cache_dtype_skip_layers", None):
        problem = "kv_cache_dtype_skip_layers gives its layers different KV dtypes"
    elif getattr(vllm_config.cache_config, "calculate_kv_scales", False):
        problem = "calculate_kv_scales makes each process compute its own k/v scales"
    elif type(spec) is SlidingWindowSpec:
        retained = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return GroupSpec(index, names, "sliding_window", int(spec.sliding_window), retained)
    elif type(spec) is ChunkedLocalAttentionSpec:
        return GroupSpec(index, names, "chunked_local", int(spec.attention_chunk_size))
    elif type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        # without the hybrid allocator a windowed layer is allocated as full attention: every page holds
        # every token's KV, so it is restored like full attention
        return GroupSpec(index, names)
    else:
        problem = f"its KV cache spec is {kind}"
    raise NotImplementedError(
        f"tiercache: cannot cache this model's KV: {problem}; supported: full attention, MLA, sliding "
        "window and chunked local attention"
    )


def check_layerwise(groups: Sequence[GroupSpec], layerwise: bool) -> None:
    """``NotImplementedError`` (one line) for layerwise objects on a hybrid model: they are stored and
    restored per layer of one full-attention group only."""
    if layerwise and any(g.hybrid for g in groups):
        kinds = sorted({f"{g.kind}" + (f" {g.window}" if g.window else "") for g in groups})
        raise NotImplementedError(
            f"tiercache: layerwise=true needs one full-attention KV cache group; this model has "
            f"{len(groups)} ({', '.join(kinds)}): set layerwise=false"
        )


def slot_mapping(block_ids: Sequence[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Slots of tokens ``0..num_tokens-1``: ``block_id * block_size + offset``; -1 past the given blocks."""
    import torch

    pos = torch.arange(num_tokens, dtype=torch.int64)
    index = pos // block_size
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    have = index < len(block_ids)
    if bool(have.any()):
        blocks = torch.tensor(list(block_ids), dtype=torch.int64)
        slots[have] = blocks[index[have]] * block_size + pos[have] % block_size
    return slots


def live_slots(block_ids: Sequence[int], num_tokens: int, block_size: int, *, null_ok: bool) -> Any:
    """Slots of tokens ``0..num_tokens-1`` (``block_id * block_size + offset``; -1 past the given blocks);
    a null block's tokens get -1 (a load leaves them alone) unless ``null_ok`` (a save gathers the null
    page itself: vLLM never reads it, and a load never writes it back)."""
    slots = slot_mapping(block_ids, num_tokens, block_size)
    if not null_ok:
        slots[(slots >= 0) & (slots < block_size)] = -1
    return slots
