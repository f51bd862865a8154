"""``file:///abs/dir``: objects as files in a sharded directory tree, written by temp file + rename.

Layout: ``<root>/<h0h1>/<key>`` where ``h`` is the hex xxh64 digest of the key: ``shard_depth`` levels of
two hex characters, one by default, whose 256 directories ``open`` makes, so a put into a new store never
makes a directory (deeper layouts make the rest of a path when missing). A store written with the former
default of two levels (``<root>/<h0h1>/<h2h3>/<key>``) is recognised at open and kept at two levels when
``shard_depth`` is not given (``_scan``). A put writes ``.<key>.<owner>.<random>.tmp`` in the
object's directory (optionally fsyncs it), then ``os.replace``s it over the object: a reader sees the old
object, the new one or nothing, never a part. The owner (host, pid and process start time,
``tiercache.adapters._tempfiles``) lets a sweep remove only the temp files of writers that are gone (a
crash), never those of live writers of any process; files of other hosts or without an owner are removed
once ``stale_temp_s`` (default 3600) old. The sweep runs at open and every ``temp_sweep_s`` (default 300;
0: only at open); ``stats`` counts the temp files it saw and removed.

Blocking file I/O runs on a dedicated ``ThreadPoolExecutor`` (``threads`` workers, which also bounds the
parallelism of a batch). Measured on the project machine for 1-32 MiB objects, a dedicated executor was at
least as fast as ``asyncio.to_thread`` (which shares the loop's default pool) and faster than ``aiofiles``
(one executor hop per open/write/close instead of one per object). Reads stat the open file and copy it once
(``os.read`` into new bytes; objects of 8 MiB and more in parallel ranges into one bytearray).

Cached reads skip the thread hop: where the kernel offers ``RWF_NOWAIT``, a get first tries ``preadv2`` with
it on the loop thread, which copies data that is wholly in the page cache and answers ``EAGAIN`` instead of
waiting for the disk; only misses of the cache go to the pool. The inline path is bounded (objects up to
``_INLINE_MAX_BYTES``, at most ``_INLINE_BATCH_BYTES`` per batch) so a batch never holds the loop for long.

Small puts skip the thread hop too: a value of at most ``inline_put_bytes`` (default 4 MiB) is written on
the loop thread when ``fsync`` is off, the directory is on a local filesystem, the page cache is far from
the kernel's writer throttling and the last inline writes were fast (``tiercache.adapters._inline_writes``:
a slow one sends puts back to the pool for a back-off period), at most ``_INLINE_BATCH_BYTES`` per batch.
A hop to an idle thread costs as much as copying 1 MiB into the page cache on the project VM; the file is
the same temp file + rename either way. An inline put writes into a spare: an empty temp file made ahead on
the pool (``tiercache.adapters._spare_files``), so the create, whose cost varies most, is off the loop too.

Capacity is tracked per adapter: ``open`` scans the tree (key -> size, oldest mtime first) and puts evict the
least recently used objects (a get refreshes recency in memory; after a restart recency is the write time),
or with ``eviction=s3fifo`` the objects S3-FIFO picks (scan-resistant: see ``tiercache.eviction``).
Several processes may share a directory (objects are visible to all of them); each then enforces the capacity
only over the objects it knows.

Tenants: where a tier has per-tenant quotas, the store tags each object it puts with its tenant id, an
extended attribute of its file (``user.tiercache.tenant``; the object's bytes and name are unchanged), and at
open the quotas count what each tenant holds from ``tenant_usage``. A filesystem without user extended
attributes keeps no tags: its objects count as the default tenant after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, TypeVar

import xxhash

from tiercache.adapters._base import (
    Adapter,
    Buffer,
    Capabilities,
    check_key,
    check_keys,
    check_lengths,
    is_key,
)
from tiercache.adapters._detached import DetachedWork
from tiercache.adapters._inline_writes import (
    LOCAL_FILESYSTEMS,
    InlineWritePolicy,
    filesystem_type,
    voluntary_switches,
)
from tiercache.adapters._listeners import TierListener, TierListeners
from tiercache.adapters._local_url import local_url
from tiercache.adapters._spare_files import SpareFiles
from tiercache.adapters._tempfiles import TempFileState, is_temp_name, temp_name, temp_state
from tiercache.adapters.options import MAX_SIZE, Range, Size, check_options, parse_options
from tiercache.buffers import as_readable_bytes
from tiercache.errors import AdapterUnavailable, ConfigError
from tiercache.eviction import S3FIFOPolicy

if TYPE_CHECKING:
    from typing import Self

__all__ = ["PosixAdapter", "PosixOptions"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_DEFAULT_THREADS = min(32, 4 * (os.cpu_count() or 1))
_SPLIT_BYTES = 4 << 20  # smallest range a large read is split into
_READ_PARTS = 4  # most ranges one read is split into
_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)  # Linux >= 4.14: read only what the page cache holds
_INLINE_MAX_BYTES = 8 << 20  # larger cached objects still go to the pool (parallel ranges)
_INLINE_BATCH_BYTES = 16 << 20  # at most this much copied (read or written) on the loop thread per batch
_INLINE_PUT_BYTES = 4 << 20  # default of ``inline_put_bytes``
_FIRST_LEVEL = [f"{i:02x}" for i in range(256)]  # the shard directories made at open
_DEFAULT_DEPTH = 1  # shard levels of a new store when ``shard_depth`` is not given
_LEGACY_DEPTH = 2  # the former default: a store with second-level directories keeps it


def _shard_dirs(key: str, depth: int) -> list[str]:
    digest = xxhash.xxh64_hexdigest(key.encode())
    return [digest[2 * i : 2 * i + 2] for i in range(depth)]


def _pread_into(fd: int, view: memoryview, offset: int) -> bool:
    """Fill ``view`` from ``fd`` at ``offset``; False if the file ends first."""
    done, size = 0, len(view)
    while done < size:
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            return False
        done += n
    return True


def _read_cached(path: str, budget: int) -> tuple[bool, Buffer | None]:
    """``(True, bytes or None if absent)`` when the file is at most ``budget`` bytes and wholly in the page
    cache (never waits for the disk), else ``(False, None)``: read it on the pool. Needs ``RWF_NOWAIT``."""
    import numpy as np

    assert _NOWAIT is not None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return True, None
    try:
        size = os.fstat(fd).st_size
        if size > budget:
            return False, None
        if size == 0:
            return True, b""
        view = np.empty(size, dtype=np.uint8).data  # no zero-fill: preadv overwrites it all or we give up
        try:
            got = os.preadv(fd, [view], 0, _NOWAIT)
        except BlockingIOError:
            return False, None
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystem without RWF_NOWAIT support
                return False, None
            raise
        return (True, view) if got == size else (False, None)
    finally:
        os.close(fd)


def _read_file(path: str, helpers: ThreadPoolExecutor | None = None, parts: int = 1) -> Buffer | None:
    """The whole file (one copy), or None if it does not exist now.

    The file is read with ``preadv`` into an uninitialised numpy buffer (no zero-fill; on the pool this
    measured about 1.5x faster than ``os.read`` into new bytes). Files of two ``_SPLIT_BYTES`` and more are
    read in up to ``parts`` page-aligned ranges at once, the first here and the others on ``helpers``, all
    through the one open descriptor, so every range comes from the same object; a range no helper has
    started is read here.
    """
    import numpy as np

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        size = os.fstat(fd).st_size
        n = min(parts, size // _SPLIT_BYTES) if helpers is not None else 1
        if size == 0:
            return b""
        view = np.empty(size, dtype=np.uint8).data
        if n <= 1:
            return view if _pread_into(fd, view, 0) else None
        step = ((size + n - 1) // n + 4095) & ~4095  # page-aligned ranges
        ranges = [(a, min(a + step, size)) for a in range(0, size, step)]
        assert helpers is not None
        futures = [helpers.submit(_pread_into, fd, view[a:b], a) for a, b in ranges[1:]]
        try:
            ok = _pread_into(fd, view[ranges[0][0] : ranges[0][1]], 0)
            for future, (a, b) in zip(futures, ranges[1:], strict=True):
                if future.cancel():
                    ok = _pread_into(fd, view[a:b], a) and ok
        finally:
            wait(futures)
        ok = all(f.result() for f in futures if not f.cancelled()) and ok
        return view if ok else None  # short: cannot happen for objects written by rename
    finally:
        os.close(fd)


def _write_file(
    directory: str,
    path: str,
    key: str,
    value: Buffer,
    fsync: bool,
    victims: Sequence[str],
    spare: tuple[int, str] | None = None,
) -> bool:
    """Unlink ``victims``, then write ``value`` to a temp file and rename it to ``path``; False on OSError.
    The temp file is created in ``directory``, or is ``spare`` (an empty one already open for writing,
    ``tiercache.adapters._spare_files``), which this call then owns."""
    for victim in victims:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(victim)
    fd, tmp = spare if spare is not None else (-1, f"{directory}{os.sep}{temp_name(key)}")
    try:
        if spare is None:
            fd = _create(directory, tmp)
        try:
            view = as_readable_bytes(value)
            done, size = 0, len(view)
            while done < size:
                done += os.write(fd, view[done:])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(tmp, path)
        except FileNotFoundError:
            if spare is None:
                raise
            os.makedirs(directory, exist_ok=True)  # the object's directory went (the spare lives elsewhere)
            os.replace(tmp, path)
        if fsync:
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False


def _create(directory: str, tmp: str) -> int:
    """Create the temp file ``tmp`` in ``directory`` (made when missing) and open it for writing."""
    try:
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:  # a new shard directory: its parent is made at open (one mkdir here)
        try:
            os.mkdir(directory)
        except FileNotFoundError:  # shard_depth > 2, or the tree was removed under us
            os.makedirs(directory, exist_ok=True)
        except FileExistsError:  # made by a concurrent put
            pass
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)


def _file_size(path: str) -> int | None:
    """Bytes of the file at ``path``, or None if there is none."""
    try:
        return os.stat(path).st_size
    except (FileNotFoundError, NotADirectoryError):
        return None


TENANT_XATTR = "user.tiercache.tenant"
"""The extended attribute holding an object's tenant id."""


