"""PosixAdapter: the conformance kit plus layout, capacity/LRU, restart, temp-file and failure handling."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
import xxhash

from tiercache.adapters import posix
from tiercache.adapters._spare_files import SPARE_KEY
from tiercache.adapters.posix import PosixAdapter
from tiercache.errors import AdapterUnavailable, ConfigError
from tiercache.testing.adapters import AdapterConformance

if TYPE_CHECKING:
    from tiercache.adapters import Adapter
    from tiercache.testing.adapters import AdapterFactory


class PosixKit(AdapterConformance):
    """The kit against temp directories: ``store`` opened with the ``query`` options; the bounded test's
    ``bounded`` directory with a capacity of 2 MiB and ``bounded_options``, its bytes on disk counted."""

    query: ClassVar[str] = ""
    bounded_options: ClassVar[dict[str, str]] = {}

    @pytest.fixture
    def adapter_factory(self, tmp_path: Path) -> AdapterFactory:
        return lambda: PosixAdapter.open(f"file://{tmp_path}/store{self.query}")

    @pytest.fixture
    def bounded_adapter_factory(self, tmp_path: Path) -> AdapterFactory:
        self.root = tmp_path / "bounded"
        return lambda: PosixAdapter.open(f"file://{self.root}", capacity="2MiB", **self.bounded_options)

    async def stored_bytes(self, adapter: Adapter) -> int | None:
        return _bytes_on_disk(self.root)


class TestPosixConformance(PosixKit):
    """The kit against a temp directory (reopened on the same directory for the persistence test)."""


class TestPosixConformanceS3FIFO(PosixKit):
    """The kit with S3-FIFO eviction (query option) under a capacity."""

    query = "?eviction=s3fifo&capacity=64MiB"
    bounded_options: ClassVar[dict[str, str]] = {"eviction": "s3fifo"}


class TestPosixConformanceFsyncFlat(AdapterConformance):
    """The kit with fsync on, no sharding and one I/O thread (smaller objects to stay fast)."""

    max_object_bytes = 4 << 20

    @pytest.fixture
    def adapter_factory(self, tmp_path: Path) -> AdapterFactory:
        return lambda: PosixAdapter.open(f"file://{tmp_path}?fsync=true&shard_depth=0&threads=1")


def _drops_page_cache(directory: Path) -> bool:
    """Whether POSIX_FADV_DONTNEED really evicts file pages here (not on tmpfs, for one)."""
    probe = directory / "fadvise-probe"
    probe.write_bytes(os.urandom(1 << 20))
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            os.preadv(fd, [bytearray(1 << 20)], 0, os.RWF_NOWAIT)
        except BlockingIOError:
            return True
        return False
    finally:
        os.close(fd)
        probe.unlink()


def _files(root: Path) -> list[str]:
    """Files under ``root`` but an open adapter's spare temp files (made ahead for inline puts)."""
    spare = f".{SPARE_KEY}."
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.startswith(spare)
    )


@pytest.mark.asyncio
async def test_sharded_layout(tmp_path: Path) -> None:
    """A new store is one level deep (``<h0h1>/<key>``); ``shard_depth`` 2 and 0 as given."""
    adapter = await PosixAdapter.open(f"file://{tmp_path}/one")
    assert adapter.shard_depth == 1
    assert await adapter.batched_put(["alpha", "beta"], [b"1", b"22"]) == [True, True]
    await adapter.aclose()
    one, two = [], []
    for key in ("alpha", "beta"):
        h = xxhash.xxh64_hexdigest(key.encode())
        one.append(f"{h[0:2]}/{key}")
        two.append(f"{h[0:2]}/{h[2:4]}/{key}")
        assert (tmp_path / "one" / h[0:2] / key).read_bytes() == (b"1" if key == "alpha" else b"22")
    assert _files(tmp_path / "one") == sorted(one)
    reopened = await PosixAdapter.open(f"file://{tmp_path}/one")  # stays one level deep
    assert (reopened.shard_depth, reopened.used_bytes) == (1, 3)
    await reopened.aclose()

    deep = await PosixAdapter.open(f"file://{tmp_path}/two", shard_depth=2)
    assert await deep.batched_put(["alpha", "beta"], [b"1", b"22"]) == [True, True]
    await deep.aclose()
    assert _files(tmp_path / "two") == sorted(two)

    flat = await PosixAdapter.open(f"file://{tmp_path}/flat", shard_depth=0)
    assert await flat.batched_put(["gamma"], [b"3"]) == [True]
    await flat.aclose()
    assert _files(tmp_path / "flat") == ["gamma"]


