"""The small PromQL evaluator the dashboard test uses: rate, aggregations, matchers, vector arithmetic and
histogram_quantile give Prometheus' answers on known scrapes; unsupported shapes are refused."""

from __future__ import annotations

import math

import pytest

from tiercache.testing.promql import evaluate, parse_scrape

BEFORE = """\
# TYPE hits_total counter
hits_total{m="a",tier="L1"} 10
hits_total{m="a",tier="disk"} 0
hits_total{m="b",tier="disk"} 5
# TYPE misses_total counter
misses_total{m="a",tier="L1"} 10
misses_total{m="a",tier="disk"} 0
misses_total{m="b",tier="disk"} 5
# TYPE lat_seconds histogram
lat_seconds_bucket{le="0.1",tier="disk"} 0
lat_seconds_bucket{le="1.0",tier="disk"} 0
lat_seconds_bucket{le="+Inf",tier="disk"} 0
lat_seconds_sum{tier="disk"} 0
lat_seconds_count{tier="disk"} 0
# TYPE depth gauge
depth{tier="disk"} 3
depth{tier="L1"} 0
"""
AFTER = """\
# TYPE hits_total counter
hits_total{m="a",tier="L1"} 70
hits_total{m="a",tier="disk"} 30
hits_total{m="b",tier="disk"} 35
hits_total{m="a",tier="new"} 5
# TYPE misses_total counter
misses_total{m="a",tier="L1"} 70
misses_total{m="a",tier="disk"} 90
misses_total{m="b",tier="disk"} 5
# TYPE lat_seconds histogram
lat_seconds_bucket{le="0.1",tier="disk"} 30
lat_seconds_bucket{le="1.0",tier="disk"} 60
lat_seconds_bucket{le="+Inf",tier="disk"} 60
lat_seconds_sum{tier="disk"} 12
lat_seconds_count{tier="disk"} 60
# TYPE depth gauge
depth{tier="disk"} 4
depth{tier="L1"} 1
"""
SCRAPES = [parse_scrape(BEFORE), parse_scrape(AFTER)]


def ev(query: str) -> dict[tuple[tuple[str, str], ...], float]:
    return evaluate(query, SCRAPES, 60.0, {"m": "a|b", "__rate_interval": "1m"})


def test_rate_sum_by_and_ratio() -> None:
    assert ev('sum by (tier) (rate(hits_total{m=~"$m"}[$__rate_interval]))') == {
        (("tier", "L1"),): 1.0,
        (("tier", "disk"),): 1.0,  # (30 + 30) / 60; the series born after the first scrape has no rate
    }
    ratio = ev(
        "sum by (tier) (rate(hits_total[1m])) / (sum by (tier) (rate(hits_total[1m])) + "
        "sum by (tier) (rate(misses_total[1m])))"
    )
    assert ratio == {(("tier", "L1"),): 0.5, (("tier", "disk"),): 0.4}
    assert ev('sum(rate(hits_total{tier!="L1"}[5m]))') == {(): 1.0}
    assert ev('rate(hits_total{m="b"}[5m]) * 60') == {(("m", "b"), ("tier", "disk")): 30.0}


def test_gauges_and_aggregations() -> None:
    assert ev("max by (tier) (depth)") == {(("tier", "disk"),): 4.0, (("tier", "L1"),): 1.0}
    assert ev("sum(depth)") == {(): 5.0}
    assert ev('min(depth{tier!~"L.*"})') == {(): 4.0}
    assert ev("avg(depth) - 1") == {(): 1.5}
    assert ev("no_such_metric") == {}
    assert ev("sum by (tier) (no_such_metric)") == {}


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    q = ev("histogram_quantile(0.5, sum by (le, tier) (rate(lat_seconds_bucket[1m])))")
    assert q == {(("tier", "disk"),): pytest.approx(0.1)}
    q90 = ev("histogram_quantile(0.9, sum by (le, tier) (rate(lat_seconds_bucket[1m])))")
    assert q90[(("tier", "disk"),)] == pytest.approx(0.1 + 0.9 * (54 - 30) / 30)
    empty = evaluate("histogram_quantile(0.5, rate(lat_seconds_bucket[1m]))", [SCRAPES[0]] * 2, 60)
    assert math.isnan(empty[(("tier", "disk"),)])


@pytest.mark.parametrize(
    "query", ["increase(hits_total[1m])", "hits_total[1m]", "sum(hits_total) offset 5m", "topk(3, depth)"]
)
def test_unsupported_shapes_are_refused(query: str) -> None:
    with pytest.raises(ValueError, match=r"supported|unexpected|range vector|expected"):
        ev(query)
