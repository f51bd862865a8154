"""SlabAdapter (``nvme+slab``): the conformance kit plus classes, eviction, replay, locking and checksums."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import pytest

from tiercache.adapters._slab_layout import class_sizes
from tiercache.adapters.nvme_slab import SlabAdapter
from tiercache.errors import AdapterUnavailable, ConfigError
from tiercache.testing.adapters import AdapterConformance

if TYPE_CHECKING:
    from tiercache.testing.adapters import AdapterFactory

MiB = 1 << 20


BOUNDED = "capacity=6MiB&max_object=1MiB&extent_size=2MiB"


class SlabKit(AdapterConformance):
    """The kit on sparse slab files under ``tmp_path``: kit.slab opened with ``kit_options``, the bounded
    test's bounded.slab with ``bounded_options`` (None: the bounded test runs on kit.slab)."""

    kit_options: ClassVar[str]
    bounded_options: ClassVar[str | None] = BOUNDED

    @pytest.fixture
    def adapter_factory(self, tmp_path: Path) -> AdapterFactory:
        url = f"nvme+slab://{tmp_path}/kit.slab?{self.kit_options}"
        return lambda: SlabAdapter.open(url, preallocate=False)

    @pytest.fixture
    def bounded_adapter_factory(self, tmp_path: Path, adapter_factory: AdapterFactory) -> AdapterFactory:
        if self.bounded_options is None:
            return adapter_factory
        url = f"nvme+slab://{tmp_path}/bounded.slab?{self.bounded_options}"
        return lambda: SlabAdapter.open(url, preallocate=False)


class TestSlabConformance(SlabKit):
    """The kit on a sparse slab file, O_DIRECT where the filesystem allows it (reopened for persistence)."""

    kit_options = "capacity=640MiB&max_object=64MiB&extent_size=64MiB"


class TestSlabConformanceS3FIFO(SlabKit):
    """The kit with S3-FIFO eviction within classes (reopened for persistence: replay rebuilds the order)."""

    max_object_bytes = 4 * MiB
    kit_options = "capacity=256MiB&max_object=8MiB&eviction=s3fifo"
    bounded_options = BOUNDED + "&eviction=s3fifo"


class TestSlabConformanceBuffered(SlabKit):
    """The kit with buffered I/O and fsync on (smaller objects to stay fast)."""

    max_object_bytes = 4 * MiB
    kit_options = "capacity=256MiB&max_object=8MiB&direct=false&fsync=true"
    bounded_options = None


async def _open(tmp_path: Path, **options: object) -> SlabAdapter:
    opts: dict[str, object] = {"capacity": "160MiB", "max_object": "8MiB", "extent_size": "16MiB"}
    opts.update(options)
    return await SlabAdapter.open(f"nvme+slab://{tmp_path}/s.slab", preallocate=False, **opts)


def test_class_sizes() -> None:
    sizes = class_sizes(130 * MiB)
    assert sizes[0] == 64 << 10
    assert all(s % 4096 == 0 for s in sizes)
    assert all(b > a for a, b in itertools.pairwise(sizes))
    assert all(b / a <= 1.0 + 1 / 16 + 1e-9 for a, b in itertools.pairwise(sizes))
    assert 34 * MiB in sizes  # a 32 MiB chunk plus its frame header wastes < 6.25 %


@pytest.mark.asyncio
async def test_describe_and_capabilities(tmp_path: Path) -> None:
    a = await _open(tmp_path)
    try:
        text = a.describe()
        assert "O_DIRECT" in text or "buffered" in text
        assert a.capabilities.persistent
        assert not a.capabilities.shared
        assert a.capabilities.delete
        assert a.capabilities.max_value_bytes == 8 * MiB
    finally:
        await a.aclose()
    b = await _open(tmp_path, direct=False)
    try:
        assert "buffered" in b.describe()
    finally:
        await b.aclose()


