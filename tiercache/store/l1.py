"""L1 host-memory tier: one preallocated (pinned when CUDA is present) pool of fixed-size slots, eviction of
unleased, unpinned READY objects in the order of an eviction policy (``lru`` or the scan-resistant
``s3fifo``), per-tenant byte quotas, two-phase writes and expiring reader leases.

Torch is imported lazily (first construction / first ``tensor()`` call), so importing this module is light.

Lifecycle of one key::

    reserve_write -> WRITING (invisible) --finish_write--> READY (visible, ordered) --evict/delete--> gone
                                         --abort_write---> gone

A reader holds an :class:`L1Lease`. An unexpired, unreleased lease protects its object from eviction and
deletion; an expired lease protects nothing (no pin ever leaks). Every slot carries a generation counter that
is bumped whenever the slot is freed, so :meth:`L1Lease.valid` tells a reader whether the bytes it copied out
really belonged to its object: copy first, then call ``valid()``, and drop the copy if it returns False.

Quotas: a tenant (the ``cache_salt`` of the request that stored an object) whose held bytes would pass its
budget evicts its own least recently used objects, and is refused when none can go; other tenants' objects
are untouched.

Pins (:meth:`L1Cache.pin`) keep a READY object in L1 until unpinned: never evicted, never deleted. Each
tenant may pin at most ``max_pinned_share`` of the slots. Listeners (:meth:`L1Cache.add_listener`) hear every
key that becomes visible (``"stored"``) or leaves (``"evicted"``, ``"deleted"``).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import mmap
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from tiercache.config import L1_CODECS
from tiercache.store.policy import TenantLabels, TenantQuotas, make_policy

if TYPE_CHECKING:
    import torch

    from tiercache.spec import KVSpec

__all__ = [
    "L1_CODECS",
    "KVObject",
    "L1Cache",
    "L1Lease",
    "L1Listener",
    "L1Stats",
    "ObjectState",
    "TenantStats",
    "stored_nbytes",
]

_log = logging.getLogger(__name__)

L1Listener = Callable[[str, Sequence[str]], None]
"""``fn(kind, keys)``: ``kind`` is ``"stored"`` (keys became visible), ``"evicted"`` (pushed out for room) or
``"deleted"`` (removed on request). Called under the cache's lock, in the order things happened: it must be
quick and must not call back into the cache (hand the keys to a queue). What it raises is logged, dropped."""

# Slot stride alignment (bytes): every slot starts at a multiple of this, so any KV dtype view is aligned.
_SLOT_ALIGN = 8


def stored_nbytes(codec: str, spec: KVSpec) -> int:
    """Bytes an object of ``spec`` takes in an L1 of ``codec``: ``spec.nbytes`` (raw) or the size of
    ``Fp8Codec("channel")``'s payload (4 bytes per channel scale plus one per element)."""
    if codec == "raw":
        return spec.nbytes
    if codec == "fp8":
        from tiercache.serde.fp8 import Fp8Codec

        return Fp8Codec("channel").max_encoded_size(spec.nbytes, spec)
    raise ValueError(f"L1 codec must be one of {', '.join(L1_CODECS)}, not {codec!r}")


_HUGE_PAGE = 2 << 20


def _host_pool(nbytes: int, pinned: bool) -> torch.Tensor:
    """The slot pool: pinned memory (CUDA present), else a private anonymous mapping viewed from a 2 MiB
    boundary that Linux is asked to back with transparent huge pages (``madvise``): a 32 MiB object then
    takes 16 TLB entries instead of 8192 (a refused advice leaves ordinary pages; the tensor keeps the
    mapping alive)."""
    import torch

    if pinned or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    return raw[start : start + nbytes]


class ObjectState(enum.Enum):
    """State of a KV object in L1: WRITING (reserved, invisible to readers) or READY (visible)."""

    WRITING = 1
    READY = 2


@dataclass(frozen=True, slots=True)
class L1Stats:
    """A consistent snapshot of L1 occupancy and counters."""

    used_slots: int
    num_slots: int
    used_bytes: int
    capacity: int
    ready: int
    writing: int
    leased: int
    evictions: int
    expired_leases: int
    alloc_failures: int
    pinned: int = 0
    quota_refusals: int = 0
    quota_evictions: int = 0


