"""Two reads of overlapping keys from L2 at once: the one whose keys the other started loading while it
asked the tier waits for those loads instead of answering a miss (a short load of a hit), as long as such a
load may take (its size-scaled read deadline, not only the manager's short L2 deadline)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import pytest

from tests.unit.test_manager import (
    POLICY,
    ROOMY,
    SPEC,
    GatedAdapter,
    ManualTimer,
    keys_of,
    make_l1,
    payload,
    stored_in_memory,
    until,
)
from tiercache.adapters.memory import MemoryAdapter
from tiercache.serde.pipeline import build_pipeline
from tiercache.store.hits import TierHit
from tiercache.store.manager import StorageManager

pytestmark = pytest.mark.asyncio


class GatedContains(GatedAdapter):
    """Fault injection: existence checks wait for the test's gate as well as gets."""

    def __init__(self, inner: MemoryAdapter) -> None:
        super().__init__(inner)
        self.contains_gate = asyncio.Event()
        self.contains_waiting = 0

    async def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        self.contains_waiting += 1
        await self.contains_gate.wait()
        return await super().batched_contains(keys)


async def test_a_read_waits_for_the_loads_another_read_started_meanwhile() -> None:
    slow = GatedContains(await stored_in_memory(4))
    async with StorageManager(make_l1(), [("mem", slow, build_pipeline(["raw"]))], ROOMY) as reader:
        keys = keys_of(4)
        short = asyncio.ensure_future(reader.batched_get(keys[:2], [SPEC] * 2))
        await until(lambda: slow.contains_waiting == 1)  # asking the tier which of its keys it holds
        hits = [TierHit("mem", 1)] * 4
        long = asyncio.ensure_future(reader.batched_get(keys, [SPEC] * 4, hits=hits))
        await until(lambda: "k0001" in slow.requested)  # the other read is loading the same keys now
        slow.contains_gate.set()
        await asyncio.sleep(0.01)
        for key in keys:
            slow.gates.setdefault(key, asyncio.Event()).set()
        got_short, got_long = await short, await long
        assert [lease is not None for lease in got_short] == [True, True]
        assert [lease is not None for lease in got_long] == [True] * 4
        for key, lease in zip(keys, got_short + got_long[2:], strict=False):
            assert lease is not None
            assert bytes(lease.obj.buffer()) == payload(key)
        for lease in got_short + got_long:
            assert lease is not None
            lease.release()
        assert slow.requested.count("k0000") == 1  # loaded once, by the read that started it


SHORT_DEADLINE = dataclasses.replace(POLICY, l2_deadline_s=0.1, lookup_deadline_s=0.1, l2_read_floor_s=3600.0)
"""A short L2 deadline and a read deadline (floor) no loaded machine reaches."""


async def test_a_read_waits_out_a_prefetch_slower_than_the_l2_deadline() -> None:
    slow = GatedAdapter(await stored_in_memory(2))
    timer = ManualTimer()  # the prefetch's own read deadline never passes: only the test opens the gates
    async with StorageManager(
        make_l1(), [("mem", slow, build_pipeline(["raw"]))], SHORT_DEADLINE, read_timer=timer
    ) as reader:
        keys = keys_of(2)
        reader.start_prefetch(keys, ["mem", "mem"], [SPEC, SPEC])  # a lookup's prefetch, still reading
        await until(lambda: "k0001" in slow.requested)
        got = asyncio.ensure_future(reader.batched_get(keys, [SPEC] * 2, hits=[TierHit("mem", 1)] * 2))
        # at least three l2_deadline_s pass (more on a loaded machine: the read's deadline is an hour)
        await asyncio.sleep(3 * SHORT_DEADLINE.l2_deadline_s)
        assert not got.done()  # still waiting for the prefetch, past the L2 deadline
        for key in keys:
            slow.gates.setdefault(key, asyncio.Event()).set()
        leases = await got
        assert [lease is not None for lease in leases] == [True, True]
        for key, lease in zip(keys, leases, strict=True):
            assert lease is not None
            assert bytes(lease.obj.buffer()) == payload(key)
            lease.release()
        assert slow.requested.count("k0000") == 1  # read once, by the prefetch
