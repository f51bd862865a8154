"""``nvme+slab:///path?capacity=500GiB``: one preallocated file (or block device) cut into fixed-size slots.

Layout (``tiercache.adapters._slab_layout``): a superblock, then equal *extents*, each a table (extent
header + one 512-byte record per slot) followed by its data. An extent is assigned to one *slot class* when
first needed; classes are 4 KiB-aligned sizes from 64 KiB up, 16 per power of two (a full-chunk frame wastes
at most 6.25 % of its slot), up to the class holding ``max_object`` (default 128 MiB). A larger value is
rejected: its put returns False, is logged at debug level and counted in ``stats["rejected_too_big"]``.

Writes: a value goes into a free slot of its class (else the least recently used unpinned object of the class
is evicted, or with ``eviction=s3fifo`` the one S3-FIFO picks among the class's objects; a class with no
evictable object takes the extent holding the globally least recently used object from another class, or a
free extent). The data is written first, then its index record (key, length, xxh3_64
of the value, commit sequence) is committed; an overwrite writes a NEW slot, commits it, then tombstones the
old record and frees the old slot (after its readers are done). All record writes go through one FIFO thread,
so a slot's tombstone always lands before the next record for that slot, and data is written into a reused
slot only after its tombstone. On open, the records are replayed: a torn or stale record fails its checksum
or generation and is dropped; of two records for a key the later sequence wins. Every get verifies the xxh3_64
of the bytes it read against the record (a mismatch is a miss, counted in ``stats["corrupt"]``), so a stale
or torn slot is never served even after a power loss without ``fsync``.

I/O: data goes through ``O_DIRECT`` where the filesystem allows it (probed at open: 512-byte or 4 KiB
alignment), else buffered I/O (``describe()`` says which; ``tiercache check`` prints it). Values of 256 KiB
and more are written without a copy: the write starts at the value's address rounded down to the alignment
and the record keeps that *skew*; only the last partial block goes through a bounce buffer. Large objects are
written and read in parallel 8 MiB ranges on an I/O pool while the calling worker computes the hash. Reads
land in recycled page-aligned buffers (fresh pages cost ~4x the read itself on the reference VM): a value of
1 MiB or more is returned as a read-only memoryview into such a buffer, which is reused only once every
reference to that value is gone (CPython reference counts); smaller values are returned as ``bytes``.
With ``fsync=true`` each put batch calls ``fdatasync`` before committing its records and again after.

One process owns a slab (``flock``); a second open raises ``AdapterUnavailable``. Options: ``capacity``
(required for a new regular file; a block device defaults to its size), ``max_object``, ``extent_size``,
``direct`` (auto/true/false), ``fsync``, ``threads``, ``io_threads``, ``preallocate`` (posix_fallocate a new
file, default true), ``format`` (reformat the file, dropping every object, or use one that is not a slab;
default false), ``read_buffers`` (bytes of recycled read buffers, default 1 GiB).

A new (or reformatted) slab file must fit its filesystem: when the bytes it still needs exceed the free space
(``statvfs``: blocks available to unprivileged users), ``open`` raises ``ConfigError`` naming the capacity
and the free bytes, and leaves nothing behind (a file it created is removed, an existing one keeps its old
size). A ``posix_fallocate`` that runs out of space all the same is undone and refused alike. With
``preallocate=false`` (a sparse file, by request) the slab opens with a warning instead.

Nothing is destroyed silently: an existing slab is opened with the geometry in its superblock (capacity,
extent size, largest class; options that differ are logged at warning level), and is reformatted only with
``format=true``. A batch whose caller is cancelled runs to its end detached (slots written are committed,
the others released), and ``aclose`` waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import secrets
import stat
import sys
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, TypeVar

import numpy as np
import xxhash

from tiercache.adapters._base import Adapter, Buffer, Capabilities, check_key, check_keys, check_lengths
from tiercache.adapters._detached import DetachedWork
from tiercache.adapters._listeners import TierListener, TierListeners
from tiercache.adapters._local_url import local_url
from tiercache.adapters._slab_layout import (
    HEADER_BYTES,
    RECORD_BYTES,
    Geometry,
    Record,
    align_up,
    bytes_text,
    class_index,
    class_sizes,
    pack_extent_header,
    pack_record,
    pack_superblock,
    tombstone,
    unpack_extent_header,
    unpack_record,
    unpack_superblock,
)
from tiercache.adapters.options import MAX_SIZE, Range, Size, check_options, parse_bool, parse_options
from tiercache.buffers import as_readable_bytes
from tiercache.errors import AdapterUnavailable, ConfigError
from tiercache.eviction import S3FIFOPolicy

if TYPE_CHECKING:
    from typing import Self

__all__ = ["DEFAULT_MAX_OBJECT", "SlabAdapter", "SlabOptions"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
DEFAULT_MAX_OBJECT = 128 << 20
_IO_CHUNK = 8 << 20  # parallel range size for large objects
_ZERO_COPY_MIN = 256 << 10  # smaller values are copied into a bounce buffer (one write)
_VIEW_MIN = 1 << 20  # smaller values are returned as bytes
_DEFAULT_THREADS = min(32, 4 * (os.cpu_count() or 1))
_EMPTY_HASH = xxhash.xxh3_64_intdigest(b"")


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _parse_direct(value: object) -> bool | None:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    return parse_bool(value)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short read (file ends inside the slab)")
        done += n


class _BufferPool:
    """Page-aligned anonymous mappings reused once nothing references them (see the module docstring)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._held = 0
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        size = align_up(max(size, 1), mmap.PAGESIZE)
        with self._lock:
            bucket = self._free.setdefault(size, [])
            for buf in bucket:
                # bucket + loop variable + getrefcount's argument: nobody else holds it
                if sys.getrefcount(buf) <= 3:
                    return buf
            buf = mmap.mmap(-1, size)
            if self._held + size <= self._limit:
                bucket.append(buf)
                self._held += size
            return buf