@pytest.mark.asyncio
async def test_too_big_is_rejected_not_raised(tmp_path: Path) -> None:
    a = await _open(tmp_path)
    try:
        assert await a.batched_put(["big", "ok"], [bytes(8 * MiB + 1), b"x"]) == [False, True]
        assert a.stats["rejected_too_big"] == 1
        assert await a.batched_contains(["big", "ok"]) == [False, True]
        assert await a.batched_put(["max"], [bytes(8 * MiB)]) == [True]
    finally:
        await a.aclose()


@pytest.mark.asyncio
async def test_lru_eviction_within_class(tmp_path: Path) -> None:
    # one 16 MiB extent; 4 MiB + 100 bytes (+ any skew) take the 4.25 MiB class: 3 slots
    a = await _open(tmp_path, capacity="17MiB", extent_size="16MiB")
    try:
        keys = ["a", "b", "c", "d"]
        vals = {k: os.urandom(4 * MiB + 100) for k in keys}
        slots = 3
        for k in keys[:slots]:
            assert await a.batched_put([k], [vals[k]]) == [True]
        (got,) = await a.batched_get([keys[0]])  # keys[0] is now the most recent
        assert got is not None
        assert bytes(got) == vals[keys[0]]
        del got
        assert await a.batched_put([keys[slots]], [vals[keys[slots]]]) == [True]
        present = await a.batched_contains(keys)
        assert present[0]
        assert present[slots]
        assert not present[1]
        assert a.stats["evicted"] == 1
    finally:
        await a.aclose()


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
@pytest.mark.asyncio
async def test_s3fifo_keeps_reread_objects_through_a_scan(tmp_path: Path, eviction: str) -> None:
    """One class of N slots: 5 objects read once after their put survive 4N one-off puts under s3fifo (they
    are in its main queue, which the scan never enters); LRU loses them after N."""
    a = await _open(tmp_path, capacity="17MiB", extent_size="16MiB", eviction=eviction)
    hot = [f"hot{i}" for i in range(5)]
    values = [k.encode().ljust(1000, b".") for k in hot]
    try:
        assert await a.batched_put(hot, values) == [True] * 5
        assert [bytes(v) for v in await a.batched_get(hot) if v is not None] == values
        n = 0
        while not a.stats["evicted"]:  # fill the class: N slots in all
            assert await a.batched_put([f"fill{n}"], [b"f" * 1000]) == [True]
            n += 1
        for i in range(4 * n):
            assert await a.batched_put([f"scan{i}"], [b"s" * 1000]) == [True]
        found = await a.batched_get(hot)
        assert all(v is None or bytes(v) == want for v, want in zip(found, values, strict=True))
        assert sum(v is not None for v in found) == (5 if eviction == "s3fifo" else 0)
    finally:
        await a.aclose()


@pytest.mark.asyncio
async def test_extents_move_between_classes(tmp_path: Path) -> None:
    a = await _open(tmp_path, capacity="40MiB", extent_size="16MiB")  # 2 extents
    try:
        assert await a.batched_put(["small"], [b"s" * 1000]) == [True]
        assert await a.batched_put(["mid"], [b"m" * (2 * MiB)]) == [True]
        # a third class: no free extent, its class has nothing to evict: the LRU extent moves
        assert await a.batched_put(["large"], [b"L" * (5 * MiB)]) == [True]
        assert await a.batched_contains(["small", "mid", "large"]) == [False, True, True]
        assert a.stats["extents_moved"] == 1
        (got,) = await a.batched_get(["large"])
        assert got is not None
        assert bytes(got) == b"L" * (5 * MiB)
    finally:
        await a.aclose()
    b = await _open(tmp_path, capacity="40MiB", extent_size="16MiB")
    try:
        assert await b.batched_contains(["small", "mid", "large"]) == [False, True, True]
    finally:
        await b.aclose()


