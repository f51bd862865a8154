"""Where lookups found chunks: :class:`TierHit` per key and :class:`PrefixHit` for a key list."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["L1_TIER", "PrefixHit", "TierHit"]

L1_TIER = "L1"


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
