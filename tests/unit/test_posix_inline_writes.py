"""POSIX puts written on the loop thread: the policy that allows them (clock and page-cache probe injected),
the fall-back to the pool when the disk makes writes wait, and crash safety of the inline path."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tiercache.adapters import _inline_writes, posix
from tiercache.adapters._inline_writes import (
    BACKOFF_S,
    HEADROOM,
    SAMPLE_S,
    DirtyPages,
    InlineWritePolicy,
    filesystem_type,
    read_dirty_pages,
    slow_s,
)
from tiercache.adapters._spare_files import SPARE_KEY, make_spares
from tiercache.adapters.posix import PosixAdapter
from tiercache.testing.fakes import FakeClock

MiB = 1 << 20
ROOMY = DirtyPages(dirty=0, freerun=1 << 40)  # the page cache far from throttling


def _all_files(root: Path, spares: bool = False) -> list[str]:
    """Files under ``root``; the spare temp files made ahead for inline puts only if ``spares``."""
    return sorted(
        os.path.join(d, f)
        for d, _, files in os.walk(root)
        for f in files
        if spares or not f.startswith(f".{SPARE_KEY}.")
    )


def _temp_files(root: Path, spares: bool = False) -> dict[str, int]:
    """Each temp file under ``root`` and its size (spares only if ``spares``)."""
    return {f: os.stat(f).st_size for f in _all_files(root, spares) if os.path.basename(f).startswith(".")}


def _policy(
    probe: Callable[[], DirtyPages | None] = lambda: ROOMY, max_bytes: int = 4 * MiB, local: bool = True
) -> tuple[InlineWritePolicy, FakeClock]:
    clock = FakeClock()
    return InlineWritePolicy(max_bytes, local=local, clock=clock, probe=probe), clock


# -- the policy -------------------------------------------------------------------------------------------


def test_policy_bounds_size_and_needs_a_local_filesystem() -> None:
    policy, _ = _policy()
    assert policy.allow(4 * MiB)
    assert not policy.allow(4 * MiB + 1)
    assert policy.allow(0)
    remote, _ = _policy(local=False)
    assert not remote.allow(1)
    off, _ = _policy(max_bytes=0)
    assert not off.allow(1)


def test_policy_refuses_near_the_dirty_threshold_and_counts_what_it_wrote() -> None:
    sample = DirtyPages(dirty=100 * MiB, freerun=int(240 * MiB / HEADROOM))  # 140 MiB of headroom
    calls = 0

    def probe() -> DirtyPages:
        nonlocal calls
        calls += 1
        return sample

    policy, clock = _policy(probe)
    assert policy.allow(4 * MiB)
    written = 0
    for _ in range(100):  # inline writes since the sample eat the headroom
        if not policy.allow(4 * MiB):
            break
        policy.record(4 * MiB, 0.0, waited=False)
        written += 4 * MiB
    assert written == 140 * MiB
    assert calls == 1  # one /proc read for all of them (same instant)
    clock.now += 2 * SAMPLE_S  # a fresh sample: the kernel wrote them back meanwhile
    assert policy.allow(4 * MiB)
    assert calls == 2


def test_policy_refuses_when_the_page_cache_cannot_be_read() -> None:
    policy, _ = _policy(lambda: None)
    assert not policy.allow(1)


def test_policy_backs_off_after_a_write_that_waited_and_doubles_while_slow() -> None:
    policy, clock = _policy()
    size = MiB
    policy.record(size, slow_s(size) * 0.99, waited=True)  # fast enough
    policy.record(size, slow_s(size) * 10, waited=False)  # slow but never slept: CPU contention
    assert policy.allow(size)
    assert policy.slow_writes == 0
    policy.record(size, slow_s(size) * 1.01, waited=True)
    assert policy.slow_writes == 1
    assert not policy.allow(size)
    clock.now += BACKOFF_S * 0.99
    assert not policy.allow(size)
    clock.now += BACKOFF_S * 0.02
    assert policy.allow(size)  # the back-off is over: try inline again
    policy.record(size, slow_s(size) * 2, waited=True)  # slow again: twice as long off
    clock.now += BACKOFF_S * 1.5
    assert not policy.allow(size)
    clock.now += BACKOFF_S * 0.6
    assert policy.allow(size)
    policy.record(size, 0.0, waited=True)  # a fast write resets the back-off
    policy.record(size, slow_s(size) * 2, waited=True)
    clock.now += BACKOFF_S * 1.01
    assert policy.allow(size)


def test_dirty_threshold_follows_the_kernel_formula() -> None:
    meminfo = b"MemTotal: 9999 kB\nMemFree: 1000 kB\nActive(file): 600 kB\nInactive(file): 400 kB\n"
    meminfo += b"Dirty: 30 kB\nWriteback: 12 kB\nHugePages_Total: 0\n"
    vm = {"dirty_ratio": b"20\n", "dirty_bytes": b"0\n", "dirty_background_ratio": b"10\n"}
    vm["dirty_background_bytes"] = b"0\n"

    def read(path: str) -> bytes:
        return meminfo if path == "/proc/meminfo" else vm[path.rsplit("/", 1)[1]]

    dirtyable = (1000 + 600 + 400) * 1024
    assert read_dirty_pages(read) == DirtyPages(
        dirty=42 * 1024, freerun=(dirtyable * 20 // 100 + dirtyable * 10 // 100) // 2
    )
    vm["dirty_bytes"], vm["dirty_background_bytes"] = b"8000000\n", b"9000000\n"  # background >= limit
    assert read_dirty_pages(read) == DirtyPages(dirty=42 * 1024, freerun=(8_000_000 + 4_000_000) // 2)
    meminfo = b"MemFree: 1000 kB\n"  # fields missing: cannot tell
    assert read_dirty_pages(read) is None


def test_filesystem_type_by_device() -> None:
    assert filesystem_type("/proc/self") == "proc"
    assert filesystem_type("/no/such/path") is None


# -- the adapter ------------------------------------------------------------------------------------------


class WriteSpy:
    """Wraps ``posix._write_file``: which thread wrote each key, and an optional hook run during a write."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on_loop: dict[str, bool] = {}
        self.during: Callable[[], None] | None = None
        self._write = posix._write_file
        self._loop_thread = threading.get_ident()
        monkeypatch.setattr(posix, "_write_file", self)

    def __call__(self, directory: str, path: str, key: str, *args: object) -> bool:
        self.on_loop[key] = threading.get_ident() == self._loop_thread
        if self.during is not None:
            self.during()
        return self._write(directory, path, key, *args)  # type: ignore[arg-type]


