"""When a POSIX put may write on the event loop thread instead of handing the write to a worker thread.

A buffered write of a few MiB into the page cache takes about as long as the thread hop that would carry it
(a wake-up of an idle vCPU costs 0.1-0.3 ms on the project VM, as much as copying 1 MiB), so small puts are
written inline, but only while the kernel will not make the writer wait for the disk:

- the directory is on a local filesystem (``LOCAL_FILESYSTEMS``; on a network filesystem open and rename
  wait for the server);
- the page cache is far from the point where the kernel throttles writers: ``Dirty + Writeback`` plus what
  was written inline since the last look stays under ``HEADROOM`` of the free-run threshold (the midpoint of
  the ``vm.dirty_background_*`` and ``vm.dirty_*`` limits over dirtyable memory, as the kernel computes it;
  ``/proc`` is read at most every ``SAMPLE_S``; no ``/proc``: never inline);
- the last inline writes did not wait: one that took longer than ``slow_s(size)`` *and* slept in the
  kernel (a voluntary context switch of the loop thread during the write, ``getrusage(RUSAGE_THREAD)``: the
  disk, writer throttling, a journal commit or a cgroup limit made it wait) turns inline writes off for
  ``BACKOFF_S``, doubling while the retry is slow again (up to ``MAX_BACKOFF_S``). A write that was slow only
  because other processes had the CPU (involuntary switches) does not count: a thread would wait for the
  CPU alike. Without ``RUSAGE_THREAD`` every slow write counts.

So the loop is held at most for one slow write before the puts go back to the threads. The clock and the
page-cache probe are injectable (tests).
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "BACKOFF_S",
    "HEADROOM",
    "LOCAL_FILESYSTEMS",
    "MAX_BACKOFF_S",
    "SAMPLE_S",
    "DirtyPages",
    "InlineWritePolicy",
    "filesystem_type",
    "read_dirty_pages",
    "slow_s",
    "voluntary_switches",
]

LOCAL_FILESYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "tmpfs", "bcachefs", "zfs", "jfs", "overlay"}
)
HEADROOM = 0.75  # inline only while dirty pages stay under 3/4 of the free-run threshold
SAMPLE_S = 0.02  # /proc/meminfo read at most this often (about 4 µs a read)
BACKOFF_S = 1.0  # inline writes off this long after a slow one (doubles while slow again)
MAX_BACKOFF_S = 60.0
_SLOW_BASE_S = 1e-3  # a write is slow beyond 1 ms plus its bytes at 0.5 GB/s
_SLOW_BYTES_PER_S = 0.5e9
_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)


def slow_s(size: int) -> float:
    """How long an inline write of ``size`` bytes may take before inline writes back off."""
    return _SLOW_BASE_S + size / _SLOW_BYTES_PER_S


def voluntary_switches() -> int | None:
    """Times the calling thread has slept in the kernel so far (None where the platform cannot tell)."""
    if _RUSAGE_THREAD is None:
        return None
    return resource.getrusage(_RUSAGE_THREAD).ru_nvcsw


@dataclass(frozen=True, slots=True)
class DirtyPages:
    """The page cache's dirty bytes now and the free-run threshold below which writers are never throttled."""

    dirty: int
    freerun: int


def _read_proc(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 16384)
    finally:
        os.close(fd)


