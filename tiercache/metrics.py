"""Prometheus metrics of one storage manager (own registry, so several managers never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


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
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefetched = Counter(
            "tiercache_prefetched", "Chunks loaded from L2 into L1", ["tier"], registry=r
        )
        self.l1_alloc_failures = Counter("tiercache_l1_alloc_failures", "L1 allocations refused", registry=r)

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
