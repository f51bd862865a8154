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
    """Up to ``limit`` bytes of bytearrays kept for reuse, one list per size; thread-safe."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
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
            if self._kept + size <= self._limit:
                kept.append(buf)
                self._kept += size
            return buf
