"""The L2 adapter contract: an async, batched store of opaque frames addressed by key strings."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from tiercache.errors import Unsupported

if TYPE_CHECKING:
    from types import TracebackType
    from typing import Self

__all__ = ["Adapter", "Buffer", "Capabilities", "check_key", "check_keys", "check_lengths", "is_key"]

Buffer = bytes | bytearray | memoryview
"""What adapters store and return: opaque bytes (a whole frame)."""

_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an adapter can do; the manager and the conformance kit gate on these, never on isinstance."""

    persistent: bool = False
    """Objects survive closing and reopening the adapter on the same location."""
    shared: bool = False
    """Several processes or hosts see the same objects."""
    delete: bool = True
    """``batched_delete`` is supported."""
    ttl: bool = False
    """Objects can expire after a configured time."""
    max_value_bytes: int | None = None
    """Largest value ``batched_put`` accepts (None: no limit below memory); the manager never sends a larger
    frame (it is skipped and counted as ``stores_dropped{reason="too_large"}``)."""
    list_keys: bool = False
    """``iter_keys`` is supported: every key stored under a prefix can be enumerated (resets and deletes by
    prefix then reach objects other processes stored)."""


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe object name (``[A-Za-z0-9][A-Za-z0-9._-]{0,254}``), else ValueError."""
    candidate: object = key  # checked at run time: callers may pass anything
    if not isinstance(candidate, str) or _KEY_RE.match(candidate) is None:
        raise ValueError(f"invalid object key {key!r}: use [A-Za-z0-9][A-Za-z0-9._-]{{0,254}}")
    return key


def check_keys(keys: Sequence[str]) -> None:
    """``check_key`` of every key of a batch, before any of it is done (ValueError on the first bad one)."""
    for key in keys:
        check_key(key)


def is_key(name: str) -> bool:
    """Whether ``name`` is a safe object name (what ``check_key`` accepts); listings skip other names."""
    return _KEY_RE.match(name) is not None


def check_lengths(keys: Sequence[str], values: Sequence[object]) -> None:
    """``ValueError`` unless keys and values pair up one to one."""
    if len(keys) != len(values):
        raise ValueError(f"batch length mismatch: {len(keys)} keys, {len(values)} values")


class Adapter(ABC):
    """One L2 tier. Methods run on the manager's event loop and must never block it.

    Results are positional, one per key. A miss is a result (``False``/``None``), never an exception; only
    transport failures raise ``AdapterUnavailable`` or ``AdapterTimeout``. A put becomes visible only when
    complete: a reader sees the old value, the new value or nothing, never a part. Deadlines, retries, metrics
    and circuit breaking belong to the storage manager; an adapter keeps only its client's transport timeouts,
    so that a call the manager stopped waiting for still ends.
    """

    scheme: ClassVar[str]
    capabilities: ClassVar[Capabilities] = Capabilities()

    @classmethod
    @abstractmethod
    async def open(cls, url: str, **options: object) -> Self:
        """Open the store named by ``url`` with typed ``options``; unknown options raise ``ConfigError``."""

    @abstractmethod
    async def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether a complete object is stored under it now."""

    @abstractmethod
    async def batched_get(self, keys: Sequence[str]) -> list[Buffer | None]:
        """For each key, the stored bytes or None on a miss."""

    @abstractmethod
    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Store each value under its key (replacing an old one); True where it is now stored."""

    async def batched_delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove each key; True where an object was removed. Gated by ``capabilities.delete``."""
        raise Unsupported(f"{type(self).__name__} does not support delete")

    def iter_keys(self, prefix: str) -> AsyncIterator[list[str]]:
        """Every key stored now that starts with ``prefix``, in batches (each key once, in no set order; a key
        put or deleted meanwhile may or may not appear). Gated by ``capabilities.list_keys``."""
        raise Unsupported(f"{type(self).__name__} cannot list its keys")

    @abstractmethod
    async def aclose(self) -> None:
        """Release connections and threads; idempotent. Later calls raise ``AdapterUnavailable``."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
