"""Slot bookkeeping of the server: FREE -> RESERVED(owner, gen) -> PUBLISHED(leases) -> FREE, the generation
bumped on every free. Pure logic: no sockets, mirrored into the segment header table.

Size classes come from the objects: an object goes to the smallest class whose slots hold it, or makes a new
class of its own size (``declare`` makes one ahead, from a client's HELLO or the configured ``slot_bytes``). A
class takes whole regions of the segment as it needs them: a free region, then its own least recently used
unleased published slot, then a region of another class that holds nothing reserved or leased. A region whose
slots are all free goes back to the pool.

Leases and reservations belong to connection ids. When a connection is gone its leases drop, and its
reservations are *orphaned*: their keys leave the index at once (no key is counted present that no one will
publish; another client may store it) while their slots stay out of use until nothing of the lost writer can
still land (:meth:`SlotTable.free_reservations`). Per-connection caps bound what one client can hold.

Tenant quotas (``Caps.quotas``, bytes of slot strides per tenant id): a tenant whose reserved and published
slots would pass its budget evicts its own least recently used unheld published slots first, and is refused
(counted in ``quota_refusals``) when none can go.

Pins (:meth:`SlotTable.pin`) keep a published key until unpinned (never evicted, stolen or cleared), at most
``Caps.max_pinned_share`` of the segment per tenant. Listeners (:meth:`SlotTable.add_listener`) hear each key
that is published (``"stored"``) or leaves (``"evicted"``, ``"deleted"``), as :data:`L1Listener` describes.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from tiercache.adapters._listeners import TierListeners
from tiercache.server.segment import FREE, PUBLISHED, RESERVED, Segment, stride_of
from tiercache.store.l1 import L1Listener
from tiercache.store.policy import HitRateCeiling, TenantQuotas

__all__ = ["MAX_CLASSES", "Caps", "Hit", "SlotTable"]

_log = logging.getLogger(__name__)

MAX_CLASSES = 64
"""Size classes one server keeps; past it a class that holds no region takes the new size, and an object
that would need yet another is refused (counted as too large)."""


@dataclass(frozen=True, slots=True)
class Caps:
    """What one client may hold: ``max_leases`` read leases per connection, and at most ``max_share`` of the
    segment's bytes reserved or leased per holder (a client process: all its connections, live or lost,
    together), though always one slot. A lost connection's reservations count each region they lie in whole
    (no other class can take that region until they are freed). Connection 0 (the server's own) is not
    capped. ``max_pinned_share``: the share of the segment's bytes one tenant may keep pinned; ``quotas``:
    tenant id -> bytes its slots may take, ``default_quota`` for the others (0: no limit)."""

    max_leases: int = 16384
    max_share: float = 0.9
    max_pinned_share: float = 0.5
    quotas: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    default_quota: int = 0


@dataclass(slots=True)
class _Slot:
    key: str
    state: int
    owner: int  # connection id of a RESERVED slot
    nbytes: int
    meta: bytes
    leases: set[int] = field(default_factory=set)
    tenant: str = ""
    pinned: bool = False


@dataclass(slots=True)
class _Region:
    cls: int = -1  # size class, -1 = in the free pool
    free: list[int] = field(default_factory=list)  # free slot ids (low ids popped first)
    live: set[int] = field(default_factory=set)  # RESERVED or PUBLISHED slot ids


@dataclass(slots=True)
class _Class:
    stride: int
    regions: set[int] = field(default_factory=set)
    partial: dict[int, None] = field(default_factory=dict)  # regions with a free slot (ordered set)
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)  # PUBLISHED slots, least recent first


class Hit(NamedTuple):
    """A published slot found by lookup; ``lease`` is 0 when not pinned (a tuple: sent on the wire as is)."""

    slot: int
    generation: int
    nbytes: int
    meta: bytes
    lease: int
    offset: int


class SlotTable:
    """Index, states, leases, classes and LRU of one segment; every method is O(keys) (a region's slots when
    a class takes it) and never blocks."""

    def __init__(self, segment: Segment, caps: Caps | None = None) -> None:
        """Every region in the pool, every slot FREE at generation 0."""
        self.seg = segment
        self.caps = caps or Caps()
        geo = segment.geometry
        self._region_bytes = geo.region_bytes
        self._per_region = geo.slots_per_region
        self._regions = [_Region() for _ in range(geo.num_regions)]
        self._free_regions = list(range(geo.num_regions - 1, -1, -1))
        self._classes: list[_Class] = []
        self._slots: dict[int, _Slot] = {}  # RESERVED or PUBLISHED slots
        self._gens: dict[int, int] = {}  # mirror of the header's generations (0 when absent)
        self._index: dict[str, int] = {}  # key -> RESERVED or PUBLISHED slot
        self._leases: dict[int, tuple[int, int]] = {}  # lease id -> (conn, slot)
        self._conn_leases: dict[int, set[int]] = {}
        self._conn_reserved: dict[int, set[int]] = {}
        self._holders: dict[int, int] = {}  # connection -> holder (its process) whose bytes are capped
        self._held_bytes: dict[int, int] = {}  # holder -> bytes it holds (slots' strides, lost regions)
        self._lost: set[int] = set()  # connections whose reservations are orphaned
        self._lost_regions: dict[int, Counter[int]] = {}  # holder -> region -> its orphaned reservations
        self._lease_ids = itertools.count(1)
        self.evictions = 0
        self.alloc_failures = 0
        self.too_large = 0
        self.cap_refusals = 0
        self._pinned_bytes: dict[str, int] = {}  # tenant -> bytes (strides) of its pinned slots
        self._quotas = TenantQuotas(self.caps.quotas, self.caps.default_quota)  # counts strides
        self._tenant_lru: dict[str, OrderedDict[int, None]] = {}  # with quotas: published slots per tenant
        self.quota_refusals = 0
        self.quota_evictions = 0
        self.ceiling = HitRateCeiling(sample_bits=4)
        """Keys of presence lookups (not reads): the hit rate an unbounded shared L1 would reach on them."""
        self._listeners = TierListeners("slot")

    # ------------------------------------------------------------------ geometry
    @property
    def max_object(self) -> int:
        """Bytes of the largest object a slot can hold (one region)."""
        return self._region_bytes

    @property
    def classes(self) -> list[tuple[int, int]]:
        """(stride, regions held) per size class."""
        return [(c.stride, len(c.regions)) for c in self._classes]

    def declare(self, nbytes: int) -> bool:
        """Make a class of exactly ``nbytes``' stride (a client's chunk size) unless one exists, so its
        objects never sit in a larger class's slots; False when too large or out of classes."""
        return self._class_for(nbytes, exact=True) is not None

    def _class_for(self, nbytes: int, *, exact: bool = False) -> int | None:
        """The smallest class whose stride holds ``nbytes`` (with ``exact``, only one of exactly its stride);
        a new class of that stride when none does."""
        if nbytes > self._region_bytes:
            return None
        want = max(stride_of(nbytes), self.seg.geometry.min_stride)
        best = None
        for ci, c in enumerate(self._classes):
            fits = c.stride == want if exact else c.stride >= want
            if fits and (best is None or c.stride < self._classes[best].stride):
                best = ci
        if best is None:
            if len(self._classes) < MAX_CLASSES:
                self._classes.append(_Class(want))
                return len(self._classes) - 1
            idle = next((ci for ci, c in enumerate(self._classes) if not c.regions), None)
            if idle is not None:  # a class holding no region has no slot: it takes the new size
                self._classes[idle] = _Class(want)
            best = idle
        return best

    def offset_of(self, slot: int) -> int:
        """Byte offset of ``slot`` in the data (its region's class decides the stride)."""
        region, index = divmod(slot, self._per_region)
        return region * self._region_bytes + index * self._classes[self._regions[region].cls].stride

    def _gen(self, slot: int) -> int:
        return self._gens.get(slot, 0)

    # ------------------------------------------------------------------ regions
    def _assign(self, region: int, ci: int) -> None:
        c = self._classes[ci]
        r = self._regions[region]
        r.cls = ci
        base = region * self._per_region
        r.free = list(range(base + self._region_bytes // c.stride - 1, base - 1, -1))
        c.regions.add(region)
        c.partial[region] = None

    def _release_region(self, region: int) -> None:
        r = self._regions[region]
        c = self._classes[r.cls]
        c.regions.discard(region)
        c.partial.pop(region, None)
        r.cls, r.free = -1, []
        self._free_regions.append(region)

    def _steal_region(self, ci: int) -> bool:
        """Free a region of another class that holds nothing reserved or leased (evicting its published
        slots), fewest published first; False when none can be taken."""
        best: tuple[int, int] | None = None
        for region, r in enumerate(self._regions):
            if r.cls < 0 or r.cls == ci:
                continue
            if any(self._held(self._slots[slot]) for slot in r.live):
                continue
            if best is None or len(r.live) < best[1]:
                best = (region, len(r.live))
        if best is None:
            return False
        for slot in list(self._regions[best[0]].live):
            self._free_slot(slot, "evicted")
            self.evictions += 1
        return True

    def _take(self, ci: int) -> int | None:
        """A free slot of class ``ci``: a partly used region, a pool region, the class's own LRU victim,
        then a region of another class; None when every slot is reserved or leased."""
        c = self._classes[ci]
        for _ in range(4):
            if c.partial:
                region = next(iter(c.partial))
                r = self._regions[region]
                slot = r.free.pop()
                r.live.add(slot)
                if not r.free:
                    del c.partial[region]
                return slot
            if self._free_regions:
                self._assign(self._free_regions.pop(), ci)
                continue
            victim = next((slot for slot in c.lru if not self._held(self._slots[slot])), None)
            if victim is not None:
                self._free_slot(victim, "evicted")
                self.evictions += 1
                continue
            if not self._steal_region(ci):
                return None
        return None

    # ------------------------------------------------------------------ slot states
    def _set_state(self, slot: int, state: int) -> None:
        self.seg.table[slot, 1] = state

    def set_holder(self, conn: int, holder: int) -> None:
        """Count what ``conn`` holds against ``holder`` (e.g. its process) for the share cap."""
        self._holders[conn] = holder

    def _charge(self, conn: int, slot: int, sign: int) -> None:
        if conn:
            self._add_held(self._holders.get(conn, conn), sign * self._stride(slot))

    def _charge_lost(self, conn: int, slot: int, sign: int) -> None:
        """Count an orphaned reservation by its region: the holder pays each region its lost writes lie in
        once, whole (a region holding one reservation is out of every other class's reach)."""
        holder = self._holders.get(conn, conn)
        regions = self._lost_regions.setdefault(holder, Counter())
        region = slot // self._per_region
        before = regions[region]
        regions[region] = before + sign
        if not regions[region]:
            del regions[region]
            if not regions:
                del self._lost_regions[holder]
        if (before == 0) != (before + sign == 0):
            self._add_held(holder, sign * self._region_bytes)

    def _add_held(self, holder: int, nbytes: int) -> None:
        held = self._held_bytes.get(holder, 0) + nbytes
        if held:
            self._held_bytes[holder] = held
        else:
            self._held_bytes.pop(holder, None)

    def _stride(self, slot: int) -> int:
        return self._classes[self._regions[slot // self._per_region].cls].stride

    def _over_cap(self, conn: int, slot_stride: int) -> bool:
        if not conn or self.caps.max_share >= 1:
            return False
        held = self._held_bytes.get(self._holders.get(conn, conn), 0)
        return held > 0 and held + slot_stride > self.caps.max_share * self.seg.data_bytes

    @staticmethod
    def _held(s: _Slot) -> bool:
        """Whether ``s`` must stay: reserved, leased or pinned."""
        return s.state != PUBLISHED or bool(s.leases) or s.pinned

    def _free_slot(self, slot: int, kind: str = "deleted") -> None:
        """Free ``slot``; a published key's removal is announced to listeners as ``kind``."""
        s = self._slots.pop(slot)
        if s.pinned:
            self._unpin(s, slot)
        if self._quotas.enabled:
            self._quotas.add(s.tenant, -self._stride(slot))
            own = self._tenant_lru.get(s.tenant)
            if own is not None:
                own.pop(slot, None)
                if not own:
                    del self._tenant_lru[s.tenant]
        region = slot // self._per_region
        ci = self._regions[region].cls
        if s.state == PUBLISHED:
            del self._classes[ci].lru[slot]
        elif s.state == RESERVED:
            self._conn_reserved.get(s.owner, set()).discard(slot)
            if s.owner in self._lost:
                self._charge_lost(s.owner, slot, -1)
            else:
                self._charge(s.owner, slot, -1)
        if self._index.get(s.key) == slot:
            del self._index[s.key]
        for lid in s.leases:
            conn, _ = self._leases.pop(lid)
            self._conn_leases.get(conn, set()).discard(lid)
            self._charge(conn, slot, -1)
        gen = self._gen(slot) + 1
        self._gens[slot] = gen
        self.seg.table[slot, 0] = gen  # generation first, then state: never FREE at the old gen
        self._set_state(slot, FREE)
        r = self._regions[region]
        r.free.append(slot)
        r.live.discard(slot)
        if not r.live:
            self._release_region(region)
        else:
            self._classes[ci].partial[region] = None
        if s.state == PUBLISHED and self._listeners:
            self._listeners.notify(kind, [s.key])

    def _check(self, conn: int, slot: int, gen: int, state: int) -> bool:
        s = self._slots.get(slot)
        return (
            s is not None
            and s.state == state
            and self._gen(slot) == gen
            and (state != RESERVED or s.owner == conn)
        )

    # ------------------------------------------------------------------ requests
    def lookup(self, conn: int, keys: list[str], *, pin: bool, prefix: bool) -> tuple[list[Hit | None], int]:
        """Per key its published slot or None, and how many pinned hits the connection's caps refused (those
        are None). ``prefix`` stops at the first miss; ``pin`` leases hits and makes them most recently used
        (a presence check leaves the LRU order alone)."""
        out: list[Hit | None] = []
        refused = 0
        if not pin:  # a presence check asks whether a request's chunks are cached (a read asks again)
            self.ceiling.observe(keys)
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
                stride = self._stride(slot)
                if conn and (
                    len(self._conn_leases.get(conn, ())) >= self.caps.max_leases
                    or self._over_cap(conn, stride)
                ):
                    refused += 1
                    if prefix:
                        break
                    out.append(None)
                    continue
                self._classes[self._regions[slot // self._per_region].cls].lru.move_to_end(slot)
                own = self._tenant_lru.get(s.tenant)
                if own is not None and slot in own:
                    own.move_to_end(slot)
                lease = next(self._lease_ids)
                s.leases.add(lease)
                self._leases[lease] = (conn, slot)
                self._conn_leases.setdefault(conn, set()).add(lease)
                self._charge(conn, slot, 1)
            out.append(Hit(slot, self._gen(slot), s.nbytes, s.meta, lease, self.offset_of(slot)))
        self.cap_refusals += refused
        return out, refused

    def alloc(
        self, conn: int, keys: list[str], nbytes: list[int], metas: list[bytes], tenant: str = ""
    ) -> list[object]:
        """Per key ``[slot, gen, offset]`` reserved for ``conn`` on behalf of ``tenant``, ``"present"`` if the
        key exists, None if no room (too large, every slot held, or the connection's share used up)."""
        out: list[object] = []
        for key, n, meta in zip(keys, nbytes, metas, strict=True):
            if key in self._index:
                out.append("present")
                continue
            ci = self._class_for(n)
            if ci is None:
                self.too_large += 1
                out.append(None)
                continue
            if self._over_cap(conn, self._classes[ci].stride):
                self.cap_refusals += 1
                out.append(None)
                continue
            if self._quotas.enabled and not self._make_quota_room(tenant, self._classes[ci].stride):
                self.quota_refusals += 1
                out.append(None)
                continue
            slot = self._take(ci)
            if slot is None:
                self.alloc_failures += 1
                out.append(None)
                continue
            self._slots[slot] = _Slot(key=key, state=RESERVED, owner=conn, nbytes=n, meta=meta, tenant=tenant)
            self._set_state(slot, RESERVED)
            self._index[key] = slot
            self._conn_reserved.setdefault(conn, set()).add(slot)
            self._charge(conn, slot, 1)
            if self._quotas.enabled:
                self._quotas.add(tenant, self._stride(slot))
            out.append([slot, self._gen(slot), self.offset_of(slot)])
        return out

    def commit(self, conn: int, refs: list[tuple[int, int]]) -> list[bool]:
        """Publish each reservation ``conn`` holds at that generation; False for a stale/foreign ref."""
        out = []
        stored: list[str] = []
        for slot, gen in refs:
            ok = self._check(conn, slot, gen, RESERVED) and self._index.get(self._slots[slot].key) == slot
            if ok:
                stored.append(self._slots[slot].key)
                self._conn_reserved[conn].discard(slot)
                self._charge(conn, slot, -1)
                self._slots[slot].state = PUBLISHED
                self._set_state(slot, PUBLISHED)
                self._classes[self._regions[slot // self._per_region].cls].lru[slot] = None
                if self._quotas.enabled:
                    self._tenant_lru.setdefault(self._slots[slot].tenant, OrderedDict())[slot] = None
            out.append(ok)
        if stored and self._listeners:
            self._listeners.notify("stored", stored)
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
            self._charge(conn, held[1], -1)

    def drop_leases(self, conn: int) -> None:
        """Release every lease of ``conn`` (END, or the connection closed)."""
        self.release(conn, list(self._conn_leases.get(conn, ())))
        self._conn_leases.pop(conn, None)

    def orphan(self, conn: int) -> int:
        """``conn`` is gone: drop its leases, and take its reservations' keys out of the index (never
        published; the slots stay reserved until :meth:`free_reservations`). How many are orphaned."""
        self.drop_leases(conn)
        slots = self._conn_reserved.get(conn, set())
        if not slots:
            self._conn_reserved.pop(conn, None)
            self._holders.pop(conn, None)
        for slot in slots:
            key = self._slots[slot].key
            if self._index.get(key) == slot:
                del self._index[key]
            if conn:  # from now on charged by region: see Caps
                self._charge(conn, slot, -1)
                self._charge_lost(conn, slot, 1)
        if slots and conn:
            self._lost.add(conn)
        return len(slots)

    def free_reservations(self, conn: int) -> int:
        """Free every reservation of ``conn`` (once nothing of its writer can land); the number freed."""
        slots = list(self._conn_reserved.pop(conn, ()))
        for slot in slots:
            s = self._slots.get(slot)
            if s is not None and s.state == RESERVED and s.owner == conn:
                self._free_slot(slot)
        self._lost.discard(conn)
        self._holders.pop(conn, None)
        return len(slots)

    def key_of(self, slot: int) -> str:
        """The key a RESERVED or PUBLISHED ``slot`` holds ("" when FREE)."""
        s = self._slots.get(slot)
        return "" if s is None else s.key

    def tenant_of(self, slot: int) -> str:
        """The tenant a RESERVED or PUBLISHED ``slot`` was allocated for ("" when FREE or none)."""
        s = self._slots.get(slot)
        return "" if s is None else s.tenant

    def clear(self) -> int:
        """Free every PUBLISHED slot without a lease or pin (CLEAR); reservations, leased and pinned slots
        stay. The number freed."""
        unleased = [slot for c in self._classes for slot in c.lru if not self._held(self._slots[slot])]
        for slot in unleased:
            self._free_slot(slot)
        return len(unleased)

    def keys(self, prefix: str = "", tenant: str | None = None) -> list[str]:
        """Published keys starting with ``prefix`` (of ``tenant`` when given)."""
        slots, published = self._slots, PUBLISHED
        return [
            key
            for key, slot in self._index.items()
            if key.startswith(prefix)
            and (s := slots.get(slot)) is not None
            and s.state == published
            and (tenant is None or s.tenant == tenant)
        ]

    def delete(self, key: str) -> bool:
        """Free the published ``key`` (its pin goes with it; announced as ``"deleted"``); False when
        absent, not published or leased."""
        slot = self._index.get(key)
        s = None if slot is None else self._slots.get(slot)
        if slot is None or s is None or s.state != PUBLISHED or s.leases:
            return False
        self._free_slot(slot, "deleted")
        return True

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        """Per tenant: published objects, their bytes (slot strides) and pinned objects."""
        out: dict[str, dict[str, int]] = {}
        for slot, s in self._slots.items():
            if s.state != PUBLISHED:
                continue
            row = out.setdefault(s.tenant, {"objects": 0, "bytes": 0, "pinned": 0})
            row["objects"] += 1
            row["bytes"] += self._stride(slot)
            row["pinned"] += int(s.pinned)
        return out

    def _make_quota_room(self, tenant: str, stride: int) -> bool:
        """Evict ``tenant``'s least recently used unheld published slots until ``stride`` more bytes fit its
        quota; False when they cannot."""
        quotas = self._quotas
        while quotas.over(tenant, stride):
            own = self._tenant_lru.get(tenant, OrderedDict())
            victim = next((slot for slot in own if not self._held(self._slots[slot])), None)
            if victim is None:
                return False
            self._free_slot(victim, "evicted")
            self.evictions += 1
            self.quota_evictions += 1
        return True

    def held_bytes(self, tenant: str) -> int:
        """Bytes (slot strides) ``tenant``'s reserved and published slots take (counted with quotas on)."""
        return self._quotas.held.get(tenant, 0)

    def pin(self, key: str) -> bool:
        """Keep the published ``key`` until :meth:`unpin` (never evicted, stolen or cleared); True when pinned
        (again), False when absent or its tenant's pinned bytes would pass ``Caps.max_pinned_share``."""
        slot = self._index.get(key)
        s = None if slot is None else self._slots.get(slot)
        if slot is None or s is None or s.state != PUBLISHED:
            return False
        if s.pinned:
            return True
        stride = self._stride(slot)
        held = self._pinned_bytes.get(s.tenant, 0)
        if held + stride > self.caps.max_pinned_share * self.seg.data_bytes:
            return False
        s.pinned = True
        self._pinned_bytes[s.tenant] = held + stride
        return True

    def unpin(self, key: str) -> bool:
        """Let ``key`` be evicted again; False when absent or not pinned."""
        slot = self._index.get(key)
        s = None if slot is None else self._slots.get(slot)
        if slot is None or s is None or not s.pinned:
            return False
        self._unpin(s, slot)
        return True

    def _unpin(self, s: _Slot, slot: int) -> None:
        s.pinned = False
        left = self._pinned_bytes[s.tenant] - self._stride(slot)
        if left:
            self._pinned_bytes[s.tenant] = left
        else:
            del self._pinned_bytes[s.tenant]

    def pinned_bytes(self, tenant: str | None = None) -> int:
        """Bytes (slot strides) pinned, by ``tenant`` when given."""
        return sum(self._pinned_bytes.values()) if tenant is None else self._pinned_bytes.get(tenant, 0)

    def add_listener(self, fn: L1Listener) -> Callable[[], None]:
        """Call ``fn(kind, keys)`` on every publish and removal from now on; returns its remover."""
        return self._listeners.add_listener(fn)

    def reserved_by(self, conn: int) -> int:
        """How many slots ``conn`` holds RESERVED."""
        return len(self._conn_reserved.get(conn, ()))

    def leases_of(self, conn: int) -> int:
        """How many leases ``conn`` holds."""
        return len(self._conn_leases.get(conn, ()))

    def stats(self) -> dict[str, int]:
        """Counters and occupancy. Slot counts are over the regions classes hold, plus the pool's regions
        counted in slots of the largest class."""
        reserved = orphaned = 0
        for slot, s in self._slots.items():
            if s.state == RESERVED:
                reserved += 1
                orphaned += self._index.get(s.key) != slot
        carved = sum(self._region_bytes // self._classes[r.cls].stride for r in self._regions if r.cls >= 0)
        largest = max((c.stride for c in self._classes), default=self._region_bytes)
        pooled = len(self._free_regions) * (self._region_bytes // largest)
        return {
            "num_slots": carved + pooled,
            "free": carved + pooled - len(self._slots),
            "reserved": reserved,
            "orphaned": orphaned,
            "published": len(self._slots) - reserved,
            "leases": len(self._leases),
            "leased_slots": sum(1 for s in self._slots.values() if s.leases),
            "pinned_slots": sum(1 for s in self._slots.values() if s.pinned),
            "evictions": self.evictions,
            "alloc_failures": self.alloc_failures,
            "too_large": self.too_large,
            "cap_refusals": self.cap_refusals,
            "quota_refusals": self.quota_refusals,
            "quota_evictions": self.quota_evictions,
            "regions": len(self._regions),
            "free_regions": len(self._free_regions),
            "classes": len(self._classes),
        }
