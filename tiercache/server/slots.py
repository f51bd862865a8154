"""Slot bookkeeping of the server: FREE -> RESERVED(owner, gen) -> PUBLISHED(leases) -> FREE, the generation
bumped on every free. Leases and reservations belong to connection ids. Eviction takes only PUBLISHED slots
without a lease, least recently used first. Pure logic: no sockets, mirrored into the segment header table.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from tiercache.server.segment import FREE, PUBLISHED, RESERVED, Segment

__all__ = ["Hit", "SlotTable"]


@dataclass(slots=True)
class _Slot:
    key: str = ""
    state: int = FREE
    owner: int = 0  # connection id of a RESERVED slot
    nbytes: int = 0
    meta: bytes = b""
    leases: set[int] = field(default_factory=set)


class Hit(NamedTuple):
    """A published slot found by lookup; ``lease`` is 0 when not pinned (a tuple: sent on the wire as is)."""

    slot: int
    generation: int
    nbytes: int
    meta: bytes
    lease: int


class SlotTable:
    """Index, states, leases and LRU of one segment; every method is O(keys) and never blocks."""

    def __init__(self, segment: Segment) -> None:
        """All slots FREE at generation 0."""
        self.seg = segment
        self._slots = [_Slot() for _ in range(segment.num_slots)]
        self._gens = [int(g) for g in segment.table[:, 0]]  # mirror of the header's generations (fast reads)
        self._free: list[list[int]] = [[] for _ in segment.classes]
        for s in range(segment.num_slots - 1, -1, -1):
            self._free[segment.class_of[s]].append(s)
        self._index: dict[str, int] = {}  # key -> RESERVED or PUBLISHED slot
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in segment.classes]  # PUBLISHED
        self._leases: dict[int, tuple[int, int]] = {}  # lease id -> (conn, slot)
        self._conn_leases: dict[int, set[int]] = {}
        self._conn_reserved: dict[int, set[int]] = {}
        self._lease_ids = itertools.count(1)
        self.evictions = 0
        self.alloc_failures = 0

    # ------------------------------------------------------------------ internals
    def _set_state(self, slot: int, state: int) -> None:
        self._slots[slot].state = state
        self.seg.table[slot, 1] = state

    def _free_slot(self, slot: int) -> None:
        s = self._slots[slot]
        if s.state == PUBLISHED:
            del self._lru[self.seg.class_of[slot]][slot]
        elif s.state == RESERVED:
            self._conn_reserved.get(s.owner, set()).discard(slot)
        if self._index.get(s.key) == slot:
            del self._index[s.key]
        for lid in s.leases:
            conn, _ = self._leases.pop(lid)
            self._conn_leases.get(conn, set()).discard(lid)
        self._slots[slot] = _Slot()
        self._gens[slot] += 1
        self.seg.table[slot, 0] = self._gens[slot]  # generation first, then state: never FREE at the old gen
        self._set_state(slot, FREE)
        self._free[self.seg.class_of[slot]].append(slot)

    def _class_for(self, nbytes: int) -> int | None:
        best = None
        for ci, c in enumerate(self.seg.classes):
            if c.slot_bytes >= nbytes and (best is None or c.slot_bytes < self.seg.classes[best].slot_bytes):
                best = ci
        return best

    def _take(self, ci: int) -> int | None:
        if self._free[ci]:
            return self._free[ci].pop()
        for slot in self._lru[ci]:
            if not self._slots[slot].leases:
                self._free_slot(slot)
                self.evictions += 1
                return self._free[ci].pop()
        return None

    def _check(self, conn: int, slot: int, gen: int, state: int) -> bool:
        if slot >= len(self._slots):
            return False
        s = self._slots[slot]
        return s.state == state and self._gens[slot] == gen and (state != RESERVED or s.owner == conn)

    # ------------------------------------------------------------------ requests
    def lookup(self, conn: int, keys: list[str], *, pin: bool, prefix: bool) -> list[Hit | None]:
        """Per key its published slot or None; ``prefix`` stops at the first miss; ``pin`` leases hits (and
        makes them most recently used; an unpinned lookup leaves the LRU order alone)."""
        out: list[Hit | None] = []
        for key in keys:
            slot = self._index.get(key)
            s = None if slot is None else self._slots[slot]
            if slot is None or s is None or s.state != PUBLISHED:
                if prefix:
                    break
                out.append(None)
                continue
            lease = 0
            if pin:  # a pinned hit is about to be read: most recently used (a presence check is not)
                self._lru[self.seg.class_of[slot]].move_to_end(slot)
                lease = next(self._lease_ids)
                s.leases.add(lease)
                self._leases[lease] = (conn, slot)
                self._conn_leases.setdefault(conn, set()).add(lease)
            out.append(Hit(slot, self._gens[slot], s.nbytes, s.meta, lease))
        return out

    def alloc(self, conn: int, keys: list[str], nbytes: list[int], metas: list[bytes]) -> list[object]:
        """Per key ``[slot, gen]`` reserved for ``conn``, ``"present"`` if the key exists, None if no room."""
        out: list[object] = []
        for key, n, meta in zip(keys, nbytes, metas, strict=True):
            if key in self._index:
                out.append("present")
                continue
            ci = self._class_for(n)
            slot = None if ci is None else self._take(ci)
            if slot is None:
                self.alloc_failures += 1
                out.append(None)
                continue
            self._slots[slot] = _Slot(key=key, state=RESERVED, owner=conn, nbytes=n, meta=meta)
            self._set_state(slot, RESERVED)
            self._index[key] = slot
            self._conn_reserved.setdefault(conn, set()).add(slot)
            out.append([slot, self._gens[slot]])
        return out

    def commit(self, conn: int, refs: list[tuple[int, int]]) -> list[bool]:
        """Publish each reservation ``conn`` holds at that generation; False for a stale/foreign ref."""
        out = []
        for slot, gen in refs:
            ok = self._check(conn, slot, gen, RESERVED)
            if ok:
                self._conn_reserved[conn].discard(slot)
                self._set_state(slot, PUBLISHED)
                self._lru[self.seg.class_of[slot]][slot] = None
            out.append(ok)
        return out

    def abort(self, conn: int, refs: list[tuple[int, int]]) -> list[bool]:
        """Free each reservation ``conn`` holds at that generation; False for a stale/foreign ref."""
        out = []
        for slot, gen in refs:
            ok = self._check(conn, slot, gen, RESERVED)
            if ok:
                self._free_slot(slot)
            out.append(ok)
        return out

    def release(self, conn: int, leases: list[int]) -> None:
        """Drop ``conn``'s leases among ``leases`` (unknown or foreign ids are ignored)."""
        for lid in leases:
            held = self._leases.get(lid)
            if held is None or held[0] != conn:
                continue
            del self._leases[lid]
            self._conn_leases.get(conn, set()).discard(lid)
            self._slots[held[1]].leases.discard(lid)

    def drop_leases(self, conn: int) -> None:
        """Release every lease of ``conn`` (END, or the connection closed)."""
        self.release(conn, list(self._conn_leases.get(conn, ())))
        self._conn_leases.pop(conn, None)

    def free_reservations(self, conn: int) -> int:
        """Free every reservation of ``conn`` (only once its process has exited); the number freed."""
        slots = list(self._conn_reserved.pop(conn, ()))
        for slot in slots:
            if self._slots[slot].state == RESERVED and self._slots[slot].owner == conn:
                self._free_slot(slot)
        return len(slots)

    def key_of(self, slot: int) -> str:
        """The key a RESERVED or PUBLISHED ``slot`` holds ("" when FREE)."""
        return self._slots[slot].key

    def clear(self) -> int:
        """Free every PUBLISHED slot without a lease (CLEAR); reservations and leased slots stay. The number
        freed."""
        unleased = [slot for lru in self._lru for slot in lru if not self._slots[slot].leases]
        for slot in unleased:
            self._free_slot(slot)
        return len(unleased)

    def reserved_by(self, conn: int) -> int:
        """How many slots ``conn`` holds RESERVED."""
        return len(self._conn_reserved.get(conn, ()))

    def stats(self) -> dict[str, int]:
        """Counters and occupancy."""
        states = [s.state for s in self._slots]
        return {
            "num_slots": len(self._slots),
            "free": states.count(FREE),
            "reserved": states.count(RESERVED),
            "published": states.count(PUBLISHED),
            "leases": len(self._leases),
            "leased_slots": sum(1 for s in self._slots if s.leases),
            "evictions": self.evictions,
            "alloc_failures": self.alloc_failures,
        }
