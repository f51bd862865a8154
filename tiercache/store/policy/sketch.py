"""Admission by frequency: a count-min sketch of how often each key was seen, with 4-bit saturating
counters that halve after ``10 x width`` sightings (old popularity fades), and :class:`Admission`, which lets
a key in once it was seen ``admit_after`` times."""

from __future__ import annotations

import hashlib
import threading

__all__ = ["Admission", "FrequencySketch"]

_MAX = 15  # 4-bit counters
_ROWS = 4


def _hashes(key: str) -> tuple[int, int, int, int]:
    d = hashlib.blake2b(key.encode(), digest_size=16).digest()
    return (
        int.from_bytes(d[0:4], "little"),
        int.from_bytes(d[4:8], "little"),
        int.from_bytes(d[8:12], "little"),
        int.from_bytes(d[12:16], "little"),
    )


class FrequencySketch:
    """Approximate per-key counts in ``width x 4`` counters: never under the true count since the last
    halving (over it only by collisions). Not thread-safe: :class:`Admission` locks."""

    def __init__(self, width: int = 1 << 16) -> None:
        """``width`` counters per row, rounded up to a power of two; ValueError when not positive."""
        if width <= 0:
            raise ValueError(f"sketch width must be positive: {width}")
        self.width = 1 << (width - 1).bit_length()
        self._mask = self.width - 1
        self._rows = [bytearray(self.width) for _ in range(_ROWS)]
        self._added = 0
        self.sample = 10 * self.width
        """Sightings after which every counter halves."""

    def add(self, key: str) -> int:
        """Count one sighting of ``key``; its estimate afterwards."""
        hs = _hashes(key)
        idx = [h & self._mask for h in hs]
        low = min(row[i] for row, i in zip(self._rows, idx, strict=True))
        for row, i in zip(self._rows, idx, strict=True):  # conservative update: raise only the minima
            if row[i] == low and low < _MAX:
                row[i] = low + 1
        est = min(low + 1, _MAX)
        self._added += 1
        if self._added >= self.sample:
            self._halve()
        return est

    def estimate(self, key: str) -> int:
        """Sightings of ``key`` (saturating at 15)."""
        return min(row[h & self._mask] for row, h in zip(self._rows, _hashes(key), strict=True))

    def _halve(self) -> None:
        self._added //= 2
        for i, row in enumerate(self._rows):
            self._rows[i] = bytearray(bytes(b >> 1 for b in row))


class Admission:
    """Whether a tier takes a key: always (``admit_after`` 1) or once seen ``admit_after`` times (lookups
    and stores both count as sightings, via :meth:`seen`). Thread-safe; counts admitted and refused keys."""

    def __init__(self, admit_after: int = 1, width: int = 1 << 16) -> None:
        """ValueError unless ``1 <= admit_after <= 15``."""
        if not 1 <= admit_after <= _MAX:
            raise ValueError(f"admit_after must be in 1..{_MAX}: {admit_after}")
        self.admit_after = admit_after
        self._sketch = FrequencySketch(width) if admit_after > 1 else None
        self._lock = threading.Lock()
        self.admitted = 0
        self.refused = 0

    def seen(self, keys: list[str]) -> None:
        """Count one sighting of each key (a lookup asked for it)."""
        sketch = self._sketch
        if sketch is None:
            return
        with self._lock:
            for key in keys:
                sketch.add(key)

    def admit(self, key: str) -> bool:
        """Whether to store ``key`` now (seen often enough); counted."""
        sketch = self._sketch
        if sketch is None:
            self.admitted += 1
            return True
        with self._lock:
            ok = sketch.estimate(key) >= self.admit_after
            if ok:
                self.admitted += 1
            else:
                self.refused += 1
            return ok
