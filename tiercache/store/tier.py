"""The tier client: one opened L2 tier (adapter + codec chain) called under deadlines, a circuit and metrics.

Every call has a deadline; an error or timeout is a miss for that tier and a metric, and repeated failures
open the tier's circuit. The tier also carries its write-behind lane (queue + worker task), which the
:class:`~tiercache.store.store_controller.StoreController` drives.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tiercache.store.circuit import CircuitBreaker

if TYPE_CHECKING:
    from tiercache.adapters import Adapter
    from tiercache.config import ManagerConfig, TierConfig
    from tiercache.metrics import Metrics
    from tiercache.serde import CodecPipeline
    from tiercache.store.l1_surface import L1LeaseView

__all__ = ["JobRunner", "TierClient", "open_tier_adapter"]

T = TypeVar("T")


class JobRunner(Protocol):
    """Runs a blocking codec job off the event loop and returns its result."""

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]:
        """Await ``fn()`` run on a worker thread."""
        ...


class _Late:
    """Marks a call still running past its deadline (its outcome is delivered later)."""


def _late_done(
    pending: set[asyncio.Future[Any]], late: Callable[[T | None], None], task: asyncio.Future[T]
) -> None:
    pending.discard(task)
    late(None if task.cancelled() or task.exception() is not None else task.result())


def _is_down(adapter: Adapter) -> float:
    """1.0 while ``adapter`` stands for a tier not re-opened yet (the ``tier_down`` gauge)."""
    return 0.0 if getattr(adapter, "up", True) else 1.0


class TierClient:
    """One L2 tier: adapter, codec pipeline, circuit breaker, metrics and its write-behind lane."""

    def __init__(
        self,
        name: str,
        adapter: Adapter,
        pipeline: CodecPipeline,
        policy: ManagerConfig,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.adapter = adapter
        self.pipeline = pipeline
        self.metrics = metrics
        self.breaker = CircuitBreaker(policy.circuit_failures, policy.circuit_cooldown_s, clock)
        self.queue: asyncio.Queue[tuple[str, L1LeaseView]] = asyncio.Queue(policy.store_queue_size)
        """Write-behind lane: (key, lease on the L1 object) waiting to be encoded and put."""
        self.workers: set[asyncio.Task[None]] = set()
        """Store workers draining ``queue`` (at most ``ManagerConfig.store_parallel``; none while idle)."""
        self.late: set[asyncio.Future[Any]] = set()
        """Puts that outlived their deadline and are still landing (counted when they end)."""
        self.store_error_logged = False
        metrics.add_tier(name)
        metrics.watch_tier(name, adapter)
        metrics.store_queue_depth.labels(name).set_function(self.queue.qsize)
        metrics.tier_down.labels(name).set_function(partial(_is_down, adapter))

    async def call(
        self,
        op: str,
        call: Callable[[], Awaitable[T]],
        deadline_s: float,
        late: Callable[[T | None], None] | None = None,
    ) -> T | None:
        """Run one adapter call under the deadline and circuit; None means it failed (a miss).

        With ``late``, the call's outcome (its result, or None where it failed) is also handed to ``late``,
        and a call still running at the deadline is not cancelled (a write may be landing): it counts as a
        timeout now and ``late`` gets its outcome when it ends."""
        outcome = await self._attempt(op, call, deadline_s, late)
        if late is not None and not isinstance(outcome, _Late):
            late(outcome)
        return None if isinstance(outcome, _Late) else outcome

    async def _attempt(
        self,
        op: str,
        call: Callable[[], Awaitable[T]],
        deadline_s: float,
        late: Callable[[T | None], None] | None,
    ) -> T | _Late | None:
        if not self.breaker.allow():
            return None
        probe = self.breaker.probing  # this call holds the half-open probe: it must resolve it
        started = time.perf_counter()
        task = asyncio.ensure_future(call())
        try:
            done, _ = await asyncio.wait({task}, timeout=deadline_s)
        except asyncio.CancelledError:
            task.cancel()
            self.abandon(probe)
            raise
        finally:
            self.metrics.latency.labels(self.name, op).observe(time.perf_counter() - started)
        if not done:
            self.failed(op)
            if late is None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                return None
            self.late.add(task)
            task.add_done_callback(partial(_late_done, self.late, late))
            return _Late()
        if task.cancelled() or task.exception() is not None:
            self.failed(op)
            return None
        self.succeeded()
        return task.result()

    def failed(self, op: str) -> None:
        """Count a failed call of ``op``; may open the circuit."""
        self.metrics.errors.labels(self.name, op).inc()
        if self.breaker.record_failure():
            self.metrics.circuit_open.labels(self.name).set(1)

    def succeeded(self) -> None:
        """A call succeeded: the circuit closes."""
        self.breaker.record_success()
        self.metrics.circuit_open.labels(self.name).set(0)

    def abandon(self, probe: bool) -> None:
        """A call admitted by the circuit ended without a result (cancelled)."""
        if self.breaker.abandon(probe):
            self.metrics.circuit_open.labels(self.name).set(1)

    async def contains(self, keys: list[str], deadline_s: float) -> list[bool]:
        """Which ``keys`` the tier holds; a failed call is all misses (counted)."""
        result = await self.call("contains", lambda: self.adapter.batched_contains(keys), deadline_s)
        if result is None:  # its keys are misses here: the lookup counts them per chunk
            return [False] * len(keys)
        return result

    async def wait_late(self, timeout_s: float | None = None) -> None:
        """Wait for puts past their deadline to end; with ``timeout_s``, cancel those still running then."""
        if not self.late:
            return
        _, still = await asyncio.wait(set(self.late), timeout=timeout_s)
        for task in still:
            task.cancel()
        await asyncio.gather(*still, return_exceptions=True)


async def open_tier_adapter(tier: TierConfig, reopen_delay_s: float) -> Adapter:
    """Open one tier; a backend that is down now gives a ``ReopeningAdapter`` that keeps trying."""
    from tiercache._open import open_adapter
    from tiercache.store._reopen import ReopeningAdapter, is_down

    def opener() -> Awaitable[Adapter]:
        return open_adapter(tier.url, adapter=tier.adapter, **tier.adapter_options())

    try:
        return await opener()
    except Exception as exc:
        if not is_down(exc):
            raise
        return ReopeningAdapter(tier.name, opener, exc, first_delay_s=reopen_delay_s)
