"""Empty temp files made ahead on a worker thread, so a put written on the event loop skips the create.

Creating a file is the part of a small put whose cost varies most: it allocates an inode in the directory's
inode group, which on a busy filesystem (on ext4 without a journal, one that scans recently deleted inodes)
measured 5-350 µs against 2-20 µs for the rename. A POSIX put on the loop thread takes a spare instead: an
empty temp file already open for writing, named like any writer's temp file
(``tiercache.adapters._tempfiles``: ``.spare.<owner>.<serial>.tmp``, so a crash leaves files the next sweep
removes), writes into it and renames it into the object's directory (a rename within one filesystem, atomic
as before). Spares live in the tree's directories at the layout's depth (where sweeps look for temp files),
each in the next one round the list, and are taken oldest first: a refill creating files holds the lock of
the directory it creates in, which a rename out of that directory would wait for (measured: a loop thread
that slept there backed inline writes off). ``take`` asks a thread for more when half are used, and answers
None (create as before) when none is ready."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial

from tiercache.adapters._tempfiles import temp_name
from tiercache.errors import AdapterUnavailable

__all__ = ["SPARE_KEY", "SpareFiles", "make_spares"]

log = logging.getLogger(__name__)

SPARE_KEY = "spare"  # the key part of a spare's temp name
_Spare = tuple[int, str]  # (descriptor open for writing, path)


def make_spares(directories: Sequence[str], count: int) -> list[_Spare]:
    """Create ``count`` empty temp files, one in each of ``directories`` in turn (made if missing), open for
    writing."""
    made: list[_Spare] = []
    try:
        for i in range(count):
            directory = directories[i % len(directories)]
            path = os.path.join(directory, temp_name(SPARE_KEY))
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:  # the directory was removed under the adapter: made again
                os.makedirs(directory, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            made.append((fd, path))
    except OSError:
        _discard(made)
        raise
    return made


def _discard(spares: list[_Spare]) -> None:
    """Close and remove ``spares`` (unused)."""
    for fd, path in spares:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


class SpareFiles:
    """Up to ``target`` spares spread over ``directories``, refilled through ``submit`` (runs a function on a
    thread)."""

    def __init__(
        self,
        directories: Sequence[str],
        submit: Callable[[Callable[[], list[_Spare]]], asyncio.Future[list[_Spare]]],
        target: int = 16,
    ) -> None:
        """Nothing is created until the first ``take``."""
        self.directories = list(directories)
        self.target = target
        self._submit = submit
        self._next = 0  # index of the directory the next refill starts in
        self._ready: deque[_Spare] = deque()
        self._refill: asyncio.Future[list[_Spare]] | None = None
        self._closed = False

    def take(self) -> _Spare | None:
        """A spare (open descriptor, path) the caller now owns, or None if none is ready; asks for more
        when half are used (never waits for them)."""
        ready = self._ready
        if len(ready) <= self.target // 2 and self._refill is None and not self._closed:
            self._start_refill()
        return ready.popleft() if ready else None

    def _start_refill(self) -> None:
        count, start = self.target - len(self._ready), self._next
        self._next = (start + count) % len(self.directories)
        order = self.directories[start:] + self.directories[:start]
        try:
            self._refill = self._submit(partial(make_spares, order, count))
        except AdapterUnavailable as exc:  # the pool is shutting down: go on without spares
            log.debug("file: cannot make spare temp files: %s", exc)
            return
        self._refill.add_done_callback(self._refilled)

    def _refilled(self, future: asyncio.Future[list[_Spare]]) -> None:
        self._refill = None
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:  # e.g. the directory is gone or full: puts create their files meanwhile
            log.debug("file: cannot make spare temp files: %s", exc)
            return
        if self._closed:
            _discard(future.result())
        else:
            self._ready.extend(future.result())

    def close(self) -> None:
        """Close and remove the spares not taken (a refill still running removes its own when it ends)."""
        self._closed = True
        ready, self._ready = list(self._ready), deque()
        _discard(ready)
