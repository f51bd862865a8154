"""L1 cache: two-phase writes, views, LRU eviction, expiring leases, generations, thread safety."""

from __future__ import annotations

import mmap
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.unit._l1_helpers import SLOT, SPEC, pattern, put, read
from tiercache.spec import KVFormat, KVSpec
from tiercache.store.l1 import KVObject, L1Cache, L1Lease, L1Stats, ObjectState
from tiercache.testing.fakes import FakeClock


def make(slots: int = 4, slot_bytes: int = SLOT, **kw: object) -> L1Cache:
    return L1Cache(slots * slot_bytes, slot_bytes, pinned=False, **kw)  # type: ignore[arg-type]


def check_invariants(cache: L1Cache) -> None:
    """Structural invariants, checked against the implementation's internals and its stats."""
    free = cache._free
    assert len(set(free)) == len(free), "a slot is on the free list twice"
    owners = cache._owner
    for s in free:
        assert owners[s] is None, "a free slot has an owner"
    live = [o for o in owners if o is not None]
    assert len(live) + len(free) == cache.num_slots
    assert len({id(o) for o in live}) == len(live), "one object in two slots"
    for i, o in enumerate(owners):
        if o is not None:
            assert o._slot == i
            assert o._gen == cache._gens[i]
            assert cache._objects[o.key] is o
    assert len(cache._objects) == len(live)
    ready = [o for o in live if o.state is ObjectState.READY]
    assert sorted(cache._ready) == sorted(o.key for o in ready)
    for key, obj in cache._ready.items():
        assert bytes(obj.buffer()) == pattern(key, obj.spec.nbytes), f"{key} lost its data"
    st_ = cache.stats()
    assert st_.used_slots == len(live)
    assert st_.used_slots + len(free) == st_.num_slots == cache.num_slots
    assert st_.ready == len(ready)
    assert st_.writing == len(live) - len(ready)
    assert st_.used_bytes == sum(o.spec.nbytes for o in live)
    assert st_.used_bytes <= st_.used_slots * cache.slot_bytes <= st_.capacity


# ---------------------------------------------------------------------------------------------- construction


