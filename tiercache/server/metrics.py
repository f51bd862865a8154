"""Prometheus view of a running L1Server (slot states, leases, evictions, peers), read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tiercache.server.server import L1Server

__all__ = ["ServerCollector", "serve_metrics"]


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
            ("drain_timeouts", "stops whose L2 drain passed drain_s (stores dropped)"),
            ("protocol_errors", "connections dropped for a malformed message"),
            ("refused_peers", "connections refused by the uid/gid check"),
            ("connections", "connections accepted"),
        ):
            yield CounterMetricFamily(f"tiercache_server_{name}", help_text, value=self.server.counters[name])


def serve_metrics(server: L1Server, host: str, port: int) -> int:
    """Start the ``/metrics`` HTTP endpoint in a daemon thread; returns the bound port (``port`` 0 = any)."""
    storage = server.storage
    registry = CollectorRegistry() if storage is None else storage.manager.metrics.registry  # tier metrics
    registry.register(ServerCollector(server))
    httpd, _ = start_http_server(port, addr=host, registry=registry)
    return int(httpd.server_port)