@dataclass(frozen=True, slots=True)
class TenantStats:
    """One tenant's (or the ``"other"`` bucket's) L1 counters: reads served, bytes held, evictions."""

    hits: int = 0
    held_bytes: int = 0
    evictions: int = 0


class KVObject:
    """A view on one L1 slot holding ``spec``; created by :meth:`L1Cache.reserve_write`, never by users."""

    __slots__ = (
        "_cache",
        "_gen",
        "_label",
        "_leases",
        "_pinned",
        "_slot",
        "continues",
        "key",
        "nbytes",
        "spec",
        "state",
        "tenant",
    )

    def __init__(
        self, cache: L1Cache, key: str, spec: KVSpec, slot: int, gen: int, nbytes: int, tenant: str = ""
    ) -> None:
        """Bind ``key``/``spec`` to ``slot`` at generation ``gen``, ``nbytes`` stored bytes (internal)."""
        self._cache = cache
        self.key = key
        self.spec = spec
        self.tenant = tenant
        """Who stored the object (its ``cache_salt``, "" for none): quotas and pin bounds count by it."""
        self.continues = False
        """Stored by a request whose cached prefix held an earlier request's last chunks (a conversation's
        next turn): the eviction policy takes that as evidence of reuse."""
        self._label = cache._labels.label(tenant)  # the tenant's metric label, looked up once
        self._pinned = False
        self.nbytes = nbytes
        """Bytes the object takes in its slot: ``spec.nbytes`` in a raw L1, the fp8 payload in an fp8 L1."""
        self.state = ObjectState.WRITING
        self._slot = slot
        self._gen = gen
        self._leases: dict[int, float] = {}  # lease id -> expires_at (unreleased, not yet seen expired)

    def tensor(self) -> torch.Tensor:
        """A no-copy view shaped ``spec.shape``, torch dtype of ``spec.dtype``, on the slot's memory (a raw
        L1 only: ``ValueError`` in an fp8 L1, whose objects hold the fp8 payload, see ``payload``). The
        slot keeps its last view, so the same tensor may be handed out again: never reshape it in place."""
        cache = self._cache
        if cache.codec != "raw":
            raise ValueError(f"{self!r} holds the {cache.codec} payload of its KV: use payload()")
        kept = cache._views[self._slot]
        spec = self.spec
        if kept is not None and (kept[0] is spec or kept[0] == spec):
            return kept[1]
        import torch

        view = self.payload().view(getattr(torch, spec.dtype)).view(spec.shape)
        cache._views[self._slot] = (spec, view)
        return view

    def payload(self) -> torch.Tensor:
        """The stored bytes (``nbytes``) as a no-copy uint8 tensor on the slot's memory: the KV's bytes in a
        raw L1, ``Fp8Codec("channel")``'s payload of it in an fp8 L1."""
        off = self._slot * self._cache._stride
        return self._cache._pool[off : off + self.nbytes]

    def buffer(self) -> memoryview:
        """A writable uint8 memoryview of exactly the stored bytes (``nbytes``) of the slot (no copy)."""
        off = self._slot * self._cache._stride
        return self._cache._mv[off : off + self.nbytes]

    def __repr__(self) -> str:
        """Debug representation."""
        return f"KVObject(key={self.key!r}, state={self.state.name}, slot={self._slot}, gen={self._gen})"