def test_construction_and_geometry() -> None:
    c = L1Cache(10 * SLOT + 5, SLOT, pinned=False)
    assert (c.capacity, c.slot_bytes, c.num_slots) == (10 * SLOT + 5, SLOT, 10)
    assert c._pool.numel() == 10 * SLOT
    assert c._pool.dtype == torch.uint8
    assert not c._pool.is_pinned()
    with pytest.raises(ValueError, match="no slot"):
        L1Cache(SLOT - 1, SLOT, pinned=False)
    with pytest.raises(ValueError, match="slot_bytes"):
        L1Cache(SLOT, 0, pinned=False)
    auto = L1Cache(SLOT, SLOT)
    assert auto.pinned is torch.cuda.is_available()
    assert auto._pool.is_pinned() is torch.cuda.is_available()


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (Linux ``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no transparent huge pages (not Linux)")
def test_unpinned_pool_asks_for_huge_pages() -> None:
    """An unpinned pool starts on a 2 MiB boundary of a private mapping advised for transparent huge pages
    (a slot of a few MiB then takes a few TLB entries), and its slots hold what was written."""
    c = L1Cache(3 * (4 << 20), 4 << 20, pinned=False)
    assert c._pool.data_ptr() % (2 << 20) == 0
    assert c._pool.numel() == 3 * (4 << 20)
    flags = _vm_flags(c._pool.data_ptr())
    assert "hg" in flags  # MADV_HUGEPAGE
    assert "sh" not in flags  # private: a forked child gets copy-on-write pages, as with malloc
    obj = put(c, "a")
    assert obj.payload().data_ptr() % (2 << 20) == 0
    assert read(c, "a") == pattern("a", SPEC.nbytes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_pool() -> None:
    c = L1Cache(4 * SLOT, SLOT, pinned=True)
    assert c._pool.is_pinned()
    obj = put(c, "a")
    assert obj.tensor().is_pinned()


def test_import_is_torch_free() -> None:
    code = "import sys, tiercache.store.l1; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------ two-phase writes


def test_writing_is_invisible_until_finish() -> None:
    c = make()
    obj = c.reserve_write("a", SPEC)
    assert obj is not None
    assert obj.state is ObjectState.WRITING
    assert obj.key == "a"
    assert obj.spec == SPEC
    assert not c.contains("a")
    assert c.batched_contains(["a"]) == [False]
    assert c.acquire("a") is None
    assert c.delete("a") is False
    assert c.stats().writing == 1
    assert c.stats().ready == 0
    obj.buffer()[:] = pattern("a", SLOT)
    c.finish_write(obj)
    assert obj.state is ObjectState.READY
    assert c.contains("a")
    assert read(c, "a") == pattern("a", SLOT)
    with pytest.raises(ValueError, match="not a live"):
        c.finish_write(obj)  # already READY
    with pytest.raises(ValueError, match="not a live"):
        c.abort_write(obj)  # not WRITING


def test_first_writer_wins() -> None:
    c = make()
    first = c.reserve_write("a", SPEC)
    assert first is not None
    assert c.reserve_write("a", SPEC) is None  # WRITING
    first.buffer()[:] = pattern("a", SLOT)
    c.finish_write(first)
    second = c.reserve_write("a", SPEC.with_tokens(2))
    assert second is None  # READY
    assert read(c, "a") == pattern("a", SLOT)
    s = c.stats()
    assert s.alloc_failures == 0
    assert s.used_slots == 1


def test_abort_write_frees_the_slot() -> None:
    c = make(slots=1)
    obj = c.reserve_write("a", SPEC)
    assert obj is not None
    gen = c._gens[obj._slot]
    c.abort_write(obj)
    assert c._gens[obj._slot] == gen + 1  # freeing a slot bumps its generation
    assert not c.contains("a")
    assert c.stats().used_slots == 0
    assert c.stats().writing == 0
    assert c.stats().used_bytes == 0
    b = c.reserve_write("b", SPEC)  # the only slot is free again, no eviction needed
    assert b is not None
    assert c.stats().evictions == 0
    c.abort_write(b)
    put(c, "a")  # the aborted key can be written afresh
    assert read(c, "a") == pattern("a", SLOT)
    with pytest.raises(ValueError, match="not a live"):
        c.abort_write(obj)  # stale object
    with pytest.raises(ValueError, match="not a live"):
        c.finish_write(obj)
    check_invariants(c)


def test_objects_from_another_cache_are_refused() -> None:
    c1, c2 = make(), make()
    obj = c1.reserve_write("a", SPEC)
    assert obj is not None
    c2.reserve_write("a", SPEC)
    with pytest.raises(ValueError, match="not a live"):
        c2.finish_write(obj)
    with pytest.raises(ValueError, match="not a live"):
        c2.abort_write(obj)


def test_oversize_spec_is_refused_and_counted() -> None:
    c = make(slots=2)
    big = SPEC.with_tokens(SPEC.tokens + 1)
    assert big.nbytes > c.slot_bytes
    assert c.reserve_write("big", big) is None
    assert c.reserve_write("big2", big) is None
    assert c.stats().alloc_failures == 2
    assert c.stats().used_slots == 0
    exact = c.reserve_write("exact", SPEC)  # nbytes == slot_bytes fits
    assert exact is not None
    small = c.reserve_write("small", SPEC.with_tokens(1))
    assert small is not None
    assert c.stats().used_bytes == SPEC.nbytes + SPEC.with_tokens(1).nbytes
    assert c.stats().alloc_failures == 2


# ---------------------------------------------------------------------------------------------- views


SPECS = [
    pytest.param(KVSpec(2, 2, 4, dt, KVFormat.KV_2LTD, tokens=4), id=f"2LTD-{dt}")
    for dt in ("bfloat16", "float16", "float32")
] + [
    pytest.param(KVSpec(3, 1, 8, dt, KVFormat.KV_MLA, tokens=5), id=f"MLA-{dt}")
    for dt in ("bfloat16", "float16", "float32")
]


@pytest.mark.parametrize("spec", SPECS)
def test_tensor_and_buffer_alias_the_slot(spec: KVSpec) -> None:
    # An odd slot size exercises the aligned stride; two objects check that neighbours do not overlap.
    c = L1Cache(3 * (spec.nbytes + 3), spec.nbytes + 3, pinned=False)
    a = c.reserve_write("a", spec)
    b = c.reserve_write("b", spec)
    assert a is not None
    assert b is not None
    t = a.tensor()
    assert tuple(t.shape) == spec.shape
    assert t.dtype == getattr(torch, spec.dtype)
    assert t.is_contiguous()
    buf = a.buffer()
    assert isinstance(buf, memoryview)
    assert not buf.readonly
    assert buf.nbytes == len(buf) == spec.nbytes
    assert buf.format == "B"
    # no copy: both views sit on the pool
    pool_lo = c._pool.data_ptr()
    assert pool_lo <= t.data_ptr() < pool_lo + c._pool.numel()
    b.buffer()[:] = b"\xee" * spec.nbytes
    assert b.tensor().dtype == t.dtype  # a slot at an odd byte offset could not be viewed as bf16/fp32
    # tensor -> buffer
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape).to(t.dtype))
    assert bytes(buf) == t.contiguous().view(torch.uint8).numpy().tobytes()
    # buffer -> tensor
    buf[:] = pattern("a", spec.nbytes)
    fresh = a.tensor()
    assert fresh.view(torch.uint8).reshape(-1).numpy().tobytes() == pattern("a", spec.nbytes)
    assert torch.equal(fresh.view(torch.uint8), t.view(torch.uint8))
    assert bytes(b.buffer()) == b"\xee" * spec.nbytes  # neighbour untouched