@dataclass(eq=False, slots=True)
class _Entry:
    key: str
    extent: int
    slot: int
    cls: int
    length: int
    vhash: int
    skew: int
    seq: int
    tick: int = 0
    pins: int = 0
    dead: bool = False  # no longer in the index; the slot is freed when the last reader unpins
    tomb: Future[None] | None = None  # the tombstone write that must land before the slot is reused


@dataclass(eq=False, slots=True)
class _Extent:
    index: int
    cls: int | None = None
    gen: int = 0
    busy: int = 0  # slots being written + pins of readers
    used: dict[int, _Entry] = field(default_factory=dict)  # slot -> committed entry
    ready: Future[None] | None = None  # header write that data writes must follow


def _unpinned(lru: Mapping[str, _Entry], key: str) -> bool:
    return not lru[key].pins


@dataclass(eq=False, slots=True)
class _Class:
    size: int
    extents: list[int] = field(default_factory=list)
    free: list[tuple[int, int]] = field(default_factory=list)
    lru: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)
    policy: S3FIFOPolicy | None = None  # eviction=s3fifo: the order victims come in


@dataclass(slots=True)
class _Reserved:
    extent: int
    slot: int
    cls: int
    offset: int
    barriers: list[Future[None]]


@dataclass(frozen=True, slots=True)
class SlabOptions:
    """Options of ``nvme+slab:///abs/path`` URLs (query string or keywords); each parsed from its type."""

    capacity: Annotated[Size, Range(0, MAX_SIZE)] | None = None
    """Bytes of the slab (required for a new regular file; a block device defaults to its size)."""
    max_object: Annotated[Size, Range(1, 1 << 40)] = DEFAULT_MAX_OBJECT
    """Largest value (bytes or "128MiB"; at most 1 TiB)."""
    extent_size: Annotated[Size, Range(1, 1 << 40)] | None = None
    """Bytes per extent, rounded up to 1 MiB (None: the geometry planner chooses; at most 1 TiB)."""
    direct: bool | None = field(default=None, metadata={"parse": _parse_direct})
    """O_DIRECT data I/O: true, false or auto (None)."""
    fsync: bool = False
    """fdatasync each put batch before committing its records and again after."""
    threads: Annotated[int, Range(1, 1024)] = _DEFAULT_THREADS
    """Worker threads (1 to 1024)."""
    io_threads: Annotated[int, Range(1, 1024)] = 8
    """I/O threads (1 to 1024)."""
    preallocate: bool = True
    """posix_fallocate a new file (one that does not fit the free space is refused; false: a sparse file,
    which may fill the filesystem later)."""
    format: bool = False
    """Reformat the file, dropping every object, or use one that is not a slab."""
    read_buffers: Annotated[Size, Range(0, 1 << 40)] = 1 << 30
    """Bytes of recycled read buffers (at most 1 TiB)."""
    eviction: Literal["lru", "s3fifo"] = "lru"
    """Which object of a full class goes for a new one: least recently used, or S3-FIFO's choice."""


