"""``memory://name?capacity=64MiB``: a process-local, byte-bounded LRU store (for tests and small setups).

Every ``open`` creates a new, private store; the URL's name is only a label (two adapters opened on the same
URL do not share objects, and nothing survives ``aclose``). Values are copied in on put and are immutable
``bytes`` afterwards, so callers' buffers are never aliased. All operations run on the event loop thread and
complete without awaiting, so a put is atomic with respect to concurrent gets.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, ClassVar
from urllib.parse import urlsplit

from tiercache.adapters._base import Adapter, Buffer, Capabilities, check_key, check_keys, check_lengths
from tiercache.adapters.options import MAX_SIZE, Range, Size, check_options, parse_options
from tiercache.errors import AdapterUnavailable, ConfigError

if TYPE_CHECKING:
    from typing import Self

__all__ = ["DEFAULT_CAPACITY", "MemoryAdapter", "MemoryOptions"]

DEFAULT_CAPACITY = 1 << 30
"""Capacity in bytes when neither the URL nor the options name one (1 GiB)."""


@dataclass(frozen=True, slots=True)
class MemoryOptions:
    """Options of ``memory://`` URLs (query string or keywords)."""

    capacity: Annotated[Size, Range(0, MAX_SIZE)] = DEFAULT_CAPACITY
    """Bytes the store holds (sum of value lengths); bytes or "64MiB"."""


class MemoryAdapter(Adapter):
    """A bounded in-process store: LRU eviction by total value bytes; a value over capacity is refused."""

    scheme: ClassVar[str] = "memory"
    capabilities: ClassVar[Capabilities] = Capabilities(
        delete=True, persistent=False, shared=False, list_keys=True
    )

    def __init__(self, *, name: str = "", capacity: int = DEFAULT_CAPACITY) -> None:
        """A new empty store of ``capacity`` bytes (sum of value lengths); ``name`` is a label only."""
        check_options(MemoryOptions(capacity=capacity), "memory")
        self.name = name
        self.capacity = capacity
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._closed = False

    @classmethod
    async def open(cls, url: str, **options: object) -> Self:
        """Open ``memory://name`` with option ``capacity`` (bytes or "64MiB"; URL query or keyword)."""
        parts = urlsplit(url)
        if parts.scheme != cls.scheme:
            raise ConfigError(f"memory: expected a memory:// URL, got {url!r}")
        opts = parse_options(MemoryOptions, "memory", parts.query, options)
        return cls(name=parts.netloc + parts.path, capacity=opts.capacity)

    @property
    def used_bytes(self) -> int:
        """Total length of the stored values."""
        return self._used

    def __len__(self) -> int:
        return len(self._data)

    def _check_open(self) -> None:
        if self._closed:
            raise AdapterUnavailable(f"memory adapter {self.name!r} is closed")

    async def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether it is stored (does not change recency)."""
        self._check_open()
        return [check_key(k) in self._data for k in keys]

    async def batched_get(self, keys: Sequence[str]) -> list[Buffer | None]:
        """For each key, its bytes (and mark it recently used) or None."""
        self._check_open()
        check_keys(keys)
        out: list[Buffer | None] = []
        for k in keys:
            value = self._data.get(k)
            if value is not None:
                self._data.move_to_end(k)
            out.append(value)
        return out

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Copy each value in, evicting least recently used objects; False for a value over capacity."""
        self._check_open()
        check_lengths(keys, values)
        check_keys(keys)
        out: list[bool] = []
        for k, v in zip(keys, values, strict=True):
            data = bytes(v)
            if len(data) > self.capacity:
                out.append(False)
                continue
            old = self._data.pop(k, None)
            if old is not None:
                self._used -= len(old)
            while self._used + len(data) > self.capacity:
                _, victim = self._data.popitem(last=False)
                self._used -= len(victim)
            self._data[k] = data
            self._used += len(data)
            out.append(True)
        return out

    async def batched_delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove each key; True where it was stored."""
        self._check_open()
        check_keys(keys)
        out: list[bool] = []
        for k in keys:
            old = self._data.pop(k, None)
            if old is not None:
                self._used -= len(old)
            out.append(old is not None)
        return out

    async def iter_keys(self, prefix: str) -> AsyncIterator[list[str]]:
        """The stored keys starting with ``prefix``, in one batch."""
        self._check_open()
        yield [k for k in self._data if k.startswith(prefix)]

    async def aclose(self) -> None:
        """Drop all objects; idempotent. Later calls raise AdapterUnavailable."""
        self._closed = True
        self._data.clear()
        self._used = 0