def test_a_slot_keeps_its_view_until_it_holds_another_shape() -> None:
    """tensor() hands out the slot's kept view while the spec is the same (no torch op on the store path),
    and a fresh view of the new shape and dtype once the slot holds a shorter bf16 or a float32 object."""
    short = KVSpec(2, 2, 4, "bfloat16", KVFormat.KV_2LTD, tokens=2)
    wide = KVSpec(2, 2, 2, "float32", KVFormat.KV_2LTD, tokens=4)
    c = make(slots=1)
    first = put(c, "a")
    view = first.tensor()
    assert first.tensor() is view
    assert c.delete("a")
    again = put(c, "b")  # the same slot, the same spec: the same view, now over b's bytes
    assert again.tensor() is view
    assert view.view(torch.uint8).reshape(-1).numpy().tobytes() == pattern("b", SPEC.nbytes)
    for key, spec in (("c", short), ("d", wide), ("e", SPEC)):
        assert c.delete(c._owner[0].key)  # type: ignore[union-attr]
        obj = put(c, key, spec)
        t = obj.tensor()
        assert tuple(t.shape) == spec.shape
        assert t.dtype == getattr(torch, spec.dtype)
        assert t.data_ptr() == c._pool.data_ptr()
        assert t.view(torch.uint8).reshape(-1).numpy().tobytes() == pattern(key, spec.nbytes)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_data_survives_bit_exact(dtype: str) -> None:
    spec = SPEC.with_dtype(dtype)
    c = L1Cache(4 * spec.nbytes, spec.nbytes, pinned=False)
    gen = torch.Generator().manual_seed(7)
    originals = {}
    for k in "abcd":
        obj = c.reserve_write(k, spec)
        assert obj is not None
        src = torch.randn(spec.shape, generator=gen).to(getattr(torch, dtype))
        src.view(-1)[0] = float("nan")
        src.view(-1)[1] = -0.0
        obj.tensor().copy_(src)
        originals[k] = src.clone()
        c.finish_write(obj)
    for k, src in originals.items():
        lease = c.acquire(k)
        assert lease is not None
        got = lease.obj.tensor().clone()
        assert lease.valid()
        lease.release()
        assert got.dtype == src.dtype
        # compare the raw bits (NaN and -0.0 included)
        assert torch.equal(got.view(torch.uint8), src.view(torch.uint8))