def _set_tenant(path: str, tenant: str) -> bool:
    try:
        os.setxattr(path, TENANT_XATTR, tenant.encode())
    except OSError:
        return False
    return True


def _get_tenant(path: str) -> str:
    try:
        return os.getxattr(path, TENANT_XATTR).decode("ascii")
    except (OSError, UnicodeDecodeError):
        return ""


class _Ended(Enum):
    """What is left to do when a put of a key ends (``PosixAdapter._end_put``)."""

    DONE = "done"
    REMOVE = "remove"
    RECOUNT = "recount"


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


@dataclass(frozen=True, slots=True)
class PosixOptions:
    """Options of ``file:///abs/dir`` URLs (query string or keywords); each parsed from its type."""

    capacity: Annotated[Size, Range(0, MAX_SIZE)] | None = None
    """Bytes of values kept (eviction beyond; None: unbounded)."""
    eviction: Literal["lru", "s3fifo"] = "lru"
    """Which objects go when ``capacity`` is reached: least recently used, or S3-FIFO's choice."""
    fsync: bool = False
    """fsync each value (and its directory) as it is written."""
    shard_depth: Annotated[int, Range(0, 8)] | None = None
    """Levels of two-hex-character subdirectories (0 to 8); None: the store's own (2 for a tree written
    with the former default, which has second-level directories), else 1."""
    threads: Annotated[int, Range(1, 1024)] = _DEFAULT_THREADS
    """File I/O threads (1 to 1024)."""
    temp_sweep_s: Annotated[float, Range(0, 86400)] = 300.0
    """Seconds between sweeps of dead writers' temp files (0: only at open; at most a day)."""
    stale_temp_s: Annotated[float, Range(0, 365 * 86400)] = 3600.0
    """Age in seconds after which a temp file of another host or without an owner is removed (at most a
    year)."""
    inline_put_bytes: Annotated[Size, Range(0, 1 << 30)] = _INLINE_PUT_BYTES
    """Values up to this size (at most 1 GiB) are written on the event loop thread while the disk keeps up
    (0: never; never with ``fsync`` or on a network filesystem)."""


