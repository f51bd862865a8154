"""Prometheus view of a running L1Server (slot states, leases, evictions, peers, per-op latency), read at
scrape time."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from tiercache.server.protocol import Op

if TYPE_CHECKING:  # server.py may import OpLatency from here: no import cycle
    from tiercache.server.server import L1Server

__all__ = ["OP_SECONDS_BUCKETS", "OpLatency", "ServerCollector", "serve_metrics"]

# fmt: off
OP_SECONDS_BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
# fmt: on
"""Upper bounds in seconds of ``tiercache_server_op_seconds`` (10 µs ... 10 s, then +Inf)."""

MAX_OPS = 64  # distinct op labels kept; later new names count under "other"


class _OpHistogram:
    """One op's counts per bucket (not cumulative; the last is +Inf) and sum; written by one thread."""

    __slots__ = ("counts", "sum")

    def __init__(self, nbuckets: int) -> None:
        self.counts = [0] * (nbuckets + 1)
        self.sum = 0.0


class OpLatency:
    """Request latency per op, as histogram counters: :meth:`observe` on the server's event loop (O(1), no
    lock), :meth:`snapshot` from the metrics thread at scrape time.

    Safe without a lock because the writer never resizes what a reader may be iterating: each op's bucket
    list has a fixed length, and a new op name is added by publishing a new dict (copy on write; request op
    names are there from the start, so that happens only for names outside :class:`Op`).
    """

    def __init__(
        self, ops: Iterable[str] | None = None, buckets: Iterable[float] = OP_SECONDS_BUCKETS
    ) -> None:
        """``ops``: names exported from the start, even before their first request (default: the request
        ops of :class:`Op`); ``buckets``: increasing upper bounds in seconds."""
        self.buckets = tuple(float(b) for b in buckets)
        if not self.buckets or any(b >= c for b, c in zip(self.buckets, self.buckets[1:], strict=False)):
            raise ValueError(f"buckets must be increasing and non-empty, got {self.buckets!r}")
        names = [op.name for op in Op if op < Op.OK] if ops is None else list(ops)
        self._ops: dict[str, _OpHistogram] = {name: _OpHistogram(len(self.buckets)) for name in names}

    def observe(self, op: str, seconds: float) -> None:
        """Count one request of ``op`` that took ``seconds`` (the event loop only)."""
        hist = self._ops.get(op)
        if hist is None:
            hist = self._add(op)
        if not seconds >= 0.0:  # NaN or a clock step back: count it, never poison the sum
            seconds = 0.0
        hist.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        hist.sum += seconds

    def _add(self, op: str) -> _OpHistogram:
        if len(self._ops) >= MAX_OPS:
            op = "other"
            if op in self._ops:
                return self._ops[op]
        hist = _OpHistogram(len(self.buckets))
        # publish a new dict: a reader iterating the old one is unaffected
        self._ops = {**self._ops, op: hist}
        return hist

    def snapshot(self) -> dict[str, tuple[list[int], float]]:
        """Per op: cumulative counts per bucket (the last is +Inf, the op's request count) and the sum."""
        out = {}
        for op, hist in self._ops.items():  # the dict is never resized in place (see the class doc)
            counts, total = hist.counts[:], hist.sum
            running, cumulative = 0, []
            for c in counts:
                running += c
                cumulative.append(running)
            out[op] = (cumulative, total)
        return out


_COUNTER_HELP = {
    "drain_timeouts": "stops whose L2 drain passed drain_s (stores dropped)",
    "protocol_errors": "connections dropped for a malformed message",
    "refused_peers": "connections refused by the uid/gid check",
    "connections": "connections accepted",
    "accept_errors": "accept() failures survived with a backoff (EMFILE included)",
    "busy_refusals": "connections refused at max_clients",
    "fenced_sessions": "lost sessions fenced by their client",
    "freed_on_exit": "reserved slots freed when their writer process exited",
    "freed_by_fence": "reserved slots freed when their client fenced the lost session",
    "freed_after_grace": "reserved slots freed after orphan_grace_s (writer not watchable)",
    "freed_unsent": "reserved slots freed at once: their ALLOC answer never reached the client",
}


class ServerCollector(Collector):
    """Collects ``tiercache_server_*`` from the server's slot table and counters on each scrape."""

    def __init__(self, server: L1Server) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        """One family per quantity; slot counts labelled by state."""
        stats = self.server.table.stats()
        slots = GaugeMetricFamily("tiercache_server_slots", "L1 slots by state", labels=["state"])
        for state in ("free", "reserved", "published"):
            slots.add_metric([state], stats[state])
        yield slots
        yield GaugeMetricFamily("tiercache_server_leases", "live read leases", value=stats["leases"])
        yield GaugeMetricFamily(
            "tiercache_server_hit_rate_ceiling",
            "estimated hit rate an unbounded shared L1 would reach on the chunks looked up so far",
            value=self.server.table.ceiling.ceiling(),
        )
        yield GaugeMetricFamily(
            "tiercache_server_clients", "connected clients", value=len(self.server._conns)
        )
        yield GaugeMetricFamily(
            "tiercache_server_epoch", "epoch of this server's segment", value=self.server.epoch
        )
        yield CounterMetricFamily(
            "tiercache_server_evictions", "published slots evicted", value=stats["evictions"]
        )
        yield CounterMetricFamily(
            "tiercache_server_alloc_failures",
            "ALLOC keys refused for lack of room",
            value=stats["alloc_failures"],
        )
        storage = self.server.storage
        yield GaugeMetricFamily(
            "tiercache_server_pending_stores",
            "write-behind stores to L2 queued or in flight",
            value=0 if storage is None else storage.pending_stores(),
        )
        for name, help_text in (
            ("too_large", "ALLOC keys refused: the object is larger than a region"),
            ("cap_refusals", "leases or reservations refused by a connection's caps"),
            ("quota_refusals", "ALLOC keys refused: the tenant is at its quota and holds nothing to evict"),
            ("quota_evictions", "published slots a tenant at its quota evicted of its own"),
        ):
            if name in stats:
                yield CounterMetricFamily(f"tiercache_server_{name}", help_text, value=stats[name])
        for name, value in sorted(self.server.counters.items()):  # every server counter, known or new
            help_text = _COUNTER_HELP.get(name, f"server counter {name}")
            yield CounterMetricFamily(f"tiercache_server_{name}", help_text, value=value)
        latency: OpLatency | None = getattr(self.server, "op_latency", None)
        if latency is not None:
            yield _op_histogram(latency)


def _op_histogram(latency: OpLatency) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        "tiercache_server_op_seconds", "time the server took per request, by op", labels=["op"]
    )
    bounds = [repr(b) for b in latency.buckets] + ["+Inf"]  # le="1e-05", ..., "10.0", "+Inf"
    for op, (cumulative, total) in sorted(latency.snapshot().items()):
        family.add_metric([op], list(zip(bounds, cumulative, strict=True)), total)
    return family


def serve_metrics(server: L1Server, host: str, port: int) -> int:
    """Start the ``/metrics`` HTTP endpoint in a daemon thread; returns the bound port (``port`` 0 = any).

    Gives the server an :class:`OpLatency` (``server.op_latency``) unless it has one: requests are timed only
    where someone scrapes them. Call it on the server's event loop thread (before or while it serves).
    """
    if getattr(server, "op_latency", None) is None:
        server.op_latency = OpLatency()
    storage = server.storage
    registry = CollectorRegistry() if storage is None else storage.manager.metrics.registry  # tier metrics
    registry.register(ServerCollector(server))
    httpd, _ = start_http_server(port, addr=host, registry=registry)
    return int(httpd.server_port)