# ---------------------------------------------------------------------------------------------- LRU eviction


def test_lru_evicts_oldest_and_keeps_recently_acquired() -> None:
    c = make(slots=3)
    for k in "abc":
        put(c, k)
    assert c.reserve_write("a", SPEC) is None  # still there, no eviction for a duplicate
    lease = c.acquire("a")  # a becomes most recently used
    assert lease is not None
    lease.release()
    assert c.contains("b")  # contains does not reorder
    put(c, "d")  # evicts b, the oldest unleased
    assert c.batched_contains(["a", "b", "c", "d"]) == [True, False, True, True]
    put(c, "e")  # evicts c
    assert c.batched_contains(["a", "b", "c", "d", "e"]) == [True, False, False, True, True]
    put(c, "f")  # evicts a
    assert c.batched_contains(["a", "d", "e", "f"]) == [False, True, True, True]
    s = c.stats()
    assert s.evictions == 3
    assert s.alloc_failures == 0
    for k in "def":
        assert read(c, k) == pattern(k, SLOT)
    check_invariants(c)


def test_writing_objects_are_never_evicted() -> None:
    c = make(slots=2)
    w = c.reserve_write("w", SPEC)
    assert w is not None
    put(c, "a")
    put(c, "b")  # evicts a, not the older WRITING w
    assert not c.contains("a")
    assert c.contains("b")
    assert c.stats().writing == 1
    assert c.stats().evictions == 1
    assert c._owner[w._slot] is w


def test_leased_objects_are_not_evicted() -> None:
    c = make(slots=2)
    put(c, "a")
    put(c, "b")
    la, lb = c.acquire("a"), c.acquire("b")
    assert la is not None
    assert lb is not None
    assert c.reserve_write("c", SPEC) is None
    assert c.stats().alloc_failures == 1
    assert c.stats().leased == 2
    assert c.contains("a")
    assert c.contains("b")
    # a is the LRU once b is acquired after it; releasing b alone must make b (not a) the victim
    lb.release()
    put(c, "c")
    assert c.batched_contains(["a", "b", "c"]) == [True, False, True]
    assert la.valid()
    assert read(c, "a") == pattern("a", SLOT)
    la.release()
    check_invariants(c)


def test_everything_writing_or_leased_means_no_slot() -> None:
    c = make(slots=2)
    put(c, "a")
    assert c.acquire("a") is not None
    assert c.reserve_write("w", SPEC) is not None
    assert c.reserve_write("x", SPEC) is None
    assert c.reserve_write("y", SPEC) is None
    assert c.stats().alloc_failures == 2
    assert c.stats().evictions == 0


# ---------------------------------------------------------------------------------------------- leases


def leased_a(slots: int, lease_s: float | None = None, **kw: object) -> tuple[FakeClock, L1Cache, L1Lease]:
    """A cache of ``slots`` slots on a fake clock holding "a", and a lease on "a" (``lease_s``; None: the
    cache's default); ``kw`` goes to the cache."""
    clock = FakeClock()
    c = make(slots, SLOT, clock=clock, **kw)
    put(c, "a")
    lease = c.acquire("a") if lease_s is None else c.acquire("a", lease_s=lease_s)
    assert lease is not None
    return clock, c, lease


def test_leases_expire_then_object_is_evictable_and_lease_invalid() -> None:
    clock, c, lease = leased_a(1, lease_s=5.0, default_lease_s=30.0)
    assert lease.expires_at == clock.now + 5.0
    assert lease.valid()
    clock.advance(4.9)
    assert lease.valid()
    assert c.reserve_write("b", SPEC) is None  # still protected
    assert c.delete("a") is False
    clock.advance(0.2)  # expired
    assert not lease.valid()
    assert c.stats().leased == 0
    put(c, "b")  # now the slot is reused
    assert not c.contains("a")
    s = c.stats()
    assert s.evictions == 1
    assert s.expired_leases == 1
    assert not lease.valid()
    lease.release()  # after expiry and reuse: harmless
    assert read(c, "b") == pattern("b", SLOT)


