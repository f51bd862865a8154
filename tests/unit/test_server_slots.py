"""tiercache.server.slots + segment: sealed memfds, slot states, generations mirrored in the header, size
classes over regions, leases, eviction, orphaned reservations and per-connection caps."""

from __future__ import annotations

import errno
import mmap
import os

import pytest

from tiercache.server.segment import FREE, MIN_SLOT, PUBLISHED, RESERVED, Geometry, Segment
from tiercache.server.slots import Caps, SlotTable
from tiercache.server.storage import ServerL1
from tiercache.spec import KVSpec

A, B = 1, 2  # connection ids
REGION = 4 * MIN_SLOT  # four 4 KiB slots (or one 16 KiB slot) per region


def _table(regions: int = 1, region: int = REGION, caps: Caps | None = None) -> SlotTable:
    seg, data_fd, header_fd = Segment.create(Geometry(region, regions), epoch=7)
    os.close(data_fd)
    os.close(header_fd)
    return SlotTable(seg, caps or Caps(max_share=1.0))


def _store(t: SlotTable, conn: int, key: str, nbytes: int = 1) -> tuple[int, int]:
    [ref] = t.alloc(conn, [key], [nbytes], [b""])
    assert isinstance(ref, list)
    assert t.commit(conn, [(ref[0], ref[1])]) == [True]
    return ref[0], ref[1]