def skip_unless_local(directory: Path) -> None:
    """Skip the test when ``directory`` is not on a local filesystem (no inline writes there)."""
    if filesystem_type(str(directory)) not in _inline_writes.LOCAL_FILESYSTEMS:
        pytest.skip("the temp directory is not on a local filesystem")


async def _open(
    root: Path, probe: Callable[[], DirtyPages | None] = lambda: ROOMY, **options: object
) -> tuple[PosixAdapter, FakeClock]:
    adapter = await PosixAdapter.open(f"file://{root}", **options)
    clock = FakeClock()
    if adapter.inline.max_bytes:  # armed by open: this filesystem is local
        adapter.inline = InlineWritePolicy(adapter.inline.max_bytes, local=True, clock=clock, probe=probe)
    return adapter, clock


@pytest.mark.asyncio
async def test_small_puts_are_written_on_the_loop_thread_large_ones_on_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    skip_unless_local(tmp_path)
    spy = WriteSpy(monkeypatch)
    adapter, _ = await _open(tmp_path, inline_put_bytes="1MiB")
    try:
        values = {"small": b"s" * 1000, "edge": b"e" * MiB, "big": b"b" * (MiB + 1)}
        assert await adapter.batched_put(list(values), list(values.values())) == [True, True, True]
        assert spy.on_loop == {"small": True, "edge": True, "big": False}
        assert adapter.stats["inline_puts"] == 2
        assert [bytes(v or b"") for v in await adapter.batched_get(list(values))] == list(values.values())
        # A batch writes at most _INLINE_BATCH_BYTES on the loop thread; the rest goes to the pool.
        n = posix._INLINE_BATCH_BYTES // MiB + 2
        keys = [f"batch{i}" for i in range(n)]
        assert all(await adapter.batched_put(keys, [bytes([i]) * MiB for i in range(n)]))
        assert [spy.on_loop[k] for k in keys] == [True] * (n - 2) + [False] * 2
        got = await adapter.batched_get(keys)
        assert [bytes(v or b"") for v in got] == [bytes([i]) * MiB for i in range(n)]
        assert adapter.used_bytes == sum(map(len, values.values())) + n * MiB
    finally:
        await adapter.aclose()


