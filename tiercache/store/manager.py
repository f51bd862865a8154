"""The storage manager: L1 plus ordered L2 tiers behind one async, batched API.

Every L2 call has a deadline; an error or timeout is a miss for that tier and a metric, and repeated failures
open the tier's circuit. Stores to L2 run in the background through bounded queues (full: dropped and counted,
never blocking the caller). Lookups stop at the first miss (``contiguous_prefix``); a hit below L1 starts a
prefetch (L2 -> decode -> L1) bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from tiercache.config import ManagerConfig
from tiercache.errors import FrameError
from tiercache.keys import contiguous_prefix
from tiercache.metrics import Metrics
from tiercache.store._frames import FrameBuffers
from tiercache.store.circuit import CircuitBreaker

if TYPE_CHECKING:
    from tiercache.adapters import Adapter, Buffer
    from tiercache.config import Config, TierConfig
    from tiercache.serde import CodecPipeline
    from tiercache.spec import KVSpec
    from tiercache.store.l1 import KVObject, L1Cache, L1Lease

__all__ = ["L1_TIER", "L2Tier", "PrefixHit", "StorageManager", "TierHit"]

log = logging.getLogger(__name__)

L1_TIER = "L1"
T = TypeVar("T")

STORE_LEASE_DEADLINES = 8
"""A queued background store holds its L1 object for this many ``l2_deadline_s``: time to wait in the
queue behind other batches, encode and put; past it the lease lapses and the store is dropped
(``lease_expired``)."""

STORE_BATCH_BYTES = 8 << 20
"""A background store batch ends at ``store_batch`` objects or this many bytes, whichever comes first, so
large objects go out one per batch and ``store_parallel`` of them are encoded and sent at once."""


@dataclass(frozen=True, slots=True)
class TierHit:
    """Where a chunk was found: tier name and level (0 = L1, 1.. = L2 tiers in order)."""

    tier: str
    level: int


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The contiguous cached prefix of a key list: its length in chunks and the tier serving each chunk."""

    chunks: int
    tiers: tuple[str, ...]
    hits: tuple[TierHit | None, ...] = ()
    """Where each key asked for was found (None: nowhere); ``batched_get(hits=...)`` reuses it."""

    def count(self, tier: str) -> int:
        """Chunks of the prefix served by ``tier``."""
        return self.tiers.count(tier)


@dataclass
class L2Tier:
    """One opened L2 tier: adapter, codec pipeline, circuit breaker and background store queue."""

    name: str
    adapter: Adapter
    pipeline: CodecPipeline
    breaker: CircuitBreaker
    queue: asyncio.Queue[tuple[str, L1Lease]] = field(default_factory=lambda: asyncio.Queue(1))
    workers: set[asyncio.Task[None]] = field(default_factory=set)
    """Store workers draining ``queue`` (at most ``ManagerConfig.store_parallel``)."""
    late: set[asyncio.Future[Any]] = field(default_factory=set)
    store_error_logged: bool = False
    """Puts that outlived their deadline and are still landing (counted when they end)."""


class _Late:
    """Marks a call still running past its deadline (its outcome is delivered later)."""


def _late_done(
    pending: set[asyncio.Future[Any]], late: Callable[[T | None], None], task: asyncio.Future[T]
) -> None:
    pending.discard(task)
    late(None if task.cancelled() or task.exception() is not None else task.result())


