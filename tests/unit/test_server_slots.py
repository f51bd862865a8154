"""tiercache.server.slots + segment: slot states, generations mirrored in the header, leases, eviction."""

from __future__ import annotations

import os

import pytest

from tiercache.server.segment import FREE, PUBLISHED, RESERVED, Segment, SlotClass
from tiercache.server.slots import SlotTable
from tiercache.server.storage import ServerL1
from tiercache.spec import KVSpec

A, B = 1, 2  # connection ids


def _table(*classes: SlotClass) -> SlotTable:
    seg, data_fd, header_fd = Segment.create(list(classes) or [SlotClass(100, 2)], epoch=7)
    os.close(data_fd)
    os.close(header_fd)
    return SlotTable(seg)


def test_segment_layout_and_header() -> None:
    t = _table(SlotClass(100, 2), SlotClass(1000, 1))
    seg = t.seg
    assert seg.offsets == [0, 128, 256]
    assert seg.capacities == [100, 100, 1000]
    assert int(seg.epoch_cell[0]) == 7
    assert [seg.slot_state(s) for s in range(3)] == [(0, FREE)] * 3
    with pytest.raises(ValueError, match="slot classes"):
        Segment.create([SlotClass(0, 1)], epoch=1)


def test_reserve_commit_lookup_and_header_mirror() -> None:
    t = _table()
    [ref] = t.alloc(A, ["k"], [10], [b"m"])
    assert isinstance(ref, list)
    slot, gen = ref
    assert t.seg.slot_state(slot) == (gen, RESERVED)
    assert t.lookup(B, ["k"], pin=False, prefix=False) == [None]  # reserved is invisible
    assert t.alloc(B, ["k"], [10], [b""]) == ["present"]  # first writer wins
    assert t.commit(B, [(slot, gen)]) == [False]  # not B's reservation
    assert t.commit(A, [(slot, gen + 1)]) == [False]  # wrong generation
    assert t.commit(A, [(slot, gen)]) == [True]
    assert t.seg.slot_state(slot) == (gen, PUBLISHED)
    [hit] = t.lookup(B, ["k"], pin=True, prefix=False)
    assert hit is not None
    assert (hit.slot, hit.generation, hit.nbytes, hit.meta) == (slot, gen, 10, b"m")
    assert hit.lease > 0
    assert t.commit(A, [(slot, gen)]) == [False]  # already published


def test_prefix_lookup_stops_at_first_miss() -> None:
    t = _table(SlotClass(100, 3))
    for key in ("a", "c"):
        [(slot, gen)] = t.alloc(A, [key], [1], [b""])  # type: ignore[misc]
        t.commit(A, [(slot, gen)])
    assert [h is not None for h in t.lookup(A, ["a", "b", "c"], pin=False, prefix=False)] == [
        True,
        False,
        True,
    ]
    assert len(t.lookup(A, ["a", "b", "c"], pin=False, prefix=True)) == 1


def test_abort_frees_and_bumps_generation() -> None:
    t = _table()
    [(slot, gen)] = t.alloc(A, ["k"], [10], [b""])  # type: ignore[misc]
    assert t.abort(A, [(slot, gen)]) == [True]
    assert t.seg.slot_state(slot) == (gen + 1, FREE)
    assert t.lookup(A, ["k"], pin=False, prefix=False) == [None]
    assert t.abort(A, [(slot, gen)]) == [False]


def test_eviction_takes_lru_unleased_and_never_a_leased_slot() -> None:
    t = _table(SlotClass(100, 2))
    refs = [t.alloc(A, [k], [1], [b""])[0] for k in ("old", "new")]
    t.commit(A, [tuple(r) for r in refs])  # type: ignore[misc]
    [lease] = t.lookup(B, ["old"], pin=True, prefix=False)  # also makes "old" most recently used
    assert lease is not None
    [ref] = t.alloc(A, ["third"], [1], [b""])
    assert isinstance(ref, list)
    assert ref[0] == refs[1][0]
    assert t.lookup(A, ["new"], pin=False, prefix=False) == [None]
    assert t.evictions == 1
    # Only "old" (leased) is published and the other slot is reserved: no room.
    assert t.alloc(A, ["fourth"], [1], [b""]) == [None]
    assert t.alloc_failures == 1
    t.release(A, [lease.lease])  # a foreign connection cannot release B's lease
    assert t.alloc(A, ["fourth"], [1], [b""]) == [None]
    t.release(B, [lease.lease])
    [ref4] = t.alloc(A, ["fourth"], [1], [b""])
    assert isinstance(ref4, list)
    assert ref4[0] == refs[0][0]


