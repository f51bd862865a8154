"""vLLM's KV cache groups as the connector sees them: which layers, what attention, which tokens a page needs.

A model with attention of several kinds (sliding window beside full attention, chunked local attention)
runs, under vLLM's hybrid memory allocator, with one KV cache group per kind and layer set. Each group has
its own block ids; the blocks a windowed group no longer attends are vLLM's null block (id 0). The connector
stores one object per group per chunk, keyed with the group's spec (``GroupSpec.tag``), restores only the
pages a group's window needs, and counts a hit only when every group can be restored.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiercache_vllm._state import check_state_chunks

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from tiercache_vllm._common import ConnectorSettings

__all__ = [
    "NULL_BLOCK",
    "GroupSpec",
    "check_layerwise",
    "check_window_checkpoint",
    "checked_groups",
    "kv_groups",
    "live_slots",
    "slot_mapping",
    "window_boundary",
    "window_chunks",
]

NULL_BLOCK = 0
"""vLLM's null block: stands for a page a windowed group no longer holds (never written by a load)."""


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV cache group: its index, layers and attention ``kind`` (``full``, ``sliding_window``,
    ``chunked_local`` or ``recurrent``) with ``window`` tokens (the sliding window, the local-attention chunk
    or the tokens between two recurrent state snapshots, vLLM's block size; 0: full)."""

    index: int
    layer_names: tuple[str, ...]
    kind: str = "full"
    window: int = 0
    extra_retained: int = 0
    """Tokens vLLM keeps behind a sliding window (speculative decoding): their pages stay live."""
    hybrid: bool = False
    """True when the model has several groups or a windowed one: ``tag`` then names the group."""
    state: str = ""
    """A recurrent group's state format (``_state.state_descriptor``), part of its tag."""

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
        return f"{self.kind}:{self.window}:{layers}" + (f":{self.state}" if self.state else "")

    def first_needed(self, end: int) -> int:
        """The first token whose KV this group still attends after ``end`` computed tokens (vLLM's
        ``get_num_skipped_tokens``): pages wholly before it are the null block."""
        if self.kind == "sliding_window":
            return max(0, end - self.window + 1 - self.extra_retained)
        if self.kind == "chunked_local":
            return end // self.window * self.window
        if self.kind == "recurrent":  # the state at the last snapshot before ``end``: that block only
            return max(0, end - 1) // self.window * self.window
        return 0

    def read_from(self, boundary: int, block_size: int) -> int:
        """The first token a load restoring a prefix that ends at ``boundary`` reads for this group, in
        whole pages: vLLM asks for ``boundary`` or ``boundary - 1`` tokens (never a whole prompt)."""
        return self.first_needed(max(0, boundary - 1)) // block_size * block_size


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
        found = [dataclasses.replace(g, hybrid=True) for g in found]
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
        from vllm.platforms import current_platform

        from tiercache_vllm._state import state_descriptor, state_problem

        mode = str(getattr(vllm_config.cache_config, "mamba_cache_mode", "none"))
        problem = state_problem(spec, mode, on_cpu=current_platform.is_cpu())
        if not problem:
            return GroupSpec(index, names, "recurrent", int(spec.block_size), state=state_descriptor(spec))
        problem = f"{problem.replace('group holds', f'group {index} holds', 1)}"
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
        "window, chunked local attention and gated DeltaNet state (prefix caching on)"
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


def checked_groups(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig | None,
    settings: ConnectorSettings,
    chunk_size: int,
) -> list[GroupSpec]:
    """The model's KV cache groups (``kv_groups``), checked against the connector's settings and
    ``chunk_size``: layerwise objects, window checkpoints and recurrent state chunks (one-line errors)."""
    groups = kv_groups(vllm_config, kv_cache_config)
    check_layerwise(groups, settings.layerwise)
    check_window_checkpoint(settings.window_checkpoint_tokens, chunk_size)
    check_state_chunks([g.window for g in groups if g.kind == "recurrent"], chunk_size)
    return groups


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


def check_window_checkpoint(tokens: int, chunk_size: int) -> None:
    """``ValueError`` (one line) unless ``window_checkpoint_tokens`` is 0 (every chunk boundary) or a
    positive multiple of ``chunk_size`` (a hit always ends at a chunk boundary)."""
    if tokens < 0 or tokens % chunk_size:
        raise ValueError(
            f"kv_connector_extra_config['window_checkpoint_tokens'] must be 0 (every chunk boundary) or a "
            f"positive multiple of chunk_size ({chunk_size}): {tokens}"
        )


def window_chunks(
    group: GroupSpec, prompt_len: int, chunk_size: int, checkpoint: int, *, unfull: bool, block_size: int
) -> set[int] | None:
    """The chunks of a ``prompt_len``-token prompt that ``group`` stores with window checkpoints every
    ``checkpoint`` tokens: those a load of a hit boundary reads (every multiple of ``checkpoint``, the
    prompt's last whole chunk boundary, and its end when ``unfull`` chunks are stored). None: every chunk
    (full attention, or checkpoints off)."""
    if not group.windowed or checkpoint <= 0:
        return None
    boundaries = set(range(checkpoint, prompt_len + 1, checkpoint))
    boundaries.add(prompt_len // chunk_size * chunk_size)
    if unfull:
        boundaries.add(prompt_len)
    keep: set[int] = set()
    for b in boundaries:
        if b > 0:
            keep.update(range(group.read_from(b, block_size) // chunk_size, -(-b // chunk_size)))
    return keep


def window_boundary(
    groups: Sequence[GroupSpec],
    present: Sequence[Sequence[bool]],
    num_tokens: int,
    chunk_size: int,
    block_size: int,
) -> int:
    """The longest prefix of a ``num_tokens``-token prompt a load can restore, in tokens: the largest chunk
    boundary ``b`` (or ``num_tokens``) where every full-attention group holds every chunk of ``[0, b)`` and
    every windowed group the chunks a load of ``b`` reads. ``present[c][i]``: chunk ``c`` of ``groups[i]``
    is stored."""
    full = [i for i, g in enumerate(groups) if not g.windowed]
    limit = len(present)
    for c, row in enumerate(present):
        if not all(row[i] for i in full):
            limit = c
            break
    for k in range(limit, 0, -1):
        b = min(k * chunk_size, num_tokens)
        if all(
            all(present[c][i] for c in range(g.read_from(b, block_size) // chunk_size, k))
            for i, g in enumerate(groups)
            if g.windowed
        ):
            return b
    return 0
