"""tiercache's numbers inside vLLM's own: the KV-connector stats hooks (``vllm.distributed.kv_transfer.
kv_connector.v1.metrics``), so hits per tier, bytes moved, load errors and store drops reach ``vllm serve``'s
``/metrics`` and its periodic "KV Transfer metrics" log line.

Flow (vLLM 0.32): every step the worker's and the scheduler's ``get_kv_connector_stats`` return a
``TierCacheStats`` holding the *increments* since the previous call; vLLM aggregates them over workers and the
scheduler, ships ``to_dict()`` to the front-end process, rebuilds the object with
``build_kv_connector_stats`` and feeds it to ``TierCachePromMetrics.observe`` (Prometheus counters named
``vllm:tiercache_*``, labelled with vLLM's engine labels plus ``tier``) and, per logging interval, to
``reduce()`` for the log line.

Payload (JSON-able, string keys only)::

    {"counters": {name: {tier: increment}}, "gauges": {name: {tier: value}}}

Counters from each engine's ``tiercache.metrics.Metrics`` (summed over labels other than ``tier``): ``hits``,
``misses``, ``read_bytes``, ``written_bytes``, ``stores``, ``stores_dropped``, ``frames_rejected``,
``tier_errors``, ``prefetched``, ``call_seconds``/``calls`` (the tier-call latency histogram's sum and
count over all operations: their rates give the mean latency); from the connector's own counters
(tier ``""``): ``load_errors``, ``invalid_blocks``, ``tokens_loaded``, ``tokens_saved``, ``save_failures``,
``kv_bytes_read``, ``kv_bytes_read_full``, ``kv_bytes_stored`` (hybrid models), ``lookups``,
``lookup_failures``, ``lookup_hit_tokens``; in server mode, from each engine's client of the
server (tier ``""``): ``server_requests``, ``server_lost_connections``, ``server_reconnects``,
``server_offline_misses``, ``server_skipped_stores``, ``server_refused_leases``. Gauges (the largest value
over workers): ``circuit_open`` (1 while a tier's circuit is open), ``store_queue_depth``, ``tier_down``,
and the usage gauges ``used_bytes``, ``objects``, ``capacity_bytes`` (which alone never make an interval
non-empty). Usage gauges of an in-process engine too: ``hit_rate_ceiling`` (tier ``""``: the hit rate an
unbounded cache would reach on the chunks its lookups asked for) and, by tenant label in place of the tier,
``tenant_l1_bytes``, ``tenant_l1_hits``, ``tenant_l1_evictions`` (``TENANT_GAUGES``). Also ``evictions``
and ``vanished`` counters, the tier-call latency histogram's bucket increments under ``histograms``
(``stats_histograms``), and, in an engine's first interval, ``tiers``: the tier names, so the front end
creates every counter, gauge and histogram of each tier at 0 (and ``evicting``: the L2 tiers that count their
own evictions, whose ``evictions`` it creates at 0 too).
Increments are taken per ``Metrics`` object, shared by every connector side of the process, so an engine the
scheduler shares with the worker is counted once.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from tiercache.metrics import TIER_OPS
from tiercache_vllm.stats_histograms import PromHistograms, add_histograms, histogram_increments

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from tiercache.metrics import Metrics
    from tiercache.store.engine import CacheEngine

__all__ = [
    "CONNECTOR_COUNTERS",
    "ENGINE_COUNTERS",
    "GAUGES",
    "PROM_PREFIX",
    "SERVER_COUNTERS",
    "TENANT_GAUGES",
    "SideCounters",
    "TierCachePromMetrics",
    "TierCacheStats",
    "collect_stats",
    "engine_increments",
    "read_engine_metrics",
    "read_engine_metrics_slow",
    "server_increments",
    "usage_gauges",
]

PROM_PREFIX = "vllm:tiercache_"
"""Prefix of the Prometheus metrics the connector adds to vLLM's registry (counters end in ``_total``)."""

