"""What both of one L1's L2 controllers (write-behind ``StoreController``, ``PrefetchController``) work on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiercache.store.l1_frames import l1_codec

if TYPE_CHECKING:
    from tiercache.config import ManagerConfig
    from tiercache.metrics import Metrics
    from tiercache.store.l1_surface import AnyL1
    from tiercache.store.tier import JobRunner, TierClient

__all__ = ["L2Context", "L2Controller"]


@dataclass(frozen=True, slots=True)
class L2Context:
    """One L1 and its L2 tier clients (in order), the policy and metrics they run under, and ``run``, which
    runs a codec job off the event loop; the manager builds one and hands it to both controllers."""

    l1: AnyL1
    tiers: Sequence[TierClient]
    policy: ManagerConfig
    metrics: Metrics
    run: JobRunner


class L2Controller:
    """Moves objects between ``ctx.l1`` and its L2 tiers, on one event loop."""

    def __init__(self, ctx: L2Context) -> None:
        self.l1 = ctx.l1
        self.tiers = ctx.tiers
        self.policy = ctx.policy
        self.metrics = ctx.metrics
        self._run = ctx.run
        self._l1_codec = l1_codec(ctx.l1)  # the codec of the L1's objects (raw, or fp8 in an fp8 L1)
