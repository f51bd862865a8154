"""A storage manager's metrics: hits and misses per chunk with one tier label scheme (so hits / (hits +
misses) is each tier's hit ratio), every child at 0 from the start, L1 and tier usage, evictions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tiercache.adapters.memory import MemoryAdapter
from tiercache.config import ManagerConfig
from tiercache.metrics import DROP_REASONS, TIER_OPS, Metrics
from tiercache.serde import build_pipeline
from tiercache.spec import KVSpec
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager, TierHit

pytestmark = pytest.mark.asyncio

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=16, dtype="bfloat16", tokens=4)
RAW = build_pipeline(["raw"])
POLICY = ManagerConfig(l2_deadline_s=5, lookup_deadline_s=5, store_queue_size=16)


def frame(key: str) -> bytes:
    return bytes(RAW.encode(bytes([len(key)]) * SPEC.nbytes, SPEC, key))


async def store_in_l1(manager: StorageManager, keys: list[str]) -> None:
    objects = await manager.batched_allocate(keys, [SPEC] * len(keys))
    assert all(o is not None for o in objects)
    await manager.batched_put([o for o in objects if o is not None])


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every exported sample, parsed back from the Prometheus text (what a scrape sees)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render())
        for s in family.samples
    }


async def test_hits_and_misses_pair_per_tier_and_chunk() -> None:
    """k0 in L1, k1 only in tier a, k2 only in tier b, k3 nowhere: each chunk is a hit where it is served
    and a miss at every level above; the unserved chunk is a miss everywhere."""
    a, b = MemoryAdapter(), MemoryAdapter()
    async with StorageManager(
        L1Cache(SPEC.nbytes * 8, SPEC.nbytes), [("a", a, RAW), ("b", b, RAW)], POLICY
    ) as manager:
        await store_in_l1(manager, ["k0"])
        await a.batched_put(["k1"], [frame("k1")])
        await b.batched_put(["k2"], [frame("k2")])
        m = manager.metrics
        base = {
            t: (m.value("tiercache_hits_total", tier=t), m.value("tiercache_misses_total", tier=t))
            for t in ("L1", "a", "b")
        }
        found = await manager.lookup_prefix(["k0", "k1", "k2", "k3"], prefetch=False)
        assert found.tiers == ("L1", "a", "b")
        delta = {
            t: (
                m.value("tiercache_hits_total", tier=t) - base[t][0],
                m.value("tiercache_misses_total", tier=t) - base[t][1],
            )
            for t in ("L1", "a", "b")
        }
        assert delta == {"L1": (1, 3), "a": (1, 2), "b": (1, 1)}
        # a prefix that stops at the first gap: k3 missing ends it, k0 after it is not served
        await manager.lookup_prefix(["k3", "k0"], prefetch=False)
        assert m.value("tiercache_misses_total", tier="L1") - base["L1"][1] == 5
        assert m.value("tiercache_misses_total", tier="b") - base["b"][1] == 3
        assert m.value("tiercache_hits_total", tier="L1") - base["L1"][0] == 1


async def test_every_child_exists_at_zero_from_the_start() -> None:
    """Before any call each tier's counters, gauges and histograms are exported (at 0): a dashboard shows
    0, not "No data"."""
    async with StorageManager(
        L1Cache(SPEC.nbytes * 4, SPEC.nbytes), [("disk", MemoryAdapter(), RAW)], POLICY
    ) as manager:
        got = samples(manager.metrics)
        for name in ("hits", "misses", "evictions"):
            assert got[(f"tiercache_{name}_total", (("tier", "L1"),))] == 0, name
        for name in (
            "hits",
            "misses",
            "read_bytes",
            "written_bytes",
            "stores",
            "frames_rejected",
            "prefetched",
        ):
            assert got[(f"tiercache_{name}_total", (("tier", "disk"),))] == 0, name
        for op in TIER_OPS:
            assert got[("tiercache_tier_errors_total", (("op", op), ("tier", "disk")))] == 0, op
            assert got[("tiercache_tier_latency_seconds_count", (("op", op), ("tier", "disk")))] == 0, op
        for reason in DROP_REASONS:
            assert got[("tiercache_stores_dropped_total", (("reason", reason), ("tier", "disk")))] == 0
        for gauge in ("circuit_open", "tier_down", "store_queue_depth", "used_bytes", "objects"):
            assert got[(f"tiercache_{gauge}", (("tier", "disk"),))] == 0, gauge
        assert got[("tiercache_capacity_bytes", (("tier", "L1"),))] == SPEC.nbytes * 4


async def test_l1_and_tier_usage_and_evictions() -> None:
    """Bytes and objects held by L1 and by a tier are read at scrape time; L1's evictions are counted."""
    tier = MemoryAdapter()
    async with StorageManager(L1Cache(SPEC.nbytes * 2, SPEC.nbytes), [("mem", tier, RAW)], POLICY) as manager:
        m = manager.metrics
        await store_in_l1(manager, ["k0", "k1"])
        assert m.value("tiercache_objects", tier="L1") == 2
        assert m.value("tiercache_used_bytes", tier="L1") == 2 * SPEC.nbytes
        assert m.value("tiercache_evictions_total", tier="L1") == 0
        await manager.drain()
        await store_in_l1(manager, ["k2"])  # L1 is full: the least recently used object goes
        assert m.value("tiercache_evictions_total", tier="L1") == 1
        assert m.value("tiercache_objects", tier="L1") == 2
        await manager.drain()
        assert m.value("tiercache_objects", tier="mem") == 3
        assert m.value("tiercache_used_bytes", tier="mem") == tier.used_bytes > 3 * SPEC.nbytes


class RemoteL1:
    """A server's shared L1 as the manager sees it (``LocatesL2``): it answers where each key is."""

    def __init__(self, where: dict[str, TierHit]) -> None:
        self.where = where

    def batched_locate(self, keys: Sequence[str], *, prefetch: bool) -> list[TierHit | None]:
        return [self.where.get(k) for k in keys]

    def batched_acquire_loaded(self, keys: Sequence[str], wait_s: float) -> list[Any]:
        return [None] * len(keys)


async def test_server_mode_learns_the_servers_tiers_for_the_misses() -> None:
    """In server mode the tiers are the server's: a hit from its level-2 tier teaches the manager that
    level, so later chunks served or missed below count there too (the same pairing as in process)."""
    where = {"a": TierHit("L1", 0), "b": TierHit("redis", 1), "c": TierHit("disk", 2)}
    async with StorageManager(RemoteL1(where)) as manager:  # type: ignore[arg-type]
        m = manager.metrics
        await manager.lookup_prefix(["a", "b", "c", "x"], prefetch=False)
        got = {
            t: (m.value("tiercache_hits_total", tier=t), m.value("tiercache_misses_total", tier=t))
            for t in ("L1", "redis", "disk")
        }
        assert got == {"L1": (1, 3), "redis": (1, 2), "disk": (1, 1)}
        await manager.lookup_prefix(["x"], prefetch=False)  # a miss everywhere, at every level learnt
        assert m.value("tiercache_misses_total", tier="disk") == 2
        assert m.value("tiercache_misses_total", tier="redis") == 3