ENGINE_COUNTERS: dict[str, tuple[str, str]] = {
    # payload name: (tiercache.metrics sample name, help text)
    "hits": ("tiercache_hits_total", "Chunks found by lookups, by tier"),
    "misses": ("tiercache_misses_total", "Chunks looked up and not found, by tier"),
    "read_bytes": ("tiercache_read_bytes_total", "Frame bytes read from a tier"),
    "written_bytes": ("tiercache_written_bytes_total", "Frame bytes stored in a tier"),
    "stores": ("tiercache_stores_total", "Objects stored, by tier"),
    "stores_dropped": ("tiercache_stores_dropped_total", "Stores dropped (queue full, evicted, failed)"),
    "frames_rejected": ("tiercache_frames_rejected_total", "Frames that failed their checks (misses)"),
    "tier_errors": ("tiercache_tier_errors_total", "Failed or timed-out tier calls"),
    "prefetched": ("tiercache_prefetched_total", "Chunks loaded from L2 into L1"),
    "vanished": ("tiercache_vanished_total", "Chunks a lookup found that were gone when loaded"),
    "evictions": ("tiercache_evictions_total", "Objects evicted to make room, by tier"),
    "call_seconds": ("tiercache_tier_latency_seconds_sum", "Seconds spent in tier calls (all operations)"),
    "calls": ("tiercache_tier_latency_seconds_count", "Tier calls (all operations)"),
}
CONNECTOR_COUNTERS: dict[str, str] = {
    "load_errors": "KV loads that failed (the blocks were recomputed)",
    "invalid_blocks": "Blocks reported to vLLM for recomputation",
    "tokens_loaded": "Tokens restored from tiercache into the paged KV",
    "tokens_saved": "Tokens newly stored from the paged KV into tiercache (cached chunks count none)",
    "save_failures": "KV saves that failed (nothing stored)",
    "kv_bytes_read": "Bytes of chunk objects a hybrid model's loads read (windowed groups: their window's)",
    "kv_bytes_read_full": "Bytes those loads would read with every group needing every chunk",
    "kv_bytes_stored": "Bytes of chunk objects a hybrid model's saves gathered (one per group per chunk)",
    "lookups": "Scheduler lookups of a prompt's stored prefix",
    "lookup_failures": "Scheduler lookups that failed (treated as misses)",
    "lookup_hit_tokens": "Tokens the scheduler reported as external hits",
    "server_requests": "Round trips to the tiercache server (server mode)",
    "server_lost_connections": "Connections to the server lost (a failed or timed-out request, a hang-up)",
    "server_reconnects": "Connections to the server made again after one was lost",
    "server_offline_misses": "Keys looked up while no connection to the server was up (misses at once)",
    "server_skipped_stores": "Objects not stored while no connection to the server was up",
    "server_refused_leases": "Hits the server answered as misses (this client's lease caps)",
}
SERVER_COUNTERS = (
    "server_requests",
    "server_lost_connections",
    "server_reconnects",
    "server_offline_misses",
    "server_skipped_stores",
    "server_refused_leases",
)
"""The CONNECTOR_COUNTERS read from an engine's client of the server (``_server.server_engine_stats``)."""
GAUGES: dict[str, tuple[str, str]] = {
    "circuit_open": ("tiercache_circuit_open", "1 while a tier's circuit is open"),
    "store_queue_depth": ("tiercache_store_queue_depth", "Objects waiting in a tier's store queue"),
    "tier_down": ("tiercache_tier_down", "1 while a tier that was down at start is not re-opened yet"),
    "used_bytes": ("tiercache_used_bytes", "Bytes held, by tier"),
    "objects": ("tiercache_objects", "Objects held, by tier"),
    "capacity_bytes": ("tiercache_capacity_bytes", "Bytes a tier may hold (0: unbounded)"),
}
TENANT_GAUGES: dict[str, tuple[str, str]] = {
    # payload name: (field of tiercache.store.l1.TenantStats, help text); rows keyed by tenant label
    "tenant_l1_bytes": ("held_bytes", "L1 bytes held, by tenant"),
    "tenant_l1_hits": ("hits", "L1 reads served, by tenant"),
    "tenant_l1_evictions": ("evictions", "L1 objects evicted, by tenant"),
}
CEILING = "hit_rate_ceiling"
CEILING_DOC = "Estimated hit rate an unbounded cache would reach on the chunks looked up so far"
_USAGE_GAUGES = frozenset({"used_bytes", "objects", "capacity_bytes", CEILING, *TENANT_GAUGES})
"""Gauges that ride along with an interval's other numbers but do not make it non-empty by themselves."""
_SAMPLE_TO_COUNTER = {sample: name for name, (sample, _) in ENGINE_COUNTERS.items()}
_SAMPLE_TO_GAUGE = {sample: name for name, (sample, _) in GAUGES.items()}
_NO_TIER = ""

