"""KV events, cache resets and hit sources for vLLM: the connector's ``take_events``, ``reset_cache`` and
``get_external_cache_hit_sources``.

The worker's engine carries an :class:`~tiercache.events.EventSink` that follows its L1 and L2 tiers. Each
step the worker hands the sink's events to vLLM (``get_kv_connector_kv_cache_events``), vLLM brings them to
the scheduler (``update_connector_output``), and vLLM's scheduler publishes what ``take_events`` yields on
its KV event stream (``kv_events_config``). In server mode the server owns L1 and L2 and publishes the node's
events itself: the connector then yields none.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiercache.events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    Cleared,
    Event,
    EventSink,
    ForwardingSink,
    Removed,
    Stored,
    medium_of,
)
from tiercache.store.hits import L1_TIER
from tiercache_vllm import _loop

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from tiercache.config import Config
    from tiercache.store.engine import CacheEngine
    from tiercache_vllm.scheduler import SchedulerSide
    from tiercache_vllm.worker import WorkerSide

__all__ = [
    "EventRelay",
    "HitSources",
    "TierCacheKVEvents",
    "attach_sink",
    "hit_source",
    "reset_cache",
    "reset_worker",
    "to_vllm",
    "worker_events",
]

logger = logging.getLogger(__name__.replace("tiercache_vllm", "tiercache.vllm", 1))

_SOURCES = {MEDIUM_CPU: CacheHitSource.HOST, MEDIUM_DISK: CacheHitSource.DISK}


def hit_source(medium: str) -> CacheHitSource:
    """vLLM's hit source of a medium: L1 and memory tiers HOST, file tiers DISK, remote tiers EXTERNAL."""
    return _SOURCES.get(medium, CacheHitSource.EXTERNAL_UNSPECIFIED)


def tier_media(config: Config) -> dict[str, str]:
    """Each configured tier's event medium (L1 is CPU)."""
    return {L1_TIER: MEDIUM_CPU, **{tier.name: medium_of(tier.url) for tier in config.tiers}}


def events_enabled(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (``kv_events_config.enable_kv_cache_events``)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events)


def to_vllm(events: Iterable[Event]) -> list[KVCacheEvent]:
    """tiercache events as vLLM's event structs."""
    out: list[KVCacheEvent] = []
    for event in events:
        if isinstance(event, Stored):
            out.append(
                BlockStored(
                    block_hashes=list(event.block_hashes),
                    parent_block_hash=event.parent,
                    token_ids=list(event.token_ids),
                    block_size=event.block_size,
                    lora_id=None,
                    medium=event.medium,
                    lora_name=event.lora_name,
                )
            )
        elif isinstance(event, Removed):
            out.append(BlockRemoved(block_hashes=list(event.block_hashes), medium=event.medium))
        elif isinstance(event, Cleared):
            out.append(AllBlocksCleared())
    return out


def _identity(event: KVCacheEvent) -> Any:
    """A hashable stand-in for an event (vLLM's ``AllBlocksCleared`` is not hashable)."""
    if isinstance(event, AllBlocksCleared):
        return ("cleared",)
    return event


class TierCacheKVEvents(KVConnectorKVEvents):  # type: ignore[misc]
    """One step's events of the workers vLLM combined; ``aggregate`` keeps the events every worker sent
    (tensor-parallel ranks store the same blocks)."""

    def __init__(self, events: list[KVCacheEvent] | None = None, num_workers: int = 1) -> None:
        self._events: list[KVCacheEvent] = list(events or ())
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> TierCacheKVEvents:
        if self._workers > 1:
            counts = Counter(_identity(e) for e in self._events)
            kept: list[KVCacheEvent] = []
            for event in self._events:
                ident = _identity(event)
                if counts.get(ident, 0) >= self._workers:
                    kept.append(event)
                    del counts[ident]
            self._events = kept
            self._workers = 1
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []
        self._workers = 1


