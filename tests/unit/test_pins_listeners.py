"""Pins and removal listeners of the in-process L1 and the server's slot table: a pinned key is never evicted,
deleted or cleared, pins are bounded per tenant, and listeners hear every store and removal in order."""

from __future__ import annotations

import os

from tests.unit._l1_helpers import SLOT, SPEC, pattern, read
from tiercache.server.segment import MIN_SLOT, Geometry, Segment
from tiercache.server.slots import Caps, SlotTable
from tiercache.store.l1 import L1Cache


def _l1(slots: int = 4, **kw: float) -> L1Cache:
    return L1Cache(slots * SLOT, SLOT, pinned=False, **kw)


def _put(cache: L1Cache, key: str, tenant: str = "") -> None:
    obj = cache.reserve_write(key, SPEC, tenant)
    assert obj is not None, key
    obj.buffer()[:] = pattern(key, SPEC.nbytes)
    cache.finish_write(obj)


def test_l1_pinned_object_outlives_pressure_and_delete() -> None:
    c = _l1(4)
    _put(c, "p")
    assert c.pin("p")
    assert c.pin("p")
    for i in range(20):
        _put(c, f"k{i}")
    assert read(c, "p") == pattern("p", SPEC.nbytes)
    assert not c.delete("p")
    assert c.stats().pinned == 1
    assert c.unpin("p")
    assert not c.unpin("p")
    for i in range(20, 24):
        _put(c, f"k{i}")
    assert read(c, "p") is None  # evictable again


def test_l1_all_pinned_refuses_new_writes() -> None:
    c = _l1(2, max_pinned_share=1.0)
    for k in "ab":
        _put(c, k)
        assert c.pin(k)
    assert c.reserve_write("c", SPEC) is None
    assert c.stats().alloc_failures == 1


def test_l1_pins_bounded_per_tenant() -> None:
    c = _l1(4, max_pinned_share=0.5)
    assert c.max_pins_per_tenant == 2
    for k in "abc":
        _put(c, k, tenant="t1")
    _put(c, "d", tenant="t2")
    assert c.pin("a")
    assert c.pin("b")
    assert not c.pin("c")  # t1 is at its bound
    assert c.pin("d")  # another tenant is not
    assert (c.pinned_count("t1"), c.pinned_count("t2"), c.pinned_count()) == (2, 1, 3)
    assert c.unpin("a")
    assert c.pin("c")
    assert not c.pin("missing")


def test_l1_listener_hears_store_evict_delete_in_order() -> None:
    c = _l1(2)
    heard: list[tuple[str, list[str]]] = []
    remove = c.add_listener(lambda kind, keys: heard.append((kind, list(keys))))
    _put(c, "a")
    _put(c, "b")
    _put(c, "c")  # evicts a
    assert c.delete("b")
    aborted = c.reserve_write("x", SPEC)
    assert aborted is not None
    c.abort_write(aborted)  # never visible: nothing said
    assert heard == [
        ("stored", ["a"]),
        ("stored", ["b"]),
        ("evicted", ["a"]),
        ("stored", ["c"]),
        ("deleted", ["b"]),
    ]
    remove()
    _put(c, "d")
    assert len(heard) == 5


def test_l1_failing_listener_does_not_fail_writes() -> None:
    c = _l1(2)

    def boom(kind: str, keys: object) -> None:
        raise RuntimeError("listener down")

    c.add_listener(boom)
    for k in "abc":
        _put(c, k)
    assert read(c, "c") == pattern("c", SPEC.nbytes)


def _table(regions: int = 2, caps: Caps | None = None) -> SlotTable:
    seg, data_fd, header_fd = Segment.create(Geometry(4 * MIN_SLOT, regions), epoch=1)
    os.close(data_fd)
    os.close(header_fd)
    return SlotTable(seg, caps or Caps(max_share=1.0))


def _store(t: SlotTable, key: str, tenant: str = "") -> None:
    [ref] = t.alloc(1, [key], [1], [b""], tenant)
    assert isinstance(ref, list)
    assert t.commit(1, [(ref[0], ref[1])]) == [True]


def test_slots_pin_survives_eviction_steal_and_clear() -> None:
    t = _table(regions=1)
    heard: list[tuple[str, list[str]]] = []
    t.add_listener(lambda kind, keys: heard.append((kind, list(keys))))
    _store(t, "p")
    assert t.pin("p")
    for i in range(10):
        _store(t, f"k{i}")
    assert t.lookup(0, ["p"], pin=False, prefix=False)[0][0] is not None
    assert ("evicted", ["p"]) not in heard
    assert ("evicted", ["k0"]) in heard
    # a different size class cannot steal the region holding the pinned slot
    [ref] = t.alloc(1, ["big"], [4 * MIN_SLOT], [b""])
    assert ref is None
    t.clear()
    assert t.lookup(0, ["p"], pin=False, prefix=False)[0][0] is not None
    assert t.stats()["pinned_slots"] == 1
    assert t.unpin("p")
    assert not t.unpin("p")
    assert t.clear() == 1
    assert heard[-1] == ("deleted", ["p"])


def test_slots_pins_bounded_per_tenant() -> None:
    t = _table(regions=2, caps=Caps(max_share=1.0, max_pinned_share=0.25))  # two 4 KiB slots per tenant
    for k in "abc":
        _store(t, k, tenant="t1")
    _store(t, "d", tenant="t2")
    assert t.pin("a")
    assert t.pin("b")
    assert not t.pin("c")
    assert t.pin("d")
    assert t.pinned_bytes("t1") == 2 * MIN_SLOT
    assert t.pinned_bytes() == 3 * MIN_SLOT
    assert not t.pin("nope")


def test_slots_listener_hears_commits_once_per_batch() -> None:
    t = _table()
    heard: list[tuple[str, list[str]]] = []
    remove = t.add_listener(lambda kind, keys: heard.append((kind, list(keys))))
    refs = t.alloc(1, ["a", "b"], [1, 1], [b"", b""])
    assert t.commit(1, [(r[0], r[1]) for r in refs if isinstance(r, list)]) == [True, True]
    assert heard == [("stored", ["a", "b"])]
    remove()
    _store(t, "c")
    assert len(heard) == 1
