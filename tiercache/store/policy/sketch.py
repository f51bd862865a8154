"""Admission by frequency: a count-min sketch of how often each key was seen, with 4-bit saturating
counters that halve after ``10 x width`` sightings (old popularity fades), and :class:`Admission`, which tells
whether a key was seen at least N times. Keys are hashed with Python's ``hash`` (cached on each string,
randomized per process: the sketch lives in memory only)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

__all__ = ["Admission", "FrequencySketch"]

_MAX = 15  # 4-bit counters
_MASK64 = (1 << 64) - 1
_MULS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)


class FrequencySketch:
    """Approximate per-key counts in 4 rows of ``width`` counters: never under the true count since the
    last halving (over it only by collisions). Not thread-safe: :class:`Admission` locks."""

    def __init__(self, width: int = 1 << 16) -> None:
        """``width`` counters per row, rounded up to a power of two; ValueError when not positive."""
        if width <= 0:
            raise ValueError(f"sketch width must be positive: {width}")
        self.width = 1 << (width - 1).bit_length()
        self._shift = 64 - self.width.bit_length() + 1
        self._rows = [bytearray(self.width) for _ in _MULS]
        self._added = 0
        self.sample = 10 * self.width
        """Sightings after which every counter halves."""

    def _index(self, key: str) -> list[int]:
        h = hash(key) & _MASK64
        shift = self._shift
        if self.width == 1:
            return [0] * len(_MULS)
        return [((h * m) & _MASK64) >> shift for m in _MULS]

    def add(self, key: str) -> int:
        """Count one sighting of ``key``; its estimate afterwards."""
        idx = self._index(key)
        rows = self._rows
        low = min(row[i] for row, i in zip(rows, idx, strict=True))
        if low < _MAX:
            for row, i in zip(rows, idx, strict=True):  # conservative update: raise only the minima
                if row[i] == low:
                    row[i] = low + 1
        self._added += 1
        if self._added >= self.sample:
            self._halve()
        return min(low + 1, _MAX)

    def estimate(self, key: str) -> int:
        """Sightings of ``key`` (saturating at 15)."""
        return min(row[i] for row, i in zip(self._rows, self._index(key), strict=True))

    def _halve(self) -> None:
        self._added //= 2
        table = bytes(b >> 1 for b in range(256))
        for row in self._rows:
            row[:] = row.translate(table)


class Admission:
    """How often lookups asked for each key, and whether a tier should take a key: once asked for
    ``threshold`` times (1: always). Thread-safe."""

    def __init__(self, width: int = 1 << 16) -> None:
        """A sketch of ``width`` counters per row (a few times the distinct chunks seen per ``10 x width``
        sightings keeps collisions rare)."""
        self._sketch = FrequencySketch(width)
        self._lock = threading.Lock()

    def seen(self, keys: Iterable[str]) -> None:
        """Count one sighting of each key (a lookup asked for it)."""
        with self._lock:
            add = self._sketch.add
            for key in keys:
                add(key)

    def count(self, key: str) -> int:
        """Sightings of ``key`` so far (saturating at 15)."""
        with self._lock:
            return self._sketch.estimate(key)

    def admit(self, key: str, threshold: int) -> bool:
        """Whether ``key`` was seen at least ``threshold`` times; ValueError unless 1..15."""
        if not 1 <= threshold <= _MAX:
            raise ValueError(f"admit_after must be in 1..{_MAX}: {threshold}")
        return threshold == 1 or self.count(key) >= threshold
