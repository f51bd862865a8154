"""Large receive buffers handed out again once nothing references them (no fresh pages per large reply).

A fresh 64 MiB buffer costs its pages (faults and zeroing by the kernel) on every read: about a fifth of a
parted 64 MiB GET on the project box. ``RecvBuffers.take`` returns a view of a block it keeps; a block is
handed out again only when the pool's own references are the only ones left (every view, slice, NumPy array
or tensor made from it holds a reference to it), so a caller that still holds a result never sees it
overwritten. CPython only (``sys.getrefcount``); the event loop's thread only.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["RecvBuffers"]


class RecvBuffers:
    """Keeps up to ``max_blocks`` blocks of at least ``min_bytes`` (``max_bytes`` in all) for reuse."""

    def __init__(self, min_bytes: int = 8 << 20, max_blocks: int = 8, max_bytes: int = 512 << 20) -> None:
        self.min_bytes, self.max_blocks, self.max_bytes = min_bytes, max_blocks, max_bytes
        self._blocks: list[np.ndarray] = []
        self.reused = 0
        """Takes served by a kept block (for tests and benchmarks)."""

    @staticmethod
    def _idle(blocks: list[np.ndarray], i: int) -> bool:
        # references: the list's and getrefcount's argument: nothing outside holds the block
        return sys.getrefcount(blocks[i]) == 2

    def take(self, size: int) -> memoryview:
        """A writable buffer of ``size`` bytes, not zero-filled: a kept idle block of that size, or new."""
        if size < self.min_bytes:
            view: memoryview = np.empty(size, dtype=np.uint8).data
            return view
        blocks = self._blocks
        for i in range(len(blocks)):
            if blocks[i].nbytes == size and self._idle(blocks, i):
                blocks.append(blocks.pop(i))  # most recently used last
                self.reused += 1
                return blocks[-1].data
        blocks.append(np.empty(size, dtype=np.uint8))
        kept = sum(b.nbytes for b in blocks)
        while len(blocks) > self.max_blocks or (kept > self.max_bytes and len(blocks) > 1):
            kept -= blocks.pop(0).nbytes  # the oldest: its users (if any) keep it alive, the pool forgets it
        return blocks[-1].data
