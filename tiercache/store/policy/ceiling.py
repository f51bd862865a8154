"""The hit-rate ceiling: the share of chunk lookups an unbounded cache would have answered on the traffic
seen, ``1 - distinct / lookups`` (each distinct chunk misses once), with ``distinct`` from a HyperLogLog
(2^p registers, about ``1.04 / sqrt(2^p)`` relative error). A low hit rate under a high ceiling means the
cache is too small; a low ceiling means the workload does not reuse."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

__all__ = ["HitRateCeiling", "HyperLogLog"]


_MASK64 = (1 << 64) - 1


def _mix(h: int) -> int:
    """A 64-bit finalizer (splitmix64) over Python's ``hash``: every bit depends on every input bit."""
    h &= _MASK64
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
    return h ^ (h >> 31)


class HyperLogLog:
    """Distinct-count estimate over strings in ``2**p`` one-byte registers."""

    def __init__(self, p: int = 14) -> None:
        """ValueError unless ``4 <= p <= 18``."""
        if not 4 <= p <= 18:
            raise ValueError(f"HyperLogLog precision must be in 4..18: {p}")
        self.p = p
        self.m = 1 << p
        self._regs = bytearray(self.m)

    def add(self, key: str) -> None:
        """Count ``key``."""
        self.add_hash(_mix(hash(key)))

    def add_hash(self, h: int) -> None:
        """Count a key by its well-mixed 64-bit hash."""
        idx = h & (self.m - 1)
        rest = h >> self.p
        rank = (64 - self.p) - rest.bit_length() + 1
        if rank > self._regs[idx]:
            self._regs[idx] = rank

    def count(self) -> float:
        """Estimated distinct keys added (linear counting while many registers are empty)."""
        m = self.m
        alpha = 0.7213 / (1 + 1.079 / m)
        raw = alpha * m * m / sum(2.0**-r for r in self._regs)
        zeros = self._regs.count(0)
        if raw <= 2.5 * m and zeros:
            return m * math.log(m / zeros)
        return raw


class HitRateCeiling:
    """Lookups and distinct chunks seen; :meth:`ceiling` is the best hit rate any cache could reach on
    them. Counts one key in ``2**sample_bits``, chosen by hash (every lookup of a chosen key counts, so the
    ratio holds). Thread-safe."""

    def __init__(self, p: int = 14, sample_bits: int = 0) -> None:
        """A HyperLogLog of precision ``p`` (16 KiB of registers, about 0.8% error, at 14)."""
        if not 0 <= sample_bits <= 16:
            raise ValueError(f"sample_bits must be in 0..16: {sample_bits}")
        self._hll = HyperLogLog(p)
        self._lock = threading.Lock()
        self._sample_mask = (1 << sample_bits) - 1
        self.lookups = 0
        """Lookups counted (of sampled keys)."""

    def observe(self, keys: Sequence[str]) -> None:
        """Each key was looked up once."""
        mask = self._sample_mask
        # the sample: by the raw hash's low bits, independent of the mixed one (chosen before the lock: most
        # lookups have no sampled key and take no lock)
        sampled: list[int] = []
        for key in keys:
            if not (raw := hash(key)) & mask:
                sampled.append(raw)
        if not sampled:
            return
        with self._lock:
            add = self._hll.add_hash
            for raw in sampled:
                add(_mix(raw))
            self.lookups += len(sampled)

    def distinct(self) -> float:
        """Estimated distinct keys looked up (never more than the lookups)."""
        with self._lock:
            return min(self._hll.count(), float(self.lookups))

    def ceiling(self) -> float:
        """``1 - distinct / lookups`` in [0, 1]; 0.0 before any lookup."""
        lookups = self.lookups
        if not lookups:
            return 0.0
        return max(0.0, 1.0 - self.distinct() / lookups)
