"""L2 tiers that evict on their own (file, nvme+slab) count what they push out in ``tiercache_evictions``
under their tier label, from 0: a small tier forced to evict moves the counter by exactly the objects it lost;
deletes are not evictions. A tier that never evicts on its own has no evictions series."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercache.adapters import Adapter
from tiercache.adapters.memory import MemoryAdapter
from tiercache.adapters.nvme_slab import SlabAdapter
from tiercache.adapters.posix import PosixAdapter
from tiercache.config import ManagerConfig
from tiercache.serde import build_pipeline
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager

pytestmark = pytest.mark.asyncio

RAW = build_pipeline(["raw"])
POLICY = ManagerConfig(l2_deadline_s=30, lookup_deadline_s=30, store_queue_size=16)
EVICTIONS = "tiercache_evictions_total"


async def _evicts_exactly(tier: Adapter, sizes: list[int]) -> None:
    """Put one object of each size (one at a time) into ``tier`` under a manager: the evictions counter
    starts at 0 and ends at the number of objects no longer held; a delete leaves it unchanged."""
    async with StorageManager(
        L1Cache(1 << 20, 4096), [("t", tier, RAW), ("mem", MemoryAdapter(), RAW)], POLICY
    ) as m:
        metrics = m.metrics
        assert f'{EVICTIONS[:-6]}_total{{tier="t"}} 0.0' in metrics.render()
        assert 'tiercache_evictions_total{tier="mem"}' not in metrics.render()
        keys = [f"k{i}" for i in range(len(sizes))]
        for key, size in zip(keys, sizes, strict=True):
            assert await tier.batched_put([key], [bytes([len(key)]) * size]) == [True]
        held = await tier.batched_contains(keys)
        evicted = held.count(False)
        assert evicted >= len(keys) // 2, held  # the tier was forced to evict
        assert metrics.value(EVICTIONS, tier="t") == evicted
        survivor = keys[held.index(True)]
        assert await tier.batched_delete([survivor]) == [True]
        assert metrics.value(EVICTIONS, tier="t") == evicted  # a delete is not an eviction
        assert metrics.value(EVICTIONS, tier="mem") == 0


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
async def test_file_tier_counts_its_evictions(tmp_path: Path, eviction: str) -> None:
    tier = await PosixAdapter.open(f"file://{tmp_path}?capacity=40000&eviction={eviction}")
    await _evicts_exactly(tier, [10_000] * 16)


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
async def test_slab_tier_counts_its_evictions(tmp_path: Path, eviction: str) -> None:
    url = (
        f"nvme+slab://{tmp_path}/t.slab?capacity=4MiB&max_object=256KiB&extent_size=1MiB&eviction={eviction}"
    )
    tier = await SlabAdapter.open(url)
    try:
        await _evicts_exactly(tier, [200_000] * 24 + [30_000] * 40)  # two size classes: extents change hands
        assert tier.stats["evicted"] > 0
    finally:
        await tier.aclose()
