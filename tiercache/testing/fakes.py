"""Fault injection for tests without services: a wrapper that adds latency, errors, hangs and corrupt reads,
and a clock the test moves by hand.

The store underneath is a real adapter, usually ``MemoryAdapter`` (``memory://``): there is one in-memory
adapter, and this module only injects faults around it. ``FaultInjectingAdapter``'s constructor is a stable
test API (storage-manager tests build on it). ``InMemoryAdapter`` is the kit's old name of ``MemoryAdapter``,
kept so third-party suites keep importing. Nothing here imports pytest.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from tiercache.adapters._base import Adapter, Buffer
from tiercache.adapters.memory import MemoryAdapter
from tiercache.errors import AdapterUnavailable, Unsupported

if TYPE_CHECKING:
    from typing import Self


__all__ = ["ALL_OPS", "FakeClock", "FaultInjectingAdapter", "InMemoryAdapter"]

InMemoryAdapter = MemoryAdapter
"""The old kit name of ``tiercache.adapters.memory.MemoryAdapter`` (``memory://``; no ``fake-memory://``)."""

ALL_OPS: frozenset[str] = frozenset({"contains", "get", "put", "delete", "list"})
"""Operation names ``FaultInjectingAdapter`` can fail: one per batched method."""


class FakeClock:
    """A monotonic clock (seconds, called like ``time.monotonic``) that moves only when the test moves it:
    ``advance`` or set ``now``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FaultInjectingAdapter(Adapter):
    """Wraps an adapter, injecting latency, errors, hangs and corrupt reads; each knob can change mid-test.

    Parameters (all also public attributes, switchable at runtime, e.g. ``fake.fail_rate = 1.0``):

    - ``latency``: seconds slept before every call (all ops, whether or not in ``fail_ops``).
    - ``fail_rate``: probability in [0, 1] that a call of an op in ``fail_ops`` raises ``error``.
    - ``fail_ops``: the ops that may fail or hang (names from ``ALL_OPS``: contains, get, put, delete,
      list);
      default all of them.
    - ``error``: exception class raised for an injected failure (default ``AdapterUnavailable``).
    - ``hang``: if true, calls of ops in ``fail_ops`` wait forever (until cancelled, e.g. by a deadline).
    - ``corrupt_rate``: probability that each non-empty value ``batched_get`` returns has one byte flipped.
    - ``seed``: seed of the private random generator (runs are reproducible).
    - ``sleep``: the coroutine function that waits out ``latency`` (default ``asyncio.sleep``; tests inject
      one).

    Counters: ``calls[op]`` (every call), ``faults["latency" | "error" | "hang" | "corrupt"]``.
    ``capabilities`` and ``scheme`` mirror the wrapped adapter's; ``aclose`` is never faulted and
    closes the wrapped adapter.
    """

    scheme: ClassVar[str] = "fault"

    def __init__(
        self,
        wrapped: Adapter | None = None,
        *,
        latency: float = 0.0,
        fail_rate: float = 0.0,
        fail_ops: frozenset[str] = ALL_OPS,
        error: type[BaseException] = AdapterUnavailable,
        hang: bool = False,
        corrupt_rate: float = 0.0,
        seed: int = 0,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        """Wrap ``wrapped`` (default: a new ``MemoryAdapter``), owned by this object: ``aclose`` closes it."""
        unknown = set(fail_ops) - ALL_OPS
        if unknown:
            raise ValueError(f"unknown op(s) in fail_ops: {sorted(unknown)}; known: {sorted(ALL_OPS)}")
        self.wrapped: Adapter = MemoryAdapter() if wrapped is None else wrapped
        self.sleep = sleep
        self.latency = latency
        self.fail_rate = fail_rate
        self.fail_ops = frozenset(fail_ops)
        self.error = error
        self.hang = hang
        self.corrupt_rate = corrupt_rate
        self.rng = random.Random(seed)
        self.calls: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        # An instance attribute shadows the ClassVar so the kit and the manager gate on the real capabilities.
        setattr(self, "capabilities", self.wrapped.capabilities)  # noqa: B010
        setattr(self, "scheme", self.wrapped.scheme)  # noqa: B010

    @classmethod
    async def open(cls, url: str, **options: object) -> Self:
        """Not openable by URL: construct it around an opened adapter."""
        raise Unsupported("FaultInjectingAdapter is built as FaultInjectingAdapter(wrapped, ...), not by URL")

    async def _inject(self, op: str) -> None:
        self.calls[op] += 1
        if self.latency > 0:
            self.faults["latency"] += 1
            await self.sleep(self.latency)
        if op not in self.fail_ops:
            return
        if self.hang:
            self.faults["hang"] += 1
            await asyncio.Event().wait()
        if self.fail_rate > 0 and self.rng.random() < self.fail_rate:
            self.faults["error"] += 1
            raise self.error(f"injected fault in {op}")

    async def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """Inject, then forward."""
        await self._inject("contains")
        return await self.wrapped.batched_contains(keys)

    async def batched_get(self, keys: Sequence[str]) -> list[Buffer | None]:
        """Inject, forward, then maybe flip one byte of each returned value."""
        await self._inject("get")
        values = await self.wrapped.batched_get(keys)
        if self.corrupt_rate <= 0:
            return values
        out: list[Buffer | None] = []
        for value in values:
            if value is not None and len(value) > 0 and self.rng.random() < self.corrupt_rate:
                damaged = bytearray(value)
                damaged[self.rng.randrange(len(damaged))] ^= 0xFF
                self.faults["corrupt"] += 1
                value = damaged
            out.append(value)
        return out

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Inject, then forward."""
        await self._inject("put")
        return await self.wrapped.batched_put(keys, values)

    async def batched_delete(self, keys: Sequence[str]) -> list[bool]:
        """Inject, then forward."""
        await self._inject("delete")
        return await self.wrapped.batched_delete(keys)

    async def iter_keys(self, prefix: str) -> AsyncIterator[list[str]]:
        """Inject (op ``list``), then forward."""
        await self._inject("list")
        async for batch in self.wrapped.iter_keys(prefix):
            yield batch

    async def aclose(self) -> None:
        """Close the wrapped adapter (never faulted)."""
        await self.wrapped.aclose()