class StorageManager:
    """L1 + L2 tiers on one event loop. Construct inside the loop (or with ``open``), then ``aclose``."""

    def __init__(
        self,
        l1: L1Cache,
        tiers: Sequence[tuple[str, Adapter, CodecPipeline]] = (),
        policy: ManagerConfig | None = None,
        *,
        metrics: Metrics | None = None,
        store_batch: int = 8,
        clock: Callable[[], float] = time.monotonic,
        read_timer: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.l1 = l1
        self._read_timer = read_timer  # awaited for an L2 read's deadline (tests inject a controlled one)
        self.policy = policy or ManagerConfig()
        self.metrics = metrics or Metrics()
        self.store_batch = store_batch
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tiercache-codec")
        # frames of stores in flight reuse their buffers (room for two batches per store worker)
        self._frames = FrameBuffers(2 * self.policy.store_parallel * STORE_BATCH_BYTES + (64 << 20))
        self.tiers: list[L2Tier] = []
        for name, adapter, pipeline in tiers:
            tier = L2Tier(
                name,
                adapter,
                pipeline,
                CircuitBreaker(self.policy.circuit_failures, self.policy.circuit_cooldown_s, clock),
                asyncio.Queue(self.policy.store_queue_size),
            )
            self.tiers.append(tier)
            self.metrics.store_queue_depth.labels(name).set_function(tier.queue.qsize)
            self.metrics.tier_down.labels(name).set_function(partial(_is_down, adapter))
        self._prefetching: dict[str, asyncio.Future[bool]] = {}
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
        from tiercache.serde import build_pipeline
        from tiercache.store.l1 import L1Cache

        l1 = L1Cache(config.l1.capacity, slot_bytes, pinned=config.l1.pinned)
        opened: list[tuple[str, Adapter, CodecPipeline]] = []
        try:
            for tier in config.tiers:
                pipeline = build_pipeline(list(tier.codecs))
                adapter = await _open_or_down(tier, reopen_delay_s)
                opened.append((tier.name, adapter, pipeline))
        except BaseException:
            for _, adapter, _ in opened:
                await adapter.aclose()
            raise
        return cls(l1, opened, config.manager, metrics=metrics)

    # ----- L2 calls: deadline, circuit, metrics ------------------------------------------------------------
    async def _call(
        self,
        tier: L2Tier,
        op: str,
        call: Callable[[], Awaitable[T]],
        deadline_s: float,
        late: Callable[[T | None], None] | None = None,
    ) -> T | None:
        """Run one adapter call under the tier's deadline and circuit; None means it failed (a miss).

        With ``late``, the call's outcome (its result, or None where it failed) is also handed to ``late``,
        and a call still running at the deadline is not cancelled (a write may be landing): it counts as a
        timeout now and ``late`` gets its outcome when it ends."""
        outcome = await self._attempt(tier, op, call, deadline_s, late)
        if late is not None and not isinstance(outcome, _Late):
            late(outcome)
        return None if isinstance(outcome, _Late) else outcome

    async def _attempt(
        self,
        tier: L2Tier,
        op: str,
        call: Callable[[], Awaitable[T]],
        deadline_s: float,
        late: Callable[[T | None], None] | None,
    ) -> T | _Late | None:
        if not tier.breaker.allow():
            return None
        probe = tier.breaker.probing  # this call holds the half-open probe: it must resolve it
        started = time.perf_counter()
        task = asyncio.ensure_future(call())
        try:
            done, _ = await asyncio.wait({task}, timeout=deadline_s)
        except asyncio.CancelledError:
            task.cancel()
            if tier.breaker.abandon(probe):
                self.metrics.circuit_open.labels(tier.name).set(1)
            raise
        finally:
            self.metrics.latency.labels(tier.name, op).observe(time.perf_counter() - started)
        if not done:
            self._failed(tier, op)
            if late is None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                return None
            tier.late.add(task)
            task.add_done_callback(partial(_late_done, tier.late, late))
            return _Late()
        if task.cancelled() or task.exception() is not None:
            self._failed(tier, op)
            return None
        tier.breaker.record_success()
        self.metrics.circuit_open.labels(tier.name).set(0)
        return task.result()

    def _failed(self, tier: L2Tier, op: str) -> None:
        self.metrics.errors.labels(tier.name, op).inc()
        if tier.breaker.record_failure():
            self.metrics.circuit_open.labels(tier.name).set(1)

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    # ----- allocation and puts ------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def writing(
        self, keys: Sequence[str], specs: Sequence[KVSpec]
    ) -> AsyncIterator[list[KVObject | None]]:
        """A write session: reserve L1 objects (None where the key is stored already or L1 is full), let the
        caller fill them, then publish and queue them for L2 on exit; on an exception every reserved object
        is aborted (never visible) and the exception propagates."""
        objects = await self.batched_allocate(keys, specs)
        reserved = [obj for obj in objects if obj is not None]
        try:
            yield objects
        except BaseException:
            for obj in reserved:
                self.l1.abort_write(obj)
            raise
        if reserved:
            await self.batched_put(reserved)

    async def batched_allocate(self, keys: Sequence[str], specs: Sequence[KVSpec]) -> list[KVObject | None]:
        """Reserve L1 objects to write into; None where the key is already stored or L1 has no room."""
        objects = [self.l1.reserve_write(key, spec) for key, spec in zip(keys, specs, strict=True)]
        failures = sum(
            obj is None and not self.l1.contains(key) for obj, key in zip(objects, keys, strict=True)
        )
        if failures:
            self.metrics.l1_alloc_failures.inc(failures)
        return objects

    async def batched_put(self, objects: Sequence[KVObject]) -> None:
        """Publish written objects in L1 and queue them for every L2 tier (never blocks on L2)."""
        for obj in objects:
            self.l1.finish_write(obj)
        for tier in self.tiers:
            for obj in objects:
                lease = self.l1.acquire(obj.key, lease_s=self.policy.l2_deadline_s * STORE_LEASE_DEADLINES)
                if lease is None:
                    self.metrics.stores_dropped.labels(tier.name, "evicted").inc()
                    continue
                try:
                    tier.queue.put_nowait((obj.key, lease))
                except asyncio.QueueFull:
                    lease.release()
                    self.metrics.stores_dropped.labels(tier.name, "queue_full").inc()
                    continue
                self._start_store_workers(tier)

    def _start_store_workers(self, tier: L2Tier) -> None:
        """Run up to ``store_parallel`` workers on ``tier``'s queue (a worker finding it empty ends)."""
        tier.workers = {w for w in tier.workers if not w.done()}
        while len(tier.workers) < min(self.policy.store_parallel, tier.queue.qsize()):
            tier.workers.add(asyncio.get_running_loop().create_task(self._store_worker(tier)))

    async def _store_worker(self, tier: L2Tier) -> None:
        """Drain a tier's store queue in batches: encode off the loop, then one batched put.

        Survives any exception of a codec or adapter: the batch is dropped and counted
        (``stores_dropped{reason="error"}``), the first such error per tier is logged, leases are released."""
        while not tier.queue.empty():
            batch = [tier.queue.get_nowait()]
            size = batch[0][1].obj.spec.nbytes
            while len(batch) < self.store_batch and size < STORE_BATCH_BYTES and not tier.queue.empty():
                batch.append(tier.queue.get_nowait())
                size += batch[-1][1].obj.spec.nbytes
            try:
                await self._store_batch(tier, batch)
            except Exception as exc:
                self.metrics.stores_dropped.labels(tier.name, "error").inc(len(batch))
                if not tier.store_error_logged:
                    tier.store_error_logged = True
                    log.error(
                        "tier %s: a background store failed (%r); later failures are only counted",
                        tier.name,
                        exc,
                    )
            finally:
                for _, lease in batch:
                    lease.release()

    async def _store_batch(self, tier: L2Tier, batch: list[tuple[str, L1Lease]]) -> None:
        limit = tier.adapter.capabilities.max_value_bytes
        too_large = 0

        def encode() -> list[tuple[str, memoryview]]:
            nonlocal too_large
            frames = []
            for key, lease in batch:
                buf = self._frames.take(tier.pipeline.max_frame_size(lease.obj.spec))
                n = tier.pipeline.encode_into(lease.obj.buffer(), lease.obj.spec, key, buf)
                frame = memoryview(buf)[:n]
                del buf
                if not lease.valid():  # the slot was reused while we read it
                    continue
                if limit is not None and len(frame) > limit:  # the tier would refuse it: never sent
                    too_large += 1
                    continue
                frames.append((key, frame))
            return frames

        frames = await self._run(encode)
        if too_large:
            self.metrics.stores_dropped.labels(tier.name, "too_large").inc(too_large)
        dropped = len(batch) - len(frames) - too_large
        if dropped:
            self.metrics.stores_dropped.labels(tier.name, "lease_expired").inc(dropped)
        if not frames:
            return
        keys = [k for k, _ in frames]
        values = [f for _, f in frames]
        if tier.late:  # at most one put past its deadline per worker: wait it out before the next one (it is
            # bounded by the adapter's own timeouts; meanwhile new stores queue up or are dropped, counted)
            await asyncio.wait(set(tier.late))
        # like a read, a put's deadline grows with its bytes (a 32 MiB frame is not held to a 2 s floor)
        put_s = max(self.policy.l2_deadline_s, self.policy.l2_read_deadline_s(sum(len(v) for v in values)))
        await self._call(
            tier,
            "put",
            lambda: tier.adapter.batched_put(keys, values),
            put_s,
            late=partial(self._count_stores, tier, values),
        )

    def _count_stores(self, tier: L2Tier, values: list[memoryview], stored: list[bool] | None) -> None:
        """Count a put batch by what reached the tier (None: the call failed, nothing is counted stored)."""
        if stored is None:
            self.metrics.stores_dropped.labels(tier.name, "failed").inc(len(values))
            return
        for ok, value in zip(stored, values, strict=True):
            if ok:
                self.metrics.stores.labels(tier.name).inc()
                self.metrics.bytes_written.labels(tier.name).inc(len(value))
            else:
                self.metrics.stores_dropped.labels(tier.name, "refused").inc()

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued background store has finished (tests, shutdown, the demo)."""
        workers = [w for t in self.tiers for w in t.workers if not w.done()]
        if workers:
            await asyncio.wait_for(asyncio.gather(*workers, return_exceptions=True), timeout_s)

    # ----- lookups ------------------------------------------------------------------------------------------
    async def batched_contains(
        self, keys: Sequence[str], tiers: Sequence[str] | None = None
    ) -> list[TierHit | None]:
        """For each key, the first tier (L1, then L2 in order) that holds it now; None where none does."""
        wanted = None if tiers is None else set(tiers)
        hits: list[TierHit | None] = [None] * len(keys)
        if wanted is None or L1_TIER in wanted:
            l1_hit = TierHit(L1_TIER, 0)
            for i, present in enumerate(self.l1.batched_contains(keys)):
                if present:
                    hits[i] = l1_hit
        for level, tier in enumerate(self.tiers, start=1):
            if wanted is not None and tier.name not in wanted:
                continue
            todo = [i for i, hit in enumerate(hits) if hit is None]
            if not todo:
                break
            found = await self._contains(tier, [keys[i] for i in todo], self.policy.lookup_deadline_s)
            for i, present in zip(todo, found, strict=True):
                if present:
                    hits[i] = TierHit(tier.name, level)
        return hits

    async def _contains(self, tier: L2Tier, keys: list[str], deadline_s: float) -> list[bool]:
        result = await self._call(tier, "contains", lambda: tier.adapter.batched_contains(keys), deadline_s)
        if result is None:
            self.metrics.misses.labels(tier.name).inc(len(keys))
            return [False] * len(keys)
        return result

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
        """
        if group < 1 or len(keys) % group:
            raise ValueError(f"{len(keys)} keys do not split into groups of {group}")
        hits = await self.batched_contains(keys)
        per_chunk: list[TierHit | None] = hits if group == 1 else []
        for start in range(0, len(keys), group) if group > 1 else ():
            members = hits[start : start + group]
            found = [h for h in members if h is not None]
            per_chunk.append(max(found, key=lambda h: h.level) if len(found) == group else None)
        chunks = contiguous_prefix(per_chunk)
        prefix = [h for h in per_chunk[:chunks] if h is not None]
        for tier_name, count in Counter(h.tier for h in prefix).items():
            self.metrics.hits.labels(tier_name).inc(count)
        if chunks < len(per_chunk):
            self.metrics.misses.labels("all").inc()
        if prefetch:
            below = [i for i in range(chunks * group) if (h := hits[i]) is not None and h.level > 0]
            if below:
                self.start_prefetch(
                    [keys[i] for i in below],
                    [hits[i].tier for i in below],  # type: ignore[union-attr]
                    None if specs is None else [specs[i] for i in below],
                )
        return PrefixHit(chunks, tuple(h.tier for h in prefix), tuple(hits))

    # ----- prefetch -----------------------------------------------------------------------------------------
    def start_prefetch(
        self, keys: Sequence[str], tiers: Sequence[str], specs: Sequence[KVSpec] | None = None
    ) -> asyncio.Task[int]:
        """Load ``keys`` (from the named tier of each) into L1 in the background; the task returns the
        number of leading keys now in L1."""
        loop = asyncio.get_running_loop()
        futures = {}
        for key in keys:
            if key not in self._prefetching:
                futures[key] = self._prefetching[key] = loop.create_future()
        task = loop.create_task(self._prefetch(list(keys), list(tiers), specs, futures))
        return task

    async def _prefetch(
        self,
        keys: list[str],
        tiers: list[str],
        specs: Sequence[KVSpec] | None,
        futures: dict[str, asyncio.Future[bool]],
    ) -> int:
        loaded = [False] * len(keys)
        try:
            by_tier: dict[str, list[int]] = {}
            for i, name in enumerate(tiers):
                if keys[i] in futures:
                    by_tier.setdefault(name, []).append(i)
                else:
                    loaded[i] = True  # someone else is loading it; waited for in batched_get
            for tier in self.tiers:
                idx = by_tier.get(tier.name)
                if idx:
                    ok = await self._load_streaming(
                        tier, [keys[i] for i in idx], None if specs is None else [specs[i] for i in idx]
                    )
                    for i, good in zip(idx, ok, strict=True):
                        loaded[i] = good
        finally:
            for i, key in enumerate(keys):
                future = futures.get(key)
                if future is not None:
                    self._prefetching.pop(key, None)
                    if not future.done():
                        future.set_result(loaded[i])
        return contiguous_prefix(loaded)

    def _read_bytes(self, count: int, specs: Sequence[KVSpec] | None) -> int:
        """Bytes an L2 read of ``count`` chunks asks for (their specs, else full L1 slots)."""
        return sum(s.nbytes for s in specs) if specs is not None else count * self.l1.slot_bytes

    async def _load_streaming(self, tier: L2Tier, keys: list[str], specs: list[KVSpec] | None) -> list[bool]:
        """Get ``keys`` from one tier chunk by chunk (``l2_read_parallel`` in flight, in prefix order), each
        decoded into L1 as it lands, under one deadline scaled with the bytes asked for; at the deadline the
        gets still running are cancelled and the chunks that landed stay. Returns which keys are now in L1."""
        if not keys or not tier.breaker.allow():
            return [False] * len(keys)
        probe = tier.breaker.probing
        deadline_s = self.policy.l2_read_deadline_s(self._read_bytes(len(keys), specs))
        results = [False] * len(keys)
        failures = 0
        gate = asyncio.Semaphore(self.policy.l2_read_parallel)
        started = time.perf_counter()

        async def one(i: int) -> None:
            nonlocal failures
            try:
                async with gate:
                    frames = await tier.adapter.batched_get([keys[i]])
            except asyncio.CancelledError:
                raise
            except Exception:  # a backend failure is a miss
                failures += 1
                return
            frame = frames[0] if len(frames) == 1 else None
            if frame is None:
                self.metrics.misses.labels(tier.name).inc()
                return
            self.metrics.bytes_read.labels(tier.name).inc(len(frame))
            spec = None if specs is None else specs[i]
            # the decode writes into L1 from a codec thread: never cancelled half way
            results[i] = await asyncio.shield(self._decode_into_l1(tier, keys[i], frame, spec))

        gets = [asyncio.ensure_future(one(i)) for i in range(len(keys))]
        everything = asyncio.gather(*gets, return_exceptions=True)
        timer = asyncio.ensure_future(self._read_timer(deadline_s))
        try:
            waits: list[asyncio.Future[Any]] = [everything, timer]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            for g in gets:
                g.cancel()
            if tier.breaker.abandon(probe):
                self.metrics.circuit_open.labels(tier.name).set(1)
            raise
        finally:
            timer.cancel()
            self.metrics.latency.labels(tier.name, "get").observe(time.perf_counter() - started)
        timed_out = not everything.done()
        for g in gets:
            g.cancel()
        with contextlib.suppress(BaseException):
            await everything
        if timed_out or failures:
            self._failed(tier, "get")
        else:
            tier.breaker.record_success()
            self.metrics.circuit_open.labels(tier.name).set(0)
        return results

    async def _decode_into_l1(self, tier: L2Tier, key: str, frame: Buffer, spec: KVSpec | None) -> bool:
        """Decode one frame into a fresh L1 object (its header parsed once, here); a bad frame is a miss."""
        from tiercache.serde import read_header

        try:
            header = read_header(frame)
        except FrameError:
            self.metrics.frames_rejected.labels(tier.name).inc()
            return False
        target = spec or header.spec
        obj = self.l1.reserve_write(key, target)
        if obj is None:
            return self.l1.contains(key)
        try:
            await self._run(
                lambda: tier.pipeline.decode_into(
                    frame, key, obj.buffer(), expected_spec=target, header=header
                )
            )
        except FrameError:
            self.l1.abort_write(obj)
            self.metrics.frames_rejected.labels(tier.name).inc()
            return False
        except BaseException:
            self.l1.abort_write(obj)
            raise
        self.l1.finish_write(obj)
        self.metrics.prefetched.labels(tier.name).inc()
        return True

    # ----- reads --------------------------------------------------------------------------------------------
    async def batched_get(
        self,
        keys: Sequence[str],
        specs: Sequence[KVSpec] | None = None,
        *,
        deadline_s: float | None = None,
        hits: Sequence[TierHit | None] | None = None,
    ) -> list[L1Lease | None]:
        """Leases on L1 objects for ``keys``, loading a contiguous prefix from L2 first where needed.

        ``hits``: where a lookup just found each key (``PrefixHit.hits``): keys missing from L1 are loaded
        from those tiers without asking the L2 tiers again. Stops at the first key no tier can deliver
        within the deadline; later entries are None.
        """
        if hits is not None and len(hits) != len(keys):
            raise ValueError(f"{len(hits)} hits for {len(keys)} keys")
        deadline_s = self.policy.l2_deadline_s if deadline_s is None else deadline_s
        pending = [self._prefetching[k] for k in keys if k in self._prefetching]
        if pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(asyncio.gather(*pending)), deadline_s)
        present = self.l1.batched_contains(keys)
        first_missing = contiguous_prefix(present)
        if first_missing < len(keys) and self.tiers:
            rest = list(keys[first_missing:])
            if hits is None:
                found = await self.batched_contains(rest, tiers=[t.name for t in self.tiers])
            else:  # the lookup's answer; a key it saw in L1 (since evicted) is asked for again
                found = list(hits[first_missing:])
                stale = [i for i, h in enumerate(found) if h is not None and h.level == 0]
                if stale:
                    again = await self.batched_contains(
                        [rest[i] for i in stale], tiers=[t.name for t in self.tiers]
                    )
                    for i, hit in zip(stale, again, strict=True):
                        found[i] = hit
            n = contiguous_prefix(found)
            if n:
                task = self.start_prefetch(
                    rest[:n],
                    [h.tier for h in found[:n] if h is not None],
                    None if specs is None else list(specs[first_missing : first_missing + n]),
                )
                read_s = self.policy.l2_read_deadline_s(
                    self._read_bytes(n, None if specs is None else specs[first_missing : first_missing + n])
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(task), max(deadline_s, read_s))
        leases: list[L1Lease | None] = []
        for key in keys:
            lease = self.l1.acquire(key)
            leases.append(lease)
            if lease is None:
                break
        return leases + [None] * (len(keys) - len(leases))

    # ----- lifecycle ----------------------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Stop background work and close every adapter; idempotent."""
        if self._closed:
            return
        self._closed = True
        for tier in self.tiers:
            for worker in tier.workers:
                worker.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await worker
            while not tier.queue.empty():
                _, lease = tier.queue.get_nowait()
                lease.release()
            with contextlib.suppress(Exception):
                await tier.adapter.aclose()  # waits for writes the adapter cannot stop
            if tier.late:  # puts past their deadline: counted as they end (bounded), then stop waiting
                _, still = await asyncio.wait(set(tier.late), timeout=self.policy.l2_deadline_s)
                for task in still:
                    task.cancel()
                await asyncio.gather(*still, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> StorageManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _is_down(adapter: Adapter) -> float:
    """1.0 while ``adapter`` stands for a tier not re-opened yet (the ``tier_down`` gauge)."""
    return 0.0 if getattr(adapter, "up", True) else 1.0


async def _open_or_down(tier: TierConfig, reopen_delay_s: float) -> Adapter:
    """Open one tier; a backend that is down now gives a ``ReopeningAdapter`` that keeps trying."""
    from tiercache._open import open_adapter
    from tiercache.store._reopen import ReopeningAdapter, is_down

    def opener() -> Awaitable[Adapter]:
        return open_adapter(tier.url, adapter=tier.adapter, **tier.adapter_options())

    try:
        return await opener()
    except Exception as exc:
        if not is_down(exc):
            raise
        return ReopeningAdapter(tier.name, opener, exc, first_delay_s=reopen_delay_s)