def attach_sink(engine: CacheEngine, vllm_config: VllmConfig, config: Config) -> EventSink:
    """Give a worker's in-process engine a sink following its tiers: events when vLLM publishes them, and
    always the keys each tier holds (what ``reset_cache`` deletes). On a server's shared L1 the sink only
    forwards which blocks each stored chunk covers: the server publishes the node's events."""
    from vllm import envs

    int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    describe = getattr(engine.manager.l1, "describe", None)
    if engine.manager.remote and describe is not None:
        engine.events = ForwardingSink(describe, int_hashes=int_hashes)
        return engine.events
    sink = EventSink(tier_media(config), emit=events_enabled(vllm_config), int_hashes=int_hashes)
    sink.attach(engine.manager)
    engine.events = sink
    return sink


def worker_events(worker: WorkerSide | None) -> TierCacheKVEvents | None:
    """The events the worker's engine queued since the last step (None: none, or no in-process engine)."""
    engine = None if worker is None else worker.engine
    sink = None if engine is None else engine.events
    if sink is None or isinstance(sink, ForwardingSink):
        return None
    events = to_vllm(sink.take())
    return TierCacheKVEvents(events) if events else None


class EventRelay:
    """Scheduler side: the workers' events (``update_connector_output``) until ``take_events``.

    With ``workers`` tensor-parallel workers an event goes out once every worker has sent it (they store
    and drop the same blocks, each its own rank's objects), in the step the last one did: a worker may
    report it steps later (a backend's expiry of each rank's object comes when it comes). Events some
    worker has not sent yet wait, the oldest forgotten past ``max_waiting``."""

    def __init__(self, workers: int = 1, *, max_waiting: int = 1 << 16) -> None:
        self.workers = max(1, workers)
        self.max_waiting = max_waiting
        self._pending: TierCacheKVEvents | None = None
        self._waiting: dict[Any, tuple[KVCacheEvent, int]] = {}  # identity -> (event, workers that sent it)

    def collect(self, output: KVConnectorOutput) -> None:
        """Keep the events a step's output carries."""
        events = getattr(output, "kv_cache_events", None)
        if not isinstance(events, TierCacheKVEvents):
            return
        if self._pending is None:
            self._pending = events
        else:
            self._pending.add_events(events.get_all_events())
            self._pending.increment_workers(events.get_number_of_workers())

    def take(self) -> list[KVCacheEvent]:
        """The events every worker has sent, as of the steps collected since the last call."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        events = pending.get_all_events()
        if self.workers == 1:
            return events
        counts = Counter(_identity(e) for e in events)
        out: list[KVCacheEvent] = []
        for event in events:
            ident = _identity(event)
            sent = counts.pop(ident, 0)
            if not sent:
                continue  # a later copy of one counted already
            sent += self._waiting.pop(ident, (event, 0))[1]
            if sent >= self.workers:
                out.append(event)
            else:
                self._waiting[ident] = (event, sent)
        while len(self._waiting) > self.max_waiting:
            del self._waiting[next(iter(self._waiting))]
        return out


class HitSources:
    """Per request, the tier behind each chunk of its planned load, for ``get_external_cache_hit_sources``."""

    def __init__(self, media: dict[str, str], chunk_size: int) -> None:
        self.media = media
        self.chunk_size = chunk_size
        self._plans: dict[str, tuple[int, tuple[str, ...]]] = {}

    def remember(self, side: SchedulerSide, request: Request, num_external_tokens: int) -> None:
        """Note where the lookup found the request's chunks (before the load plan consumes the lookup)."""
        req_id = request.request_id
        found = side._lookups.get(req_id)
        tiers = () if found is None else found.result.tiers if found.result is not None else found.tiers
        if num_external_tokens <= 0 or found is None or not tiers:
            self._plans.pop(req_id, None)
            return
        self._plans[req_id] = (found.local, tuple(tiers))

    def split(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """``num_external_tokens`` by source: each loaded token counts for the tier of its chunk."""
        if num_external_tokens <= 0:
            return {}
        plan = self._plans.pop(request.request_id, None)
        if plan is None:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        local, tiers = plan
        out: Counter[CacheHitSource] = Counter()
        start, end = local, local + num_external_tokens
        chunk = self.chunk_size
        while start < end:
            index = start // chunk
            stop = min(end, (index + 1) * chunk)
            tier = tiers[index] if index < len(tiers) else ""
            out[hit_source(self.media.get(tier, ""))] += stop - start
            start = stop
        return dict(out)

    def forget(self, req_id: str) -> None:
        self._plans.pop(req_id, None)


def reset_cache(side: SchedulerSide | None) -> bool:
    """Delete what this engine's keyspace holds in L1 and the L2 tiers (announced as events): in process,
    what the worker's engine holds, now; with workers in their own processes, each worker's at its next step
    (``reset_worker``; lookups miss until every worker has); in server mode, the keyspace on the node server
    (every instance of the same model there). False where the connector is disabled, the in-process clear
    failed, or the server refused (cache control needs its uid or admin group)."""
    if side is None:
        return False
    engines = side._get_engines()
    if not engines:
        return False
    prefixes = sorted({e.token_db.key_prefix for e in engines})
    if side.server.socket is not None:
        return _reset_on_server(side, side.server.socket, prefixes)
    if not side.shares_worker_engine:
        side.request_reset()
        logger.info("tiercache: reset_cache: the workers clear their keyspace before their next step")
        return True
    if engines[0].events is None:
        logger.warning("tiercache: reset_cache: the worker's engine follows no tier; nothing was reset")
        return False
    from tiercache.store.control import clear_keyspaces

    try:
        deleted = _loop.call(
            clear_keyspaces(engines[0].manager, engines[0].events, prefixes), side.settings.save_timeout_s
        )
    except Exception:
        logger.exception("tiercache: reset_cache failed")
        return False
    side._lookups.clear()
    logger.info("tiercache: reset_cache deleted %d objects", deleted)
    return True


def reset_worker(worker: WorkerSide, epoch: int) -> None:
    """Worker side of a reset the scheduler asked for (``TierCacheMetadata.reset_epoch`` newer than the
    worker's): finish the saves in flight, then delete what the worker's keyspace holds in its L1 and L2
    tiers (announced as events). A failure is logged; the epoch counts as done either way (a worker that
    could not delete must not keep every lookup a miss)."""
    if epoch <= worker.reset_epoch:
        return
    worker.reset_epoch = epoch
    engine = worker.engine
    sink = None if engine is None else engine.events
    if engine is None or sink is None or isinstance(sink, ForwardingSink):
        return  # no engine (disabled), or a server's L1: the scheduler reset it there
    from tiercache.store.control import clear_keyspaces

    prefixes = sorted({e.token_db.key_prefix for e in worker._group_engines or [engine]})
    try:
        worker._wait_saves()
        deleted = _loop.call(clear_keyspaces(engine.manager, sink, prefixes), worker.settings.save_timeout_s)
    except Exception:
        logger.exception("tiercache: reset_cache on a worker failed")
        return
    logger.info("tiercache: reset_cache deleted %d objects of this worker", deleted)


def _reset_on_server(side: SchedulerSide, socket_path: str, prefixes: list[str]) -> bool:
    """``tiercache cache delete --prefix`` of each keyspace prefix on the node server."""
    from tiercache.cli.cache import control

    deleted = 0
    try:
        for prefix in prefixes:
            deleted += int(control(socket_path, "delete", prefix=prefix).get("deleted", 0))
    except Exception as exc:
        logger.warning("tiercache: reset_cache on the server at %s failed: %s", socket_path, exc)
        return False
    side._lookups.clear()
    logger.info("tiercache: reset_cache deleted %d objects on the server", deleted)
    return True