@pytest.mark.asyncio
async def test_puts_go_to_the_pool_while_the_page_cache_is_near_throttling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    skip_unless_local(tmp_path)
    spy = WriteSpy(monkeypatch)
    pressure = DirtyPages(dirty=80 * MiB, freerun=int(90 * MiB / HEADROOM))
    adapter, clock = await _open(tmp_path, probe=lambda: pressure)
    try:
        assert await adapter.batched_put(["a"], [b"a" * 1000]) == [True]  # 10 MiB of headroom left: fits
        pressure = DirtyPages(dirty=90 * MiB, freerun=int(90 * MiB / HEADROOM))  # no headroom left
        clock.now += 2 * SAMPLE_S
        assert await adapter.batched_put(["b"], [b"b" * 1000]) == [True]
        assert spy.on_loop == {"a": True, "b": False}
        assert await adapter.batched_get(["a", "b"]) == [b"a" * 1000, b"b" * 1000]
    finally:
        await adapter.aclose()


@pytest.mark.asyncio
async def test_a_write_that_waited_on_the_disk_sends_puts_to_the_pool_for_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    skip_unless_local(tmp_path)
    spy = WriteSpy(monkeypatch)
    adapter, clock = await _open(tmp_path)
    switches = 0
    monkeypatch.setattr(posix, "voluntary_switches", lambda: switches)  # read as a write begins
    monkeypatch.setattr(_inline_writes, "voluntary_switches", lambda: switches)  # and after a slow one

    def slow_cpu_bound() -> None:  # the write took long, but the loop thread never slept
        clock.now += 1.0

    def waited_on_disk() -> None:  # the write slept in the kernel for a second
        nonlocal switches
        clock.now += 1.0
        switches += 1

    try:
        spy.during = slow_cpu_bound
        assert await adapter.batched_put(["cpu"], [b"c" * 100]) == [True]
        spy.during = waited_on_disk
        assert await adapter.batched_put(["disk"], [b"d" * 100]) == [True]
        assert adapter.stats["inline_slow_writes"] == 1
        spy.during = None
        assert await adapter.batched_put(["next"], [b"n" * 100]) == [True]
        clock.now += BACKOFF_S
        assert await adapter.batched_put(["later"], [b"l" * 100]) == [True]
        assert spy.on_loop == {"cpu": True, "disk": True, "next": False, "later": True}
        got = await adapter.batched_get(["cpu", "disk", "next", "later"])
        assert got == [b"c" * 100, b"d" * 100, b"n" * 100, b"l" * 100]
    finally:
        await adapter.aclose()


