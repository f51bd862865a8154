"""A Redis tier that is down when the engine opens: the run goes on (misses, counted), the tier is re-opened
in the background and used once the server is up (real redis-server started after the open)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tiercache.config import config_from_dict
from tiercache.errors import AdapterUnavailable, ConfigError
from tiercache.gpu.layouts import LayoutKind, PagedLayout, object_spec
from tiercache.gpu.move import Move
from tiercache.gpu.reference import gather, scatter
from tiercache.store._reopen import ReopeningAdapter
from tiercache.store.engine import CacheEngine
from tiercache.store.manager import StorageManager
from tiercache.testing.harness.backends import start_redis_process
from tiercache.testing.harness.processes import ServerProcess, free_port

LAYOUT = PagedLayout(
    LayoutKind.VLLM_FLASH, num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="bfloat16"
)
BLOCKS = 64


def _config(port: int) -> object:
    return config_from_dict(
        {
            "chunk_size": 256,
            "l1": {"capacity": "32MiB", "pinned": False},
            "manager": {"circuit_failures": 1, "circuit_cooldown_s": 0.05, "l2_deadline_s": 5.0},
            "tiers": [{"name": "redis", "url": f"redis://127.0.0.1:{port}/0"}],
        }
    )


def _paged(seed: int, tokens: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A paged KV cache holding ``tokens`` tokens of seeded KV, its slot mapping and the expected KV."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(object_spec(LAYOUT, tokens).shape, generator=gen).to(torch.bfloat16)
    cache = [torch.zeros(LAYOUT.layer_shape(BLOCKS), dtype=torch.bfloat16) for _ in range(LAYOUT.num_layers)]
    slots = torch.arange(tokens)
    scatter(cache, Move.scatter(LAYOUT, slots, [(0, tokens)], [kv]))
    return cache, slots, kv


@pytest.mark.asyncio
async def test_redis_down_at_open_then_up_is_used(redis_binary: str, tmp_path: Path) -> None:
    port = free_port()
    config = _config(port)
    prefill = await CacheEngine.open(config, LAYOUT, model="t/m")  # type: ignore[arg-type]
    decode = await CacheEngine.open(config, LAYOUT, model="t/m")  # type: ignore[arg-type]
    server: ServerProcess | None = None
    try:
        adapter = prefill.manager.tiers[0].adapter
        assert isinstance(adapter, ReopeningAdapter)
        metrics = prefill.manager.metrics
        assert metrics.value("tiercache_tier_down", tier="redis") == 1.0
        with pytest.raises(AdapterUnavailable):
            await adapter.batched_contains(["k"])

        # Down: stores land in L1 only (the L2 store is dropped and counted), the other process misses.
        cache, slots, _ = _paged(1, 512)
        tokens_a = list(range(512))
        assert await prefill.store(tokens_a, cache, slots) == 512
        await prefill.drain()
        assert metrics.value("tiercache_stores_dropped_total", tier="redis", reason="failed") >= 1
        assert await decode.lookup(tokens_a) == 0
        assert decode.manager.metrics.value("tiercache_tier_errors_total", tier="redis", op="contains") >= 1

        server = start_redis_process(redis_binary, port, tmp_path / "redis", timeout=15)
        for engine in (prefill, decode):
            tier_adapter = engine.manager.tiers[0].adapter
            assert isinstance(tier_adapter, ReopeningAdapter)
            await asyncio.wait_for(tier_adapter.reopened.wait(), 60)
        assert metrics.value("tiercache_tier_down", tier="redis") == 0.0

        # Up: a new prompt goes to Redis and the other process restores it bit-exact from there.
        cache_b, slots_b, kv_b = _paged(2, 512)
        tokens_b = list(range(10_000, 10_512))
        assert await prefill.store(tokens_b, cache_b, slots_b) == 512
        await prefill.drain()
        assert metrics.value("tiercache_stores_total", tier="redis") == 2
        assert await decode.lookup(tokens_b) == 512
        target = [torch.full_like(c, float("nan")) for c in cache_b]
        assert bool((await decode.retrieve(tokens_b, target, slots_b)).all())
        out = torch.empty(object_spec(LAYOUT, 512).shape, dtype=torch.bfloat16)
        gather(target, Move.gather(LAYOUT, slots_b, [(0, 512)], [out]))
        assert torch.equal(out.view(torch.int16), kv_b.view(torch.int16))
        assert decode.manager.metrics.value("tiercache_prefetched_total", tier="redis") == 2
    finally:
        await prefill.aclose()
        await decode.aclose()
        if server is not None:
            server.stop()


@pytest.mark.asyncio
async def test_config_errors_still_raise_at_open() -> None:
    """Only a down backend is tolerated: a bad option is still an error at open."""
    config = config_from_dict(
        {"tiers": [{"name": "redis", "url": "redis://127.0.0.1:1/0", "options": {"no_such_option": 1}}]}
    )
    with pytest.raises(ConfigError):
        await StorageManager.open(config, 1024)


@pytest.mark.asyncio
async def test_aclose_stops_reopening_before_the_tier_is_back() -> None:
    config = _config(free_port())
    manager = await StorageManager.open(config, 1024, reopen_delay_s=0.01)  # type: ignore[arg-type]
    adapter = manager.tiers[0].adapter
    assert isinstance(adapter, ReopeningAdapter)
    await manager.aclose()
    assert adapter.closed
    assert not adapter.up


@pytest.mark.asyncio
async def test_cluster_down_at_open_is_a_down_tier() -> None:
    """redis-py's own cluster errors at open (no startup node answers) also make a down tier."""
    port = free_port()
    config = config_from_dict({"tiers": [{"name": "cluster", "url": f"redis+cluster://127.0.0.1:{port}"}]})
    manager = await StorageManager.open(config, 1024, reopen_delay_s=30)
    try:
        adapter = manager.tiers[0].adapter
        assert isinstance(adapter, ReopeningAdapter)
        assert manager.metrics.value("tiercache_tier_down", tier="cluster") == 1.0
        assert await manager.batched_contains(["k"]) == [None]
        assert manager.metrics.value("tiercache_tier_errors_total", tier="cluster", op="contains") == 1
    finally:
        await manager.aclose()


def test_demo_runs_with_a_redis_tier_down(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's reproduction: ``tiercache demo`` with a Redis tier that is down goes on without it."""
    from tiercache import cli

    config = tmp_path / "demo.toml"
    config.write_text(
        f'chunk_size = 256\n[l1]\ncapacity = "256MiB"\npinned = false\n'
        f'[[tiers]]\nname = "disk"\nurl = "file://{tmp_path}/l2"\n'
        f'[[tiers]]\nname = "redis"\nurl = "redis://127.0.0.1:{free_port()}/0"\n'
    )
    assert cli.main(["demo", "--config", str(config)]) == 0
    out = capsys.readouterr()
    assert "OK: every restored token is bit-exact" in out.out
    assert "6/6" in out.out
    assert "(not encrypted)" in out.err  # the demo's first line shows each tier's encryption
