"""Hits and misses a lookup counts, over generated placements of its chunks across L1 and two L2 tiers: a
chunk served by tier T is a hit at T and a miss at every level above T; each chunk after the prefix is a miss
at every level (whether one tier serves the whole prefix or several do)."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.adapters.memory import MemoryAdapter
from tiercache.config import ManagerConfig
from tiercache.metrics import Metrics
from tiercache.serde import build_pipeline
from tiercache.spec import KVSpec
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=16, dtype="bfloat16", tokens=4)
RAW = build_pipeline(["raw"])
POLICY = ManagerConfig(l2_deadline_s=5, lookup_deadline_s=5, store_queue_size=64)
LEVELS = ("L1", "a", "b")
NOWHERE = len(LEVELS)


def frame(key: str) -> bytes:
    return bytes(RAW.encode(bytes([len(key)]) * SPEC.nbytes, SPEC, key))


def expected(places: list[int]) -> dict[str, tuple[int, int]]:
    """(hits, misses) per tier, chunk by chunk from the definition."""
    hits = dict.fromkeys(LEVELS, 0)
    misses = dict.fromkeys(LEVELS, 0)
    served = True
    for place in places:
        served = served and place != NOWHERE
        for level, tier in enumerate(LEVELS):
            if served and level == place:
                hits[tier] += 1
            elif not served or level < place:
                misses[tier] += 1
    return {t: (hits[t], misses[t]) for t in LEVELS}


def totals(metrics: Metrics) -> dict[str, tuple[float, float]]:
    """(hits, misses) so far per tier."""
    return {
        t: (metrics.value("tiercache_hits_total", tier=t), metrics.value("tiercache_misses_total", tier=t))
        for t in LEVELS
    }


async def counted(places: list[list[int]]) -> list[dict[str, tuple[int, int]]]:
    """Each lookup's (hits, misses) per tier, with every key placed at the level given (3: nowhere)."""
    a, b = MemoryAdapter(), MemoryAdapter()
    async with StorageManager(
        L1Cache(SPEC.nbytes * 64, SPEC.nbytes), [("a", a, RAW), ("b", b, RAW)], POLICY
    ) as manager:
        out: list[dict[str, tuple[int, int]]] = []
        for n, lookup in enumerate(places):
            keys = [f"q{n}k{i}" for i in range(len(lookup))]
            in_l1 = [k for k, p in zip(keys, lookup, strict=True) if p == 0]
            if in_l1:
                objects = await manager.batched_allocate(in_l1, [SPEC] * len(in_l1))
                await manager.batched_put([o for o in objects if o is not None])
            for level, adapter in ((1, a), (2, b)):
                there = [k for k, p in zip(keys, lookup, strict=True) if p == level]
                if there:
                    await adapter.batched_put(there, [frame(k) for k in there])
            before = totals(manager.metrics)
            await manager.lookup_prefix(keys, prefetch=False)
            after = totals(manager.metrics)
            out.append(
                {t: (int(after[t][0] - before[t][0]), int(after[t][1] - before[t][1])) for t in LEVELS}
            )
        return out


placements = st.lists(st.lists(st.integers(0, NOWHERE), min_size=1, max_size=6), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(places=placements)
def test_each_lookup_counts_its_hits_and_misses_per_tier(places: list[list[int]]) -> None:
    assert asyncio.run(counted(places)) == [expected(p) for p in places]


@settings(max_examples=20, deadline=None)
@given(tier=st.integers(0, NOWHERE - 1), served=st.integers(1, 4), unserved=st.integers(0, 3))
def test_a_prefix_one_tier_serves(tier: int, served: int, unserved: int) -> None:
    """The usual shape: one tier serves the whole prefix, then nothing (counted twice in one manager, the
    second time through what the first kept)."""
    places = [[tier] * served + [NOWHERE] * unserved] * 2
    assert asyncio.run(counted(places)) == [expected(p) for p in places]