def _two_level_path(root: Path, key: str) -> Path:
    """Where the former default layout (two levels) kept ``key``."""
    h = xxhash.xxh64_hexdigest(key.encode())
    return root / h[0:2] / h[2:4] / key


@pytest.mark.asyncio
async def test_store_in_the_former_two_level_layout_is_read_counted_evicted_and_written(
    tmp_path: Path,
) -> None:
    """A tree written with the former default (``<h0h1>/<h2h3>/<key>``, built here by hand from that
    layout's description) opened without ``shard_depth``: its objects are found, counted at open, evicted
    oldest first, read, deleted, and new puts go where the same layout puts them."""
    from tiercache.adapters import _tempfiles

    values = {f"old{i}": bytes([i]) * (1000 + i) for i in range(6)}
    for i, (key, value) in enumerate(values.items()):
        path = _two_level_path(tmp_path, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(value)
        os.utime(path, (1_000_000 + i, 1_000_000 + i))  # old0 is the oldest
    dead_temp = (
        _two_level_path(tmp_path, "old0").parent / f".old0.{_tempfiles._host()}_{_exited_pid()}_1.x.tmp"
    )
    dead_temp.write_bytes(b"partial")
    total = sum(map(len, values.values()))

    adapter = await PosixAdapter.open(f"file://{tmp_path}", temp_sweep_s=0)
    try:
        assert adapter.shard_depth == 2
        assert adapter.used_bytes == total
        assert not dead_temp.exists()  # swept at the leaf level
        assert await adapter.batched_contains(list(values)) == [True] * 6
        assert [bytes(v) for v in await adapter.batched_get(list(values)) if v is not None] == list(
            values.values()
        )
        assert await adapter.batched_delete(["old5"]) == [True]
        assert not _two_level_path(tmp_path, "old5").exists()
        assert adapter.used_bytes == total - len(values["old5"])
        assert await adapter.batched_put(["new"], [b"n" * 10]) == [True]
        assert _two_level_path(tmp_path, "new").read_bytes() == b"n" * 10
    finally:
        await adapter.aclose()

    # Reopened with a smaller capacity: still two levels, the oldest objects evicted at open.
    capacity = len(values["old3"]) + len(values["old4"]) + 10
    bounded = await PosixAdapter.open(f"file://{tmp_path}", capacity=capacity, temp_sweep_s=0)
    try:
        assert bounded.shard_depth == 2
        assert bounded.used_bytes == capacity
        assert await bounded.batched_contains([*values, "new"]) == [False] * 3 + [True, True, False, True]
        assert _files(tmp_path) == sorted(
            str(_two_level_path(tmp_path, k).relative_to(tmp_path)) for k in ("new", "old3", "old4")
        )
    finally:
        await bounded.aclose()


@pytest.mark.asyncio
async def test_lru_eviction_by_capacity(tmp_path: Path) -> None:
    adapter = await PosixAdapter.open(f"file://{tmp_path}", capacity="3KB")
    for k in ("a", "b", "c"):
        assert await adapter.batched_put([k], [k.encode() * 1000]) == [True]
    assert await adapter.batched_get(["a"]) == [b"a" * 1000]  # a is now more recent than b
    assert await adapter.batched_put(["d"], [b"d" * 1000]) == [True]
    assert await adapter.batched_contains(["a", "b", "c", "d"]) == [True, False, True, True]
    assert adapter.used_bytes == 3000
    assert await adapter.batched_put(["c"], [b"C" * 2000]) == [True]  # overwrite grows: evicts a (LRU)
    assert await adapter.batched_contains(["a", "b", "c", "d"]) == [False, False, True, True]
    assert adapter.used_bytes == 3000
    assert len(_files(tmp_path)) == 2
    await adapter.aclose()


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
@pytest.mark.asyncio
async def test_s3fifo_keeps_reread_objects_through_a_scan(tmp_path: Path, eviction: str) -> None:
    """20 objects fit. 5 objects are read once after their put, then again after every 20 one-off puts (a
    scan). S3-FIFO keeps the 5 (read while on probation: promoted to its main queue, which the scan never
    enters); LRU loses them to the scan between two reads."""
    adapter = await PosixAdapter.open(f"file://{tmp_path}", capacity=20 * 100, eviction=eviction)
    hot = [f"hot{i}" for i in range(5)]
    values = [k.encode().ljust(100, b".") for k in hot]
    try:
        assert await adapter.batched_put(hot, values) == [True] * 5
        assert await adapter.batched_get(hot) == values
        kept = 0
        for i in range(60):
            assert await adapter.batched_put([f"scan{i}"], [b"s" * 100]) == [True]
            assert adapter.used_bytes <= 20 * 100
            if i % 20 == 19:
                found = await adapter.batched_get(hot)
                assert all(v is None or v == want for v, want in zip(found, values, strict=True))
                kept += sum(v is not None for v in found)
        assert kept == (15 if eviction == "s3fifo" else 0)
    finally:
        await adapter.aclose()


@pytest.mark.asyncio
async def test_too_big_object_rejected(tmp_path: Path) -> None:
    adapter = await PosixAdapter.open(f"file://{tmp_path}?capacity=1KiB")
    assert await adapter.batched_put(["keep"], [b"k" * 100]) == [True]
    assert await adapter.batched_put(["big", "ok"], [b"x" * 1025, b"y" * 1000]) == [False, True]
    assert await adapter.batched_contains(["big", "ok"]) == [False, True]
    assert await adapter.batched_contains(["keep"]) == [False]  # evicted to make room for "ok"
    await adapter.aclose()
    assert not any("big" in f for f in _files(tmp_path))


@pytest.mark.asyncio
async def test_restart_rebuilds_index_and_respects_capacity(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    first = await PosixAdapter.open(url)
    for i, k in enumerate(("old", "mid", "new")):
        assert await first.batched_put([k], [bytes([i]) * 1000]) == [True]
        path = first._path(k)
        os.utime(path, (1_000_000 + i, 1_000_000 + i))  # distinct mtimes: old < mid < new
    await first.aclose()

    second = await PosixAdapter.open(url, capacity=3000)
    assert second.used_bytes == 3000
    assert await second.batched_get(["new", "mid", "old"]) == [b"\2" * 1000, b"\1" * 1000, b"\0" * 1000]
    await second.aclose()

    # a smaller capacity evicts the oldest (by mtime) at open
    third = await PosixAdapter.open(url, capacity=2000)
    assert third.used_bytes == 2000
    assert await third.batched_contains(["old", "mid", "new"]) == [False, True, True]
    assert await third.batched_put(["newer"], [b"n" * 1000]) == [True]
    assert await third.batched_contains(["old", "mid", "new", "newer"]) == [False, False, True, True]
    await third.aclose()


def _exited_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


@pytest.mark.asyncio
async def test_temp_files_of_dead_writers_removed_live_ones_kept_and_counted(tmp_path: Path) -> None:
    """Cleanup removes only dead writers' temp files (pid + start time), counts the others."""
    from tiercache.adapters import _tempfiles

    adapter = await PosixAdapter.open(f"file://{tmp_path}", temp_sweep_s=0)
    assert await adapter.batched_put(["obj"], [b"data"]) == [True]
    shard = Path(os.path.dirname(adapter._path("obj")))
    await adapter.aclose()
    host = _tempfiles._host()
    exited = _exited_pid()
    live = _sleeper()
    try:
        live_start = _tempfiles._start_ticks(live.pid)
        me = _tempfiles.owner_tag()
        mine_start = int(me.rsplit("_", 1)[1])
        files = {
            "dead_writer": shard / f".obj.{host}_{exited}_1.abc.tmp",
            "recycled_pid": shard / f".obj.{host}_{os.getpid()}_{mine_start + 1}.abc.tmp",
            "legacy_old": shard / ".obj.abc123.tmp",
            "live_writer": shard / f".obj.{host}_{live.pid}_{live_start}.abc.tmp",
            "this_process": shard / f".obj.{me}.abc.tmp",
            "other_host_fresh": shard / ".obj.0badc0de_1_1.abc.tmp",
            "legacy_fresh": shard / ".obj.def456.tmp",
        }
        for path in files.values():
            path.write_bytes(b"partial")
        os.utime(files["legacy_old"], (1, 1))
        reopened = await PosixAdapter.open(f"file://{tmp_path}", temp_sweep_s=0)
        try:
            present = {name: path.exists() for name, path in files.items()}
            assert present == {
                "dead_writer": False,
                "recycled_pid": False,
                "legacy_old": False,
                "live_writer": True,
                "this_process": True,
                "other_host_fresh": True,
                "legacy_fresh": True,
            }
            assert reopened.stats["temp_files"] == 4
            assert reopened.stats["temp_bytes"] == 4 * len(b"partial")
            assert reopened.stats["temp_files_removed"] == 3
            assert await reopened.batched_get(["obj"]) == [b"data"]
            assert reopened.used_bytes == 4
            _stop(live)
            assert await reopened.sweep_temp_files() == 1  # its writer died: now it goes
            assert not files["live_writer"].exists()
            assert reopened.stats["temp_files"] == 3
        finally:
            await reopened.aclose()
    finally:
        _stop(live)


@pytest.mark.asyncio
async def test_temp_files_are_swept_periodically(tmp_path: Path) -> None:
    """An open adapter removes a crashed writer's temp file without being reopened."""
    from tiercache.adapters import _tempfiles

    adapter = await PosixAdapter.open(f"file://{tmp_path}", temp_sweep_s=0.02)
    try:
        assert await adapter.batched_put(["obj"], [b"data"]) == [True]
        exited = _exited_pid()
        leftover = Path(os.path.dirname(adapter._path("obj"))) / f".obj.{_tempfiles._host()}_{exited}_1.x.tmp"
        leftover.write_bytes(b"partial")
        for _ in range(500):  # bounded poll: the sweep runs every 20 ms (counted once its walk has ended)
            if adapter.stats["temp_files_removed"]:
                break
            await asyncio.sleep(0.01)
        assert adapter.stats["temp_files_removed"] == 1
        assert not leftover.exists()
    finally:
        await adapter.aclose()


@pytest.mark.asyncio
async def test_write_failure_leaves_no_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = await PosixAdapter.open(f"file://{tmp_path}", capacity=10_000)
    assert await adapter.batched_put(["prev"], [b"old"]) == [True]

    def enospc(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(posix.os, "replace", enospc)
    assert await adapter.batched_put(["new", "prev"], [b"n" * 100, b"p" * 100]) == [False, False]
    monkeypatch.undo()
    assert await adapter.batched_contains(["new", "prev"]) == [False, False]
    assert _files(tmp_path) == []  # no object, no temp file
    assert adapter.used_bytes == 0
    assert await adapter.batched_put(["new"], [b"n"]) == [True]
    await adapter.aclose()


@pytest.mark.asyncio
async def test_write_error_midway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = await PosixAdapter.open(f"file://{tmp_path}")
    real_write = os.write
    calls = 0

    def flaky_write(fd: int, data: bytes) -> int:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise OSError(13, "Permission denied")
        return real_write(fd, memoryview(data)[:10])  # short write, then failure

    monkeypatch.setattr(posix.os, "write", flaky_write)
    assert await adapter.batched_put(["k"], [b"x" * 100]) == [False]
    monkeypatch.undo()
    assert await adapter.batched_get(["k"]) == [None]
    assert _files(tmp_path) == []
    await adapter.aclose()


@pytest.mark.asyncio
async def test_vanished_file_is_a_miss(tmp_path: Path) -> None:
    adapter = await PosixAdapter.open(f"file://{tmp_path}")
    assert await adapter.batched_put(["gone"], [b"x" * 10]) == [True]
    assert await adapter.batched_contains(["gone"]) == [True]
    os.unlink(adapter._path("gone"))  # e.g. another process evicted it
    assert await adapter.batched_get(["gone"]) == [None]
    assert adapter.used_bytes == 0
    await adapter.aclose()


@pytest.mark.asyncio
async def test_shared_directory_two_adapters(tmp_path: Path) -> None:
    a = await PosixAdapter.open(f"file://{tmp_path}")
    b = await PosixAdapter.open(f"file://{tmp_path}")
    assert await a.batched_put(["x"], [b"from-a"]) == [True]
    assert await b.batched_get(["x"]) == [b"from-a"]
    assert await b.batched_delete(["x"]) == [True]
    assert await a.batched_get(["x"]) == [None]
    await a.aclose()
    await b.aclose()


@pytest.mark.asyncio
async def test_get_returns_fresh_buffers(tmp_path: Path) -> None:
    adapter = await PosixAdapter.open(f"file://{tmp_path}")
    assert await adapter.batched_put(["k"], [b"abc"]) == [True]
    assert await adapter.batched_put(["big"], [b"b" * (9 << 20)]) == [True]
    first, big = await adapter.batched_get(["k", "big"])
    assert first == b"abc"
    assert isinstance(big, memoryview)  # large objects: parallel ranges into one fresh buffer
    assert not big.readonly
    assert big == b"b" * (9 << 20)
    big[0] = 0  # the caller owns it: changing it changes nothing stored
    assert await adapter.batched_get(["k", "big"]) == [b"abc", b"b" * (9 << 20)]
    await adapter.aclose()


@pytest.mark.asyncio
async def test_close_waits_for_inflight_and_rejects_later_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write held in the pool keeps ``aclose`` waiting; once it lands, the put succeeds and the adapter
    refuses later calls."""
    started, release = threading.Event(), threading.Event()
    write_file = posix._write_file

    def held(*args: Any, **kwargs: Any) -> bool:
        started.set()
        release.wait(60)
        return write_file(*args, **kwargs)

    monkeypatch.setattr(posix, "_write_file", held)
    adapter = await PosixAdapter.open(f"file://{tmp_path}")
    try:
        put = asyncio.ensure_future(adapter.batched_put(["k"], [b"v" * (32 << 20)]))  # past the inline budget
        assert await asyncio.to_thread(started.wait, 60), "the put never reached its write"
        closing = asyncio.ensure_future(adapter.aclose())
        for _ in range(100):  # the loop turns: close is still waiting for the held write
            await asyncio.sleep(0)
        assert not closing.done()
    finally:
        release.set()  # a failed check leaves no write held
    await closing
    assert await put == [True]
    assert Path(adapter._path("k")).stat().st_size == 32 << 20  # noqa: ASYNC240
    with pytest.raises(AdapterUnavailable):
        await adapter.batched_get(["k"])


@pytest.mark.asyncio
async def test_open_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'colour'"):
        await PosixAdapter.open(f"file://{tmp_path}", colour="blue")
    with pytest.raises(ConfigError, match="'bogus'"):
        await PosixAdapter.open(f"file://{tmp_path}?bogus=1")
    with pytest.raises(ConfigError, match="fsync"):
        await PosixAdapter.open(f"file://{tmp_path}?fsync=maybe")
    with pytest.raises(ConfigError, match="absolute"):
        await PosixAdapter.open("file://./relative")
    with pytest.raises(ConfigError, match="shard_depth"):
        await PosixAdapter.open(f"file://{tmp_path}", shard_depth=9)
    blocker = tmp_path / "afile"
    blocker.write_bytes(b"")
    with pytest.raises(AdapterUnavailable, match="root"):
        await PosixAdapter.open(f"file://{blocker}/sub")
    ok = await PosixAdapter.open(f"posix://{tmp_path}/alias?capacity=1MiB&fsync=1&shard_depth=1")
    assert (ok.capacity, ok.fsync, ok.shard_depth) == (1 << 20, True, 1)
    await ok.aclose()


@pytest.mark.asyncio
async def test_reads_from_page_cache_and_from_disk_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cached objects are read inline (RWF_NOWAIT); evicted ones and large ones go to the pool: same bytes."""
    adapter = await PosixAdapter.open(f"file://{tmp_path}/s")
    try:
        values = {f"k{i}": os.urandom(size) for i, size in enumerate([1, 5000, 1 << 20, 9 << 20, 3 << 20])}
        assert all(await adapter.batched_put(list(values), list(values.values())))
        pooled: list[str] = []
        original = posix._read_file

        def spy(path: str, *args: object, **kwargs: object) -> object:
            pooled.append(os.path.basename(path))
            return original(path, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(posix, "_read_file", spy)
        got = await adapter.batched_get(list(values))
        assert [bytes(v) for v in got if v is not None] == list(values.values())
        if posix._NOWAIT is not None:
            assert "k3" in pooled  # 9 MiB: over the inline limit
            assert "k0" not in pooled  # small and cached: read on the loop thread
        # Drop the page cache for one object: it must come from the pool, byte-exact.
        target = adapter._path("k2")
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        pooled.clear()
        (value,) = await adapter.batched_get(["k2"])
        assert value is not None
        assert bytes(value) == values["k2"]
        if posix._NOWAIT is not None and _drops_page_cache(tmp_path):
            assert pooled == ["k2"]  # not in the page cache: the loop thread must not have waited for it
        monkeypatch.setattr(posix, "_NOWAIT", None)  # a kernel without RWF_NOWAIT: everything via the pool
        pooled.clear()
        got = await adapter.batched_get(list(values))
        assert [bytes(v) for v in got if v is not None] == list(values.values())
        assert sorted(pooled) == sorted(values)
    finally:
        await adapter.aclose()


def _bytes_on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


@pytest.mark.asyncio
async def test_cancelled_puts_never_exceed_capacity(tmp_path: Path) -> None:
    """A put cancelled while its thread writes still lands; it is counted, so the tier never
    holds more than its capacity and ``used_bytes`` follows the files on disk."""
    capacity = 1 << 20
    adapter = await PosixAdapter.open(f"file://{tmp_path}", capacity=capacity, inline_put_bytes=0)
    value = b"x" * (128 << 10)
    for i in range(40):
        put = asyncio.ensure_future(adapter.batched_put([f"k{i}"], [value]))
        await asyncio.sleep(0)  # the write is on the pool now
        if put.cancel():
            with pytest.raises(asyncio.CancelledError):
                await put
        else:  # done in its first step: refused, the capacity being held by writes still in flight
            assert await put == [False]
        assert adapter.used_bytes <= capacity
    await adapter.aclose()  # waits for the writes still landing
    assert _bytes_on_disk(tmp_path) <= capacity
    assert adapter.used_bytes == _bytes_on_disk(tmp_path)


def _remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path)


@pytest.mark.asyncio
async def test_shard_directories_made_at_open_and_on_demand(tmp_path: Path) -> None:
    """Open makes the 256 first-level shard directories; a put makes what is missing below (any depth,
    also when part of the tree was removed under the adapter)."""
    flat = await PosixAdapter.open(f"file://{tmp_path}/flat", shard_depth=0)
    await flat.aclose()
    assert os.listdir(tmp_path / "flat") == []
    deep = await PosixAdapter.open(f"file://{tmp_path}/deep", shard_depth=4)
    try:
        assert sorted(os.listdir(tmp_path / "deep")) == [f"{i:02x}" for i in range(256)]
        assert await deep.batched_put(["k"], [b"v"]) == [True]
        relative = deep._path("k")[len(str(tmp_path / "deep")) + 1 :]
        assert len(relative.split(os.sep)) == 5
        await asyncio.to_thread(_remove_tree, str(tmp_path / "deep" / relative.split(os.sep)[0]))
        assert await deep.batched_put(["k"], [b"w"]) == [True]
        assert await deep.batched_get(["k"]) == [b"w"]
    finally:
        await deep.aclose()


def _object_bytes(adapter: PosixAdapter, key: str) -> int:
    try:
        return os.stat(adapter._path(key)).st_size
    except FileNotFoundError:
        return 0


@pytest.mark.asyncio
@pytest.mark.parametrize("inline_put_bytes", [0, 4 << 20], ids=["pooled", "inline-and-pooled"])
async def test_racing_puts_of_one_key_count_the_bytes_that_landed(
    tmp_path: Path, inline_put_bytes: int
) -> None:
    """Puts of one key with different sizes, many at once (threads racing to rename; with inline writes,
    small values land on the loop thread while large ones are still being written): once all have ended,
    ``used_bytes`` is the size of the file that won, in every round, also with a capacity."""
    rng = random.Random(7)
    for capacity in (None, 24 << 20):
        root = tmp_path / f"cap{capacity}"
        bound = {} if capacity is None else {"capacity": capacity}
        adapter = await PosixAdapter.open(
            f"file://{root}", inline_put_bytes=inline_put_bytes, threads=8, **bound
        )
        try:
            assert await adapter.batched_put(["other"], [b"o" * 1000]) == [True]
            for _ in range(12):
                sizes = [rng.choice([1 << 10, 300 << 10, 5 << 20]) + rng.randrange(1000) for _ in range(8)]
                puts = [adapter.batched_put(["k"], [bytes(size)]) for size in sizes]
                puts.append(adapter.batched_put(["k", "k"], [bytes(6 << 20), b"x" * 10]))  # one batch, twice
                assert all(all(r) for r in await asyncio.gather(*puts))
                on_disk = _object_bytes(adapter, "k") + _object_bytes(adapter, "other")
                assert adapter.used_bytes == on_disk == _bytes_on_disk(root)
        finally:
            await adapter.aclose()


@pytest.mark.asyncio
async def test_put_that_cannot_fit_keeps_counting_the_objects_it_would_have_evicted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put refused because the rest of the capacity is held by a write in flight evicts nothing and
    forgets nothing: ``used_bytes`` keeps following the files."""
    import threading

    adapter = await PosixAdapter.open(f"file://{tmp_path}", capacity=3000, inline_put_bytes=0)
    release = threading.Event()
    original = posix._write_file

    def held(directory: str, path: str, key: str, *args: object) -> bool:
        if key == "held":  # fault injection: this write waits until the test lets it go
            release.wait(30)
        return original(directory, path, key, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(posix, "_write_file", held)
    try:
        assert await adapter.batched_put(["a"], [b"a" * 1000]) == [True]
        in_flight = asyncio.ensure_future(adapter.batched_put(["held"], [b"h" * 1500]))
        for _ in range(1000):  # bounded poll: until the held put is accounted for
            if adapter.used_bytes == 2500:
                break
            await asyncio.sleep(0.001)
        assert await adapter.batched_put(["c"], [b"c" * 2500]) == [False]  # needs the held bytes too
        assert await adapter.batched_contains(["a"]) == [True]
        assert adapter.used_bytes == 2500
        release.set()
        assert await in_flight == [True]
        assert adapter.used_bytes == _bytes_on_disk(tmp_path) == 2500
    finally:
        release.set()
        await adapter.aclose()


def test_a_forked_child_names_temp_files_as_itself() -> None:
    """The owner tag is cached per process: a child made by fork gets its own pid in its temp names."""
    from tiercache.adapters import _tempfiles

    parent = _tempfiles.owner_tag()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its tag and leave without running any cleanup
        os.write(write_end, _tempfiles.temp_name("k").encode())
        os._exit(0)
    os.close(write_end)
    try:
        child_name = os.read(read_end, 4096).decode()
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    assert f"_{pid}_" in child_name
    assert parent not in child_name
    assert _tempfiles.owner_tag() == parent
    assert _tempfiles.temp_name("k") != _tempfiles.temp_name("k")  # serial: no two names alike