def test_slot_class_choice_and_oversize() -> None:
    t = _table(SlotClass(1000, 1), SlotClass(10, 1))
    [small] = t.alloc(A, ["s"], [8], [b""])
    [second] = t.alloc(A, ["b"], [8], [b""])  # the best-fitting class is full of reservations
    assert isinstance(small, list)
    assert small[0] == 1
    assert second is None  # an object goes to its best-fitting class only (no spill into larger slots)
    assert t.alloc(A, ["x"], [2000], [b""]) == [None]


def test_connection_cleanup_leases_then_reservations() -> None:
    t = _table(SlotClass(100, 3))
    [(s1, g1)] = t.alloc(A, ["pub"], [1], [b""])  # type: ignore[misc]
    t.commit(A, [(s1, g1)])
    t.lookup(A, ["pub"], pin=True, prefix=False)
    [(s2, g2)] = t.alloc(A, ["w"], [1], [b""])  # type: ignore[misc]
    t.drop_leases(A)
    assert t.stats()["leases"] == 0
    assert t.reserved_by(A) == 1
    assert t.seg.slot_state(s2) == (g2, RESERVED)
    assert t.free_reservations(A) == 1
    assert t.seg.slot_state(s2) == (g2 + 1, FREE)
    assert t.lookup(B, ["w", "pub"], pin=False, prefix=False)[0] is None
    assert t.stats() == {
        "num_slots": 3, "free": 2, "reserved": 0, "published": 1, "leases": 0, "leased_slots": 0,
        "evictions": 0, "alloc_failures": 0,
    }  # fmt: skip


SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens=16)  # 2048 bytes


def payload(i: int) -> bytes:
    return bytes((i * 31 + j) % 251 for j in range(SPEC.nbytes))


def test_server_l1_surface_on_a_slot_table() -> None:
    """ServerL1 (the controllers' L1 inside the server) and CLEAR, which never frees a leased slot."""
    seg, data_fd, header_fd = Segment.create([SlotClass(4096, 2)], epoch=3)
    os.close(data_fd)
    os.close(header_fd)
    l1 = ServerL1(SlotTable(seg))
    obj = l1.reserve_write("k", SPEC)
    assert obj is not None
    assert l1.reserve_write("k", SPEC) is None  # first writer wins
    obj.buffer()[:] = payload(1)
    assert not l1.contains("k")
    l1.finish_write(obj)
    lease = l1.acquire("k")
    assert lease is not None
    assert bytes(lease.obj.buffer()) == payload(1)
    assert lease.obj.spec == SPEC  # from the slot metadata
    assert l1.table.clear() == 0  # leased: CLEAR keeps it
    lease.release()
    assert not lease.valid()
    assert l1.table.clear() == 1
    assert l1.stats().ready == 0


def test_a_shared_slot_keeps_its_view_until_it_holds_another_shape() -> None:
    """A shared-L1 slot object's tensor() hands out the slot's kept view while the spec repeats, and a fresh
    view of the new shape and dtype once the slot holds a shorter or a bfloat16 object; each sits on the
    slot's memory and reads what was written there."""
    import torch

    seg, data_fd, header_fd = Segment.create([SlotClass(4096, 1)], epoch=3)
    os.close(data_fd)
    os.close(header_fd)
    l1 = ServerL1(SlotTable(seg))
    short = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens=4)
    other = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", tokens=16)
    views = []
    for i, spec in enumerate((SPEC, SPEC, short, other)):
        obj = l1.reserve_write(f"k{i}", spec)
        assert obj is not None
        obj.buffer()[:] = payload(i)[: spec.nbytes]
        t = obj.tensor()
        assert tuple(t.shape) == spec.shape
        assert t.dtype == getattr(torch, spec.dtype)
        assert t.view(torch.uint8).reshape(-1).numpy().tobytes() == payload(i)[: spec.nbytes]
        views.append(t)
        l1.abort_write(obj)  # the slot is free again for the next spec
    assert views[1] is views[0]  # the same spec: the kept view
    assert views[2] is not views[1]
    assert views[3] is not views[2]