@pytest.mark.asyncio
async def test_no_inline_writes_with_fsync_or_on_a_network_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = WriteSpy(monkeypatch)
    synced = await PosixAdapter.open(f"file://{tmp_path}/synced", fsync=True)
    assert synced.inline.max_bytes == 0
    assert await synced.batched_put(["s"], [b"s"]) == [True]
    await synced.aclose()
    monkeypatch.setattr(posix, "filesystem_type", lambda path: "nfs4")
    remote = await PosixAdapter.open(f"file://{tmp_path}/remote")
    assert remote.inline.max_bytes == 0
    assert await remote.batched_put(["r"], [b"r"]) == [True]
    await remote.aclose()
    assert spy.on_loop == {"s": False, "r": False}


@pytest.mark.asyncio
async def test_failed_inline_write_leaves_nothing_and_frees_its_capacity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    skip_unless_local(tmp_path)
    adapter, _ = await _open(tmp_path, capacity=10_000)
    try:
        assert await adapter.batched_put(["k"], [b"old"]) == [True]

        def enospc(src: str, dst: str) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "replace", enospc)
        assert await adapter.batched_put(["k"], [b"n" * 100]) == [False]
        monkeypatch.undo()
        assert adapter.stats["inline_puts"] == 2
        assert await adapter.batched_get(["k"]) == [None]  # never a stale old value
        assert adapter.used_bytes == 0
        assert _all_files(tmp_path) == []
    finally:
        await adapter.aclose()