Table = dict[str, dict[str, float]]


@dataclass
class TierCacheStats(KVConnectorStats):  # type: ignore[misc]
    """Counter increments and gauge values of one interval (see the module docstring for the payload)."""

    def __post_init__(self) -> None:
        if not isinstance(self.data.get("counters"), dict) or not isinstance(self.data.get("gauges"), dict):
            self.reset()
        if not isinstance(self.data.get("histograms", {}), dict) or not isinstance(
            self.data.get("tiers", []), list
        ):
            self.reset()

    @property
    def counters(self) -> Table:
        """``{name: {tier: increment}}``."""
        return cast("Table", self.data["counters"])

    @property
    def gauges(self) -> Table:
        """``{name: {tier: latest value}}``."""
        return cast("Table", self.data["gauges"])

    def reset(self) -> None:
        """Empty the interval."""
        self.data: dict[str, Any] = {"counters": {}, "gauges": {}}

    def add(self, name: str, tier: str, increment: float) -> None:
        """Add ``increment`` to counter ``name`` of ``tier`` (zero increments are not recorded)."""
        if increment:
            row = self.counters.setdefault(name, {})
            row[tier] = row.get(tier, 0) + increment

    def set_gauge(self, name: str, tier: str, value: float) -> None:
        """Record the current value of gauge ``name`` for ``tier``."""
        self.gauges.setdefault(name, {})[tier] = value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Sum counters; a gauge keeps the larger value (a circuit open on any worker is open)."""
        if other.is_empty():
            return self
        incoming = other if isinstance(other, TierCacheStats) else TierCacheStats(data=dict(other.data))
        for name, row in incoming.counters.items():
            for tier, value in row.items():
                self.add(name, tier, value)
        for name, row in incoming.gauges.items():
            mine = self.gauges.setdefault(name, {})
            for tier, value in row.items():
                mine[tier] = max(mine.get(tier, value), value)
        add_histograms(self.data, incoming.data.get("histograms") or {})
        for announced in ("tiers", "evicting"):
            if incoming.data.get(announced):
                self.data[announced] = sorted({*self.data.get(announced, ()), *incoming.data[announced]})
        return self

    def reduce(self) -> dict[str, int | float]:
        """The log line's values: each non-zero counter and gauge (``name[tier]``) and hit ratios."""
        out: dict[str, int | float] = {}
        for name in sorted(self.counters):
            for tier, value in sorted(self.counters[name].items()):
                out[f"{name}[{tier}]" if tier else name] = _number(value)
        hits, misses = self.counters.get("hits", {}), self.counters.get("misses", {})
        for tier in sorted(set(hits) & set(misses)):
            looked = hits[tier] + misses[tier]
            if looked:
                out[f"hit_ratio[{tier}]"] = round(hits[tier] / looked, 4)
        for name in sorted(self.gauges):
            for tier, value in sorted(self.gauges[name].items()):
                if value:
                    out[f"{name}[{tier}]"] = _number(value)
        return out

    def is_empty(self) -> bool:
        """True when nothing happened in the interval (no increments, no open circuit, no down tier, no
        queue, no new tier to announce); usage gauges alone do not count."""
        return (
            not any(self.counters.values())
            and not any(
                v for name, row in self.gauges.items() if name not in _USAGE_GAUGES for v in row.values()
            )
            and not self.data.get("histograms")
            and not self.data.get("tiers")
        )


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


