"""The L1 surface the manager and the engine use, as ``typing.Protocol``s.

Two implementations: the in-process :class:`~tiercache.store.l1.L1Cache` and the server-mode
:class:`~tiercache.server.client.SharedL1` (and, inside the server, ``tiercache.server.tiers.ServerL1``).
Writes are two-phase (reserve, fill the object's memory, publish or abort); reads take a lease, copy, then
check ``valid()`` before trusting the copy. The ``batched_*`` forms are one lock / one round trip per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    import torch

    from tiercache.spec import KVSpec
    from tiercache.store.hits import TierHit
    from tiercache.store.l1 import L1Stats

__all__ = ["AnyL1", "L1LeaseView", "L1ObjectView", "L1Surface", "LocatesL2"]


class L1ObjectView(Protocol):
    """One L1 object: its key and spec, and no-copy views of its memory."""

    key: str

    @property
    def spec(self) -> KVSpec:
        """What the object holds."""

    def buffer(self) -> memoryview:
        """A writable uint8 view of exactly ``spec.nbytes`` bytes."""

    def tensor(self) -> torch.Tensor:
        """A view shaped ``spec.shape`` with the spec's dtype."""


class L1LeaseView(Protocol):
    """A reader's hold on a published object."""

    @property
    def obj(self) -> Any:
        """The leased object (an :class:`L1ObjectView`)."""

    def valid(self) -> bool:
        """Whether the object still is the one leased (call after copying out of it)."""

    def release(self) -> None:
        """Drop the lease; idempotent, never raises."""


ObjT = TypeVar("ObjT", bound=L1ObjectView)
LeaseT = TypeVar("LeaseT", bound=L1LeaseView)


class L1Surface(Protocol[ObjT, LeaseT]):
    """What the manager and engine need of an L1: two-phase writes, presence, leases, stats."""

    @property
    def slot_bytes(self) -> int:
        """Bytes of the largest object the L1 takes."""

    def reserve_write(self, key: str, spec: KVSpec, tenant: str = "") -> ObjT | None:
        """A WRITING object for ``key``, counted against ``tenant``'s quota; None if the key exists or
        there is no room."""

    def batched_reserve_write(
        self, keys: Sequence[str], specs: Sequence[KVSpec], tenant: str = ""
    ) -> list[ObjT | None]:
        """:meth:`reserve_write` for each key in one call."""

    def finish_write(self, obj: ObjT) -> None:
        """Publish a WRITING object."""

    def batched_finish_write(self, objs: Sequence[ObjT]) -> None:
        """:meth:`finish_write` for each object in one call."""

    def abort_write(self, obj: ObjT) -> None:
        """Drop a WRITING object (never visible)."""

    def batched_abort_write(self, objs: Sequence[ObjT]) -> None:
        """:meth:`abort_write` for each object in one call."""

    def contains(self, key: str) -> bool:
        """Whether ``key`` is published."""

    def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`contains` for each key in one call."""

    def acquire(self, key: str, lease_s: float | None = None) -> LeaseT | None:
        """Lease the published ``key``; None on a miss."""

    def batched_acquire(self, keys: Sequence[str], lease_s: float | None = None) -> list[LeaseT | None]:
        """:meth:`acquire` for each key in one call."""

    def batched_release(self, leases: Sequence[LeaseT]) -> None:
        """Release each lease in one call."""

    def delete(self, key: str) -> bool:
        """Remove an unleased published ``key``; False where not possible."""

    def stats(self) -> L1Stats:
        """Occupancy and counters."""


AnyL1 = L1Surface[Any, Any]
"""An L1 of any object and lease type (what the manager holds)."""


@runtime_checkable
class LocatesL2(Protocol):
    """An L1 whose owner also runs the L2 tiers (server mode): one call answers where keys are across L1+L2
    and starts the L2 -> L1 prefetch; acquiring waits (bounded) for that prefetch."""

    def batched_locate(self, keys: Sequence[str], *, prefetch: bool) -> list[TierHit | None]:
        """Per key L1 (level 0), an L2 tier (level >= 1, being prefetched when ``prefetch``) or None."""

    def batched_acquire_loaded(self, keys: Sequence[str], wait_s: float) -> list[Any]:
        """Leases on ``keys``, first loading a contiguous L2 prefix into L1 (waiting at most ``wait_s``)."""