class SlabAdapter(Adapter):
    """A single-process, persistent slot store on one file or block device (see the module docstring)."""

    scheme: ClassVar[str] = "nvme+slab"
    capabilities: ClassVar[Capabilities] = Capabilities(
        persistent=True, shared=False, delete=True, max_value_bytes=DEFAULT_MAX_OBJECT, list_keys=True
    )
    close_timeout_s: ClassVar[float] = 60.0
    """How long ``aclose`` waits for batches still running (their caller may have been cancelled)."""

    def __init__(self, path: str, options: SlabOptions | None = None) -> None:
        """Settings only (``SlabOptions``); ``open`` (or ``_load``) opens, locks and replays the slab."""
        o = options or SlabOptions()
        check_options(o, "nvme+slab")
        capacity, max_object, extent_size, direct = o.capacity, o.max_object, o.extent_size, o.direct
        fsync, threads, io_threads, preallocate = o.fsync, o.threads, o.io_threads, o.preallocate
        format, read_buffers = o.format, o.read_buffers
        if not os.path.isabs(path):
            raise ConfigError(f"nvme+slab: path must be absolute, got {path!r}")
        self.path = path
        self.max_object = max_object
        self._want_capacity = capacity
        self._extent_size = extent_size
        self._direct_opt = direct
        self.fsync = fsync
        self._preallocate = preallocate
        self._format = format
        # Slots must hold the value plus its skew and the alignment of the last block.
        self._sizes = class_sizes(align_up(max_object, 4096) + 8192)
        self._eviction = o.eviction
        self._classes = [self._new_class(s) for s in self._sizes]
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tiercache-slab")
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="tiercache-slab-io")
        self._meta = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiercache-slab-meta")
        self._buffers = _BufferPool(read_buffers)
        self._bounce = _BufferPool(64 << 20)
        self._index: dict[str, _Entry] = {}
        self._extents: list[_Extent] = []
        self._free_extents: list[int] = []
        self._barriers: dict[tuple[int, int], Future[None]] = {}
        self._seq = 1
        self._tick = 0
        self._fd = -1  # data: O_DIRECT when self.align
        self._mfd = -1  # metadata: buffered
        self.align = 0  # 0: buffered data I/O
        self.geometry: Geometry | None = None
        self._format_id = 0
        self._detached = DetachedWork(f"nvme+slab {path}")  # batches whose caller was cancelled
        self._closed = False
        self._listeners = TierListeners()
        self.stats: dict[str, int] = {
            "rejected_too_big": 0,
            "rejected_full": 0,
            "corrupt": 0,
            "evicted": 0,
            "extents_moved": 0,
            "replayed": 0,
            "dropped_on_replay": 0,
        }
        self.__dict__["capabilities"] = Capabilities(
            persistent=True, shared=False, delete=True, max_value_bytes=max_object, list_keys=True
        )

    # -- opening -----------------------------------------------------------------------------------------

    @classmethod
    async def open(cls, url: str, **options: object) -> Self:
        """Open ``nvme+slab:///abs/path`` (see the module docstring for the options)."""
        path, query = local_url(url, ("nvme+slab",), "nvme+slab")
        opts = parse_options(SlabOptions, "nvme+slab", query, options)
        self = cls(path, opts)
        try:
            await self._load()
        except BaseException:
            self._shutdown_now()
            raise
        return self

    def _shutdown_now(self) -> None:
        self._closed = True
        for pool in (self._executor, self._io, self._meta):
            pool.shutdown(wait=False)
        for fd in (self._fd, self._mfd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._mfd = -1

    async def _load(self) -> None:
        try:
            records = await asyncio.get_running_loop().run_in_executor(self._executor, self._open_files)
        except OSError as exc:
            raise AdapterUnavailable(f"nvme+slab: cannot use {self.path!r}: {exc}") from exc
        await self._replay(records)

    def _open_files(self) -> list[tuple[int, int, int, list[Record]]]:
        """Open, lock, format or validate; return (extent, gen, class_size, valid records) per used extent."""
        try:
            mfd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            created = True
        except FileExistsError:
            mfd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            created = False
        self._mfd = mfd
        try:
            fcntl.flock(mfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise AdapterUnavailable(
                f"nvme+slab: {self.path!r} is in use by another process (one process owns a slab)"
            ) from exc
        try:
            return self._open_locked(mfd)
        except BaseException:
            if created:  # a slab that never opened leaves no file behind (we hold its lock)
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            raise

    def _open_locked(self, mfd: int) -> list[tuple[int, int, int, list[Record]]]:
        """``_open_files`` once ``mfd`` is open and locked."""
        st = os.fstat(mfd)
        block = stat.S_ISBLK(st.st_mode)
        size = os.lseek(mfd, 0, os.SEEK_END) if block else st.st_size
        head = os.pread(mfd, HEADER_BYTES, 0)
        found = unpack_superblock(head)
        if found is not None and not self._format:  # never reformat a slab unless asked to
            geo = self._adopt(found[0], size)
            self._format_id = found[1]
            self.geometry = geo
            self._extents = [_Extent(i) for i in range(geo.n_extents)]
            self._open_data(block)
            return self._scan(geo)
        capacity = self._want_capacity
        if capacity is None:
            if block:
                capacity = size
            else:
                raise ConfigError(f"nvme+slab: capacity is required to create {self.path!r}")
        if block and capacity > size:
            raise ConfigError(f"nvme+slab: capacity {capacity} exceeds the device size {size}")
        try:
            geo = Geometry.plan(capacity, self._sizes[-1], self._extent_size)
        except ValueError as exc:
            raise ConfigError(f"nvme+slab: {exc}") from exc
        if found is None and not self._format and any(head) and size > 0:
            raise AdapterUnavailable(
                f"nvme+slab: {self.path!r} is not empty and not a tiercache slab; pass format=true to use it"
            )
        if not block:  # before anything is sized by the geometry: a capacity past the disk stops here
            self._allocate(mfd, st, capacity, geo.used_bytes)
        self.geometry = geo
        self._extents = [_Extent(i) for i in range(geo.n_extents)]
        if found is not None:
            log.warning("nvme+slab: %s: format=true: reformatting (every object is dropped)", self.path)
        self._format_id = secrets.randbits(63) or 1
        os.pwrite(mfd, pack_superblock(geo, self._format_id), 0)
        os.fdatasync(mfd)
        self._open_data(block)
        return self._scan(geo)

    def _allocate(self, fd: int, st: os.stat_result, capacity: int, length: int) -> None:
        """Make the regular file ``fd`` ``length`` bytes long, allocated with ``posix_fallocate`` when
        ``preallocate`` is on. A layout that does not fit the filesystem's free space is refused
        (ConfigError naming the capacity and the free bytes) and the file is left as it was: a slab never
        fills a disk at open, nor runs out of space later (without ``preallocate`` a sparse slab may: a
        warning says so)."""
        vfs = os.fstatvfs(fd)
        free = vfs.f_bavail * vfs.f_frsize
        missing = length - min(length, st.st_blocks * 512)  # bytes the filesystem must still provide
        if missing > free:
            if self._preallocate:
                raise ConfigError(self._no_space(capacity, missing, free))
            log.warning(
                "%s; preallocate=false: the sparse slab may fill the filesystem",
                self._no_space(capacity, missing, free),
            )
        try:
            if st.st_size < length:
                os.ftruncate(fd, length)
            if self._preallocate:
                try:
                    os.posix_fallocate(fd, 0, length)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                        raise
                    log.debug("nvme+slab: %s: posix_fallocate is not supported here (sparse file)", self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):  # give back what was allocated beyond the old end
                os.ftruncate(fd, st.st_size)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                vfs = os.fstatvfs(fd)
                raise ConfigError(self._no_space(capacity, missing, vfs.f_bavail * vfs.f_frsize)) from None
            if exc.errno == errno.EFBIG:
                raise ConfigError(
                    f"nvme+slab: capacity {bytes_text(capacity)} is more than one file may hold on the "
                    f"filesystem of {os.path.dirname(self.path)!r}: lower capacity"
                ) from None
            raise

    def _no_space(self, capacity: int, missing: int, free: int) -> str:
        directory = os.path.dirname(self.path) or "/"
        return (
            f"nvme+slab: capacity {bytes_text(capacity)} does not fit on the filesystem of {directory!r}: "
            f"the slab needs {bytes_text(missing)} more and {bytes_text(free)} are free; "
            "lower capacity or free space"
        )

    def _adopt(self, found: Geometry, size: int) -> Geometry:
        """Use an existing slab's geometry (its capacity, extent size and largest class win over the options,
        which would otherwise need a reformat); refuse one that no longer fits its file or device."""
        if size < found.used_bytes:
            raise AdapterUnavailable(
                f"nvme+slab: {self.path!r} is smaller ({size} bytes) than its slab layout "
                f"({found.used_bytes} bytes): it was truncated; pass format=true to reformat it"
            )
        wanted = {
            "capacity": self._want_capacity,
            "max_class": self._sizes[-1],
            "extent_size": None if self._extent_size is None else align_up(self._extent_size, 1 << 20),
        }
        have = {"capacity": found.capacity, "max_class": found.max_class, "extent_size": found.extent_bytes}
        differ = [
            f"{k}={have[k]} (options: {v})" for k, v in wanted.items() if v is not None and v != have[k]
        ]
        if differ:
            log.warning(
                "nvme+slab: %s was formatted with %s: opened with the slab's geometry and its objects; "
                "pass format=true to reformat it (drops every object)",
                self.path,
                ", ".join(differ),
            )
        if found.max_class != self._sizes[-1]:
            self._sizes = class_sizes(found.max_class)
            self._classes = [self._new_class(sz) for sz in self._sizes]
            self.max_object = min(self.max_object, found.max_class - 8192)
            self.__dict__["capabilities"] = Capabilities(
                persistent=True, shared=False, delete=True, max_value_bytes=self.max_object, list_keys=True
            )
        return found

    def _open_data(self, block: bool) -> None:
        """Open the data descriptor: O_DIRECT with the smallest alignment that works, else buffered."""
        if self._direct_opt is not False:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
            except OSError:
                fd = -1
            if fd >= 0:
                probe = mmap.mmap(-1, 8192)
                for align in (512, 4096):
                    try:  # a read at an offset/address aligned only to ``align`` (non-destructive)
                        os.preadv(fd, [memoryview(probe)[align : 2 * align]], align)
                    except OSError:
                        continue
                    self.align = align
                    break
                probe.close()
                if self.align:
                    self._fd = fd
                    return
                os.close(fd)
            if self._direct_opt is True:
                raise AdapterUnavailable(f"nvme+slab: O_DIRECT is not supported for {self.path!r}")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)

    def _scan(self, geo: Geometry) -> list[tuple[int, int, int, list[Record]]]:
        out: list[tuple[int, int, int, list[Record]]] = []
        for e in range(geo.n_extents):
            hdr = unpack_extent_header(
                os.pread(self._mfd, HEADER_BYTES, geo.table_offset(e)), self._format_id, e
            )
            if hdr is None or hdr[1] not in self._sizes:
                out.append((e, 0, 0, []))
                continue
            gen, csize = hdr
            n = geo.slots(csize)
            raw = os.pread(self._mfd, n * RECORD_BYTES, geo.record_offset(e, 0))
            view = memoryview(raw)
            recs = []
            for s in range(len(raw) // RECORD_BYTES):
                r = unpack_record(view[s * RECORD_BYTES : (s + 1) * RECORD_BYTES], self._format_id)
                if r is None:
                    continue
                if r.gen != gen or r.extent != e or r.slot != s or r.class_size != csize:
                    continue
                need = align_up(r.skew + r.length, 512)
                if r.skew >= 4096 or need > csize:
                    continue
                recs.append(r)
            out.append((e, gen, csize, recs))
        return out

    async def _replay(self, scanned: list[tuple[int, int, int, list[Record]]]) -> None:
        best: dict[str, Record] = {}
        losers: list[Record] = []
        max_seq = 0
        for e, gen, csize, recs in scanned:
            max_seq = max(max_seq, gen)
            ext = self._extents[e]
            if not csize:
                self._free_extents.append(e)
                continue
            ci = self._sizes.index(csize)
            ext.cls, ext.gen = ci, gen
            self._classes[ci].extents.append(e)
            for r in recs:
                max_seq = max(max_seq, r.seq)
                old = best.get(r.key)
                if old is None or r.seq > old.seq:
                    if old is not None:
                        losers.append(old)
                    best[r.key] = r
                else:
                    losers.append(r)
        self._free_extents.reverse()  # pop() takes the lowest first
        self._seq = max_seq + 1
        for r in sorted(best.values(), key=lambda r: r.seq):
            ci = self._sizes.index(r.class_size)
            entry = _Entry(r.key, r.extent, r.slot, ci, r.length, r.vhash, r.skew, r.seq)
            self._extents[r.extent].used[r.slot] = entry
            self._commit_entry(entry)
        for ext in self._extents:
            if ext.cls is not None:
                cls = self._classes[ext.cls]
                cls.free.extend(
                    (ext.index, s) for s in reversed(range(self._geo.slots(cls.size))) if s not in ext.used
                )
        self.stats["replayed"] = len(best)
        self.stats["dropped_on_replay"] = len(losers)
        if losers:  # clear them so that their slots start clean
            await self._meta_write([(self._geo.record_offset(r.extent, r.slot), tombstone()) for r in losers])

    # -- helpers -----------------------------------------------------------------------------------------

    @property
    def _geo(self) -> Geometry:
        assert self.geometry is not None
        return self.geometry

    def describe(self) -> str:
        """One line for ``tiercache check``: the I/O mode and the layout."""
        mode = f"O_DIRECT (align {self.align} B)" if self.align else "buffered + fdatasync"
        geo = self._geo
        return (
            f"nvme+slab {self.path}: {mode}, fsync={'on' if self.fsync else 'off'}, "
            f"{geo.n_extents} extents x {geo.extent_bytes >> 20} MiB, "
            f"slots 64 KiB..{self._sizes[-1] >> 20} MiB, "
            f"{len(self._index)} objects"
        )

    @property
    def capacity(self) -> int:
        """Bytes of slot space (every extent's data area); ``used_bytes`` never exceeds it."""
        return self._geo.n_extents * self._geo.extent_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the values stored."""
        return sum(e.length for e in self._index.values())

    def _check_open(self) -> None:
        if self._closed:
            raise AdapterUnavailable(f"nvme+slab adapter on {self.path!r} is closed")

    def _submit(self, pool: ThreadPoolExecutor, fn: Callable[[], _T]) -> asyncio.Future[_T]:
        try:
            return asyncio.get_running_loop().run_in_executor(pool, fn)
        except RuntimeError as exc:
            raise AdapterUnavailable(f"nvme+slab adapter on {self.path!r} is closed") from exc

    def _meta_submit(self, writes: list[tuple[int, bytes]], sync_before: bool = False) -> Future[None]:
        """Queue record/header writes on the single FIFO metadata thread."""

        def job() -> None:
            if sync_before:
                os.fdatasync(self._fd)
            for offset, data in writes:
                os.pwrite(self._mfd, data, offset)
            if sync_before:
                os.fdatasync(self._mfd)

        try:
            return self._meta.submit(job)
        except RuntimeError as exc:
            raise AdapterUnavailable(f"nvme+slab adapter on {self.path!r} is closed") from exc

    async def _meta_write(self, writes: list[tuple[int, bytes]], sync: bool = False) -> None:
        try:
            await asyncio.wrap_future(self._meta_submit(writes, sync))
        except OSError as exc:
            raise AdapterUnavailable(f"nvme+slab: metadata write failed on {self.path!r}: {exc}") from exc

    def _new_class(self, size: int) -> _Class:
        return _Class(size, policy=S3FIFOPolicy(None) if self._eviction == "s3fifo" else None)

    def _commit_entry(self, entry: _Entry) -> None:
        self._tick += 1
        entry.tick = self._tick
        self._index[entry.key] = entry
        cls = self._classes[entry.cls]
        cls.lru[entry.key] = entry
        if cls.policy is not None:
            cls.policy.remove(entry.key)
            cls.policy.insert(entry.key)
        self._extents[entry.extent].used[entry.slot] = entry

    def _retire(self, entry: _Entry, writes: list[tuple[int, bytes]]) -> None:
        """Drop ``entry`` from the index and queue its tombstone in ``writes``; its slot is freed later."""
        self._index.pop(entry.key, None)
        cls = self._classes[entry.cls]
        if cls.lru.pop(entry.key, None) is not None and cls.policy is not None:
            cls.policy.remove(entry.key)
        writes.append((self._geo.record_offset(entry.extent, entry.slot), tombstone()))
        entry.dead = True

    def _release_dead(self, entry: _Entry) -> None:
        """Give a retired entry's slot back once nobody reads it (behind its tombstone write)."""
        if entry.pins or not entry.dead:
            return
        ext = self._extents[entry.extent]
        if ext.used.get(entry.slot) is entry:
            del ext.used[entry.slot]
            if ext.cls == entry.cls:
                if entry.tomb is not None:
                    self._barriers[(entry.extent, entry.slot)] = entry.tomb
                self._classes[entry.cls].free.append((entry.extent, entry.slot))

    def _retire_now(self, entries: list[_Entry]) -> Future[None] | None:
        """Retire ``entries`` with one tombstone job; free the unpinned slots behind it."""
        if not entries:
            return None
        writes: list[tuple[int, bytes]] = []
        for e in entries:
            self._retire(e, writes)
        fut = self._meta_submit(writes)
        for e in entries:
            e.tomb = fut
            self._release_dead(e)
        return fut

    # -- allocation --------------------------------------------------------------------------------------

    def _assign_extent(self, e: int, ci: int) -> None:
        ext = self._extents[e]
        ext.cls, ext.gen = ci, self._seq
        self._seq += 1
        ext.used.clear()
        cls = self._classes[ci]
        cls.extents.append(e)
        geo = self._geo
        ext.ready = self._meta_submit(
            [(geo.table_offset(e), pack_extent_header(self._format_id, ext.gen, e, cls.size))]
        )
        for key in [k for k in self._barriers if k[0] == e]:
            del self._barriers[key]
        cls.free.extend((e, s) for s in reversed(range(geo.slots(cls.size))))

    def _steal_extent(self, ci: int, empty_only: bool) -> bool:
        """Move an extent of another class to class ``ci``: one holding no objects if there is one, else
        (unless ``empty_only``) the idle extent holding the least recently used object of another class."""
        candidates: list[tuple[int, int]] = []
        for oi, other in enumerate(self._classes):
            if oi == ci:
                continue
            for e in other.extents:
                ext = self._extents[e]
                if not ext.used and not ext.busy:
                    candidates.append((-1, e))
                    break
            if not empty_only:
                candidates.extend((v.tick, v.extent) for v in other.lru.values() if not v.pins)
        for _, e in sorted(candidates):
            ext = self._extents[e]
            if ext.busy or (empty_only and ext.used):
                continue
            assert ext.cls is not None
            old = self._classes[ext.cls]
            evicted = list(ext.used.values())
            for entry in evicted:  # the new header's generation invalidates their records
                self._index.pop(entry.key, None)
                if old.lru.pop(entry.key, None) is not None and old.policy is not None:
                    old.policy.remove(entry.key)
                entry.dead = True
                self.stats["evicted"] += 1
            self._listeners.notify("evicted", [entry.key for entry in evicted])
            old.extents.remove(e)
            old.free = [fs for fs in old.free if fs[0] != e]
            self._assign_extent(e, ci)
            self.stats["extents_moved"] += 1
            return True
        return False

    def _reserve(self, ci: int) -> _Reserved | None:
        """A slot of class ``ci`` for a new write (evicting if needed), or None if none can be had.

        In order: a free slot of the class; a free extent; an extent of another class that holds no object;
        the class's least recently used unpinned object; finally (a class with nothing to evict) the idle
        extent of another class holding the least recently used object."""
        cls = self._classes[ci]
        for _ in range(4):
            if cls.free:
                e, s = cls.free.pop()
                ext = self._extents[e]
                ext.busy += 1
                barriers = [b for b in (self._barriers.pop((e, s), None), ext.ready) if b is not None]
                if ext.ready is not None and ext.ready.done():
                    ext.ready = None
                return _Reserved(e, s, ci, self._geo.data_offset(e, s, cls.size), barriers)
            if self._free_extents:
                self._assign_extent(self._free_extents.pop(), ci)
                continue
            if self._steal_extent(ci, empty_only=True):
                continue
            if cls.policy is not None:
                key = cls.policy.victim(partial(_unpinned, cls.lru))
                victim = None if key is None else cls.lru[key]
            else:
                victim = next((v for v in cls.lru.values() if not v.pins), None)
            if victim is not None:
                self.stats["evicted"] += 1
                self._retire_now([victim])
                self._listeners.notify("evicted", [victim.key])
                continue
            if not self._steal_extent(ci, empty_only=False):
                return None
        return None

    def _unreserve(self, r: _Reserved, ok: bool) -> None:
        ext = self._extents[r.extent]
        ext.busy -= 1
        if not ok and ext.cls == r.cls:
            self._classes[r.cls].free.append((r.extent, r.slot))

    # -- data I/O (worker threads) -----------------------------------------------------------------------

    def _write_value(self, r: _Reserved, view: memoryview, skew: int) -> int:
        """Write ``view`` at the slot (after its barriers); return the xxh3_64 of the value."""
        for b in r.barriers:
            b.result()
        n = len(view)
        if n == 0:
            return _EMPTY_HASH
        if not self.align:
            return self._write_buffered(r.offset, view)
        if skew == 0 and n < _ZERO_COPY_MIN:
            return self._write_small(r.offset, view)
        return self._write_direct(r.offset, view, skew)

    def _write_buffered(self, off: int, view: memoryview) -> int:
        """Buffered mode: straight from the caller's buffer, ranges in parallel."""
        n, fd = len(view), self._fd
        futures = [
            self._io.submit(_pwrite_all, fd, view[p : p + _IO_CHUNK], off + p)
            for p in range(_IO_CHUNK, n, _IO_CHUNK)
        ]
        try:
            h = xxhash.xxh3_64_intdigest(view)
            _pwrite_all(fd, view[:_IO_CHUNK], off)
        finally:
            for f in futures:
                f.result()
        return int(h)

    def _write_small(self, off: int, view: memoryview) -> int:
        """O_DIRECT, small value: one copy into an aligned bounce buffer, one write."""
        n = len(view)
        total = align_up(n, self.align)
        bounce = self._bounce.take(total)
        mv = memoryview(bounce)
        mv[:n] = view
        mv[n:total] = bytes(total - n)
        _pwrite_all(self._fd, mv[:total], off)
        return int(xxhash.xxh3_64_intdigest(view))

    def _write_direct(self, off: int, view: memoryview, skew: int) -> int:
        """O_DIRECT without a copy: whole aligned blocks from the caller's memory (starting ``skew`` bytes
        before the value, in its page), the last partial block through a bounce buffer."""
        a, n, fd = self.align, len(view), self._fd
        body = (skew + n) // a * a
        futures: list[Future[None]] = []
        if body:
            mem = (ctypes.c_char * body).from_address(_address(view) - skew)
            src = memoryview(mem).cast("B")
            futures = [
                self._io.submit(_pwrite_all, fd, src[p : p + _IO_CHUNK], off + p)
                for p in range(0, body, _IO_CHUNK)
            ]
        try:
            h = xxhash.xxh3_64_intdigest(view)
            if body < skew + n:
                bounce = self._bounce.take(a)
                mv = memoryview(bounce)[:a]
                start = max(body - skew, 0)
                at = skew if body == 0 else 0
                mv[:] = bytes(a)
                mv[at : at + n - start] = view[start:]
                _pwrite_all(fd, mv, off + body)
        finally:
            for f in futures:
                f.result()
        return int(h)

    def _read_value(self, e: _Entry, offset: int) -> Buffer | None:
        """The value's bytes if their xxh3_64 matches the record, else None."""
        n = e.length
        if n == 0:
            return b""
        start = e.skew
        total = align_up(start + n, self.align or 1)
        buf = self._buffers.take(max(total, self._sizes[e.cls]))
        mv = memoryview(buf)
        fd = self._fd
        futures = [
            self._io.submit(_pread_all, fd, mv[p : min(p + _IO_CHUNK, total)], offset + p)
            for p in range(_IO_CHUNK, total, _IO_CHUNK)
        ]
        h = xxhash.xxh3_64()
        try:
            first = min(_IO_CHUNK, total)
            _pread_all(fd, mv[:first], offset)
            h.update(mv[start : min(first, start + n)])
            for i, f in enumerate(futures):
                f.result()
                p = (i + 1) * _IO_CHUNK
                h.update(mv[p : min(p + _IO_CHUNK, start + n)])
        except BaseException:
            for f in futures:
                f.cancel()
            for f in futures:
                with contextlib.suppress(BaseException):
                    f.result()
            raise
        if h.intdigest() != e.vhash:
            return None
        value = mv[start : start + n]
        if n < _VIEW_MIN:
            return bytes(value)
        return value.toreadonly()

    # -- the adapter API ---------------------------------------------------------------------------------

    async def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether a committed object is indexed now (no I/O)."""
        self._check_open()
        return [check_key(k) in self._index for k in keys]

    async def batched_get(self, keys: Sequence[str]) -> list[Buffer | None]:
        """Read and verify each hit in parallel; a checksum mismatch is a miss (and drops the object)."""
        self._check_open()
        check_keys(keys)
        # Reads pin their slots until the threads reading them are done: a cancelled caller leaves the batch
        # to unpin (and free retired slots) on its own.
        return await self._detached.run(self._get_batch(list(keys)))

    async def _get_batch(self, keys: list[str]) -> list[Buffer | None]:
        entries: list[_Entry | None] = []
        jobs: list[asyncio.Future[Buffer | None]] = []
        geo = self._geo
        try:
            for k in keys:
                e = self._index.get(k)
                entries.append(e)
                if e is None:
                    continue
                self._tick += 1
                e.tick = self._tick
                cls = self._classes[e.cls]
                cls.lru.move_to_end(k)
                if cls.policy is not None:
                    cls.policy.touch(k)
                e.pins += 1
                self._extents[e.extent].busy += 1
                off = geo.data_offset(e.extent, e.slot, self._sizes[e.cls])
                jobs.append(self._submit(self._executor, partial(self._read_value, e, off)))
            results = list(await asyncio.gather(*jobs, return_exceptions=True))
        finally:
            for e in entries:
                if e is not None:
                    e.pins -= 1
                    self._extents[e.extent].busy -= 1
        out: list[Buffer | None] = []
        failure: BaseException | None = None
        it = iter(results)
        corrupt: list[_Entry] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            res = next(it)
            if isinstance(res, BaseException):
                failure = failure or res
                out.append(None)
            elif res is None:
                self.stats["corrupt"] += 1
                log.warning("nvme+slab: %s: object %r failed its checksum: dropped", self.path, e.key)
                if not e.dead and self._index.get(e.key) is e:
                    corrupt.append(e)
                out.append(None)
            else:
                out.append(res)
            if e.dead:
                self._release_dead(e)
        self._retire_now(corrupt)
        if failure is not None:
            if isinstance(failure, OSError):
                raise AdapterUnavailable(f"nvme+slab: read failed on {self.path!r}: {failure}") from failure
            raise failure
        return out

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Write each value into a new slot, then commit all their records (one metadata job per batch)."""
        self._check_open()
        check_lengths(keys, values)
        check_keys(keys)
        if not keys:
            return []
        # Reserved slots are written by threads that cannot be stopped: a cancelled caller leaves the batch to
        # commit what was written (or release the slots) on its own, tracked until it ends.
        return await self._detached.run(self._put_batch(list(keys), list(values)))

    async def _put_batch(self, keys: list[str], values: list[Buffer]) -> list[bool]:
        reserved: list[_Reserved | None] = []
        jobs: list[asyncio.Future[int]] = []
        views: list[tuple[memoryview, int]] = []
        for k, v in zip(keys, values, strict=True):
            view = as_readable_bytes(v)
            n = len(view)
            if n > self.max_object:
                self.stats["rejected_too_big"] += 1
                log.debug("nvme+slab: %r: %d bytes exceed max_object=%d: not stored", k, n, self.max_object)
                reserved.append(None)
                continue
            skew = _address(view) % self.align if self.align and n >= _ZERO_COPY_MIN else 0
            ci = class_index(self._sizes, align_up(skew + n, self.align or 1))
            r = self._reserve(ci) if ci < len(self._sizes) else None
            if r is None:
                self.stats["rejected_full"] += 1
                reserved.append(None)
                continue
            reserved.append(r)
            views.append((view, skew))
            jobs.append(self._submit(self._executor, partial(self._write_value, r, view, skew)))
        hashes = list(await asyncio.gather(*jobs, return_exceptions=True))
        out: list[bool] = []
        writes: list[tuple[int, bytes]] = []
        retired: list[_Entry] = []
        committed: list[_Reserved] = []
        failure: BaseException | None = None
        it = iter(zip(hashes, views, strict=True))
        geo = self._geo
        for k, r in zip(keys, reserved, strict=True):
            if r is None:
                out.append(False)
                continue
            h, (view, skew) = next(it)
            if isinstance(h, BaseException):
                self._unreserve(r, ok=False)
                if not isinstance(h, OSError):
                    failure = failure or h
                else:
                    log.warning("nvme+slab: write failed on %s: %s", self.path, h)
                out.append(False)
                continue
            entry = _Entry(k, r.extent, r.slot, r.cls, len(view), h, skew, self._seq)
            self._seq += 1
            ext = self._extents[r.extent]
            rec = Record(k, ext.gen, entry.seq, entry.length, h, r.extent, r.slot, self._sizes[r.cls], skew)
            writes.append((geo.record_offset(r.extent, r.slot), pack_record(self._format_id, rec)))
            old = self._index.get(k)
            if old is not None:
                retired.append(old)
                self._retire(old, writes)
            self._commit_entry(entry)
            committed.append(r)
            out.append(True)
        for r in committed:
            self._unreserve(r, ok=True)
        if writes:
            fut = self._meta_submit(writes, sync_before=self.fsync)
            for old in retired:
                old.tomb = fut
                self._release_dead(old)
            try:
                await asyncio.wrap_future(fut)
            except OSError as exc:
                raise AdapterUnavailable(f"nvme+slab: commit failed on {self.path!r}: {exc}") from exc
        if failure is not None:
            raise failure
        return out

    async def batched_delete(self, keys: Sequence[str]) -> list[bool]:
        """Tombstone each key's record; True where an object was removed."""
        self._check_open()
        check_keys(keys)
        out: list[bool] = []
        victims: list[_Entry] = []
        for k in keys:
            e = self._index.get(k)
            fresh = e is not None and all(v is not e for v in victims)  # a key named twice: removed once
            out.append(fresh)
            if fresh and e is not None:
                victims.append(e)
        fut = self._retire_now(victims)
        if fut is not None:
            try:
                await asyncio.wrap_future(fut)
            except OSError as exc:
                raise AdapterUnavailable(f"nvme+slab: delete failed on {self.path!r}: {exc}") from exc
        self._listeners.notify("deleted", [v.key for v in victims])
        return out

    async def iter_keys(self, prefix: str) -> AsyncIterator[list[str]]:
        """The keys of the index (the slab's one owner holds them all) starting with ``prefix``, one batch."""
        self._check_open()
        yield [k for k in self._index if k.startswith(prefix)]

    def add_listener(self, fn: TierListener) -> Callable[[], None]:
        """Call ``fn(kind, keys)`` on every eviction for room and every deletion from now on (see
        :data:`~tiercache.adapters._listeners.TierListener`); returns a function that removes it."""
        return self._listeners.add_listener(fn)

    async def aclose(self) -> None:
        """Wait for in-flight I/O, sync, unlock, close; idempotent. Later calls raise AdapterUnavailable."""
        if self._closed:
            return
        self._closed = True
        await self._detached.wait(self.close_timeout_s)

        def finish() -> None:
            self._executor.shutdown(wait=True)
            self._io.shutdown(wait=True)
            self._meta.shutdown(wait=True)
            with contextlib.suppress(OSError):
                os.fdatasync(self._mfd)
            for fd in (self._fd, self._mfd):
                if fd >= 0:
                    os.close(fd)
            self._fd = self._mfd = -1

        await asyncio.get_running_loop().run_in_executor(None, finish)