class PosixAdapter(Adapter):
    """Objects as files under a local or network-mounted directory; persistent and shareable."""

    scheme: ClassVar[str] = "file"
    capabilities: ClassVar[Capabilities] = Capabilities(
        delete=True, persistent=True, shared=True, list_keys=True
    )
    close_timeout_s: ClassVar[float] = 60.0
    """How long ``aclose`` waits for puts still writing (their caller may have been cancelled)."""

    def __init__(self, root: str, options: PosixOptions | None = None) -> None:
        """Use the existing directory ``root``; call ``open`` (or ``_load``) to scan it before use."""
        o = options or PosixOptions()
        check_options(o, "file")
        capacity, shard_depth, threads = o.capacity, o.shard_depth, o.threads
        temp_sweep_s, stale_temp_s, fsync = o.temp_sweep_s, o.stale_temp_s, o.fsync
        self.inline_put_bytes = 0 if fsync else o.inline_put_bytes
        if not os.path.isabs(root):
            raise ConfigError(f"file: root must be an absolute path, got {root!r}")
        self.temp_sweep_s = temp_sweep_s
        self.stale_temp_s = stale_temp_s
        self.stats: dict[str, int] = {
            "temp_files": 0,
            "temp_bytes": 0,
            "temp_files_removed": 0,
            "inline_puts": 0,
            "inline_slow_writes": 0,
        }
        """``temp_files``/``temp_bytes``: writers' temp files seen by the last sweep (live writers, or not
        yet known dead; an open adapter's spares among them); ``temp_files_removed``: dead writers' temp
        files removed so far; ``inline_puts``: values written on the loop thread; ``inline_slow_writes``:
        those that were slow (each sent puts back to the pool for a while)."""
        self.inline = InlineWritePolicy(0, local=False)
        """Whether a put may be written on the loop thread; ``_load`` arms it (local filesystems only)."""
        self._sweeper: asyncio.Task[None] | None = None
        self.root = os.path.normpath(root)
        self._first_level = [os.path.join(self.root, name) for name in _FIRST_LEVEL]
        self.capacity = capacity
        self.fsync = fsync
        self.shard_depth = _DEFAULT_DEPTH if shard_depth is None else shard_depth
        """Shard levels of the layout; when not given, ``_load`` sets it from the tree it finds."""
        self._depth_known = shard_depth is not None
        """Whether ``shard_depth`` is settled (given, or found by the scan at open)."""
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tiercache-posix")
        # Helpers only read ranges (never wait on anything), so a read waiting on them cannot deadlock.
        self._helpers = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tiercache-posix-read")
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> size, least recently used first
        self._policy = S3FIFOPolicy(capacity) if o.eviction == "s3fifo" and capacity else None
        """With ``eviction=s3fifo``: the order victims come in (``_index`` keeps the sizes)."""
        self._used = 0
        self._writing: dict[str, int] = {}  # key -> puts in flight (never evicted meanwhile)
        self._raced: set[str] = set()  # keys with overlapping puts in flight (``_begin_put``)
        self._detached = DetachedWork(f"file {self.root}")  # puts whose caller was cancelled
        self._spares: SpareFiles | None = None  # temp files made ahead for inline puts (``_load``)
        self._listeners = TierListeners()
        self._closed = False

    @classmethod
    async def open(cls, url: str, **options: object) -> Self:
        """Open ``file:///abs/dir`` (created if missing); options: ``PosixOptions``."""
        root, query = local_url(url, ("file", "posix"), "file")
        opts = parse_options(PosixOptions, "file", query, options)
        self = cls(root, opts)
        try:
            await self._load()
        except BaseException:
            self._executor.shutdown(wait=False)
            self._helpers.shutdown(wait=False)
            raise
        if self.temp_sweep_s > 0:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_periodically())
        return self

    async def _load(self) -> None:
        """Create the root if needed, remove leftover temp files and rebuild the size/recency index."""
        try:
            entries = await self._run(self._scan)
            await self._run(self._make_first_level)
        except OSError as exc:
            raise AdapterUnavailable(f"file: cannot use root directory {self.root!r}: {exc}") from exc
        if self.inline_put_bytes > 0:
            fstype = await self._run(partial(filesystem_type, self.root))
            self.inline = InlineWritePolicy(self.inline_put_bytes, local=fstype in LOCAL_FILESYSTEMS)
            if self.inline.max_bytes > 0:  # in directories at the layout's depth, where sweeps look
                spare_dirs = [os.path.join(self.root, *[name] * self.shard_depth) for name in _FIRST_LEVEL]
                self._spares = SpareFiles(spare_dirs if self.shard_depth else [self.root], self._submit)
        entries.sort(key=lambda e: e[2])
        self._index = OrderedDict((key, size) for key, size, _ in entries)
        self._used = sum(self._index.values())
        if self._policy is not None:
            self._policy = S3FIFOPolicy(self._policy.capacity)
            for key, size, _ in entries:
                self._policy.insert(key, size)
        evict = self._reserve_victims(0) or []
        if evict:
            await self._run(lambda: [_unlink(p) for p in evict])

    def _scan(self, objects: bool = True) -> list[tuple[str, int, float]]:
        """Walk the tree: (key, size, mtime) of each object (unless ``objects`` is False) and, on the way,
        remove dead writers' temp files and count the others (``stats``).

        When ``shard_depth`` was not given, the first walk (at open) also settles it: files are looked for
        one and two levels down, and the store is taken as two levels deep (the former default) if any
        first-level directory holds a second-level one, else as one; objects of the other depth are not
        ours (as objects written with another ``shard_depth`` never were)."""
        os.makedirs(self.root, exist_ok=True)
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable", self.root)
        found: list[tuple[str, int, float, str]] = []
        temp_files = temp_bytes = removed = 0
        detect = not self._depth_known
        lowest, deepest = (_DEFAULT_DEPTH, _LEGACY_DEPTH) if detect else (self.shard_depth,) * 2
        second_level = False

        def walk(directory: str, depth: int) -> None:
            nonlocal temp_files, temp_bytes, removed, second_level
            with os.scandir(directory) as it:
                for entry in it:
                    name = entry.name
                    if depth < deepest and entry.is_dir(follow_symlinks=False):
                        if len(name) == 2:
                            second_level = second_level or depth == 1
                            walk(entry.path, depth + 1)
                        continue
                    if depth < lowest or not entry.is_file(follow_symlinks=False):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if is_temp_name(name):
                        if temp_state(name, st.st_mtime, self.stale_temp_s) == TempFileState.DEAD:
                            if _unlink(entry.path):
                                removed += 1
                        else:
                            temp_files += 1
                            temp_bytes += st.st_size
                        continue
                    if not objects:
                        continue
                    try:
                        check_key(name)
                    except ValueError:
                        continue
                    found.append((name, st.st_size, st.st_mtime, directory))

        walk(self.root, 0)
        if detect:
            self.shard_depth = _LEGACY_DEPTH if second_level else _DEFAULT_DEPTH
            self._depth_known = True  # settled: later sweeps walk this depth only
        self.stats["temp_files"], self.stats["temp_bytes"] = temp_files, temp_bytes
        self.stats["temp_files_removed"] += removed
        # An object in another directory than its key's is not ours (e.g. written with another shard_depth).
        return [(k, size, mtime) for k, size, mtime, d in found if self._directory(k) == d]

    def _make_first_level(self) -> None:
        """Create the 256 first-level shard directories that are missing (once per store: a put into a new
        one-level tree then makes no directory; a deeper tree's put makes its missing leaf)."""
        if self.shard_depth == 0:
            return
        present = set(os.listdir(self.root))
        for name in _FIRST_LEVEL:
            if name not in present:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(os.path.join(self.root, name))

    async def sweep_temp_files(self) -> int:
        """Remove the temp files of writers that are gone (never those of live ones); how many were removed.
        Runs at open and every ``temp_sweep_s`` seconds."""
        self._check_open()
        before = self.stats["temp_files_removed"]
        await self._run(partial(self._scan, False))
        return self.stats["temp_files_removed"] - before

    async def _sweep_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.temp_sweep_s)
            try:
                await self.sweep_temp_files()
            except (OSError, AdapterUnavailable) as exc:
                log.warning("file: temp file sweep under %s failed: %s", self.root, exc)

    # -- helpers ---------------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes of the objects this adapter knows about."""
        return self._used

    def _directory(self, key: str) -> str:
        """The directory that holds ``key``'s file."""
        if self.shard_depth == 1:  # the default: one of the directories made at open, no hex formatting
            return self._first_level[xxhash.xxh64_intdigest(key.encode()) >> 56]
        return os.path.join(self.root, *_shard_dirs(key, self.shard_depth))

    def _path(self, key: str) -> str:
        return os.path.join(self._directory(key), key)

    def _check_open(self) -> None:
        if self._closed:
            raise AdapterUnavailable(f"file adapter on {self.root!r} is closed")

    def _submit(self, fn: Callable[[], _T]) -> asyncio.Future[_T]:
        """Run ``fn`` on the pool; a bare future (no Task), so a batch costs no extra loop iterations."""
        try:
            return asyncio.get_running_loop().run_in_executor(self._executor, fn)
        except RuntimeError as exc:  # executor shut down by a concurrent aclose
            raise AdapterUnavailable(f"file adapter on {self.root!r} is closed") from exc

    async def _run(self, fn: Callable[[], _T]) -> _T:
        return await self._submit(fn)

    def _touch(self, key: str, size: int) -> None:
        """Record ``key`` as most recently used with ``size`` bytes."""
        old = self._index.pop(key, None)
        if old is not None:
            self._used -= old
        self._index[key] = size
        self._used += size
        if self._policy is not None:
            self._policy.remove(key)
            self._policy.insert(key, size)

    def _forget(self, key: str) -> None:
        old = self._index.pop(key, None)
        if old is not None:
            self._used -= old
        if self._policy is not None:
            self._policy.remove(key)

    def _reserve_victims(self, extra: int) -> list[str] | None:
        """Drop LRU entries until ``extra`` more bytes fit; their paths, or None if they cannot fit (then
        nothing is dropped: the bytes held by writes in flight cannot be freed)."""
        if self.capacity is None or self._used + extra <= self.capacity:
            return []
        dropped: list[tuple[str, int]] = []
        policy = self._policy
        writing = self._writing
        lru = iter(list(self._index))
        while self._used + extra > self.capacity:
            key = policy.victim(lambda k: k not in writing) if policy else next(lru, None)
            if key is None:
                break
            if key in writing:
                continue
            size = self._index[key]
            self._forget(key)
            dropped.append((key, size))
        if self._used + extra > self.capacity:
            for key, size in reversed(dropped):  # back where they were, least recently used first
                self._index[key] = size
                self._index.move_to_end(key, last=False)
                self._used += size
                if policy is not None:
                    policy.insert(key, size)
            return None
        self._listeners.notify("evicted", [key for key, _ in dropped])
        return [self._path(key) for key, _ in dropped]

    async def batched_tag_tenants(self, keys: Sequence[str], tenants: Sequence[str]) -> list[bool]:
        """Record each object's tenant id with it (an extended attribute of its file); per key whether it
        was recorded (False: the object is gone or the filesystem keeps no user attributes)."""
        check_lengths(keys, tenants)
        self._check_open()
        paths = [self._path(check_key(k)) for k in keys]
        return await self._run(lambda: [_set_tenant(p, t) for p, t in zip(paths, tenants, strict=True)])

    async def tenant_usage(self) -> list[tuple[str, str, int]]:
        """``(key, tenant id, bytes)`` of every object this adapter knows, least recently used first (tenant
        "" where the object carries no tag)."""
        self._check_open()
        items = list(self._index.items())
        paths = [self._path(k) for k, _ in items]
        tenants = await self._run(lambda: [_get_tenant(p) for p in paths])
        return [(k, t, size) for (k, size), t in zip(items, tenants, strict=True)]

    def add_listener(self, fn: TierListener) -> Callable[[], None]:
        """Call ``fn(kind, keys)`` on every eviction for room and every deletion from now on (see
        :data:`~tiercache.adapters._listeners.TierListener`); returns a function that removes it."""
        return self._listeners.add_listener(fn)

    # -- the adapter API -------------------------------------------------------------------------------

    async def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether its file exists now (one thread hop for the whole batch)."""
        self._check_open()
        paths = [self._path(check_key(k)) for k in keys]
        if not paths:
            return []
        return await self._run(lambda: [os.path.isfile(p) for p in paths])  # isfile never raises

    async def batched_get(self, keys: Sequence[str]) -> list[Buffer | None]:
        """For each key, its bytes (fresh bytes or bytearray) or None; reads run in parallel on the pool."""
        self._check_open()
        paths = [self._path(check_key(k)) for k in keys]
        results: list[Buffer | None] = [None] * len(paths)
        pooled = list(range(len(paths)))
        try:
            if _NOWAIT is not None:
                pooled, budget = [], _INLINE_BATCH_BYTES
                for i, path in enumerate(paths):
                    done, value = (
                        _read_cached(path, min(budget, _INLINE_MAX_BYTES)) if budget > 0 else (False, None)
                    )
                    if not done:
                        pooled.append(i)
                        continue
                    results[i] = value
                    budget -= 0 if value is None else len(value)
            read = partial(_read_file, helpers=self._helpers, parts=_READ_PARTS)
            futures = [self._submit(partial(read, paths[i])) for i in pooled]
            loaded = [await futures[0]] if len(futures) == 1 else await asyncio.gather(*futures)
        except OSError as exc:  # EIO, EACCES...: a transport failure, not a miss
            raise AdapterUnavailable(f"file: read failed under {self.root!r}: {exc}") from exc
        for i, value in zip(pooled, loaded, strict=True):
            results[i] = value
        for key, value in zip(keys, results, strict=True):
            if value is None:
                if key not in self._writing:
                    self._forget(key)
            elif key in self._index:
                self._index.move_to_end(key)
                if self._policy is not None:
                    self._policy.touch(key)
            else:  # written by another process (or before a restart): start accounting for it
                self._touch(key, len(value))
        return list(results)

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Write each value (temp file + rename), evicting LRU objects; False if over capacity or on error.

        Values the inline policy allows are written here, on the loop thread, after the others have been
        handed to the pool (so both proceed at once)."""
        self._check_open()
        check_lengths(keys, values)
        check_keys(keys)
        results = [False] * len(keys)
        pooled: list[tuple[int, str, asyncio.Future[bool]]] = []
        inline: list[tuple[int, str, Buffer, int, list[str]]] = []
        budget = _INLINE_BATCH_BYTES
        for i, (key, value) in enumerate(zip(keys, values, strict=True)):
            size = memoryview(value).nbytes
            victims = self._begin_put(key, size)
            if victims is None:
                continue
            if size <= budget and self.inline.allow(size):
                budget -= size
                inline.append((i, key, value, size, victims))
            else:
                pooled.append((i, key, self._submit_write(key, value, victims)))
        for i, key, value, size, victims in inline:
            results[i] = self._put_inline(key, value, size, victims)
        if not pooled:
            return results
        # A write handed to a thread cannot be stopped: a cancelled caller leaves the batch to finish and
        # account for what lands (capacity follows the medium), tracked until it ends.
        done = await self._detached.run(self._finish_writes(pooled))
        for (i, _, _), ok in zip(pooled, done, strict=True):
            results[i] = ok
        return results

    def _begin_put(self, key: str, size: int) -> list[str] | None:
        """Account for ``size`` bytes under ``key`` (a put in flight); the paths to evict first, or None if
        the value does not fit (nothing changed). A put that starts while another of the key runs makes
        the key raced: the renames may land in any order, so the size that counts is read back once the
        last has ended (``_end_put``)."""
        if self.capacity is None:  # unbounded: nothing to evict (the path of every put, kept short)
            victims: list[str] | None = []
            index = self._index
            self._used += size - index.pop(key, 0)
            index[key] = size
        elif size > self.capacity:
            return None
        else:
            old = self._index.get(key)
            self._forget(key)
            victims = self._reserve_victims(size)
            if victims is None:
                if old is not None:  # the old object stays; keep accounting for it
                    self._touch(key, old)
                return None
            self._touch(key, size)
        writers = self._writing.get(key, 0)
        if writers:
            self._raced.add(key)
        self._writing[key] = writers + 1
        return victims

    def _end_put(self, key: str, ok: bool) -> _Ended:
        """A put of ``key`` ended: ``REMOVE`` if it failed and no other put of the key is in flight (its
        file must go: a failed put leaves no object under the key, never a stale one), ``RECOUNT`` if it
        was the last of puts that raced (count the file that landed: ``_recount``), else ``DONE``."""
        others = self._writing.pop(key) - 1
        if others:
            self._writing[key] = others
            return _Ended.DONE
        raced = key in self._raced
        self._raced.discard(key)
        if not ok:
            self._forget(key)
            return _Ended.REMOVE
        return _Ended.RECOUNT if raced else _Ended.DONE

    def _recount(self, key: str, size: int | None) -> list[str]:
        """Raced puts of ``key`` have all ended and its file now holds ``size`` bytes (None: no file):
        count that; the paths of the LRU objects to unlink if it is more than was counted."""
        if key in self._writing:  # a newer put started meanwhile: it counts what it writes
            return []
        if size is None:
            self._forget(key)
            return []
        self._touch(key, size)
        return self._reserve_victims(0) or []

    def _put_inline(self, key: str, value: Buffer, size: int, victims: list[str]) -> bool:
        """Write one value on the loop thread and tell the inline policy how long it took."""
        directory = self._directory(key)
        path = f"{directory}{os.sep}{key}"
        policy = self.inline
        ok = False
        spares = self._spares
        spare = spares.take() if spares is not None else None
        switches = voluntary_switches()
        start = policy.clock()
        try:
            ok = _write_file(directory, path, key, value, False, victims, spare)
            if not ok and spare is not None:  # e.g. the spares' directory was removed: create as before
                ok = _write_file(directory, path, key, value, False, ())
        finally:
            if policy.record_write(size, policy.clock() - start, switches):
                self.stats["inline_slow_writes"] = policy.slow_writes
            self.stats["inline_puts"] += 1
            ended = self._end_put(key, ok)
            if ended is _Ended.REMOVE:
                _unlink(path)
            elif ended is _Ended.RECOUNT:  # rare; a local filesystem (inline): a stat is microseconds
                for victim in self._recount(key, _file_size(path)):
                    _unlink(victim)
        return ok

    def _submit_write(self, key: str, value: Buffer, victims: list[str]) -> asyncio.Future[bool]:
        """Hand one write to the pool now (a failed future if the adapter is closing)."""
        directory = self._directory(key)
        path = os.path.join(directory, key)
        write = partial(_write_file, directory, path, key, value, self.fsync, victims)
        try:
            return self._submit(write)
        except AdapterUnavailable as exc:
            failed: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            return failed

    async def _finish_writes(self, pooled: list[tuple[int, str, asyncio.Future[bool]]]) -> list[bool]:
        if len(pooled) == 1:
            _, key, write = pooled[0]
            return [await self._finish_write(key, write)]
        return list(await asyncio.gather(*(self._finish_write(key, write) for _, key, write in pooled)))

    async def _finish_write(self, key: str, write: asyncio.Future[bool]) -> bool:
        ok = False
        try:
            ok = await write
        finally:
            ended = self._end_put(key, ok)
        path = self._path(key)
        with contextlib.suppress(AdapterUnavailable):
            if ended is _Ended.REMOVE:
                await self._run(partial(_unlink, path))
            elif ended is _Ended.RECOUNT:
                victims = self._recount(key, await self._run(partial(_file_size, path)))
                if victims:
                    await self._run(lambda: [_unlink(p) for p in victims])
        return ok

    async def batched_delete(self, keys: Sequence[str]) -> list[bool]:
        """Unlink each key's file; True where one was removed."""
        self._check_open()
        paths = [self._path(check_key(k)) for k in keys]
        for k in keys:
            self._forget(k)
        if not paths:
            return []
        try:
            removed = await self._run(lambda: [_unlink(p) for p in paths])
        except OSError as exc:
            raise AdapterUnavailable(f"file: delete failed under {self.root!r}: {exc}") from exc
        self._listeners.notify("deleted", [k for k, gone in zip(keys, removed, strict=True) if gone])
        return removed

    async def iter_keys(self, prefix: str) -> AsyncIterator[list[str]]:
        """The keys of the object files under the root starting with ``prefix``: one batch per first-level
        directory (temp and spare files, and files in another directory than their key's, are not objects)."""
        self._check_open()
        tops = self._first_level if self.shard_depth else [self.root]
        for top in tops:
            try:
                batch = await self._run(
                    partial(self._list_objects, top, max(self.shard_depth - 1, 0), prefix)
                )
            except OSError as exc:
                raise AdapterUnavailable(f"file: cannot list {top!r}: {exc}") from exc
            if batch:
                yield batch

    def _list_objects(self, directory: str, depth: int, prefix: str) -> list[str]:
        """Object keys starting with ``prefix`` in ``directory``, ``depth`` shard levels above its objects."""
        out: list[str] = []
        try:
            with os.scandir(directory) as it:
                for entry in it:
                    name = entry.name
                    if depth > 0:
                        if len(name) == 2 and entry.is_dir(follow_symlinks=False):
                            out += self._list_objects(entry.path, depth - 1, prefix)
                    elif (
                        name.startswith(prefix)
                        and is_key(name)
                        and entry.is_file(follow_symlinks=False)
                        and self._directory(name) == directory
                    ):
                        out.append(name)
        except FileNotFoundError:  # a shard directory removed under us holds nothing
            pass
        return out

    async def aclose(self) -> None:
        """Wait for in-flight I/O and stop the threads; idempotent. Later calls raise AdapterUnavailable."""
        if self._closed:
            return
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(BaseException):
                await self._sweeper
        await self._detached.wait(self.close_timeout_s)
        if self._spares is not None:
            self._spares.close()
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
        self._helpers.shutdown(wait=True)  # idle by now: every read waits for its helpers