_CRASHING_WRITER = textwrap.dedent(
    """
    import asyncio, os, sys
    from tiercache.adapters import posix
    from tiercache.adapters._inline_writes import DirtyPages, InlineWritePolicy
    from tiercache.adapters.posix import PosixAdapter

    root, mode = sys.argv[1], sys.argv[2]
    real_write = os.write

    def crash_before_rename(src, dst):
        os._exit(17)

    def crash_midway(fd, data):
        real_write(fd, memoryview(data)[: len(data) // 2])
        os._exit(17)

    async def main():
        adapter = await PosixAdapter.open(f"file://{root}", temp_sweep_s=0)
        roomy = DirtyPages(dirty=0, freerun=1 << 40)  # whatever the box's page cache holds now
        adapter.inline = InlineWritePolicy(adapter.inline.max_bytes, local=True, probe=lambda: roomy)
        assert adapter.inline.allow(1 << 20), "the inline path must be the one under test"
        if mode == "rename":
            posix.os.replace = crash_before_rename
        else:
            posix.os.write = crash_midway
        await adapter.batched_put(["obj"], [b"N" * (1 << 20)])

    asyncio.run(main())
    """
)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["rename", "write"])
async def test_crash_during_an_inline_put_leaves_the_old_object_whole(tmp_path: Path, mode: str) -> None:
    """A process killed between the temp write and the rename (or in the middle of the write) leaves the
    old object readable, no part of the new one, and a temp file the next open removes."""
    skip_unless_local(tmp_path)
    adapter = await PosixAdapter.open(f"file://{tmp_path}", temp_sweep_s=0)
    assert await adapter.batched_put(["obj"], [b"O" * 5000]) == [True]
    await adapter.aclose()
    writer = await asyncio.create_subprocess_exec(
        sys.executable, "-P", "-c", _CRASHING_WRITER, str(tmp_path), mode, stderr=subprocess.PIPE
    )
    _, stderr = await writer.communicate()
    assert writer.returncode == 17, stderr.decode()
    leftovers = _temp_files(tmp_path)
    assert list(leftovers.values()) == [MiB if mode == "rename" else MiB // 2]  # the crashed writer's
    spares = _temp_files(tmp_path, spares=True).keys() - leftovers.keys()  # made ahead, never used
    reopened = await PosixAdapter.open(f"file://{tmp_path}", temp_sweep_s=0)
    try:
        assert await reopened.batched_get(["obj"]) == [b"O" * 5000]
        assert reopened.stats["temp_files_removed"] == 1 + len(spares)  # a dead writer's, all of them
        assert _temp_files(tmp_path, spares=True) == {}
        assert reopened.used_bytes == 5000
    finally:
        await reopened.aclose()


@pytest.mark.asyncio
async def test_concurrent_inline_and_pooled_puts_of_one_key_keep_one_whole_value(
    tmp_path: Path,
) -> None:
    """Puts of one key racing on both paths: the key ends with one of the values, whole, counted once."""
    skip_unless_local(tmp_path)
    adapter, _ = await _open(tmp_path, inline_put_bytes=MiB)
    try:
        small, big = b"s" * 1000, b"B" * (2 * MiB)
        results = await asyncio.gather(
            adapter.batched_put(["k"], [big]),  # pooled
            adapter.batched_put(["k"], [small]),  # inline, while the big one is on the pool
        )
        assert list(results) == [[True], [True]]
        (got,) = await adapter.batched_get(["k"])
        assert got is not None
        assert bytes(got) in (small, big)
        assert adapter.used_bytes in (len(small), len(big))  # counted once
        assert not adapter._writing
        assert len(_all_files(tmp_path)) == 1  # no temp file left
    finally:
        await adapter.aclose()


async def _spares_ready(adapter: PosixAdapter) -> list[str]:
    """The spare temp files of ``adapter`` once a refill has made them (bounded poll)."""
    spares = adapter._spares
    assert spares is not None
    for _ in range(2000):
        ready = [path for _, path in spares._ready]
        if ready:
            return ready
        await asyncio.sleep(0.001)
    pytest.fail("no spare temp file was made")


@pytest.mark.asyncio
async def test_inline_puts_write_into_spare_files_made_ahead_and_close_removes_the_rest(
    tmp_path: Path,
) -> None:
    """After the first inline put asked for spares, a put's object is one of them (its inode: no create on
    the loop thread), renamed into the key's directory; values stay whole; aclose leaves no temp file."""
    skip_unless_local(tmp_path)
    adapter, _ = await _open(tmp_path, temp_sweep_s=0)
    try:
        assert await adapter.batched_put(["first"], [b"1" * 1000]) == [True]
        spare_inodes = {os.stat(path).st_ino for path in await _spares_ready(adapter)}
        values = {f"k{i}": os.urandom(5000 + i) for i in range(3)}
        for key, value in values.items():
            assert await adapter.batched_put([key], [value]) == [True]
            assert os.stat(adapter._path(key)).st_ino in spare_inodes
        assert await adapter.batched_get(list(values)) == list(values.values())
        assert adapter.used_bytes == 1000 + sum(map(len, values.values()))
        assert adapter.stats["inline_puts"] == 4
    finally:
        await adapter.aclose()
    assert _temp_files(tmp_path, spares=True) == {}


@pytest.mark.asyncio
async def test_a_put_whose_spare_is_gone_creates_its_file_as_before(tmp_path: Path) -> None:
    """The directory of the next spare removed under the adapter: the put still lands (written the usual
    way); a refill makes a missing directory again."""
    import shutil

    skip_unless_local(tmp_path)
    adapter, _ = await _open(tmp_path, temp_sweep_s=0)
    try:
        assert await adapter.batched_put(["first"], [b"1"]) == [True]
        spare_dir = os.path.dirname((await _spares_ready(adapter))[0])
        await asyncio.to_thread(shutil.rmtree, spare_dir)
        keys = [k for k in (f"k{i}" for i in range(400)) if os.path.dirname(adapter._path(k)) != spare_dir][
            :3
        ]
        for key in keys:
            assert await adapter.batched_put([key], [key.encode()]) == [True]
        assert await adapter.batched_get(keys) == [k.encode() for k in keys]
        made = make_spares([spare_dir], 2)
        assert sorted(os.listdir(spare_dir)) == sorted(os.path.basename(path) for _, path in made)
        for fd, path in made:
            os.close(fd)
            os.unlink(path)
    finally:
        await adapter.aclose()
    assert _temp_files(tmp_path, spares=True) == {}
