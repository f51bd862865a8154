"""Smoke run of benchmarks/engine_bench.py at a tiny size: its functions run, verify and emit the keys."""

from __future__ import annotations

import asyncio
import pathlib
from types import ModuleType

import pytest

from tiercache.testing.harness.scripts import load_by_path

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "engine_bench.py"


def _load() -> ModuleType:
    return load_by_path(BENCH, "engine_bench")


LAYOUT_KEYS = {
    "layout",
    "block_size",
    "bytes",
    "verified",
    "memcpy_GBps",
    "index_select_GBps",
    "store_GBps",
    "retrieve_GBps",
    "gather_GBps",
    "scatter_GBps",
    "store_ratio",
    "retrieve_ratio",
    "goal_ratio",
    "store_meets_goal",
    "retrieve_meets_goal",
    "median_ms",
    "best_ms",
    "engine_overhead_ms",
}
LOOKUP_KEYS = {"tokens", "chunks", "correct", "lookup_ms", "split_ms", "rtt_ms", "goal_ms", "meets_goal"}


@pytest.mark.parametrize("layout", ["flash", "cpu_blocks"])
def test_engine_bench_layout_smoke(layout: str) -> None:
    bench = _load()
    res = asyncio.run(bench.bench_layout(layout, 512, 1, layers=2, l1_capacity=8 * 2**20))
    assert res.keys() >= LAYOUT_KEYS
    assert res["verified"] is True
    assert res["bytes"] == 512 * 2 * 2 * 8 * 128 * 2
    # The numbers are consistent with each other (their size is measured, never asserted): each rate is
    # the bytes over the best time, each ratio the memcpy baseline's time over the operation's, each goal
    # verdict the ratio against the goal, and no best time exceeds its median.
    for op in ("store", "retrieve", "gather", "scatter"):
        best_s = res["best_ms"][op] / 1e3
        assert res[f"{op}_GBps"] == pytest.approx(res["bytes"] / best_s / 1e9, rel=0.1)  # best_ms: 0.01 ms
        assert res["best_ms"][op] <= res["median_ms"][op]
    for op in ("store", "retrieve"):
        assert res[f"{op}_ratio"] == pytest.approx(res[f"{op}_GBps"] / res["memcpy_GBps"], rel=0.02, abs=2e-3)
        assert res[f"{op}_meets_goal"] is (res[f"{op}_ratio"] >= res["goal_ratio"])


def test_engine_bench_lookup_smoke() -> None:
    bench = _load()
    res = asyncio.run(bench.bench_lookup(2560, 2, layers=2))
    assert res.keys() >= LOOKUP_KEYS
    assert res["correct"] is True
    assert res["chunks"] == 10
    assert set(res["rtt_ms"]) == {"tier1", "tier2"}
    assert res["goal_ms"] >= 2.0


def test_engine_bench_run_json_keys() -> None:
    bench = _load()
    res = asyncio.run(
        bench.run(512, 1, ("flash",), lookup_tokens=1024, lookup_repeats=1, layers=1, l1_capacity=4 * 2**20)
    )
    assert {"host", "workload", "layouts", "lookup"} <= res.keys()
    assert res["layouts"]["flash"]["verified"] is True