def read_dirty_pages(read: Callable[[str], bytes] = _read_proc) -> DirtyPages | None:
    """``Dirty + Writeback`` and the kernel's free-run threshold (``mm/page-writeback.c``:
    ``(background + dirty limit) / 2`` over free + file pages), or None where ``/proc`` cannot tell;
    ``read`` returns a ``/proc`` file's bytes."""
    try:
        info: dict[bytes, int] = {}
        for line in read("/proc/meminfo").splitlines():
            name, _, rest = line.partition(b":")
            fields = rest.split()
            if fields:
                info[name] = int(fields[0]) * 1024
        names = ("dirty_ratio", "dirty_bytes", "dirty_background_ratio", "dirty_background_bytes")
        vm = {n: int(read(f"/proc/sys/vm/{n}")) for n in names}
        dirty = info[b"Dirty"] + info[b"Writeback"]
        dirtyable = info[b"MemFree"] + info[b"Active(file)"] + info[b"Inactive(file)"]
    except (OSError, ValueError, KeyError):
        return None
    limit = vm["dirty_bytes"] or vm["dirty_ratio"] * dirtyable // 100
    background = vm["dirty_background_bytes"] or vm["dirty_background_ratio"] * dirtyable // 100
    if background >= limit:
        background = limit // 2
    return DirtyPages(dirty, (limit + background) // 2)


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem holding ``path`` (``/proc/self/mountinfo``, matched by device), or None."""
    try:
        dev = os.stat(path).st_dev
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = f"{os.major(dev)}:{os.minor(dev)}"
    found: str | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 7 or fields[2] != want or "-" not in fields[6:]:
            continue
        found = fields[fields.index("-", 6) + 1]  # the last mount of the device wins (mount order)
    return found


class InlineWritePolicy:
    """Says whether a put of ``size`` bytes may be written on the loop thread now; told how long each took.

    ``allow`` is on every put's path: it reads two attributes until the sample or the back-off expires
    (``_room``: bytes that may still be written inline, ``_until``: when to look again), because each
    object a put touches costs it a cache miss after the previous put's copy has flushed the caches."""

    __slots__ = ("_backoff", "_probe", "_room", "_until", "clock", "max_bytes", "slow_writes")

    def __init__(
        self,
        max_bytes: int,
        *,
        local: bool,
        clock: Callable[[], float] = time.monotonic,
        probe: Callable[[], DirtyPages | None] = read_dirty_pages,
    ) -> None:
        """Inline writes of at most ``max_bytes`` (0: never) where ``local``; ``clock`` in seconds."""
        self.max_bytes = max_bytes if local else 0
        self.clock = clock
        """Seconds (monotonic): times the inline writes and the back-off."""
        self._probe = probe
        self._room = -1  # bytes still allowed inline until ``_until`` (-1: none, e.g. backing off)
        self._until = float("-inf")  # when the sample (or the back-off) ends
        self._backoff = BACKOFF_S
        self.slow_writes = 0
        """Inline writes that took longer than ``slow_s`` (each turned inline writes off for a while)."""

    def allow(self, size: int) -> bool:
        """Whether a write of ``size`` bytes may run on the loop thread now."""
        if size > self.max_bytes:
            return False
        if self.clock() >= self._until:
            self._resample()
        return size <= self._room

    def _resample(self) -> None:
        """Read the page cache's state: the room left under the threshold, for ``SAMPLE_S``."""
        sample = self._probe()
        self._until = self.clock() + SAMPLE_S
        self._room = -1 if sample is None else int(sample.freerun * HEADROOM) - sample.dirty

    def record_write(self, size: int, seconds: float, switches_before: int | None) -> bool:
        """An inline write of ``size`` bytes took ``seconds``; ``switches_before``: ``voluntary_switches()``
        read as it began. Whether the thread slept meanwhile is asked only if the write was slow (one
        ``getrusage`` on the fast path). True if it was slow and waited (inline writes now back off)."""
        if seconds <= slow_s(size):
            self.record(size, seconds, False)
            return False
        after = voluntary_switches()
        waited = switches_before is None or after is None or after > switches_before
        self.record(size, seconds, waited)
        return waited

    def record(self, size: int, seconds: float, waited: bool = True) -> None:
        """An inline write of ``size`` bytes took ``seconds`` (``waited``: the thread slept in the kernel
        meanwhile, or unknown): back off if it was slow because it waited."""
        self._room -= size
        if waited and seconds > slow_s(size):
            self.slow_writes += 1
            self._until = self.clock() + self._backoff
            self._room = -1
            self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)
        else:
            self._backoff = BACKOFF_S
