"""MemoryAdapter: the conformance kit plus LRU capacity, option parsing and the registry hook."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tiercache.adapters.memory import DEFAULT_CAPACITY, MemoryAdapter
from tiercache.adapters.options import parse_size
from tiercache.errors import ConfigError
from tiercache.testing.adapters import AdapterConformance

if TYPE_CHECKING:
    from tiercache.testing.adapters import AdapterFactory


class TestMemoryConformance(AdapterConformance):
    """The kit; memory:// is not persistent, so one shared instance stands for 'the same location'."""

    @pytest.fixture
    def adapter_factory(self) -> AdapterFactory:
        return lambda: MemoryAdapter.open("memory://kit?capacity=256MiB")

    @pytest.fixture
    def bounded_adapter_factory(self) -> AdapterFactory:
        return lambda: MemoryAdapter.open("memory://bounded?capacity=2MiB")


@pytest.mark.asyncio
async def test_lru_evicts_least_recently_used() -> None:
    adapter = await MemoryAdapter.open("memory://lru", capacity=3000)
    assert await adapter.batched_put(["a", "b", "c"], [b"a" * 1000, b"b" * 1000, b"c" * 1000]) == [True] * 3
    await adapter.batched_get(["a"])  # a is now more recent than b
    assert await adapter.batched_put(["d"], [b"d" * 1000]) == [True]
    assert await adapter.batched_contains(["a", "b", "c", "d"]) == [True, False, True, True]
    assert adapter.used_bytes == 3000
    # an overwrite with a bigger value evicts enough older objects
    assert await adapter.batched_put(["d"], [b"D" * 2500]) == [True]
    assert await adapter.batched_contains(["a", "b", "c", "d"]) == [False, False, False, True]
    assert adapter.used_bytes == 2500
    await adapter.aclose()


@pytest.mark.asyncio
async def test_too_big_object_is_rejected_without_evicting() -> None:
    adapter = await MemoryAdapter.open("memory://big?capacity=1KiB")
    assert await adapter.batched_put(["small"], [b"x" * 100]) == [True]
    assert await adapter.batched_put(["big", "fits"], [b"y" * 1025, b"z" * 1024]) == [False, True]
    assert await adapter.batched_contains(["small", "big", "fits"]) == [False, False, True]
    assert await adapter.batched_put(["edge"], [b""]) == [True]
    await adapter.aclose()


@pytest.mark.asyncio
async def test_options_and_url() -> None:
    adapter = await MemoryAdapter.open("memory://x")
    assert adapter.capacity == DEFAULT_CAPACITY
    assert (await MemoryAdapter.open("memory://x?capacity=64MiB")).capacity == 64 << 20
    assert (await MemoryAdapter.open("memory://x?capacity=64MiB", capacity="1KB")).capacity == 1000
    assert (await MemoryAdapter.open("memory://x", capacity=12345)).capacity == 12345
    with pytest.raises(ConfigError, match="'colour'"):
        await MemoryAdapter.open("memory://x", colour="blue")
    with pytest.raises(ConfigError, match="'ttl'"):
        await MemoryAdapter.open("memory://x?ttl=3")
    with pytest.raises(ConfigError, match="capacity"):
        await MemoryAdapter.open("memory://x?capacity=lots")
    with pytest.raises(ConfigError, match="memory://"):
        await MemoryAdapter.open("file:///tmp/x")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (123, 123),
        ("123", 123),
        ("512MiB", 512 << 20),
        ("1.5GiB", 3 << 29),
        ("10GB", 10 * 10**9),
        ("4 KiB", 4096),
        ("2tib", 2 << 40),
        ("1TB", 10**12),
        ("7KB", 7000),
        ("3MB", 3 * 10**6),
        ("100B", 100),
    ],
)
def test_parse_size(text: int | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "MiB", "-1", "1.2.3GiB", "12 parsecs", -5, True, 1.5, None])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_builtin_hook_registers_memory_and_file() -> None:
    from tiercache.adapters import _builtin

    calls: list[tuple[str, str, tuple[str, ...]]] = []

    def register(
        scheme: str, target: str, *, aliases: tuple[str, ...] = (), extra: str | None = None
    ) -> None:
        calls.append((scheme, target, tuple(aliases)))

    _builtin.tiercache_register_adapters(register)
    assert ("memory", "tiercache.adapters.memory:MemoryAdapter", ()) in calls
    assert ("file", "tiercache.adapters.posix:PosixAdapter", ("posix",)) in calls
