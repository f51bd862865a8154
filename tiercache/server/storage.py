"""The server's L2 side: :class:`ServerL1` (the L1 surface on the server's own slot table) and
:class:`ServerStorage`, a :class:`~tiercache.store.manager.StorageManager` on it whose StoreController writes
every chunk a client publishes behind to the L2 tiers, and whose PrefetchController loads L2 hits of a LOOKUP
into the shared L1.

The server's own reservations and leases belong to connection id 0 (clients count from 1): a write-behind
store holds a lease while it encodes, so the slot is neither evicted nor cleared under it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tiercache.keys import contiguous_prefix
from tiercache.server.protocol import meta_spec, spec_meta
from tiercache.server.segment import Segment, SlotObject
from tiercache.server.slots import SlotTable
from tiercache.store.hits import TierHit
from tiercache.store.l1 import L1Stats, ObjectState
from tiercache.store.manager import StorageManager

if TYPE_CHECKING:
    from tiercache.adapters import Adapter
    from tiercache.config import ManagerConfig, TierConfig
    from tiercache.metrics import Metrics
    from tiercache.serde import CodecPipeline
    from tiercache.spec import KVSpec

__all__ = ["SERVER_CONN", "ServerL1", "ServerLease", "ServerObject", "ServerStorage"]

SERVER_CONN = 0
"""Connection id of the server's own reservations and leases."""


class ServerObject(SlotObject):
    """An object of the server's own (a prefetch's reservation, a leased slot) with the tenant its slot was
    allocated for (the write-behind counts it against that tenant's L2 quotas)."""

    __slots__ = ("tenant",)

    def __init__(
        self,
        seg: Segment,
        key: str,
        spec: KVSpec,
        slot: int,
        gen: int,
        offset: int,
        state: ObjectState,
        tenant: str = "",
    ):
        super().__init__(seg, key, spec, slot, gen, offset, state)
        self.tenant = tenant


class ServerLease:
    """A server-owned lease (connection 0) on a published slot."""

    __slots__ = ("_id", "_l1", "_released", "obj")

    def __init__(self, l1: ServerL1, obj: ServerObject, lease_id: int) -> None:
        self._l1 = l1
        self.obj = obj
        self._id = lease_id
        self._released = False

    def valid(self) -> bool:
        """Unreleased and the slot still PUBLISHED at our generation."""
        return not self._released and self.obj.published()

    def release(self) -> None:
        """Drop the lease; idempotent."""
        if not self._released:
            self._released = True
            self._l1.table.release(SERVER_CONN, [self._id])


class ServerL1:
    """The L1 surface on the server's slot table (same loop, no RPC): what the controllers run on."""

    def __init__(self, table: SlotTable) -> None:
        self.table = table
        self.seg = table.seg
        self.slot_bytes = table.max_object
        self.capacity = self.seg.data_bytes

    def reserve_write(self, key: str, spec: KVSpec, tenant: str = "") -> ServerObject | None:
        """Reserve a slot for ``key`` (connection 0) on behalf of ``tenant``; None if present or no room."""
        return self.batched_reserve_write([key], [spec], tenant)[0]

    def batched_reserve_write(
        self, keys: Sequence[str], specs: Sequence[KVSpec], tenant: str = ""
    ) -> list[ServerObject | None]:
        """:meth:`reserve_write` for each key."""
        refs = self.table.alloc(
            SERVER_CONN, list(keys), [s.nbytes for s in specs], [spec_meta(s) for s in specs], tenant
        )
        return [
            ServerObject(self.seg, key, spec, ref[0], ref[1], ref[2], ObjectState.WRITING, tenant)
            if isinstance(ref, list)
            else None
            for key, spec, ref in zip(keys, specs, refs, strict=True)
        ]

    def finish_write(self, obj: ServerObject) -> None:
        """Publish ``obj``."""
        self.batched_finish_write([obj])

    def batched_finish_write(self, objs: Sequence[ServerObject]) -> None:
        """Publish each object."""
        for obj, ok in zip(
            objs, self.table.commit(SERVER_CONN, [(o.slot, o.gen) for o in objs]), strict=True
        ):
            if ok:
                obj.state = ObjectState.READY

    def abort_write(self, obj: ServerObject) -> None:
        """Free the reservation."""
        self.batched_abort_write([obj])

    def batched_abort_write(self, objs: Sequence[ServerObject]) -> None:
        """Free each reservation."""
        self.table.abort(SERVER_CONN, [(o.slot, o.gen) for o in objs])

    def contains(self, key: str) -> bool:
        """Whether ``key`` is published."""
        return self.batched_contains([key])[0]

    def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """Per key whether it is published."""
        hits, _ = self.table.lookup(SERVER_CONN, list(keys), pin=False, prefix=False)
        return [h is not None for h in hits]

    def acquire(self, key: str, lease_s: float | None = None) -> ServerLease | None:
        """Lease the published ``key`` (no TTL: the holder always releases)."""
        return self.batched_acquire([key])[0]

    def batched_acquire(self, keys: Sequence[str], lease_s: float | None = None) -> list[ServerLease | None]:
        """:meth:`acquire` for each key."""
        out: list[ServerLease | None] = []
        hits, _ = self.table.lookup(SERVER_CONN, list(keys), pin=True, prefix=False)
        for key, hit in zip(keys, hits, strict=True):
            spec = None if hit is None else meta_spec(hit.meta)
            if hit is None or spec is None or spec.nbytes != hit.nbytes:
                if hit is not None:
                    self.table.release(SERVER_CONN, [hit.lease])
                out.append(None)
                continue
            obj = ServerObject(
                self.seg,
                key,
                spec,
                hit.slot,
                hit.generation,
                hit.offset,
                ObjectState.READY,
                self.table.tenant_of(hit.slot),
            )
            out.append(ServerLease(self, obj, hit.lease))
        return out

    def batched_release(self, leases: Sequence[ServerLease]) -> None:
        """Release each lease."""
        for lease in leases:
            lease.release()

    def delete(self, key: str) -> bool:
        """Free the published, unleased ``key`` (cache control); False otherwise."""
        return self.table.delete(key)

    def stats(self) -> L1Stats:
        """Occupancy in :class:`L1Stats` terms."""
        s = self.table.stats()
        return L1Stats(
            used_slots=s["reserved"] + s["published"],
            num_slots=s["num_slots"],
            used_bytes=0,
            capacity=self.capacity,
            ready=s["published"],
            writing=s["reserved"],
            leased=s["leased_slots"],
            evictions=s["evictions"],
            expired_leases=0,
            alloc_failures=s["alloc_failures"],
        )