@pytest.mark.asyncio
async def test_replay_keeps_latest_overwrite_and_deletes(tmp_path: Path) -> None:
    a = await _open(tmp_path)
    try:
        for i in range(5):
            assert await a.batched_put(["k"], [bytes([i]) * (100_000 + i)]) == [True]
        assert await a.batched_put(["gone", "kept"], [b"g", b"kept"]) == [True, True]
        assert await a.batched_delete(["gone", "never"]) == [True, False]
    finally:
        await a.aclose()
    b = await _open(tmp_path)
    try:
        assert await b.batched_contains(["k", "gone", "kept"]) == [True, False, True]
        assert [bytes(v) if v is not None else None for v in await b.batched_get(["k", "kept"])] == [
            bytes([4]) * 100_004,
            b"kept",
        ]
        assert b.stats["replayed"] == 2
    finally:
        await b.aclose()


@pytest.mark.asyncio
async def test_corrupt_slot_is_a_miss(tmp_path: Path) -> None:
    a = await _open(tmp_path)
    value = os.urandom(3 * MiB)
    try:
        assert await a.batched_put(["v"], [value]) == [True]
        e = a._index["v"]
        off = a._geo.data_offset(e.extent, e.slot, a._sizes[e.cls]) + e.skew + 12345
    finally:
        await a.aclose()
    path = tmp_path / "s.slab"  # flip one byte behind the adapter's back
    raw = bytearray(path.read_bytes())
    raw[off] ^= 0xFF
    path.write_bytes(bytes(raw))
    b = await _open(tmp_path)
    try:
        assert await b.batched_contains(["v"]) == [True]
        assert await b.batched_get(["v"]) == [None]
        assert b.stats["corrupt"] == 1
        assert await b.batched_contains(["v"]) == [False]
    finally:
        await b.aclose()


@pytest.mark.asyncio
async def test_changed_options_open_the_slab_with_its_own_geometry(tmp_path: Path) -> None:
    """Other max_object/extent_size/capacity never reformat: the slab's objects stay."""
    a = await _open(tmp_path)
    geometry = a.geometry
    assert await a.batched_put(["x"], [b"x" * 5000]) == [True]
    await a.aclose()
    b = await _open(tmp_path, capacity="200MiB", max_object="4MiB", extent_size="32MiB")
    try:
        assert b.geometry == geometry
        assert await b.batched_get(["x"]) == [b"x" * 5000]
        assert b.capabilities.max_value_bytes == 4 * MiB  # the smaller of the options and the slab
        assert await b.batched_put(["y"], [b"y" * (3 * MiB)]) == [True]
    finally:
        await b.aclose()
    c = await _open(tmp_path, max_object="64MiB", extent_size="64MiB", capacity="640MiB")
    try:
        assert c.geometry == geometry
        assert geometry is not None
        assert c.max_object == geometry.max_class - 8192  # what the slab's largest class holds
        assert await c.batched_put(["z"], [os.urandom(c.max_object)]) == [True]
        assert await c.batched_get(["x"]) == [b"x" * 5000]
    finally:
        await c.aclose()


@pytest.mark.asyncio
async def test_reformat_only_with_format_option(tmp_path: Path) -> None:
    a = await _open(tmp_path)
    assert await a.batched_put(["x"], [b"x"]) == [True]
    await a.aclose()
    b = await _open(tmp_path, capacity="200MiB", format=True)
    try:
        assert await b.batched_contains(["x"]) == [False]
        assert b.geometry is not None
        assert b.geometry.capacity == 200 * MiB
    finally:
        await b.aclose()


