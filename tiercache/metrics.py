"""Prometheus metrics of one storage manager (own registry, so several managers never collide).

Hits and misses are counted per chunk with one tier label scheme, so ``hits / (hits + misses)`` per tier is
that tier's hit ratio: a chunk served by tier T is a hit at T and a miss at every tier before T; a chunk no
tier served is a miss at every tier. Every child of a tier is created at 0 when the tier is added
(:meth:`Metrics.add_tier`), so dashboards show 0, not "No data", before the first event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["DROP_REASONS", "L1", "LATENCY_BUCKETS", "TIER_OPS", "Metrics"]

TIER_OPS = ("contains", "get", "put", "delete")
"""Tier call operations (``op`` label): lookup, load, save, delete."""
DROP_REASONS = (
    "queue_full",
    "evicted",
    "lease_expired",
    "too_large",
    "error",
    "failed",
    "refused",
    "not_admitted",
    "quota",
)
"""Why a store was dropped (``reason`` label of ``tiercache_stores_dropped``)."""

L1 = "L1"
"""The ``tier`` label of L1 (``tiercache.store.hits.L1_TIER``)."""


class _TenantCollector(Collector):
    """Per-tenant L1 gauges read from ``tenant_stats()`` when scraped."""

    def __init__(self, tenant_stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = tenant_stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fams = {
            "hits": GaugeMetricFamily(
                "tiercache_tenant_l1_hits", "L1 reads served, by tenant", labels=["tenant"]
            ),
            "held_bytes": GaugeMetricFamily(
                "tiercache_tenant_l1_bytes", "L1 bytes held, by tenant", labels=["tenant"]
            ),
            "evictions": GaugeMetricFamily(
                "tiercache_tenant_l1_evictions", "L1 objects evicted, by tenant", labels=["tenant"]
            ),
        }
        for label, st in self._stats().items():
            for field, fam in fams.items():
                fam.add_metric([label], float(getattr(st, field)))
        yield from fams.values()


LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    """Hits, misses, bytes, latencies, store queues, dropped stores, rejected frames, circuits per tier."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.hits = Counter("tiercache_hits", "Chunks found, by tier", ["tier"], registry=r)
        self.misses = Counter(
            "tiercache_misses", "Chunks looked up and not found, by tier", ["tier"], registry=r
        )
        self.bytes_read = Counter(
            "tiercache_read_bytes", "Frame bytes read from a tier", ["tier"], registry=r
        )
        self.bytes_written = Counter(
            "tiercache_written_bytes", "Frame bytes stored in a tier", ["tier"], registry=r
        )
        self.stores = Counter("tiercache_stores", "Objects stored, by tier", ["tier"], registry=r)
        self.stores_dropped = Counter(
            "tiercache_stores_dropped",
            "Stores dropped (queue full, L1 evicted, failed)",
            ["tier", "reason"],
            registry=r,
        )
        self.frames_rejected = Counter(
            "tiercache_frames_rejected",
            "Frames that failed their checks (served as misses)",
            ["tier"],
            registry=r,
        )
        self.errors = Counter(
            "tiercache_tier_errors", "Failed or timed-out tier calls", ["tier", "op"], registry=r
        )
        self.store_queue_depth = Gauge(
            "tiercache_store_queue_depth",
            "Objects waiting in a tier's background store queue",
            ["tier"],
            registry=r,
        )
        self.tier_down = Gauge(
            "tiercache_tier_down",
            "1 while a tier that was down at start is not re-opened yet (its calls are misses)",
            ["tier"],
            registry=r,
        )
        self.circuit_open = Gauge(
            "tiercache_circuit_open", "1 while a tier's circuit is open", ["tier"], registry=r
        )
        self.latency = Histogram(
            "tiercache_tier_latency_seconds",
            "Tier call latency",
            ["tier", "op"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefetched = Counter(
            "tiercache_prefetched", "Chunks loaded from L2 into L1", ["tier"], registry=r
        )
        self.vanished = Counter(
            "tiercache_vanished",
            "Chunks a lookup found in a tier that were gone when loaded",
            ["tier"],
            registry=r,
        )
        self.l1_alloc_failures = Counter("tiercache_l1_alloc_failures", "L1 allocations refused", registry=r)
        self.evictions = Counter(
            "tiercache_evictions", "Objects evicted to make room, by tier", ["tier"], registry=r
        )
        self.used_bytes = Gauge(
            "tiercache_used_bytes", "Bytes held, by tier (L1: its slots in use)", ["tier"], registry=r
        )
        self.objects = Gauge("tiercache_objects", "Objects held, by tier", ["tier"], registry=r)
        self.capacity_bytes = Gauge(
            "tiercache_capacity_bytes", "Bytes a tier may hold (0: unbounded)", ["tier"], registry=r
        )
        self.hit_rate_ceiling = Gauge(
            "tiercache_hit_rate_ceiling",
            "Estimated hit rate an unbounded cache would reach on the chunks looked up so far",
            registry=r,
        )

    def add_tier(self, tier: str, *, l2: bool = True) -> None:
        """Create every child of ``tier`` at 0 (idempotent): hits and misses for any tier, evictions for L1
        (an L2 tier's with :meth:`watch_tier`, for an adapter that evicts); for an L2 tier also its bytes,
        stores, drops, errors, latency per op, rejections and circuit."""
        families: list[Counter | Gauge] = [self.hits, self.misses]
        if tier == L1:
            families.append(self.evictions)
        if l2:
            families += [
                self.bytes_read,
                self.bytes_written,
                self.stores,
                self.frames_rejected,
                self.prefetched,
                self.vanished,
                self.circuit_open,
            ]
        for family in families:
            family.labels(tier)
        if not l2:
            return
        for op in TIER_OPS:
            self.errors.labels(tier, op)
            self.latency.labels(tier, op)
        for reason in DROP_REASONS:
            self.stores_dropped.labels(tier, reason)

    def watch_l1(self, l1: Any) -> None:
        """Read a local L1's occupancy at scrape time (``l1.stats()``) and count its evictions (an L1
        listener). An L1 without ``stats`` or ``add_listener`` is skipped (a server's shared L1: the server
        exports its own)."""
        stats = getattr(l1, "stats", None)
        if callable(stats):
            self.used_bytes.labels(L1).set_function(lambda: stats().used_bytes)
            self.objects.labels(L1).set_function(lambda: stats().ready)
            self.capacity_bytes.labels(L1).set_function(lambda: stats().capacity)
        self._count_evictions(L1, l1)

    def _count_evictions(self, tier: str, source: object) -> None:
        """Count what ``source`` (an L1 or an L2 adapter) reports as evicted through its ``add_listener``
        (``fn(kind, keys)``) under ``tier``, the series created at 0; nothing if it has no listeners."""
        add_listener = getattr(source, "add_listener", None)
        if not callable(add_listener):
            return
        evicted = self.evictions.labels(tier)

        def count(kind: str, keys: Sequence[str]) -> None:
            if kind == "evicted":
                evicted.inc(len(keys))

        add_listener(count)

    def watch_tenants(self, l1: Any) -> None:
        """Export a local L1's per-tenant counters (``tenant_stats()``: a bounded label set, the overflow
        under ``"other"``) at scrape time: ``tiercache_tenant_l1_{hits,bytes,evictions}``. An L1 without
        them is skipped."""
        tenant_stats = getattr(l1, "tenant_stats", None)
        if callable(tenant_stats):
            self.registry.register(_TenantCollector(tenant_stats))

    def watch_tier(self, tier: str, adapter: object) -> None:
        """Read an L2 adapter's ``used_bytes``, ``len()`` and ``capacity`` at scrape time, and count the
        objects it evicts for room (from 0) through its ``add_listener``, for those it offers (none is
        required of an adapter: one that never evicts on its own has no evictions series)."""
        self._count_evictions(tier, adapter)
        readers: dict[Gauge, Callable[[], float]] = {}
        if hasattr(type(adapter), "used_bytes"):
            readers[self.used_bytes] = lambda: float(getattr(adapter, "used_bytes", 0) or 0)
        if hasattr(type(adapter), "__len__"):
            readers[self.objects] = lambda: float(len(adapter))  # type: ignore[arg-type]
        if hasattr(adapter, "capacity"):
            readers[self.capacity_bytes] = lambda: float(getattr(adapter, "capacity", 0) or 0)
        for gauge, read in readers.items():
            gauge.labels(tier).set_function(read)

    def sample_names(self) -> set[str]:
        """Every sample name this registry can export (``_total`` counters, ``_sum``/``_count``/``_bucket``
        histograms), whether or not a labelled child exists yet (dashboards and tests check against it)."""
        suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
        return {
            f"{family.name}{suffix}"
            for family in self.registry.collect()
            for suffix in suffixes.get(family.type, ("",))
        }

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry).decode()

    def value(self, name: str, **labels: str) -> float:
        """Current value of one sample (tests and the demo's totals); 0.0 if never set."""
        got = self.registry.get_sample_value(name, labels)
        return 0.0 if got is None else got