def test_default_lease_duration() -> None:
    clock, c, lease = leased_a(1, default_lease_s=2.0)
    assert lease.expires_at == clock.now + 2.0
    [blease] = c.batched_acquire(["a"])
    assert blease is not None
    assert blease.expires_at == clock.now + 2.0
    with pytest.raises(ValueError, match="lease_s"):
        c.acquire("a", lease_s=0)
    with pytest.raises(ValueError, match="lease_s"):
        c.batched_acquire(["a"], lease_s=-1)


def test_generation_check_catches_slot_reuse() -> None:
    """valid() must compare generations, not only the clock: rewind a fake clock after the slot is reused."""
    clock, c, lease = leased_a(1, lease_s=5.0)
    old_slot = lease.obj._slot
    clock.advance(10)
    put(c, "b")  # evicts a; the same slot now holds b
    assert c._owner[old_slot] is not lease.obj
    clock.now -= 10  # the lease looks unexpired again
    assert clock.now < lease.expires_at
    assert not lease.valid()
    # copy-then-validate: the bytes now belong to b, and valid() says to discard them
    assert bytes(lease.obj.buffer())[:8] == pattern("b", SLOT)[:8]


def test_deleted_object_lease_invalid_even_if_slot_unused() -> None:
    clock, c, lease = leased_a(2, lease_s=1.0)
    clock.advance(2)
    assert c.delete("a") is True  # expired lease no longer protects
    clock.now -= 2
    assert not lease.valid()
    assert c.stats().expired_leases == 1


def test_release_drops_exactly_its_own_lease() -> None:
    clock = FakeClock()
    c = make(slots=1, clock=clock)
    put(c, "a")
    long_ = c.acquire("a", lease_s=100)
    short = c.acquire("a", lease_s=1)
    assert long_ is not None
    assert short is not None
    long_.release()
    assert short.valid()
    clock.advance(2)  # short expired, long released: nothing protects "a" any more
    assert c.delete("a") is True


def test_release_is_idempotent_and_per_lease() -> None:
    c = make(slots=1)
    put(c, "a")
    l1 = c.acquire("a")
    l2 = c.acquire("a")
    assert l1 is not None
    assert l2 is not None
    l1.release()
    l1.release()
    l1.release()
    assert not l1.valid()
    assert l2.valid()
    assert c.stats().leased == 1
    assert c.delete("a") is False
    assert c.reserve_write("b", SPEC) is None
    with l2 as same:
        assert same is l2
    assert not l2.valid()
    l2.release()
    assert c.stats().leased == 0
    assert c.delete("a") is True
    l1.release()  # after delete
    l2.release()


def test_release_never_raises_after_eviction() -> None:
    clock, c, lease = leased_a(1, lease_s=1)
    clock.advance(5)
    put(c, "b")
    lease.release()
    lease.release()
    # the new object's protection is unaffected by the stale release
    lb = c.acquire("b")
    assert lb is not None
    stale = L1Lease  # the type is public for annotations
    assert isinstance(lb, stale)
    lease.release()
    assert c.reserve_write("c", SPEC) is None
    lb.release()


def test_delete() -> None:
    clock = FakeClock()
    c = make(slots=2, clock=clock)
    assert c.delete("nope") is False
    put(c, "a")
    lease = c.acquire("a", lease_s=3)
    assert lease is not None
    assert c.delete("a") is False
    assert c.contains("a")
    lease.release()
    assert c.delete("a") is True
    assert not c.contains("a")
    assert c.delete("a") is False
    assert c.stats().used_slots == 0
    assert c.stats().evictions == 0  # delete is not an eviction
    check_invariants(c)


