"""The PrefetchController: L2 -> decode -> L1 loads of chunks a lookup found below L1.

Reads stream chunk by chunk in prefix order (``l2_read_parallel`` in flight), each decoded into a fresh L1
object as it lands, under one deadline scaled with the bytes asked for; at the deadline the gets still
running are cancelled and the chunks that landed stay. A key being loaded has a future that readers wait on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from tiercache.errors import FrameError
from tiercache.keys import contiguous_prefix
from tiercache.store.l1_frames import decode_into_l1
from tiercache.store.l2_controller import L2Context, L2Controller

if TYPE_CHECKING:
    from tiercache.adapters import Buffer
    from tiercache.spec import KVSpec
    from tiercache.store.tier import TierClient

__all__ = ["PrefetchController"]


class PrefetchController(L2Controller):
    """Loads keys from L2 tiers into one L1 (on one event loop); at most one load per key at a time."""

    def __init__(
        self,
        ctx: L2Context,
        *,
        read_timer: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        super().__init__(ctx)
        self._read_timer = read_timer  # awaited for an L2 read's deadline (tests inject a controlled one)
        self.loading: dict[str, asyncio.Future[bool]] = {}
        """Key -> future of its load in flight (True when it landed in L1)."""

    def start(
        self, keys: Sequence[str], tiers: Sequence[str], specs: Sequence[KVSpec] | None = None
    ) -> asyncio.Task[int]:
        """Load ``keys`` (from the named tier of each) into L1 in the background; the task returns the
        number of leading keys now in L1."""
        loop = asyncio.get_running_loop()
        futures = {}
        for key in keys:
            if key not in self.loading:
                futures[key] = self.loading[key] = loop.create_future()
        return loop.create_task(self._prefetch(list(keys), list(tiers), specs, futures))

    async def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the loads in flight of any of ``keys``."""
        pending = [self.loading[k] for k in keys if k in self.loading]
        if pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(asyncio.gather(*pending)), timeout_s)

    async def _prefetch(
        self,
        keys: list[str],
        tiers: list[str],
        specs: Sequence[KVSpec] | None,
        futures: dict[str, asyncio.Future[bool]],
    ) -> int:
        loaded = [False] * len(keys)
        try:
            by_tier: dict[str, list[int]] = {}
            for i, name in enumerate(tiers):
                if keys[i] in futures:
                    by_tier.setdefault(name, []).append(i)
                else:
                    loaded[i] = True  # someone else is loading it; waited for by readers
            for tier in self.tiers:
                idx = by_tier.get(tier.name)
                if idx:
                    ok = await self._load_streaming(
                        tier, [keys[i] for i in idx], None if specs is None else [specs[i] for i in idx]
                    )
                    for i, good in zip(idx, ok, strict=True):
                        loaded[i] = good
        finally:
            for i, key in enumerate(keys):
                future = futures.get(key)
                if future is not None:
                    self.loading.pop(key, None)
                    if not future.done():
                        future.set_result(loaded[i])
        return contiguous_prefix(loaded)

    def read_bytes(self, count: int, specs: Sequence[KVSpec] | None) -> int:
        """Bytes an L2 read of ``count`` chunks asks for (their specs, else full L1 slots)."""
        return sum(s.nbytes for s in specs) if specs is not None else count * self.l1.slot_bytes

    async def _load_streaming(
        self, tier: TierClient, keys: list[str], specs: list[KVSpec] | None
    ) -> list[bool]:
        """Get ``keys`` from one tier chunk by chunk, each decoded into L1 as it lands; which are in L1."""
        if not keys or not tier.breaker.allow():
            return [False] * len(keys)
        probe = tier.breaker.probing
        deadline_s = self.policy.l2_read_deadline_s(self.read_bytes(len(keys), specs))
        results = [False] * len(keys)
        failures = 0
        gate = asyncio.Semaphore(self.policy.l2_read_parallel)
        started = time.perf_counter()

        async def one(i: int) -> None:
            nonlocal failures
            try:
                async with gate:
                    frames = await tier.adapter.batched_get([keys[i]])
            except asyncio.CancelledError:
                raise
            except Exception:  # a backend failure is a miss
                failures += 1
                return
            frame = frames[0] if len(frames) == 1 else None
            if frame is None:
                self.metrics.vanished.labels(tier.name).inc()
                return
            self.metrics.bytes_read.labels(tier.name).inc(len(frame))
            spec = None if specs is None else specs[i]
            # the decode writes into L1 from a codec thread: never cancelled half way
            results[i] = await asyncio.shield(self._decode_into_l1(tier, keys[i], frame, spec))

        gets = [asyncio.ensure_future(one(i)) for i in range(len(keys))]
        everything = asyncio.gather(*gets, return_exceptions=True)
        timer = asyncio.ensure_future(self._read_timer(deadline_s))
        try:
            waits: list[asyncio.Future[Any]] = [everything, timer]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            for g in gets:
                g.cancel()
            tier.abandon(probe)
            raise
        finally:
            timer.cancel()
            self.metrics.latency.labels(tier.name, "get").observe(time.perf_counter() - started)
        timed_out = not everything.done()
        for g in gets:
            g.cancel()
        with contextlib.suppress(BaseException):
            await everything
        if timed_out or failures:
            tier.failed("get")
        else:
            tier.succeeded()
        return results

    async def _decode_into_l1(self, tier: TierClient, key: str, frame: Buffer, spec: KVSpec | None) -> bool:
        """Decode one frame into a fresh L1 object (its header parsed once, here); a bad frame is a miss."""
        from tiercache.serde import read_header

        try:
            header = read_header(frame)
        except FrameError:
            self.metrics.frames_rejected.labels(tier.name).inc()
            return False
        target = spec or header.spec
        obj = self.l1.reserve_write(key, target)
        if obj is None:
            return self.l1.contains(key)
        try:
            await self._run(lambda: decode_into_l1(tier.pipeline, frame, obj, self._l1_codec, target, header))
        except FrameError:
            self.l1.abort_write(obj)
            self.metrics.frames_rejected.labels(tier.name).inc()
            return False
        except BaseException:
            self.l1.abort_write(obj)
            raise
        self.l1.finish_write(obj)
        self.metrics.prefetched.labels(tier.name).inc()
        return True