def test_segment_geometry_header_and_seals() -> None:
    geo = Geometry(REGION, 3)
    seg, data_fd, header_fd = Segment.create(geo, epoch=7)
    try:
        assert (geo.slots_per_region, geo.num_slot_ids, seg.data_bytes) == (4, 12, 3 * REGION)
        assert int(seg.epoch_cell[0]) == 7
        assert [seg.slot_state(s) for s in range(12)] == [(0, FREE)] * 12
        for fd in (data_fd, header_fd):  # no one can make the server or a client take a SIGBUS
            with pytest.raises(PermissionError) as shrink:
                os.ftruncate(fd, 0)
            assert shrink.value.errno == errno.EPERM
            with pytest.raises(PermissionError) as grow:
                os.ftruncate(fd, 1 << 30)
            assert grow.value.errno == errno.EPERM
        with pytest.raises(PermissionError):  # the header can only be mapped read-only from now on
            mmap.mmap(header_fd, geo.header_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(header_fd, b"\x01", 8)
        client = Segment(geo, data_fd, header_fd, writable_header=False)
        seg.table[5, 0] = 9  # the server's own mapping stays writable, and a client reads it
        assert client.slot_state(5) == (9, FREE)
        client.buffer(4096, 4)[:] = b"abcd"  # the data is shared read-write
        assert bytes(seg.buffer(4096, 4)) == b"abcd"
    finally:
        os.close(data_fd)
        os.close(header_fd)
    with pytest.raises(ValueError, match="at least one region"):
        Geometry(100, 1)


def test_reserve_commit_lookup_and_header_mirror() -> None:
    t = _table()
    [ref] = t.alloc(A, ["k"], [10], [b"m"])
    assert isinstance(ref, list)
    slot, gen, offset = ref
    assert t.seg.slot_state(slot) == (gen, RESERVED)
    assert offset == t.offset_of(slot)
    assert t.lookup(B, ["k"], pin=False, prefix=False) == ([None], 0)  # reserved is invisible
    assert t.alloc(B, ["k"], [10], [b""]) == ["present"]  # first writer wins
    assert t.commit(B, [(slot, gen)]) == [False]  # not B's reservation
    assert t.commit(A, [(slot, gen + 1)]) == [False]  # wrong generation
    assert t.commit(A, [(slot, gen)]) == [True]
    assert t.seg.slot_state(slot) == (gen, PUBLISHED)
    [hit], _ = t.lookup(B, ["k"], pin=True, prefix=False)
    assert hit is not None
    assert (hit.slot, hit.generation, hit.nbytes, hit.meta, hit.offset) == (slot, gen, 10, b"m", offset)
    assert hit.lease > 0
    assert t.commit(A, [(slot, gen)]) == [False]  # already published


def test_prefix_lookup_stops_at_first_miss() -> None:
    t = _table()
    for key in ("a", "c"):
        _store(t, A, key)
    hits, _ = t.lookup(A, ["a", "b", "c"], pin=False, prefix=False)
    assert [h is not None for h in hits] == [True, False, True]
    assert len(t.lookup(A, ["a", "b", "c"], pin=False, prefix=True)[0]) == 1


def test_abort_frees_and_bumps_generation() -> None:
    t = _table()
    [(slot, gen, _)] = t.alloc(A, ["k"], [10], [b""])  # type: ignore[misc]
    assert t.abort(A, [(slot, gen)]) == [True]
    assert t.seg.slot_state(slot) == (gen + 1, FREE)
    assert t.lookup(A, ["k"], pin=False, prefix=False) == ([None], 0)
    assert t.abort(A, [(slot, gen)]) == [False]


def test_eviction_takes_lru_unleased_and_never_a_leased_slot() -> None:
    t = _table(region=2 * MIN_SLOT)  # one region of two slots
    old, new = _store(t, A, "old"), _store(t, A, "new")
    [lease], _ = t.lookup(B, ["old"], pin=True, prefix=False)  # also makes "old" most recently used
    assert lease is not None
    [ref] = t.alloc(A, ["third"], [1], [b""])
    assert isinstance(ref, list)
    assert ref[0] == new[0]
    assert t.lookup(A, ["new"], pin=False, prefix=False) == ([None], 0)
    assert t.evictions == 1
    # Only "old" (leased) is published and the other slot is reserved: no room.
    assert t.alloc(A, ["fourth"], [1], [b""]) == [None]
    assert t.alloc_failures == 1
    t.release(A, [lease.lease])  # a foreign connection cannot release B's lease
    assert t.alloc(A, ["fourth"], [1], [b""]) == [None]
    t.release(B, [lease.lease])
    [ref4] = t.alloc(A, ["fourth"], [1], [b""])
    assert isinstance(ref4, list)
    assert ref4[0] == old[0]


def test_classes_come_from_object_sizes_and_share_regions() -> None:
    """Each size makes (or reuses) the smallest class that holds it; classes take whole regions from the
    pool; a region whose slots are all free goes back; an object larger than a region is refused."""
    t = _table(regions=3)
    [small] = t.alloc(A, ["s"], [100], [b""])  # a 4 KiB class, one region
    [big] = t.alloc(A, ["b"], [3 * MIN_SLOT], [b""])  # a 12 KiB class (stride rounded), another region
    [tail] = t.alloc(A, ["t"], [2 * MIN_SLOT], [b""])  # 8 KiB fits the 12 KiB class: no third class
    assert isinstance(small, list)
    assert isinstance(big, list)
    assert isinstance(tail, list)
    assert t.classes == [(MIN_SLOT, 1), (3 * MIN_SLOT, 2)]  # one 12 KiB slot per region: two regions
    assert t.alloc(A, ["x"], [REGION + 1], [b""]) == [None]
    assert t.too_large == 1
    assert t.stats()["free_regions"] == 0
    assert t.abort(A, [(small[0], small[1])]) == [True]  # the 4 KiB region is empty again: back to the pool
    assert t.classes == [(MIN_SLOT, 0), (3 * MIN_SLOT, 2)]
    assert t.stats()["free_regions"] == 1
    assert t.declare(REGION)  # a 16 KiB class, made ahead (a client's HELLO)
    assert t.classes[-1] == (REGION, 0)
    assert not t.declare(REGION + 1)
    assert t.declare(2 * MIN_SLOT)  # a declared size gets its own class, not the 12 KiB class's slots
    assert t.classes[-1] == (2 * MIN_SLOT, 0)
    assert t.declare(2 * MIN_SLOT)
    assert len(t.classes) == 4  # declared again: the same class
    # Objects do not overlap: every live slot's bytes lie in its own region and stride.
    spans = sorted((t.offset_of(r[0]), r[2]) for r in (big, tail))
    assert spans[0][0] + 3 * MIN_SLOT <= spans[1][0]


def test_a_new_class_takes_a_region_from_another_that_holds_nothing_leased() -> None:
    t = _table(regions=2)
    for i in range(8):  # two regions of four 4 KiB slots, all published
        _store(t, A, f"k{i}")
    [lease], _ = t.lookup(B, ["k0"], pin=True, prefix=False)  # k0's region is held
    assert lease is not None
    [ref] = t.alloc(A, ["big"], [REGION], [b""])  # a 16 KiB object: the other region is taken whole
    assert isinstance(ref, list)
    assert t.evictions == 4
    hits, _ = t.lookup(A, [f"k{i}" for i in range(8)], pin=False, prefix=False)
    assert sum(h is not None for h in hits) == 4
    assert hits[0] is not None  # the leased one's region was left alone
    assert t.alloc(A, ["big2"], [REGION], [b""]) == [None]  # the only other region holds a lease


def test_orphaned_reservations_free_their_keys_at_once_and_their_slots_later() -> None:
    t = _table()
    _store(t, A, "pub")
    t.lookup(A, ["pub"], pin=True, prefix=False)
    [(slot, gen, _)] = t.alloc(A, ["w"], [1], [b""])  # type: ignore[misc]
    assert t.orphan(A) == 1  # the connection is gone
    assert t.stats()["leases"] == 0
    assert t.stats()["orphaned"] == 1
    assert t.seg.slot_state(slot) == (gen, RESERVED)  # a late write of the lost client may still land here
    assert t.commit(A, [(slot, gen)]) == [False]  # never published
    [again] = t.alloc(B, ["w"], [1], [b""])  # the key is not "present": another client stores it
    assert isinstance(again, list)
    assert again[0] != slot
    assert t.free_reservations(A) == 1
    assert t.seg.slot_state(slot) == (gen + 1, FREE)
    assert t.commit(B, [(again[0], again[1])]) == [True]
    assert t.stats()["orphaned"] == 0


def test_caps_bound_what_one_connection_holds() -> None:
    t = _table(regions=2, caps=Caps(max_leases=3, max_share=0.5))  # 8 slots; half = 4 slots' bytes
    for i in range(4):
        _store(t, A, f"k{i}")  # A holds no reservation after commit
    hits, refused = t.lookup(B, [f"k{i}" for i in range(4)], pin=True, prefix=False)
    assert refused == 1  # the fourth lease is over max_leases
    assert [h is not None for h in hits] == [True, True, True, False]
    assert t.leases_of(B) == 3
    hits2, refused2 = t.lookup(B, ["k0", "k3"], pin=True, prefix=True)
    assert (hits2, refused2) == ([], 1)  # a prefix lookup stops at the first refusal
    refs = t.alloc(A, [f"w{i}" for i in range(5)], [1] * 5, [b""] * 5)
    assert [isinstance(r, list) for r in refs] == [True] * 4 + [False]  # 4 of 8 slots: its share
    assert t.cap_refusals == 3
    one, two = t.alloc(B, ["o1", "o2"], [1, 1], [b"", b""])  # B: 3 leased slots; a 5th would pass half
    assert isinstance(one, list)
    assert two is None
    t.drop_leases(B)
    assert isinstance(t.alloc(B, ["o2"], [1], [b""])[0], list)
    assert t.lookup(0, ["k0"] * 10, pin=True, prefix=False)[1] == 0  # the server itself is not capped


SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens=16)  # 2048 bytes