@pytest.mark.asyncio
async def test_cancelled_puts_release_their_slots(tmp_path: Path) -> None:
    """Puts cancelled after reserving a slot never leak it; the slab keeps accepting puts."""
    a = await _open(tmp_path, capacity="80MiB", max_object="4MiB", extent_size="16MiB")
    value = os.urandom(2 * MiB)
    try:
        for i in range(60):
            put = asyncio.ensure_future(a.batched_put([f"c{i}"], [value]))
            await asyncio.sleep(0)  # the slot is reserved and its write is on a thread
            put.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await put  # (a put refused at once returns before the cancel lands)
        detached = getattr(a, "_detached", None)
        if detached is not None:
            await detached.wait(60)  # the cancelled batches finish writing (they cannot be stopped)
        refused = a.stats["rejected_full"]
        for i in range(40):  # far more than the slab holds at once: LRU eviction must find slots
            assert await a.batched_put([f"n{i}"], [value]) == [True], f"put {i} refused: slots leaked"
        assert a.stats["rejected_full"] == refused
        assert await a.batched_get(["n39"]) == [value]
    finally:
        await a.aclose()


@pytest.mark.asyncio
async def test_foreign_file_refused(tmp_path: Path) -> None:
    (tmp_path / "s.slab").write_bytes(b"not a slab" * 1000)
    with pytest.raises(AdapterUnavailable, match="not a tiercache slab"):
        await _open(tmp_path)
    b = await _open(tmp_path, format=True)
    await b.aclose()


@pytest.mark.asyncio
async def test_bad_options(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        await SlabAdapter.open(f"nvme+slab://{tmp_path}/new.slab")
    with pytest.raises(ConfigError, match="too small"):
        await SlabAdapter.open(f"nvme+slab://{tmp_path}/new.slab?capacity=1MiB")
    with pytest.raises(ConfigError, match="unknown option"):
        await SlabAdapter.open(f"nvme+slab://{tmp_path}/new.slab?capacity=1GiB&bogus=1")
    with pytest.raises(ConfigError, match="absolute"):
        await SlabAdapter.open("nvme+slab://relative/x.slab?capacity=1GiB")


_HOLD = """
import asyncio, sys
from tiercache.adapters.nvme_slab import SlabAdapter
async def main():
    a = await SlabAdapter.open(sys.argv[1], preallocate=False)
    print("locked", flush=True)
    sys.stdin.readline()
    await a.aclose()
asyncio.run(main())
"""


@pytest.mark.asyncio
async def test_second_process_is_refused(tmp_path: Path) -> None:
    url = f"nvme+slab://{tmp_path}/s.slab?capacity=160MiB&max_object=8MiB&extent_size=16MiB"
    child = subprocess.Popen(  # noqa: ASYNC220 - a second process must hold the lock
        [sys.executable, "-c", _HOLD, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(AdapterUnavailable, match="in use"):
            await SlabAdapter.open(url)
    finally:
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=30)
    a = await SlabAdapter.open(url)  # released on close
    await a.aclose()


@pytest.mark.asyncio
async def test_read_buffers_are_recycled_only_when_dropped(tmp_path: Path) -> None:
    a = await _open(tmp_path)
    try:
        v1, v2 = os.urandom(2 * MiB), os.urandom(2 * MiB)
        assert await a.batched_put(["a", "b"], [v1, v2]) == [True, True]
        (g1,) = await a.batched_get(["a"])
        (g2,) = await a.batched_get(["b"])  # g1 is still held: must not be overwritten
        assert g1 is not None
        assert g2 is not None
        assert bytes(g1) == v1
        assert bytes(g2) == v2
        results = await asyncio.gather(*(a.batched_get(["a", "b"]) for _ in range(4)))
        for r in results:
            assert [bytes(x) for x in r if x is not None] == [v1, v2]
        assert bytes(g1) == v1
    finally:
        await a.aclose()


@pytest.mark.asyncio
async def test_registered_scheme(tmp_path: Path) -> None:
    from tiercache import open_adapter

    a = await open_adapter(f"nvme+slab://{tmp_path}/r.slab?capacity=160MiB&max_object=8MiB&extent_size=16MiB")
    try:
        assert isinstance(a, SlabAdapter)
    finally:
        await a.aclose()
