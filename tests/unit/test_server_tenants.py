"""Tenants through the node server's write-behind: the tenant of each ALLOC reaches the L2 tiers' quotas, and
the tiers' admission thresholds apply in the server as in-process."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.unit.test_server_storage import SPEC, clients, store
from tiercache.adapters.memory import MemoryAdapter
from tiercache.cli.main import main as cli
from tiercache.config import TierConfig
from tiercache.serde import build_pipeline
from tiercache.server.client import SharedL1
from tiercache.server.server import L1Server, ServerOptions
from tiercache.store.policy import tenant_id

pytestmark = pytest.mark.asyncio

TA, TB = tenant_id("salt-a"), tenant_id("salt-b")
QUOTA = 5 * SPEC.nbytes // 2  # two frames of a (a frame: the chunk and a small header)


@pytest_asyncio.fixture
async def served(sock_dir: Path) -> AsyncIterator[tuple[L1Server, MemoryAdapter]]:
    tier = MemoryAdapter()
    configs = [
        TierConfig("mem", "memory://", quotas={TA: QUOTA}),
        TierConfig("gated", "memory://", admit_after=2),
    ]
    gated = MemoryAdapter()
    options = ServerOptions(str(sock_dir / "l1.sock"), 16 * 4096, (4096,), region_bytes=4096, drain_s=5.0)
    server = L1Server(
        options,
        tiers=[("mem", tier, build_pipeline(["raw"])), ("gated", gated, build_pipeline(["raw"]))],
        tier_configs=configs,
    )
    await server.start()
    server.gated = gated  # type: ignore[attr-defined]
    yield server, tier
    await server.stop()


async def test_write_behind_counts_each_alloc_against_its_tenant(
    served: tuple[L1Server, MemoryAdapter],
) -> None:
    server, tier = served
    l1, admin = await clients(server)
    keys_a = [f"a-{i}" for i in range(4)]
    keys_b = [f"b-{i}" for i in range(4)]
    for i in range(4):  # one commit (one write-behind batch) at a time: a's oldest go first
        await asyncio.to_thread(store, l1, [keys_a[i]], TA)
        await asyncio.to_thread(store, l1, [keys_b[i]], TB)
        assert await asyncio.to_thread(admin.drain, 5.0)
    assert await tier.batched_contains(keys_a) == [False, False, True, True]  # a held to its quota
    assert await tier.batched_contains(keys_b) == [True] * 4  # b has none
    assert server.storage is not None
    ledger = server.storage.manager.store.ledgers["mem"]
    assert 0 < ledger.held(TA) <= QUOTA
    assert ledger.held(TB) == 4 * ledger.held(TA) // 2  # counted as b, not as the default tenant
    assert ledger.held("") == 0
    assert server.storage.manager.metrics.value("tiercache_evictions_total", tier="mem") == 2


async def test_server_tier_admits_after_its_threshold(served: tuple[L1Server, MemoryAdapter]) -> None:
    server, tier = served
    gated: MemoryAdapter = server.gated  # type: ignore[attr-defined]
    l1, admin = await clients(server)
    await asyncio.to_thread(l1.batched_locate, ["seen"], prefetch=False)  # a lookup sees it once...
    await asyncio.to_thread(l1.batched_locate, ["seen"], prefetch=False)  # ...and twice
    await asyncio.to_thread(store, l1, ["seen", "once"], TB)
    assert await asyncio.to_thread(admin.drain, 5.0)
    assert await tier.batched_contains(["seen", "once"]) == [True, True]  # the ungated tier stores both
    assert await gated.batched_contains(["seen", "once"]) == [True, False]
    assert server.storage is not None
    dropped = server.storage.manager.metrics.value(
        "tiercache_stores_dropped_total", tier="gated", reason="not_admitted"
    )
    assert dropped == 1


async def test_cli_names_a_lora_tenant(served: tuple[L1Server, MemoryAdapter]) -> None:
    server, _ = served
    adapter_tenant = tenant_id("salt-a", "adapter-1")
    l1 = await asyncio.to_thread(SharedL1, server.options.socket_path)
    await asyncio.to_thread(store, l1, ["x-0", "x-1"], adapter_tenant)
    await asyncio.to_thread(store, l1, ["y-0"], TA)  # the salt without the adapter: another tenant

    def delete(*extra: str) -> dict[str, Any]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli(["cache", "delete", "--socket", server.options.socket_path, "--json", *extra]) == 0
        answer: dict[str, Any] = json.loads(out.getvalue())
        return answer

    await asyncio.to_thread(delete, "--salt", "salt-a", "--lora", "adapter-1")
    assert await asyncio.to_thread(l1.batched_contains, ["x-0", "x-1", "y-0"]) == [False, False, True]