def test_batched_ops() -> None:
    c = make(slots=3)
    put(c, "a")
    put(c, "b")
    w = c.reserve_write("w", SPEC)
    assert w is not None
    assert c.batched_contains(["b", "x", "w", "a"]) == [True, False, False, True]
    leases = c.batched_acquire(["b", "x", "w", "a"])
    assert [lease is not None for lease in leases] == [True, False, False, True]
    assert [lease.obj.key for lease in leases if lease is not None] == ["b", "a"]
    assert c.stats().leased == 2
    assert c.batched_contains([]) == []
    assert c.batched_acquire([]) == []
    for lease in leases:
        if lease is not None:
            lease.release()
    # batched_acquire marks in order: b then a, so b is now the LRU
    c.finish_write(w)
    c.acquire("w").release()  # type: ignore[union-attr]
    put(c, "d")
    assert c.batched_contains(["a", "b", "w", "d"]) == [True, False, True, True]


def test_stats_add_up() -> None:
    clock = FakeClock()
    c = make(slots=3, clock=clock)
    s0 = c.stats()
    assert isinstance(s0, L1Stats)
    assert s0 == L1Stats(0, 3, 0, 3 * SLOT, 0, 0, 0, 0, 0, 0)
    put(c, "a")
    small = SPEC.with_tokens(1)
    put(c, "b", small)
    w = c.reserve_write("w", SPEC)
    assert w is not None
    lease = c.acquire("a", lease_s=1)
    assert lease is not None
    assert c.reserve_write("huge", SPEC.with_tokens(9)) is None
    s = c.stats()
    assert s == L1Stats(
        used_slots=3,
        num_slots=3,
        used_bytes=2 * SLOT + small.nbytes,
        capacity=3 * SLOT,
        ready=2,
        writing=1,
        leased=1,
        evictions=0,
        expired_leases=0,
        alloc_failures=1,
    )
    clock.advance(2)
    put(c, "c")  # b is LRU (a was acquired later) -> evicted; a's expired lease is not even scanned
    s = c.stats()
    assert (s.evictions, s.used_bytes, s.ready, s.leased) == (1, 3 * SLOT, 2, 0)
    assert s.expired_leases == 1  # stats() itself found a's expired lease
    with pytest.raises(AttributeError):
        s.used_slots = 0  # type: ignore[misc]
    check_invariants(c)


# ---------------------------------------------------------------------------------------------- model-based


KEYS = [f"k{i}" for i in range(6)]