class ServerStorage:
    """The L2 tiers of a server and the two controllers, on the server's slot table."""

    def __init__(
        self,
        table: SlotTable,
        tiers: Sequence[tuple[str, Adapter, CodecPipeline]],
        policy: ManagerConfig | None = None,
        *,
        metrics: Metrics | None = None,
        tier_configs: Sequence[TierConfig] = (),
    ) -> None:
        """Construct inside the server's event loop; ``tier_configs``: the tiers' admission and tenant quotas
        (by tier name)."""
        self.l1 = ServerL1(table)
        self.manager = StorageManager(self.l1, tiers, policy, metrics=metrics)
        self.manager.store.configure(tier_configs)

    @property
    def tier_names(self) -> list[str]:
        """L2 tier names in level order (level = index + 1)."""
        return [t.name for t in self.manager.tiers]

    def published(self, keys: Sequence[str]) -> None:
        """Clients published ``keys``: write them behind to every tier (StoreController; never blocks)."""
        if keys and self.manager.tiers:
            self.manager.store.submit(keys)

    async def locate(self, keys: Sequence[str], *, prefetch: bool) -> list[int]:
        """Per key its level: 0 = L1, n >= 1 = L2 tier n, -1 = nowhere. With ``prefetch`` the L2 part of the
        contiguous prefix starts loading into L1 (PrefetchController). A tier that admits by frequency counts
        this lookup as a sighting of each key."""
        store = self.manager.store
        if store.admit_after:
            store.admission.seen(keys)
        hits = await self.manager.batched_contains(keys)
        if prefetch:
            n = contiguous_prefix(hits)
            below = [i for i in range(n) if (h := hits[i]) is not None and h.level > 0]
            if below:
                self.manager.start_prefetch([keys[i] for i in below], [_tier(hits[i]) for i in below])
        return [-1 if h is None else h.level for h in hits]

    async def load(self, keys: Sequence[str], wait_s: float) -> None:
        """Bring the L2 part of ``keys``' contiguous prefix into L1, waiting at most ``wait_s`` in all (the
        client's socket waits that long more than usual; loads still running go on in the background)."""
        if self.manager.tiers:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self.manager.load_into_l1(keys, None, wait_s)

    def dropped_stores(self) -> dict[str, int]:
        """Write-behind stores dropped so far, by reason (queue full, evicted, failed, ...; reasons never
        seen left out), all tiers."""
        out: dict[str, int] = {}
        for family in self.manager.metrics.stores_dropped.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.value:
                    reason = sample.labels.get("reason", "")
                    out[reason] = out.get(reason, 0) + int(sample.value)
        return out

    def pending_stores(self) -> int:
        """Write-behind stores queued or in flight."""
        return self.manager.store.pending()

    async def drain(self, timeout_s: float) -> bool:
        """Wait for the write-behind queues to empty; False when ``timeout_s`` passed first."""
        try:
            await self.manager.drain(timeout_s)
        except TimeoutError:
            return False
        return self.pending_stores() == 0

    async def aclose(self) -> None:
        """Stop the controllers (stores still queued are dropped) and close the tiers."""
        await self.manager.aclose()


def _tier(hit: TierHit | None) -> str:
    assert hit is not None
    return hit.tier


if TYPE_CHECKING:  # mypy checks that every L1 implementation satisfies the surface the manager uses
    from tiercache.server.client import SharedL1
    from tiercache.store.l1 import L1Cache
    from tiercache.store.l1_surface import AnyL1, LocatesL2

    def _l1_implementations_conform(a: L1Cache, b: SharedL1, c: ServerL1) -> tuple[AnyL1, ...]:
        located: LocatesL2 = b
        assert located is b
        return (a, b, c)
