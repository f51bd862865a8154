"""The StoreController: write-behind of published L1 objects to every L2 tier (L1 -> encode -> L2).

Each tier has a bounded queue of (key, lease) pairs; a full queue or an evicted object drops the store
(counted, never blocking the writer). A per-tier worker drains its queue in batches: encode off the event
loop, then one batched put under the tier's deadline. The lease keeps the object from eviction while it waits
(``l2_deadline_s * STORE_LEASE_DEADLINES``); it is released after the put, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

from tiercache.store._frames import FrameBuffers
from tiercache.store.l1_frames import encode_from_l1
from tiercache.store.l2_controller import L2Context, L2Controller
from tiercache.store.policy import Admission, TierLedger

if TYPE_CHECKING:
    from tiercache.config import TierConfig
    from tiercache.store.l1_surface import L1LeaseView
    from tiercache.store.tier import TierClient

__all__ = ["STORE_LEASE_DEADLINES", "StoreController", "TierListener"]

TierListener = Callable[[str, str, Sequence[str]], None]
"""``fn(tier, "stored", keys)``: ``keys`` reached ``tier`` (called on the event loop; must be quick)."""

log = logging.getLogger(__name__)

STORE_LEASE_DEADLINES = 8
"""A queued background store holds its L1 object for this many ``l2_deadline_s``: time to wait in the
queue behind other batches, encode and put; past it the lease lapses and the store is dropped
(``lease_expired``)."""

STORE_BATCH_BYTES = 8 << 20
"""A background store batch ends at ``store_batch`` objects or this many bytes, whichever comes first, so
large objects go out one per batch and ``store_parallel`` of them are encoded and sent at once."""


class StoreController(L2Controller):
    """Write-behind from one L1 to its L2 tiers (all on one event loop)."""

    def __init__(
        self,
        ctx: L2Context,
        *,
        store_batch: int = 8,
    ) -> None:
        super().__init__(ctx)
        self.store_batch = store_batch
        self.listeners: list[TierListener] = []
        """Told of every batch of keys a tier accepted (KV events)."""
        self.admit_after: dict[str, int] = {}
        """Tier -> lookups a key needs before that tier stores it (tiers not named: always)."""
        self.admission = Admission()
        """How often lookups asked for each key (fed by the manager's lookups)."""
        self.ledgers: dict[str, TierLedger] = {}
        """Tier -> its per-tenant quotas over what this process stored there (tiers not named: none)."""
        # frames of stores in flight reuse their buffers: room for two batches per store worker, or for two
        # frames per worker where one frame is larger than a batch (a batch of one large object)
        self._frames = FrameBuffers(
            2 * ctx.policy.store_parallel * STORE_BATCH_BYTES + (64 << 20), keep=2 * ctx.policy.store_parallel
        )

    async def restore_ledgers(self) -> None:
        """Count again, per tenant, what each quota'd tier holds from before this process (tiers that keep
        each object's tenant: ``tenant_usage()``; untagged objects count as the default tenant ""). A tier
        that cannot answer keeps its ledger at what this process stores."""
        for tier in self.tiers:
            ledger = self.ledgers.get(tier.name)
            usage = getattr(tier.adapter, "tenant_usage", None)
            if ledger is None or usage is None:
                continue
            try:
                ledger.restore(await usage())
            except Exception as exc:  # never fails an open: the ledger starts from what is stored now
                log.warning("tier %s: cannot count what each tenant holds there (%r)", tier.name, exc)

    def configure(self, tiers: Sequence[TierConfig]) -> None:
        """Take each configured tier's admission threshold and tenant quotas (tiers without them: store
        always, no quotas)."""
        self.admit_after = {t.name: t.admit_after for t in tiers if t.admit_after > 1}
        self.ledgers = {
            t.name: TierLedger(t.quotas, t.default_quota) for t in tiers if t.quotas or t.default_quota
        }

    def submit(self, keys: Sequence[str]) -> None:
        """Queue the published objects under ``keys`` for every tier that admits them (never blocks; drops
        and keys not admitted are counted)."""
        lease_s = self.policy.l2_deadline_s * STORE_LEASE_DEADLINES
        for tier in self.tiers:
            queued = False
            threshold = self.admit_after.get(tier.name, 1)
            for key in keys:
                if threshold > 1 and not self.admission.admit(key, threshold):
                    self.metrics.stores_dropped.labels(tier.name, "not_admitted").inc()
                    continue
                lease = self.l1.acquire(key, lease_s=lease_s)
                if lease is None:
                    self.metrics.stores_dropped.labels(tier.name, "evicted").inc()
                    continue
                try:
                    tier.queue.put_nowait((key, lease))
                except asyncio.QueueFull:
                    lease.release()
                    self.metrics.stores_dropped.labels(tier.name, "queue_full").inc()
                    continue
                queued = True
            if queued:
                self._start_workers(tier)

    def _start_workers(self, tier: TierClient) -> None:
        """Run up to ``store_parallel`` workers on ``tier``'s queue (a worker finding it empty ends)."""
        tier.workers = {w for w in tier.workers if not w.done()}
        while len(tier.workers) < min(self.policy.store_parallel, tier.queue.qsize()):
            tier.workers.add(asyncio.get_running_loop().create_task(self._worker(tier)))

    def pending(self) -> int:
        """Stores queued or in flight on any tier."""
        return sum(t.queue.qsize() for t in self.tiers) + sum(
            1 for t in self.tiers for w in t.workers if not w.done()
        )

    async def _worker(self, tier: TierClient) -> None:
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

    async def _store_batch(self, tier: TierClient, batch: list[tuple[str, L1LeaseView]]) -> None:
        limit = tier.adapter.capabilities.max_value_bytes
        too_large = 0

        def encode() -> list[tuple[str, bytearray | memoryview]]:
            nonlocal too_large
            frames = []
            for key, lease in batch:
                frame = encode_from_l1(tier.pipeline, lease.obj, self._l1_codec, self._frames)
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
        ledger = self.ledgers.get(tier.name)
        tags = None
        if ledger is not None:
            frames = await self._within_quotas(tier, ledger, batch, frames)
            if not frames:
                return
            tags = getattr(tier.adapter, "batched_tag_tenants", None)  # the tier keeps each object's tenant
        keys = [k for k, _ in frames]
        values = [f for _, f in frames]
        put: Callable[[], Awaitable[list[bool]]] = partial(tier.adapter.batched_put, keys, values)
        if tags is not None:  # a restart counts each tenant's objects there again
            owners = {key: getattr(lease.obj, "tenant", "") for key, lease in batch}
            put = partial(_put_tagged, tier.adapter, tags, keys, values, owners)
        if tier.late:  # at most one put past its deadline per worker: wait it out before the next one (it
            # is bounded by the adapter's own timeouts; meanwhile new stores queue up or are dropped, counted)
            await asyncio.wait(set(tier.late))
        # like a read, a put's deadline grows with its bytes (a 32 MiB frame is not held to a 2 s floor)
        put_s = max(self.policy.l2_deadline_s, self.policy.l2_read_deadline_s(sum(len(v) for v in values)))
        await tier.call(
            "put",
            put,
            put_s,
            late=partial(self._count_stores, tier, keys, values),
        )

    async def _within_quotas(
        self,
        tier: TierClient,
        ledger: TierLedger,
        batch: list[tuple[str, L1LeaseView]],
        frames: list[tuple[str, bytearray | memoryview]],
    ) -> list[tuple[str, bytearray | memoryview]]:
        """The frames whose tenants stay within their quotas on ``tier``, after deleting the tenants' oldest
        keys there to make room (a frame larger than its tenant's whole quota is dropped, counted)."""
        tenants = {key: getattr(lease.obj, "tenant", "") for key, lease in batch}
        kept: dict[str, bytearray | memoryview] = {}
        doomed: list[str] = []
        evicted = 0
        for key, frame in frames:
            victims = ledger.make_room(tenants.get(key, ""), key, len(frame))
            if victims is None:
                self.metrics.stores_dropped.labels(tier.name, "quota").inc()
                continue
            for victim in victims:  # deleted (it may be on the tier from before); one of this batch not sent
                doomed.append(victim)
                if kept.pop(victim, None) is None:
                    evicted += 1
                else:
                    self.metrics.stores_dropped.labels(tier.name, "quota").inc()
            kept[key] = frame
        if doomed:
            if tier.adapter.capabilities.delete:
                await tier.call(
                    "delete", lambda: tier.adapter.batched_delete(doomed), self.policy.l2_deadline_s
                )
            if evicted:
                self.metrics.evictions.labels(tier.name).inc(evicted)
        return list(kept.items())

    def _count_stores(
        self,
        tier: TierClient,
        keys: list[str],
        values: list[bytearray | memoryview],
        stored: list[bool] | None,
    ) -> None:
        """Count a put batch by what reached the tier (None: the call failed, nothing is counted stored) and
        tell the listeners which keys the tier now holds."""
        ledger = self.ledgers.get(tier.name)
        if stored is None:
            self.metrics.stores_dropped.labels(tier.name, "failed").inc(len(values))
            if ledger is not None:
                for key in keys:
                    ledger.forget(key)
            return
        if ledger is not None:
            for key, ok in zip(keys, stored, strict=True):
                if not ok:
                    ledger.forget(key)
        for ok, value in zip(stored, values, strict=True):
            if ok:
                self.metrics.stores.labels(tier.name).inc()
                self.metrics.bytes_written.labels(tier.name).inc(len(value))
            else:
                self.metrics.stores_dropped.labels(tier.name, "refused").inc()
        if self.listeners:
            landed = [key for key, ok in zip(keys, stored, strict=True) if ok]
            for fn in self.listeners:
                try:
                    fn(tier.name, "stored", landed)
                except Exception:
                    log.exception("tier %s: a store listener failed", tier.name)

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued store has finished; TimeoutError past ``timeout_s`` (the stores go on)."""
        workers = [w for t in self.tiers for w in t.workers if not w.done()]
        if workers:
            _, running = await asyncio.wait(workers, timeout=timeout_s)
            if running:
                raise TimeoutError(f"{len(running)} tier(s) still storing after {timeout_s} s")

    async def aclose(self) -> None:
        """Cancel the workers and release the leases of stores still queued (dropped)."""
        for tier in self.tiers:
            for worker in tier.workers:
                worker.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await worker
            while not tier.queue.empty():
                _, lease = tier.queue.get_nowait()
                lease.release()


async def _put_tagged(
    adapter: object,
    tag: Callable[[list[str], list[str]], Awaitable[list[bool]]],
    keys: list[str],
    values: list[bytearray | memoryview],
    owners: dict[str, str],
) -> list[bool]:
    """Put the frames, then record each landed object's tenant with it (a failed tag leaves the object
    untagged: after a restart it counts as the default tenant)."""
    stored: list[bool] = await adapter.batched_put(keys, values)  # type: ignore[attr-defined]
    landed = [key for key, ok in zip(keys, stored, strict=True) if ok and owners.get(key)]
    if landed:
        with contextlib.suppress(Exception):
            await tag(landed, [owners[key] for key in landed])
    return stored