class L1Lease:
    """A reader's expiring hold on a READY object; a context manager that releases on exit."""

    __slots__ = ("_cache", "_id", "_released", "expires_at", "obj")

    def __init__(self, cache: L1Cache, obj: KVObject, lease_id: int, expires_at: float) -> None:
        """Record a lease already registered on ``obj`` (internal)."""
        self._cache = cache
        self.obj = obj
        self._id = lease_id
        self.expires_at = expires_at
        self._released = False

    def valid(self) -> bool:
        """True while unexpired, unreleased and the slot still holds this very object (generation check)."""
        cache = self._cache
        with cache._lock:
            if self._released or cache._clock() >= self.expires_at:
                return False
            obj = self.obj
            return cache._gens[obj._slot] == obj._gen

    def release(self) -> None:
        """Drop this lease; idempotent and never raises."""
        cache = self._cache
        with cache._lock:
            if self._released:
                return
            self._released = True
            obj = self.obj
            if obj._leases.pop(self._id, None) is not None and not obj._leases:
                cache._leased_objs.discard(obj)

    def __enter__(self) -> L1Lease:
        """Return the lease itself."""
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Release the lease."""
        self.release()

    def __repr__(self) -> str:
        """Debug representation."""
        return f"L1Lease(key={self.obj.key!r}, expires_at={self.expires_at}, released={self._released})"


class L1Cache:
    """Bounded host-memory KV store: fixed-size slots, policy-ordered eviction of unleased, unpinned READY
    objects, per-tenant quotas, thread-safe.

    ``num_slots = capacity // slot_bytes`` (slots start at multiples of 8 bytes, so a ``slot_bytes`` that is
    not a multiple of 8 is rounded up for the stride). Objects larger than ``slot_bytes`` are refused.

    ``codec``: what a slot holds. ``"raw"``: the KV's bytes; ``"fp8"``: the ``Fp8Codec("channel")`` payload
    of the KV (float32 channel scales + e4m3 bytes, about half), filled by a ``Move.gather_fp8``.
    Sizes (``slot_bytes``, ``capacity``, ``used_bytes``) count stored bytes (``stored_nbytes``).
    """

    def __init__(
        self,
        capacity: int,
        slot_bytes: int,
        *,
        pinned: bool | None = None,
        default_lease_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        codec: str = "raw",
        max_pinned_share: float = 0.5,
        eviction: str = "lru",
        eviction_options: Mapping[str, float] | None = None,
        quotas: Mapping[str, int] | None = None,
        default_quota: int = 0,
        max_tenant_labels: int = 32,
    ) -> None:
        """Preallocate the pool; ValueError when it would hold no slot, a parameter is out of range or the
        codec or eviction policy is unknown. ``eviction_options``: the policy's knobs (S3-FIFO's
        ``small_share``, ``ghosts``). ``quotas``: tenant -> bytes it may hold, ``default_quota`` for the
        others (0: unlimited); tenant counters keep ``max_tenant_labels`` names, then ``"other"``."""
        if codec not in L1_CODECS:
            raise ValueError(f"L1 codec must be one of {', '.join(L1_CODECS)}, not {codec!r}")
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive: {slot_bytes}")
        if default_lease_s <= 0:
            raise ValueError(f"default_lease_s must be positive: {default_lease_s}")
        if not 0 <= max_pinned_share <= 1:
            raise ValueError(f"max_pinned_share must be in [0, 1]: {max_pinned_share}")
        stride = -(-slot_bytes // _SLOT_ALIGN) * _SLOT_ALIGN
        num_slots = capacity // stride if capacity > 0 else 0
        if num_slots <= 0:
            raise ValueError(f"capacity {capacity} holds no slot of {slot_bytes} bytes")
        import torch

        if pinned is None:
            pinned = bool(torch.cuda.is_available())
        self.capacity = capacity
        self.slot_bytes = slot_bytes
        self.codec = codec
        self.num_slots = num_slots
        self.pinned = pinned
        self.default_lease_s = default_lease_s
        self._stride = stride
        self._clock = clock
        self._pool: torch.Tensor = _host_pool(num_slots * stride, pinned)
        self._mv: memoryview = memoryview(self._pool.numpy().data).cast("B")
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._gens: list[int] = [0] * num_slots
        self._owner: list[KVObject | None] = [None] * num_slots
        self._views: list[tuple[KVSpec, torch.Tensor] | None] = [None] * num_slots  # each slot's last view
        self._objects: dict[str, KVObject] = {}  # READY and WRITING
        self._ready: dict[str, KVObject] = {}  # READY only
        self.eviction = eviction
        self._policy = make_policy(eviction, num_slots, **(eviction_options or {}))  # orders READY keys
        self._request_ends: OrderedDict[str, None] = OrderedDict()  # last chunks of recent stores
        self._quotas = TenantQuotas(quotas, default_quota)
        self._by_tenant: dict[str, OrderedDict[str, KVObject]] = {}  # with quotas: READY, least recent first
        self._labels = TenantLabels(max_tenant_labels)
        self._tenant_hits: dict[str, int] = {}  # label -> reads served
        self._tenant_evictions: dict[str, int] = {}  # label -> objects evicted
        self._quota_refusals = 0
        self._quota_evictions = 0
        self._leased_objs: set[KVObject] = set()  # objects with at least one registered lease
        self._lease_ids = itertools.count(1)
        self._used_bytes = 0
        self._writing = 0
        self._evictions = 0
        self._expired_leases = 0
        self._alloc_failures = 0
        self.max_pins_per_tenant = int(max_pinned_share * num_slots)
        """Objects one tenant may hold pinned at once."""
        self._pins: dict[str, int] = {}  # tenant -> objects it holds pinned
        self._listeners: list[L1Listener] = []

    # ------------------------------------------------------------------ internals (lock held)

    def _is_leased(self, obj: KVObject, now: float) -> bool:
        """Whether ``obj`` has an unexpired, unreleased lease; forgets (and counts) expired ones."""
        leases = obj._leases
        if not leases:
            return False
        expired = [lid for lid, exp in leases.items() if exp <= now]
        for lid in expired:
            del leases[lid]
        self._expired_leases += len(expired)
        if leases:
            return True
        self._leased_objs.discard(obj)
        return False

    def _notify(self, kind: str, keys: Sequence[str]) -> None:
        """Tell every listener ``kind`` happened to ``keys`` (lock held); a listener's error is logged."""
        for fn in self._listeners:
            try:
                fn(kind, keys)
            except Exception:
                _log.exception("L1 listener %r failed on %s", fn, kind)

    def _free_slot(self, obj: KVObject, kind: str = "") -> None:
        """Remove ``obj`` from every index and return its slot to the free list, bumping the generation;
        a READY object's removal is announced to listeners as ``kind``."""
        slot = obj._slot
        assert self._owner[slot] is obj
        del self._objects[obj.key]
        if obj.state is ObjectState.READY:
            del self._ready[obj.key]
            self._policy.remove(obj.key)
            if self._by_tenant:
                own = self._by_tenant.get(obj.tenant)
                if own is not None:
                    own.pop(obj.key, None)
                    if not own:
                        del self._by_tenant[obj.tenant]
        else:
            self._writing -= 1
        if obj._leases:
            obj._leases.clear()
            self._leased_objs.discard(obj)
        self._owner[slot] = None
        self._gens[slot] += 1
        self._used_bytes -= obj.nbytes
        self._quotas.add(obj.tenant, -obj.nbytes)
        self._free.append(slot)
        if obj._pinned:
            self._unpin_locked(obj)
        if kind and obj.state is ObjectState.READY and self._listeners:
            self._notify(kind, (obj.key,))

    def _unpin_locked(self, obj: KVObject) -> None:
        obj._pinned = False
        left = self._pins[obj.tenant] - 1
        if left:
            self._pins[obj.tenant] = left
        else:
            del self._pins[obj.tenant]

    def _evict_one(self, now: float, tenant: str | None = None) -> bool:
        """Evict the policy's next READY object without a live lease or pin (with ``tenant``: that tenant's
        least recently used one); False when none qualifies."""
        ready = self._ready
        if tenant is not None:
            own: Mapping[str, KVObject] = self._by_tenant.get(tenant, {})
            victim = next((o for o in own.values() if not o._pinned and not self._is_leased(o, now)), None)
            if victim is None:
                return False
            obj = victim
        else:
            is_leased = self._is_leased

            def evictable(key: str) -> bool:
                obj = ready[key]
                return not obj._pinned and (not obj._leases or not is_leased(obj, now))

            key = self._policy.victim(evictable)
            if key is None:
                return False
            obj = ready[key]
        self._free_slot(obj, "evicted")
        self._evictions += 1
        counts = self._tenant_evictions
        counts[obj._label] = counts.get(obj._label, 0) + 1
        return True

    def _current(self, obj: KVObject, state: ObjectState) -> None:
        """ValueError unless ``obj`` is this cache's live object for its key and is in ``state``."""
        if obj._cache is not self or self._objects.get(obj.key) is not obj or obj.state is not state:
            raise ValueError(f"{obj!r} is not a live {state.name} object of this cache")

    def _acquire_locked(self, key: str, lease_s: float, now: float) -> L1Lease | None:
        """Lease the READY object under ``key`` and mark it recently used."""
        obj = self._ready.get(key)
        if obj is None:
            return None
        self._policy.touch(key)
        if self._by_tenant:
            self._by_tenant[obj.tenant].move_to_end(key)
        hits = self._tenant_hits
        hits[obj._label] = hits.get(obj._label, 0) + 1
        lease_id = next(self._lease_ids)
        expires_at = now + lease_s
        obj._leases[lease_id] = expires_at
        self._leased_objs.add(obj)
        return L1Lease(self, obj, lease_id, expires_at)

    def _lease_seconds(self, lease_s: float | None) -> float:
        """The lease duration to use; ValueError when non-positive."""
        if lease_s is None:
            return self.default_lease_s
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive: {lease_s}")
        return lease_s

    # ------------------------------------------------------------------ public API

    def stored_nbytes(self, spec: KVSpec) -> int:
        """Bytes an object of ``spec`` takes in a slot (``spec.nbytes``, or its fp8 payload's size)."""
        return stored_nbytes(self.codec, spec)

    def reserve_write(self, key: str, spec: KVSpec, tenant: str = "") -> KVObject | None:
        """Reserve a slot for ``key`` in WRITING state, stored by ``tenant``; None if the key exists or no
        slot can be freed."""
        nbytes = self.stored_nbytes(spec)
        with self._lock:
            if key in self._objects:
                return None  # first writer wins
            if nbytes > self.slot_bytes:
                self._alloc_failures += 1
                return None
            quotas = self._quotas
            if quotas.enabled:
                now = self._clock()
                while quotas.over(tenant, nbytes):  # at its budget: the tenant makes room among its own
                    if not self._evict_one(now, tenant):
                        self._quota_refusals += 1
                        return None
                    self._quota_evictions += 1
            if not self._free and not self._evict_one(self._clock()):
                self._alloc_failures += 1
                return None
            slot = self._free.pop()
            obj = KVObject(self, key, spec, slot, self._gens[slot], nbytes, tenant)
            self._owner[slot] = obj
            self._objects[key] = obj
            self._used_bytes += nbytes
            quotas.add(tenant, nbytes)
            self._writing += 1
            return obj

    def finish_write(self, obj: KVObject) -> None:
        """WRITING -> READY: the object becomes visible to contains/acquire (most recently used)."""
        with self._lock:
            self._current(obj, ObjectState.WRITING)
            obj.state = ObjectState.READY
            self._writing -= 1
            self._ready[obj.key] = obj
            self._policy.insert(obj.key, reused=obj.continues)
            if self._quotas.enabled:
                self._by_tenant.setdefault(obj.tenant, OrderedDict())[obj.key] = obj
            if self._listeners:
                self._notify("stored", (obj.key,))

    def abort_write(self, obj: KVObject) -> None:
        """Drop a WRITING object and free its slot; the key stays absent."""
        with self._lock:
            self._current(obj, ObjectState.WRITING)
            self._free_slot(obj)

    def batched_reserve_write(
        self, keys: Sequence[str], specs: Sequence[KVSpec], tenant: str = "", prefix: Sequence[str] = ()
    ) -> list[KVObject | None]:
        """:meth:`reserve_write` for each key (one call, as on the shared L1). ``keys`` are one request's
        chunks in order, after its ``prefix`` chunks (cached elsewhere, not stored here): when the prefix and
        the cached keys before the first reserved one include the last chunks of an earlier request (this
        request continues it, as a conversation's next turn does), the reserved objects are marked
        ``continues``; this request's last two chunks are remembered for the next."""
        objs = [self.reserve_write(key, spec, tenant) for key, spec in zip(keys, specs, strict=True)]
        first = next((i for i, o in enumerate(objs) if o is not None), len(objs))
        with self._lock:
            ends = self._request_ends
            before = [*prefix, *keys[:first]]
            if first < len(objs) and any(key in ends for key in before):
                for obj in objs[first:]:
                    if obj is not None:
                        obj.continues = True
            for key in [*prefix, *keys][-2:]:  # the last chunk may be partial: the next turn's key differs
                ends[key] = None
                ends.move_to_end(key)
            while len(ends) > max(self.num_slots, 2):
                ends.popitem(last=False)
        return objs

    def batched_finish_write(self, objs: Sequence[KVObject]) -> None:
        """:meth:`finish_write` for each object."""
        for obj in objs:
            self.finish_write(obj)

    def batched_abort_write(self, objs: Sequence[KVObject]) -> None:
        """:meth:`abort_write` for each object."""
        for obj in objs:
            self.abort_write(obj)

    def batched_release(self, leases: Sequence[L1Lease]) -> None:
        """Release each lease."""
        for lease in leases:
            lease.release()

    def contains(self, key: str) -> bool:
        """Whether ``key`` is READY (does not count as a read for the eviction policy)."""
        with self._lock:
            return key in self._ready

    def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`contains` for each key, under one lock acquisition."""
        with self._lock:
            ready = self._ready
            return [k in ready for k in keys]

    def acquire(self, key: str, lease_s: float | None = None) -> L1Lease | None:
        """Lease the READY ``key`` for ``lease_s`` seconds (default ``default_lease_s``); None on a miss."""
        duration = self._lease_seconds(lease_s)
        with self._lock:
            return self._acquire_locked(key, duration, self._clock())

    def batched_acquire(self, keys: Sequence[str], lease_s: float | None = None) -> list[L1Lease | None]:
        """:meth:`acquire` for each key, under one lock acquisition."""
        duration = self._lease_seconds(lease_s)
        with self._lock:
            now = self._clock()
            return [self._acquire_locked(k, duration, now) for k in keys]

    def delete(self, key: str) -> bool:
        """Remove the READY object under ``key``; False if absent, WRITING, pinned or currently leased
        (unexpired)."""
        with self._lock:
            obj = self._ready.get(key)
            if obj is None or obj._pinned or self._is_leased(obj, self._clock()):
                return False
            self._free_slot(obj, "deleted")
            return True

    def pin(self, key: str) -> bool:
        """Keep the READY ``key`` in L1 until :meth:`unpin` (never evicted or deleted meanwhile); True when
        pinned (again), False when absent or its tenant already pins ``max_pins_per_tenant`` objects."""
        with self._lock:
            obj = self._ready.get(key)
            if obj is None:
                return False
            if obj._pinned:
                return True
            held = self._pins.get(obj.tenant, 0)
            if held >= self.max_pins_per_tenant:
                return False
            obj._pinned = True
            self._pins[obj.tenant] = held + 1
            return True

    def unpin(self, key: str) -> bool:
        """Let ``key`` be evicted again; False when it is absent or was not pinned."""
        with self._lock:
            obj = self._ready.get(key)
            if obj is None or not obj._pinned:
                return False
            self._unpin_locked(obj)
            return True

    def pinned_count(self, tenant: str | None = None) -> int:
        """How many objects are pinned (by ``tenant`` when given)."""
        with self._lock:
            return sum(self._pins.values()) if tenant is None else self._pins.get(tenant, 0)

    def add_listener(self, fn: L1Listener) -> Callable[[], None]:
        """Call ``fn(kind, keys)`` on every store and removal from now on (see :data:`L1Listener`); returns
        a function that removes it again."""
        with self._lock:
            self._listeners.append(fn)

        def remove() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._listeners.remove(fn)

        return remove

    def stats(self) -> L1Stats:
        """A consistent snapshot of occupancy and counters (``leased`` counts objects with a live lease)."""
        with self._lock:
            now = self._clock()
            leased = sum(1 for obj in list(self._leased_objs) if self._is_leased(obj, now))
            return L1Stats(
                used_slots=self.num_slots - len(self._free),
                num_slots=self.num_slots,
                used_bytes=self._used_bytes,
                capacity=self.capacity,
                ready=len(self._ready),
                writing=self._writing,
                leased=leased,
                evictions=self._evictions,
                expired_leases=self._expired_leases,
                alloc_failures=self._alloc_failures,
                pinned=sum(self._pins.values()),
                quota_refusals=self._quota_refusals,
                quota_evictions=self._quota_evictions,
            )

    def held_bytes(self, tenant: str) -> int:
        """Bytes ``tenant``'s objects (READY and WRITING) take now."""
        with self._lock:
            return self._quotas.held.get(tenant, 0)

    def tenant_stats(self) -> dict[str, TenantStats]:
        """Per tenant label (at most ``max_tenant_labels`` names, then ``"other"``): reads served, bytes
        held, evictions."""
        with self._lock:
            held: dict[str, int] = {}
            for tenant, n in self._quotas.held.items():
                label = self._labels.label(tenant)
                held[label] = held.get(label, 0) + n
            labels = held.keys() | self._tenant_hits.keys() | self._tenant_evictions.keys()
            return {
                label: TenantStats(
                    self._tenant_hits.get(label, 0), held.get(label, 0), self._tenant_evictions.get(label, 0)
                )
                for label in sorted(labels)
            }

    def __repr__(self) -> str:
        """Debug representation."""
        return f"L1Cache(num_slots={self.num_slots}, slot_bytes={self.slot_bytes}, pinned={self.pinned})"
