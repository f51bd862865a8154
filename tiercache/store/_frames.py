"""Reusable frame buffers for background stores: a frame is encoded into a buffer nothing else references.

A fresh buffer above glibc's mmap threshold (32 MiB at most) is new pages every time, and a 256-token chunk of
an 8B model is a 32 MiB payload plus its header: every store would fault its frame in page by page. A buffer
here is handed out again only once no view of it is left (the adapter, a put still landing past its deadline
and the store's own locals all hold views while they use it), so reuse can never change bytes in flight.
"""

from __future__ import annotations

import sys
import threading

__all__ = ["FrameBuffers"]


class FrameBuffers:
    """Bytearrays kept for reuse, one list per size, up to ``limit`` bytes or ``keep`` buffers of the largest
    size asked for, whichever is more (so ``keep`` frames in flight at once are reused however large a frame
    is); thread-safe."""

    def __init__(self, limit: int, keep: int = 0) -> None:
        self._limit = limit
        self._keep = keep
        self._largest = 0
        self._kept = 0
        self._free: dict[int, list[bytearray]] = {}
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        """A bytearray of exactly ``size`` bytes that no one else references (contents undefined)."""
        with self._lock:
            kept = self._free.setdefault(size, [])
            for buf in kept:
                # the list, the loop variable and getrefcount's argument: no view or other holder left
                if sys.getrefcount(buf) <= 3:
                    return buf
            buf = bytearray(size)
            self._largest = max(self._largest, size)
            if self._kept + size <= max(self._limit, self._keep * self._largest):
                kept.append(buf)
                self._kept += size
            return buf
