"""L1 with an eviction policy and tenant quotas: under any sequence of writes, reads, leases, pins and deletes
(hypothesis state machine) no tenant holds past its budget, pinned and leased objects stay, every READY object
keeps its bytes; a tenant at its quota evicts its own objects, never another tenant's; counters per tenant."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.unit._l1_helpers import SLOT, SPEC, pattern, read
from tiercache.store.l1 import L1Cache, L1Lease

TENANTS = ["", "a", "b"]


def _put(cache: L1Cache, key: str, tenant: str = "") -> bool:
    obj = cache.reserve_write(key, SPEC, tenant)
    if obj is None:
        return False
    obj.buffer()[:] = pattern(key, SPEC.nbytes)
    cache.finish_write(obj)
    return True


class QuotaMachine(RuleBasedStateMachine):
    @initialize(eviction=st.sampled_from(["lru", "s3fifo"]), slots=st.integers(2, 8))
    def setup(self, eviction: str, slots: int) -> None:
        self.budgets = {"a": 2 * SLOT, "b": 3 * SLOT}
        self.cache = L1Cache(
            slots * SLOT, SLOT, pinned=False, eviction=eviction, quotas=self.budgets, max_pinned_share=0.5
        )
        self.leases: list[L1Lease] = []
        self.pinned: set[str] = set()
        self.n = 0

    @rule(tenant=st.sampled_from(TENANTS))
    def write(self, tenant: str) -> None:
        key = f"{tenant}:{self.n}"
        self.n += 1
        others = {k for k, o in self.cache._ready.items() if o.tenant != tenant}
        budget = self.budgets.get(tenant, 0)
        at_budget = budget and self.cache.held_bytes(tenant) + SLOT > budget
        ok = _put(self.cache, key, tenant)
        if at_budget:  # the room came from the tenant's own objects: every other tenant's stayed
            assert all(self.cache.contains(k) for k in others)
        if ok:
            assert self.cache.contains(key)

    @rule(data=st.data())
    def lease(self, data: st.DataObject) -> None:
        keys = sorted(self.cache._ready)
        if keys:
            lease = self.cache.acquire(data.draw(st.sampled_from(keys)), lease_s=1e6)
            assert lease is not None
            self.leases.append(lease)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1))).release()

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        keys = sorted(self.cache._ready)
        if keys:
            key = data.draw(st.sampled_from(keys))
            if self.cache.pin(key):
                self.pinned.add(key)

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pinned)))
        assert self.cache.unpin(key)
        self.pinned.discard(key)

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        keys = sorted(self.cache._ready)
        if keys:
            key = data.draw(st.sampled_from(keys))
            held = key in self.pinned or any(le.obj.key == key and le.valid() for le in self.leases)
            assert self.cache.delete(key) is not held

    @invariant()
    def within_budgets_and_intact(self) -> None:
        c = self.cache
        for tenant, budget in self.budgets.items():
            assert c.held_bytes(tenant) <= budget
        for key in self.pinned:
            assert c.contains(key)
        for lease in self.leases:
            assert lease.valid()
        for key, obj in c._ready.items():
            assert bytes(obj.buffer()) == pattern(key, SPEC.nbytes)
        assert sorted(c._policy) == sorted(c._ready)
        assert sorted(k for own in c._by_tenant.values() for k in own) == sorted(c._ready)
        assert c.stats().pinned == len(self.pinned)
        stats = c.tenant_stats()
        assert sum(s.held_bytes for s in stats.values()) == c.stats().used_bytes


TestQuotaMachine = QuotaMachine.TestCase
TestQuotaMachine.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)


def test_tenant_at_quota_evicts_its_own_first() -> None:
    c = L1Cache(8 * SLOT, SLOT, pinned=False, quotas={"a": 2 * SLOT})
    for i in range(3):
        assert _put(c, f"other{i}", "b")
    assert _put(c, "a0", "a")
    assert _put(c, "a1", "a")
    assert _put(c, "a2", "a")  # room in L1, but a is at its budget: a0 goes
    assert not c.contains("a0")
    assert all(c.contains(f"other{i}") for i in range(3))
    assert c.held_bytes("a") == 2 * SLOT
    st_ = c.stats()
    assert (st_.quota_evictions, st_.evictions) == (1, 1)
    leases = c.batched_acquire(["a1", "a2"])
    assert all(leases)
    assert not _put(c, "a3", "a")  # its own are all leased: refused, others untouched
    c.batched_release([le for le in leases if le is not None])
    assert c.stats().quota_refusals == 1
    assert read(c, "other0") == pattern("other0", SPEC.nbytes)
    ts = c.tenant_stats()
    assert ts["a"].evictions == 1
    assert ts["a"].held_bytes == 2 * SLOT
    assert ts["a"].hits == 2
    assert ts["b"].hits == 1


def test_tenant_labels_capped() -> None:
    c = L1Cache(16 * SLOT, SLOT, pinned=False, max_tenant_labels=2)
    for i in range(5):
        assert _put(c, f"k{i}", f"t{i}")
    stats = c.tenant_stats()
    assert set(stats) == {"t0", "t1", "other"}
    assert stats["other"].held_bytes == 3 * SLOT


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="eviction policy must be one of lru, s3fifo, not 'fifo'"):
        L1Cache(4 * SLOT, SLOT, pinned=False, eviction="fifo")