def payload(i: int) -> bytes:
    return bytes((i * 31 + j) % 251 for j in range(SPEC.nbytes))


def test_server_l1_surface_on_a_slot_table() -> None:
    """ServerL1 (the controllers' L1 inside the server) and CLEAR, which never frees a leased slot."""
    l1 = ServerL1(_table(region=2 * MIN_SLOT))
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

    l1 = ServerL1(_table(region=MIN_SLOT))
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


def test_classes_are_bounded_and_an_empty_class_takes_a_new_size() -> None:
    """A client declaring every size it likes cannot use up the classes for good: past MAX_CLASSES a class
    that holds no region is given the new size, and its objects take regions as any class does."""
    from tiercache.server.slots import MAX_CLASSES

    t = _table(regions=2, region=MAX_CLASSES * 2 * MIN_SLOT)
    assert all(t.declare((i + 1) * MIN_SLOT) for i in range(MAX_CLASSES))
    assert len(t.classes) == MAX_CLASSES
    [a] = t.alloc(A, ["a"], [MIN_SLOT], [b""])  # class 0 takes region 0
    [b] = t.alloc(A, ["b"], [2 * MIN_SLOT], [b""])  # class 1 takes region 1
    assert isinstance(a, list)
    assert isinstance(b, list)
    assert t.declare(MAX_CLASSES * MIN_SLOT + 64)  # an unused class is given the new size
    assert len(t.classes) == MAX_CLASSES
    [c] = t.alloc(A, ["c"], [MAX_CLASSES * MIN_SLOT + 64], [b""])
    assert c is None  # no region free and none can be taken (both hold a reservation)
    assert t.alloc_failures == 1
    assert t.commit(A, [(a[0], a[1])]) == [True]
    [c2] = t.alloc(A, ["c2"], [MAX_CLASSES * MIN_SLOT + 64], [b""])  # region 0 holds only "a": taken
    assert isinstance(c2, list)
    assert t.lookup(A, ["a"], pin=False, prefix=False) == ([None], 0)