# ----- increments since the previous call --------------------------------------------------------------
class _Baseline:
    """The cumulative values already reported for one source (a Metrics registry or a side's counters)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: dict[tuple[str, str], float] = {}

    def increment(self, name: str, tier: str, total: float) -> float:
        key = (name, tier)
        before = self.seen.get(key, 0.0)
        self.seen[key] = total
        return total - before if total >= before else total  # a reset source starts again from zero


_ENGINE_BASELINES: weakref.WeakKeyDictionary[Metrics, _Baseline] = weakref.WeakKeyDictionary()
_SERVER_BASELINES: weakref.WeakKeyDictionary[object, _Baseline] = weakref.WeakKeyDictionary()
_ENGINE_LOCK = threading.Lock()


Readings = tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]
"""(counter totals, gauge values), each keyed by (payload name, tier)."""

# payload name -> (tiercache.metrics.Metrics attribute, what to read: "value", "sum" or "count")
_ENGINE_SOURCES: dict[str, tuple[str, str]] = {
    "hits": ("hits", "value"),
    "misses": ("misses", "value"),
    "read_bytes": ("bytes_read", "value"),
    "written_bytes": ("bytes_written", "value"),
    "stores": ("stores", "value"),
    "stores_dropped": ("stores_dropped", "value"),
    "frames_rejected": ("frames_rejected", "value"),
    "tier_errors": ("errors", "value"),
    "prefetched": ("prefetched", "value"),
    "vanished": ("vanished", "value"),
    "evictions": ("evictions", "value"),
    "call_seconds": ("latency", "sum"),
    "calls": ("latency", "count"),
}
_GAUGE_SOURCES: dict[str, str] = {name: name for name in GAUGES}


def read_engine_metrics_slow(metrics: Metrics) -> Readings:
    """Totals and gauges through the public ``registry.collect()`` (about 0.5 ms: the reference reading)."""
    totals: dict[tuple[str, str], float] = {}
    gauges: dict[tuple[str, str], float] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            tier = str(sample.labels.get("tier", _NO_TIER))
            if sample.name in _SAMPLE_TO_COUNTER:
                key = (_SAMPLE_TO_COUNTER[sample.name], tier)
                totals[key] = totals.get(key, 0.0) + sample.value
            elif sample.name in _SAMPLE_TO_GAUGE:
                gauges[(_SAMPLE_TO_GAUGE[sample.name], tier)] = sample.value
    return totals, gauges


def read_engine_metrics(metrics: Metrics) -> Readings:
    """The same readings as ``read_engine_metrics_slow`` from the metric children's values directly (tens of
    microseconds: it runs every engine step); falls back to the slow path if prometheus_client changed."""
    try:
        totals: dict[tuple[str, str], float] = {}
        for name, (attr, part) in _ENGINE_SOURCES.items():
            wrapper = getattr(metrics, attr)
            at = list(wrapper._labelnames).index("tier")
            for labels, child in list(wrapper._metrics.items()):
                if part == "value":
                    value = child._value.get()
                elif part == "sum":
                    value = child._sum.get()
                else:
                    value = sum(bucket.get() for bucket in child._buckets)
                key = (name, str(labels[at]))
                totals[key] = totals.get(key, 0.0) + value
        gauges: dict[tuple[str, str], float] = {}
        for name, attr in _GAUGE_SOURCES.items():
            wrapper = getattr(metrics, attr)
            at = list(wrapper._labelnames).index("tier")
            for labels, child in list(wrapper._metrics.items()):
                (sample,) = child._child_samples()  # one sample; also reads set_function gauges
                gauges[(name, str(labels[at]))] = float(sample.value)
        return totals, gauges
    except (AttributeError, ValueError, TypeError):
        return read_engine_metrics_slow(metrics)


def engine_increments(metrics: Metrics, into: TierCacheStats) -> None:
    """Add ``metrics``' counter increments since the last call for the same ``Metrics`` (any caller in this
    process) and its current gauge values to ``into``."""
    with _ENGINE_LOCK:
        fresh = metrics not in _ENGINE_BASELINES
        baseline = _ENGINE_BASELINES.setdefault(metrics, _Baseline())
    totals, gauges = read_engine_metrics(metrics)
    if fresh:  # announce the engine's tiers once: the front end creates their metrics at 0
        into.data["tiers"] = sorted({*into.data.get("tiers", ()), *(tier for _, tier in totals)})
        evicting = {tier for name, tier in totals if name == "evictions" and tier != "L1"}
        if evicting:
            into.data["evicting"] = sorted({*into.data.get("evicting", ()), *evicting})
    add_histograms(into.data, histogram_increments(metrics))
    with baseline.lock:
        for (name, tier), total in totals.items():
            into.add(name, tier, baseline.increment(name, tier, total))
    for (name, tier), value in gauges.items():
        into.set_gauge(name, tier, value)


def usage_gauges(engine: CacheEngine | None, into: TierCacheStats) -> None:
    """Set ``engine``'s hit-rate ceiling and its local L1's per-tenant gauges in ``into`` (those it has)."""
    manager = getattr(engine, "manager", None)
    ceiling = getattr(manager, "ceiling", None)
    if ceiling is not None:
        into.set_gauge(CEILING, _NO_TIER, round(float(ceiling.ceiling()), 4))
    tenant_stats = getattr(getattr(manager, "l1", None), "tenant_stats", None)
    if callable(tenant_stats):
        for label, st in tenant_stats().items():
            for name, (field, _) in TENANT_GAUGES.items():
                into.set_gauge(name, str(label), float(getattr(st, field)))


def server_increments(engine: CacheEngine | None, into: TierCacheStats) -> None:
    """Add the increments of ``engine``'s server-client counters (server mode; nothing for an in-process
    engine) since the last call for the same client (any caller in this process) to ``into``."""
    from tiercache_vllm._server import server_engine_stats

    totals = server_engine_stats(engine)
    if not totals or engine is None:
        return
    client = engine.manager.l1
    with _ENGINE_LOCK:
        baseline = _SERVER_BASELINES.setdefault(client, _Baseline())
    with baseline.lock:
        for name in SERVER_COUNTERS:
            into.add(name, _NO_TIER, baseline.increment(name, _NO_TIER, float(totals[name])))


class SideCounters:
    """Increments of a connector side's own cumulative counters (the worker's/scheduler's ``stats``)."""

    FIELDS: ClassVar[dict[str, str]] = {
        # connector stats attribute -> payload counter
        "load_failures": "load_errors",
        "invalid_blocks": "invalid_blocks",
        "tokens_loaded": "tokens_loaded",
        "tokens_saved": "tokens_saved",
        "save_failures": "save_failures",
        "kv_bytes_read": "kv_bytes_read",
        "kv_bytes_read_full": "kv_bytes_read_full",
        "kv_bytes_stored": "kv_bytes_stored",
        "lookups": "lookups",
        "lookup_failures": "lookup_failures",
        "hit_tokens": "lookup_hit_tokens",
    }

    def __init__(self) -> None:
        self._baselines: dict[str, _Baseline] = {}

    def add(self, side: str, stats: object, into: TierCacheStats) -> None:
        """Add the increments of the known fields of ``stats`` (a side's counters) since the last call."""
        baseline = self._baselines.setdefault(side, _Baseline())
        for attr, name in self.FIELDS.items():
            total = getattr(stats, attr, None)
            if isinstance(total, int | float) and not isinstance(total, bool):
                into.add(name, _NO_TIER, baseline.increment(name, _NO_TIER, float(total)))