class L1Machine(RuleBasedStateMachine):
    """Random op sequences against a fake clock; a model tracks writers and live leases."""

    @initialize()
    def setup(self) -> None:
        self.clock = FakeClock()
        self.cache = L1Cache(4 * SLOT, SLOT, pinned=False, clock=self.clock, default_lease_s=3.0)
        self.writing: dict[str, KVObject] = {}
        self.leases: list[L1Lease] = []
        self.dead: list[L1Lease] = []  # released leases

    def live_leased_keys(self) -> set[str]:
        return {lease.obj.key for lease in self.leases if lease.expires_at > self.clock.now}

    @rule(key=st.sampled_from(KEYS), tokens=st.integers(0, 4))
    def reserve(self, key: str, tokens: int) -> None:
        existed = key in self.writing or self.cache.contains(key)
        blocked = len(self.writing) + len(self.live_leased_keys() - set(self.writing))
        obj = self.cache.reserve_write(key, SPEC.with_tokens(tokens))
        if existed:
            assert obj is None
            return
        if obj is None:
            assert blocked == self.cache.num_slots, "refused although a slot was free or evictable"
            return
        assert obj.state is ObjectState.WRITING
        obj.buffer()[:] = pattern(key, obj.spec.nbytes)
        self.writing[key] = obj
        assert self.live_leased_keys() <= {k for k in KEYS if self.cache.contains(k)}

    @precondition(lambda self: self.writing)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.writing)))
        self.cache.finish_write(self.writing.pop(key))
        assert self.cache.contains(key)

    @precondition(lambda self: self.writing)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.writing)))
        self.cache.abort_write(self.writing.pop(key))
        assert not self.cache.contains(key)

    @rule(key=st.sampled_from(KEYS), lease_s=st.sampled_from([None, 0.5, 2.0, 10.0]))
    def acquire(self, key: str, lease_s: float | None) -> None:
        must_hit = key in self.live_leased_keys()
        lease = self.cache.acquire(key, lease_s)
        if key in self.writing:
            assert lease is None
            return
        if must_hit:
            assert lease is not None, "a leased object vanished"
        if lease is None:
            return
        data = bytes(lease.obj.buffer())
        assert lease.valid()
        assert data == pattern(key, lease.obj.spec.nbytes)
        self.leases.append(lease)

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), twice=st.booleans())
    def release(self, data: st.DataObject, twice: bool) -> None:
        lease = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        lease.release()
        if twice:
            lease.release()
        self.dead.append(lease)

    @rule(dt=st.sampled_from([0.1, 0.6, 2.5, 11.0]))
    def tick(self, dt: float) -> None:
        self.clock.advance(dt)

    @rule(key=st.sampled_from(KEYS))
    def delete(self, key: str) -> None:
        protected = key in self.live_leased_keys() or key in self.writing
        present = self.cache.contains(key)
        ok = self.cache.delete(key)
        assert ok == (present and not protected)
        if ok:
            assert not self.cache.contains(key)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        check_invariants(self.cache)
        now = self.clock.now
        for lease in self.leases:
            if lease.expires_at > now:
                assert lease.valid()
                assert self.cache.contains(lease.obj.key)
                assert bytes(lease.obj.buffer()) == pattern(lease.obj.key, lease.obj.spec.nbytes)
            else:
                assert not lease.valid()
        for lease in self.dead:
            assert not lease.valid()
        assert self.cache.stats().leased == len(self.live_leased_keys())


TestL1Machine = L1Machine.TestCase
TestL1Machine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


# ---------------------------------------------------------------------------------------------- threads


def test_concurrent_threads_keep_invariants() -> None:
    c = L1Cache(8 * SLOT, SLOT, pinned=False, default_lease_s=5.0)
    keys = [f"t{i}" for i in range(20)]
    specs = {k: SPEC.with_tokens(1 + i % 4) for i, k in enumerate(keys)}
    errors: list[BaseException] = []
    counts = {"reads": 0, "writes": 0, "discarded": 0}
    stop = time.monotonic() + 1.0
    hard_stop = stop + 60.0  # a loaded machine: run on until the counts below are reached

    def running() -> bool:
        now = time.monotonic()
        enough = counts["reads"] > 100 and counts["writes"] > 10
        return now < stop or (now < hard_stop and not enough)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while running():
                key = rng.choice(keys)
                r = rng.random()
                if r < 0.35:
                    obj = c.reserve_write(key, specs[key])
                    if obj is None:
                        continue
                    obj.buffer()[:] = pattern(key, obj.spec.nbytes)
                    if rng.random() < 0.1:
                        c.abort_write(obj)
                    else:
                        c.finish_write(obj)
                        counts["writes"] += 1
                elif r < 0.95:
                    lease = c.acquire(key, lease_s=rng.choice([1e-4, 1e-3, 5.0]))
                    if lease is None:
                        continue
                    copy = bytes(lease.obj.buffer())
                    if lease.valid():
                        assert lease.obj.key == key
                        assert copy == pattern(key, specs[key].nbytes), "corrupt read under a valid lease"
                        counts["reads"] += 1
                    else:
                        counts["discarded"] += 1
                    lease.release()
                    lease.release()
                else:
                    c.delete(key)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert counts["reads"] > 100
    assert counts["writes"] > 10
    check_invariants(c)
    s = c.stats()
    assert s.writing == 0
    assert s.leased == 0
    assert s.ready == s.used_slots
