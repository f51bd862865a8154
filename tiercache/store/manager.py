"""The storage manager: L1 plus ordered L2 tiers behind one async, batched API (a thin façade).

The parts: :class:`~tiercache.store.tier.TierClient` (one L2 tier under deadlines, circuit and metrics),
:class:`~tiercache.store.store_controller.StoreController` (write-behind L1 -> L2 through bounded queues:
full means dropped and counted, never blocking the caller) and
:class:`~tiercache.store.prefetch_controller.PrefetchController` (L2 -> decode -> L1). Lookups stop at the
first miss (``contiguous_prefix``); a hit below L1 starts a prefetch bounded by a deadline.

Server mode: on an L1 that :class:`~tiercache.store.l1_surface.LocatesL2` (the server's shared L1) the
server owns the L2 tiers and both controllers; this manager then has no tiers of its own (one owner of L2).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar, cast

from tiercache.config import ManagerConfig
from tiercache.keys import contiguous_prefix
from tiercache.metrics import Metrics
from tiercache.store.hits import L1_TIER, PrefixHit, TierHit
from tiercache.store.l1_frames import check_tier, l1_codec
from tiercache.store.l1_surface import LocatesL2
from tiercache.store.l2_controller import L2Context
from tiercache.store.policy import HitRateCeiling
from tiercache.store.prefetch_controller import PrefetchController
from tiercache.store.store_controller import STORE_LEASE_DEADLINES, StoreController
from tiercache.store.tier import TierClient, open_tier_adapter

if TYPE_CHECKING:
    from types import TracebackType

    from tiercache.adapters import Adapter
    from tiercache.config import Config
    from tiercache.serde import CodecPipeline
    from tiercache.spec import KVSpec
    from tiercache.store.l1_surface import AnyL1

__all__ = [
    "L1_TIER",
    "STORE_LEASE_DEADLINES",
    "L2Tier",
    "PrefixHit",
    "StorageManager",
    "TierHit",
    "WriteSession",
]

T = TypeVar("T")

_L1_HIT = TierHit(L1_TIER, 0)
_L1_TIERS = (L1_TIER,)
"""Every L1 hit (one immutable instance, not one per key and call)."""
_L1_SHAPES = 4096
"""Shapes (chunks found, keys asked) whose L1-only answer a manager keeps."""

L2Tier = TierClient
"""The former name of :class:`~tiercache.store.tier.TierClient` (``StorageManager.tiers`` holds them)."""


class StorageManager:
    """L1 + L2 tiers on one event loop. Construct inside the loop (or with ``open``), then ``aclose``."""

    def __init__(
        self,
        l1: AnyL1,
        tiers: Sequence[tuple[str, Adapter, CodecPipeline]] = (),
        policy: ManagerConfig | None = None,
        *,
        metrics: Metrics | None = None,
        store_batch: int = 8,
        clock: Callable[[], float] = time.monotonic,
        read_timer: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.l1 = l1
        self.remote = isinstance(l1, LocatesL2)
        """Server mode: the L1's owner runs the L2 tiers and controllers (checked here, once: a runtime
        Protocol ``isinstance`` costs about 10 us, so no per-call path repeats it)."""
        if self.remote and tiers:
            raise ValueError("on a server's shared L1 the server owns the L2 tiers: pass no tiers here")
        self.policy = policy or ManagerConfig()
        self.metrics = metrics or Metrics()
        # labelled counters looked up once (a ``labels()`` call takes a lock and builds a key: ~1 us)
        self._hit_counters: dict[str, Any] = {}
        self.metrics.add_tier(L1_TIER, l2=False)
        if not self.remote:
            self.metrics.watch_l1(l1)
            self.metrics.watch_tenants(l1)
        self.ceiling = HitRateCeiling(sample_bits=4)
        """Distinct chunks vs lookups (one key in 16 sampled, by hash: ~35 us per 512 keys): the hit rate
        an unbounded cache would reach on the traffic seen."""
        self.metrics.hit_rate_ceiling.set_function(lambda: self.ceiling.ceiling())
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tiercache-codec")
        for name, _, pipeline in tiers:
            check_tier(l1_codec(l1), name, pipeline)
        self.tiers = [
            TierClient(name, adapter, pipeline, self.policy, self.metrics, clock)
            for name, adapter, pipeline in tiers
        ]
        self._levels: list[tuple[str, Any]] = []
        """(tier, its miss counter) by level (0 = L1): each chunk a lookup did not find at a level is a miss
        there. In server mode the server's tiers are learnt from the hits it reports."""
        for name in [L1_TIER, *(tier.name for tier in self.tiers)]:
            self._levels.append((name, self.metrics.misses.labels(name)))
        self._level_of = {name: level for level, (name, _) in enumerate(self._levels)}
        self._served_by: dict[str, tuple[Any, tuple[Any, ...], tuple[Any, ...]]] = {}
        """Per tier: its hit counter, the miss counters of the levels above it and of the rest (a prefix
        one tier serves, the usual case, counts through these without a pass over the levels)."""
        self._l1_hits: dict[tuple[int, int], PrefixHit] = {}
        """:meth:`local_prefix`'s answers by (chunks, keys): immutable, so one per shape."""
        ctx = L2Context(l1, self.tiers, self.policy, self.metrics, self._run)
        self.store = StoreController(ctx, store_batch=store_batch)
        self.prefetch = PrefetchController(ctx, read_timer=read_timer)
        self._closed = False

    @classmethod
    async def open(
        cls,
        config: Config,
        slot_bytes: int,
        *,
        metrics: Metrics | None = None,
        reopen_delay_s: float = 0.5,
    ) -> StorageManager:
        """Build L1 and open every configured L2 tier.

        A tier whose backend is down (a transport error at open) is kept as a down tier: its calls are
        misses until a background re-open (first after ``reopen_delay_s``, then with doubling backoff)
        succeeds. Configuration errors still raise here."""
        from tiercache.store.l1 import L1Cache

        c = config.l1
        l1 = L1Cache(
            c.capacity,
            slot_bytes,
            pinned=c.pinned,
            codec=c.codec,
            eviction=c.eviction,
            quotas=c.quotas,
            default_quota=c.default_quota,
            max_pinned_share=c.max_pinned_share,
            max_tenant_labels=c.max_tenant_labels,
        )
        manager = cls(l1, await open_tiers(config, reopen_delay_s), config.manager, metrics=metrics)
        manager.store.configure(config.tiers)
        await manager.store.restore_ledgers()
        return manager

    async def _run(self, fn: Callable[[], T]) -> T:
        """Run a codec job on the codec threads."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    # ----- allocation and puts ------------------------------------------------------------------------------
    def writing(
        self, keys: Sequence[str], specs: Sequence[KVSpec], tenant: str = "", prefix: Sequence[str] = ()
    ) -> WriteSession:
        """A write session (``async with``): reserve L1 objects for ``tenant`` (None where the key is stored
        already or L1 is full), let the caller fill them, then publish and queue them for L2 on exit; on an
        exception every reserved object is aborted (never visible) and the exception propagates.
        ``prefix``: the request's chunks before ``keys`` that are not stored (a local L1 tells a
        conversation's next turn by them)."""
        return WriteSession(self, keys, specs, tenant, prefix)

    async def batched_allocate(
        self, keys: Sequence[str], specs: Sequence[KVSpec], tenant: str = "", prefix: Sequence[str] = ()
    ) -> list[Any]:
        """Reserve L1 objects to write into (one call) for ``tenant`` (its quota applies); None where the
        key is already stored or L1 has no room (counted in ``tiercache_l1_alloc_failures``; in server mode
        the server counts them, as ``tiercache_server_alloc_failures``, and no second round trip tells the
        two apart). ``prefix`` as :meth:`writing` takes it."""
        from tiercache.store.l1 import L1Cache

        l1 = self.l1
        if prefix and isinstance(l1, L1Cache):
            objects: list[Any] = l1.batched_reserve_write(keys, specs, tenant, prefix)
        else:
            objects = l1.batched_reserve_write(keys, specs, tenant)
        refused = [key for obj, key in zip(objects, keys, strict=True) if obj is None]
        if refused and not self.remote:
            failures = sum(not present for present in self.l1.batched_contains(refused))
            if failures:
                self.metrics.l1_alloc_failures.inc(failures)
        return objects

    async def batched_put(self, objects: Sequence[Any]) -> None:
        """Publish written objects in L1 (one call) and queue them for every L2 tier (never blocks on L2)."""
        self.l1.batched_finish_write(objects)
        if self.tiers:
            self.store.submit([obj.key for obj in objects])

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued background store has finished (tests, shutdown, the demo)."""
        await self.store.drain(timeout_s)

    # ----- lookups ------------------------------------------------------------------------------------------
    async def batched_contains(
        self, keys: Sequence[str], tiers: Sequence[str] | None = None
    ) -> list[TierHit | None]:
        """For each key, the first tier (L1, then L2 in order) that holds it now; None where none does."""
        wanted = None if tiers is None else set(tiers)
        if self.remote:
            located = cast("LocatesL2", self.l1).batched_locate(keys, prefetch=False)
            return [h if h is not None and (wanted is None or h.tier in wanted) else None for h in located]
        if wanted is None or L1_TIER in wanted:
            hits: list[TierHit | None] = [_L1_HIT if p else None for p in self.l1.batched_contains(keys)]
        else:
            hits = [None] * len(keys)
        for level, tier in enumerate(self.tiers, start=1):
            if wanted is not None and tier.name not in wanted:
                continue
            todo = [i for i, hit in enumerate(hits) if hit is None]
            if not todo:
                break
            found = await tier.contains([keys[i] for i in todo], self.policy.lookup_deadline_s)
            for i, present in zip(todo, found, strict=True):
                if present:
                    hits[i] = TierHit(tier.name, level)
        return hits

    async def lookup_prefix(
        self,
        keys: Sequence[str],
        specs: Sequence[KVSpec] | None = None,
        *,
        prefetch: bool = True,
        group: int = 1,
    ) -> PrefixHit:
        """Longest contiguous prefix of ``keys`` across L1 and L2; starts a prefetch of its L2 part.

        With ``group`` > 1, keys come in consecutive groups (one chunk's layers) and a chunk counts only when
        every key of its group is found; the chunk's tier is the slowest one serving any of its keys.
        In server mode this is one LOOKUP: the server answers across its L1 and L2 and starts the prefetch.
        """
        if group < 1 or len(keys) % group:
            raise ValueError(f"{len(keys)} keys do not split into groups of {group}")
        local = self.local_prefix(keys, group)
        if local is not None:
            return local
        self._saw(keys)
        if self.remote:
            hits = cast("LocatesL2", self.l1).batched_locate(keys, prefetch=prefetch)
        else:
            hits = await self.batched_contains(keys)
        found = self._prefix_hit(hits, group)
        chunks = found.chunks
        if prefetch and self.tiers:
            below = [i for i in range(chunks * group) if (h := hits[i]) is not None and h.level > 0]
            if below:
                self.start_prefetch(
                    [keys[i] for i in below],
                    [hits[i].tier for i in below],  # type: ignore[union-attr]
                    None if specs is None else [specs[i] for i in below],
                )
        return found

    def local_prefix(self, keys: Sequence[str], group: int = 1) -> PrefixHit | None:
        """:meth:`lookup_prefix`'s answer when this process's L1 alone decides it, with no I/O and no
        coroutine (safe from any thread): a manager without L2 tiers and server, or every key in L1 (nothing
        to prefetch). Counted like a lookup. None when L2 or the server must be asked."""
        if self.remote:
            return None
        present = self.l1.batched_contains(keys)
        if group > 1:
            if self.tiers and not all(present):
                return None
            self._saw(keys)
            return self._prefix_hit([_L1_HIT if p else None for p in present], group)
        chunks = contiguous_prefix(present)
        total = len(present)
        if self.tiers and chunks < total:
            return None
        self._saw(keys)
        found = self._l1_hits.get((chunks, total))
        if found is None:
            found = PrefixHit(chunks, _L1_TIERS * chunks, (_L1_HIT,) * chunks + (None,) * (total - chunks))
            if len(self._l1_hits) < _L1_SHAPES:
                self._l1_hits[chunks, total] = found
        self._count_lookup(found.tiers, total - chunks)
        return found

    async def lookup_prefixes(
        self, key_lists: Sequence[Sequence[str]], *, group: int = 1, count: bool = True
    ) -> list[PrefixHit]:
        """:meth:`lookup_prefix` of several key lists (one request's each) in one batched query, without
        prefetch. In server mode that is one LOOKUP per 128 keys of all the lists together (the protocol's
        limit per message, ``LOOKUP_BATCH``), not one per list. ``count=False``: the caller decides which
        chunks serve the request and counts them (:meth:`count_lookup`)."""
        if group < 1 or any(len(keys) % group for keys in key_lists):
            raise ValueError(f"a key list does not split into groups of {group}")
        for keys in key_lists:
            self._saw(keys)
        hits = await self.batched_contains([key for keys in key_lists for key in keys])
        out: list[PrefixHit] = []
        start = 0
        for keys in key_lists:
            out.append(self._prefix_hit(hits[start : start + len(keys)], group, count=count))
            start += len(keys)
        return out

    def _saw(self, keys: Sequence[str]) -> None:
        """A lookup answered for ``keys`` (counted once, where it is answered): feed the hit-rate ceiling
        and, where a tier admits by frequency, the sightings sketch."""
        self.ceiling.observe(keys)
        if self.store.admit_after:
            self.store.admission.seen(keys)

    def _prefix_hit(self, hits: list[TierHit | None], group: int, *, count: bool = True) -> PrefixHit:
        """The contiguous prefix of whole groups in ``hits`` (a chunk's tier: the slowest of its group's);
        counts its hits and a miss in the metrics (unless not ``count``)."""
        per_chunk: list[TierHit | None] = hits if group == 1 else []
        for start in range(0, len(hits), group) if group > 1 else ():
            members = hits[start : start + group]
            found = [h for h in members if h is not None]
            per_chunk.append(max(found, key=lambda h: h.level) if len(found) == group else None)
        chunks = contiguous_prefix(per_chunk)
        tiers = tuple(h.tier for h in per_chunk[:chunks] if h is not None)
        if self.remote:
            self._learn_levels(per_chunk[:chunks])
        if count:
            self._count_lookup(tiers, len(per_chunk) - chunks)
        return PrefixHit(chunks, tiers, tuple(hits))

    def count_lookup(self, tiers: Sequence[str], unserved: int) -> None:
        """Count a lookup whose served chunks the caller chose (``lookup_prefixes(count=False)``): the tier
        serving each served chunk, and the chunks after them that no tier serves."""
        self._count_lookup(tuple(tiers), unserved)

    def _count_lookup(self, tiers: tuple[str, ...], unserved: int) -> None:
        """Count a lookup per chunk: a chunk served by tier T is a hit at T and a miss at each level above
        T; each of the ``unserved`` chunks after the prefix is a miss at every level."""
        if tiers:
            first = tiers[0]
            served = len(tiers)
            if tiers.count(first) == served:  # the usual case: one tier serves the whole prefix
                counters = self._served_by.get(first) or self._serving(first)
                counters[0].inc(served)
                for missed in counters[1]:
                    missed.inc(served + unserved)
                if unserved:
                    for missed in counters[2]:
                        missed.inc(unserved)
                return
            by_tier = Counter(tiers)
            for tier_name, count in by_tier.items():
                self._hit_counter(tier_name).inc(count)
            level_of = self._level_of
            for level, (_, missed) in enumerate(self._levels):
                if missed is None:  # a server level not seen yet
                    continue
                below = sum(n for name, n in by_tier.items() if level_of.get(name, 0) > level)
                if below or unserved:
                    missed.inc(below + unserved)
        elif unserved:
            for _, missed in self._levels:
                if missed is not None:
                    missed.inc(unserved)

    def _serving(self, tier: str) -> tuple[Any, tuple[Any, ...], tuple[Any, ...]]:
        """``_served_by[tier]``, built (and kept while the levels are all known)."""
        level = self._level_of.get(tier, 0)
        levels = [missed for _, missed in self._levels]
        counters = (
            self._hit_counter(tier),
            tuple(m for m in levels[:level] if m is not None),
            tuple(m for m in levels[level:] if m is not None),
        )
        if None not in levels:  # server mode: a level learnt later changes the sets
            self._served_by[tier] = counters
        return counters

    def _learn_levels(self, hits: Sequence[TierHit | None]) -> None:
        """Server mode: record the level of each tier the server reported a hit from (for the misses)."""
        for hit in hits:
            if hit is not None and hit.tier not in self._level_of:
                while len(self._levels) <= hit.level:
                    self._levels.append(("", None))
                self._levels[hit.level] = (hit.tier, self.metrics.misses.labels(hit.tier))
                self._level_of[hit.tier] = hit.level
                self._served_by.clear()
                self.metrics.add_tier(hit.tier, l2=False)

    def _hit_counter(self, tier: str) -> Any:
        """``metrics.hits`` labelled with ``tier`` (kept)."""
        counter = self._hit_counters.get(tier)
        if counter is None:
            counter = self._hit_counters[tier] = self.metrics.hits.labels(tier)
        return counter

    def start_prefetch(
        self, keys: Sequence[str], tiers: Sequence[str], specs: Sequence[KVSpec] | None = None
    ) -> asyncio.Task[int]:
        """Load ``keys`` (from the named tier of each) into L1 in the background; the task returns the
        number of leading keys now in L1."""
        return self.prefetch.start(keys, tiers, specs)

    # ----- reads --------------------------------------------------------------------------------------------
    async def batched_get(
        self,
        keys: Sequence[str],
        specs: Sequence[KVSpec] | None = None,
        *,
        deadline_s: float | None = None,
        hits: Sequence[TierHit | None] | None = None,
    ) -> list[Any]:
        """Leases on L1 objects for ``keys``, loading a contiguous prefix from L2 first where needed.

        ``hits``: where a lookup just found each key (``PrefixHit.hits``): keys missing from L1 are loaded
        from those tiers without asking the L2 tiers again. Stops at the first key no tier can deliver
        within the deadline; later entries are None.
        """
        if hits is not None and len(hits) != len(keys):
            raise ValueError(f"{len(hits)} hits for {len(keys)} keys")
        deadline_s = self.policy.l2_deadline_s if deadline_s is None else deadline_s
        if self.remote:
            read_s = self.policy.l2_read_deadline_s(self.prefetch.read_bytes(len(keys), specs))
            wait_s = max(deadline_s, read_s)
            leases = cast("LocatesL2", self.l1).batched_acquire_loaded(keys, wait_s)
        else:
            if self.tiers:  # without L2 tiers nothing is ever loaded into L1: nothing to wait for
                await self.load_into_l1(keys, specs, deadline_s, hits)
            leases = self.l1.batched_acquire(keys)
        first_missing = contiguous_prefix(leases)
        if first_missing == len(leases):
            return leases
        beyond = [lease for lease in leases[first_missing:] if lease is not None]
        if beyond:  # the answer is a prefix: leases past a hole are not needed
            self.l1.batched_release(beyond)
        return leases[:first_missing] + [None] * (len(keys) - first_missing)

    async def load_into_l1(
        self,
        keys: Sequence[str],
        specs: Sequence[KVSpec] | None,
        deadline_s: float,
        hits: Sequence[TierHit | None] | None = None,
    ) -> None:
        """Bring the contiguous L2 part after the L1 prefix of ``keys`` into L1, waiting at most about
        ``deadline_s`` (loads in flight first; ``hits``: a lookup's answer, reused instead of asking L2)."""
        await self.prefetch.wait(keys, deadline_s)
        present = self.l1.batched_contains(keys)
        first_missing = contiguous_prefix(present)
        if first_missing == len(keys) or not self.tiers:
            return
        rest = list(keys[first_missing:])
        names = [t.name for t in self.tiers]
        if hits is None:
            found = await self.batched_contains(rest, tiers=names)
        else:  # the lookup's answer; a key it saw in L1 (since evicted) is asked for again
            found = list(hits[first_missing:])
            stale = [i for i, h in enumerate(found) if h is not None and h.level == 0]
            if stale:
                again = await self.batched_contains([rest[i] for i in stale], tiers=names)
                for i, hit in zip(stale, again, strict=True):
                    found[i] = hit
        n = contiguous_prefix(found)
        if not n:
            return
        chunk_specs = None if specs is None else list(specs[first_missing : first_missing + n])
        task = self.start_prefetch(rest[:n], [h.tier for h in found[:n] if h is not None], chunk_specs)
        read_s = self.policy.l2_read_deadline_s(self.prefetch.read_bytes(n, chunk_specs))
        budget_s = max(deadline_s, read_s)
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), budget_s)
        # keys another read started loading while this one asked the tiers: the task skipped them
        await self.prefetch.wait(rest[:n], max(0.0, budget_s - (time.monotonic() - started)))

    # ----- lifecycle ----------------------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Stop background work and close every adapter; idempotent."""
        if self._closed:
            return
        self._closed = True
        await self.store.aclose()
        for tier in self.tiers:
            with contextlib.suppress(Exception):
                await tier.adapter.aclose()  # waits for writes the adapter cannot stop
            # puts past their deadline: counted as they end (bounded), then stop waiting
            await tier.wait_late(self.policy.l2_deadline_s)
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> StorageManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def open_tiers(config: Config, reopen_delay_s: float = 0.5) -> list[tuple[str, Adapter, CodecPipeline]]:
    """Open every configured L2 tier with its codec pipeline (a tier down now is kept as a down tier)."""
    from tiercache.serde import build_pipeline

    opened: list[tuple[str, Adapter, CodecPipeline]] = []
    try:
        for tier in config.tiers:
            pipeline = build_pipeline(list(tier.codecs))
            adapter = await open_tier_adapter(tier, reopen_delay_s)
            opened.append((tier.name, adapter, pipeline))
    except BaseException:
        for _, adapter, _ in opened:
            await adapter.aclose()
        raise
    return opened


class WriteSession:
    """``StorageManager.writing``'s session: ``async with`` gives the reserved objects (a plain class, not a
    generator: it runs once per store, on the store's host path)."""

    __slots__ = ("_keys", "_manager", "_prefix", "_reserved", "_specs", "_tenant")

    def __init__(
        self,
        manager: StorageManager,
        keys: Sequence[str],
        specs: Sequence[KVSpec],
        tenant: str = "",
        prefix: Sequence[str] = (),
    ) -> None:
        """Remember what to reserve on entry."""
        self._manager = manager
        self._keys = keys
        self._specs = specs
        self._tenant = tenant
        self._prefix = prefix
        self._reserved: list[Any] = []

    async def __aenter__(self) -> list[Any]:
        """Reserve the objects (``batched_allocate``)."""
        objects = await self._manager.batched_allocate(self._keys, self._specs, self._tenant, self._prefix)
        self._reserved = [obj for obj in objects if obj is not None]
        return objects

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Publish the reserved objects and queue them for L2, or abort them all when the body raised."""
        if not self._reserved:
            return
        if exc_type is not None:
            self._manager.l1.batched_abort_write(self._reserved)
            return
        await self._manager.batched_put(self._reserved)