# ----- Prometheus --------------------------------------------------------------------------------------
class TierCachePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """``vllm:tiercache_*`` counters and gauges per engine and tier in vLLM's Prometheus registry."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = [*labelnames, "tier"]
        self._counters: dict[str, Any] = {}
        docs = {name: doc for name, (_, doc) in ENGINE_COUNTERS.items()} | CONNECTOR_COUNTERS
        for name, doc in docs.items():
            self._counters[name] = self._counter_cls(
                name=f"{PROM_PREFIX}{name}", documentation=f"tiercache: {doc}", labelnames=names
            )
        self._gauges: dict[str, Any] = {
            name: self._gauge_cls(
                name=f"{PROM_PREFIX}{name}",
                documentation=f"tiercache: {doc}",
                labelnames=names,
                multiprocess_mode="mostrecent",
            )
            for name, (_, doc) in GAUGES.items()
        }
        self._gauges[CEILING] = self._gauge_cls(
            name=f"{PROM_PREFIX}{CEILING}",
            documentation=f"tiercache: {CEILING_DOC}",
            labelnames=names,
            multiprocess_mode="mostrecent",
        )
        self._tenant_gauges: dict[str, Any] = {
            name: self._gauge_cls(
                name=f"{PROM_PREFIX}{name}",
                documentation=f"tiercache: {doc}",
                labelnames=[*labelnames, "tenant"],
                multiprocess_mode="mostrecent",
            )
            for name, (_, doc) in TENANT_GAUGES.items()
        }
        self._histograms = PromHistograms(self._histogram_cls, PROM_PREFIX, labelnames)
        self._touched: set[tuple[int, str]] = set()
        for engine_idx in per_engine_labelvalues:  # every counter at 0 from the start
            self._touch(engine_idx, _NO_TIER)
            self._touch(engine_idx, "L1")

    def _touch(self, engine_idx: int, tier: str) -> None:
        """Create ``tier``'s children of every counter, gauge and histogram (at 0), once per engine."""
        if (engine_idx, tier) in self._touched:
            return
        self._touched.add((engine_idx, tier))
        labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        names = set(CONNECTOR_COUNTERS) if tier == _NO_TIER else set(ENGINE_COUNTERS)
        if tier not in (_NO_TIER, "L1"):
            names.discard("evictions")  # an L2 tier's only when announced as evicting (``observe``)
        for name in names:
            self._counters[name].labels(*labels, tier)
        if tier == _NO_TIER:
            self._gauges[CEILING].labels(*labels, tier)
        else:
            for name, gauge in self._gauges.items():
                if name != CEILING:
                    gauge.labels(*labels, tier)
            if tier != "L1":
                self._histograms.touch(labels, tier, TIER_OPS)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's increments (``to_dict()`` of a ``TierCacheStats``) to the counters."""
        stats = TierCacheStats(data=dict(transfer_stats_data))
        labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for tier in stats.data.get("tiers") or ():
            self._touch(engine_idx, str(tier))
        for tier in stats.data.get("evicting") or ():  # L2 tiers that count their evictions: at 0 too
            self._counters["evictions"].labels(*labels, str(tier))
        self._histograms.observe(labels, stats.data.get("histograms") or {})
        for name, row in stats.counters.items():
            counter = self._counters.get(name)
            if counter is None:
                continue  # a newer worker's counter this front end does not know
            for tier, value in row.items():
                if value > 0:
                    counter.labels(*labels, tier).inc(value)
        for name, row in stats.gauges.items():
            tenant_gauge = self._tenant_gauges.get(name)
            if tenant_gauge is not None:
                for tenant, value in row.items():
                    tenant_gauge.labels(*labels, tenant).set(value)
                continue
            gauge = self._gauges.get(name)
            if gauge is not None:
                for tier, value in row.items():
                    gauge.labels(*labels, tier).set(value)


# ----- what the connector's hook calls ------------------------------------------------------------------
def collect_stats(
    worker: object | None, scheduler: object | None, sides: SideCounters
) -> TierCacheStats | None:
    """This process's increments since the last call: the sides' own counters and their engines' metrics
    (``None`` when nothing happened, as vLLM expects)."""
    stats = TierCacheStats()
    engines: list[Any] = []
    if worker is not None:
        sides.add("worker", getattr(worker, "stats", None), stats)
        engines.append(getattr(worker, "engine", None))
    if scheduler is not None:
        sides.add("scheduler", getattr(scheduler, "stats", None), stats)
        engines += list(getattr(scheduler, "_engines", None) or [])
    seen: set[int] = set()
    for engine in engines:
        metrics = getattr(getattr(engine, "manager", None), "metrics", None)
        if metrics is not None and id(metrics) not in seen:
            seen.add(id(metrics))
            engine_increments(metrics, stats)
            server_increments(engine, stats)
            usage_gauges(engine, stats)
    return None if stats.is_empty() else stats
