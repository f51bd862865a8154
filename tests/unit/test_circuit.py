"""The circuit breaker's half-open rule: after the cool-down exactly one probe call reaches the tier; every
other call is refused (a miss, no tier call) until that probe resolves, which closes or re-opens it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from tiercache.adapters.memory import MemoryAdapter
from tiercache.config import ManagerConfig
from tiercache.serde import build_pipeline
from tiercache.spec import KVSpec
from tiercache.store.circuit import CircuitBreaker
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager
from tiercache.testing.fakes import FakeClock

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=16, dtype="bfloat16", tokens=4)


def test_breaker_admits_one_probe_until_it_resolves() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failures=2, cooldown_s=5, clock=clock)
    assert breaker.record_failure() is False
    assert breaker.record_failure() is True  # the second consecutive failure opens it
    assert not breaker.allow()
    clock.now += 5
    assert breaker.allow()  # the probe
    assert breaker.probing
    assert [breaker.allow() for _ in range(5)] == [False] * 5, "a second call went out while probing"
    clock.now += 100  # however long the probe takes, no other call goes out
    assert not breaker.allow()
    assert breaker.record_failure() is True  # the probe failed: open again, a new cool-down
    assert not breaker.allow()
    clock.now += 5
    assert breaker.allow()
    assert not breaker.allow()
    breaker.record_success()  # the probe succeeded: closed, every call goes out
    assert all(breaker.allow() for _ in range(5))


class GatedContains(MemoryAdapter):
    """``batched_contains`` fails while ``failing``; while ``gate`` is clear each call waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = True
        self.gate = asyncio.Event()
        self.gate.set()
        self.calls = 0

    async def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        self.calls += 1
        await self.gate.wait()
        if self.failing:
            raise ConnectionError("tier down")
        return await super().batched_contains(keys)


@pytest.mark.asyncio
async def test_only_one_call_reaches_a_half_open_tier() -> None:
    """Ten lookups during the probe are misses at once and none reaches the tier; the probe's success
    closes the circuit and the next lookups go out again."""
    raw = build_pipeline(["raw"])
    tier = GatedContains()
    await tier.batched_put(["k"], [raw.encode(bytes(SPEC.nbytes), SPEC, "k")])
    clock = FakeClock()
    policy = ManagerConfig(
        l2_deadline_s=60, lookup_deadline_s=60, store_queue_size=8, circuit_failures=1, circuit_cooldown_s=5
    )
    async with StorageManager(
        L1Cache(SPEC.nbytes * 4, SPEC.nbytes), [("t", tier, raw)], policy, clock=clock
    ) as m:
        assert await m.batched_contains(["k"]) == [None]  # fails: the circuit opens
        assert m.metrics.value("tiercache_circuit_open", tier="t") == 1
        assert await m.batched_contains(["k"]) == [None]  # open: refused
        assert tier.calls == 1
        clock.now += 6
        tier.failing = False
        tier.gate.clear()
        probe = asyncio.ensure_future(m.batched_contains(["k"]))
        for _ in range(100):
            if tier.calls == 2:
                break
            await asyncio.sleep(0)
        assert tier.calls == 2, "the probe did not go out after the cool-down"
        others = await asyncio.gather(*(m.batched_contains(["k"]) for _ in range(10)))
        assert others == [[None]] * 10
        assert tier.calls == 2, f"{tier.calls - 2} calls reached the tier beside the half-open probe"
        tier.gate.set()
        hits = await probe
        assert [h.tier if h else None for h in hits] == ["t"]
        assert m.metrics.value("tiercache_circuit_open", tier="t") == 0
        again = await asyncio.gather(*(m.batched_contains(["k"]) for _ in range(3)))
        assert [[h.tier if h else None for h in hits] for hits in again] == [["t"]] * 3
        assert tier.calls == 5
