"""A lookup whose served chunks the caller chooses (a windowed model's hit skips chunks its window does not
read): ``lookup_prefixes(count=False)`` counts nothing, ``count_lookup`` counts exactly the chunks named."""

from __future__ import annotations

import pytest

from tests.unit.test_lookup_counts import POLICY, RAW, SPEC, frame, totals
from tiercache.adapters.memory import MemoryAdapter
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager

pytestmark = pytest.mark.asyncio


async def test_the_caller_counts_the_chunks_it_serves() -> None:
    a, b = MemoryAdapter(), MemoryAdapter()
    keys = ["k0", "k1", "k2", "k3"]
    await a.batched_put(keys[1:3], [frame(k) for k in keys[1:3]])  # k0 missing: no contiguous prefix
    async with StorageManager(
        L1Cache(SPEC.nbytes * 16, SPEC.nbytes), [("a", a, RAW), ("b", b, RAW)], POLICY
    ) as manager:
        before = totals(manager.metrics)
        (hit,) = await manager.lookup_prefixes([keys], count=False)
        assert hit.chunks == 0
        assert [h.tier if h else None for h in hit.hits] == [None, "a", "a", None]
        assert totals(manager.metrics) == before  # nothing counted
        manager.count_lookup(["a", "a"], 1)  # the caller serves chunks 1 and 2 from "a"; chunk 3 unserved
        after = totals(manager.metrics)
        assert after == {"L1": (0, 3), "a": (2, 1), "b": (0, 1)}
        await manager.lookup_prefixes([keys])  # counted as before: the contiguous prefix (none)
        assert totals(manager.metrics) == {"L1": (0, 7), "a": (2, 5), "b": (0, 5)}
