"""``tiercache bench`` reports the hit rate and the hit-rate ceiling of its in-process lookups: in the lookup
row's JSON and in the summary's caption."""

from __future__ import annotations

import pytest
from rich.console import Console

from tiercache.cli.bench.engine import traffic
from tiercache.cli.bench.report import summary_table
from tiercache.config import ManagerConfig
from tiercache.spec import KVSpec
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", tokens=16)


@pytest.mark.asyncio
async def test_traffic_reports_hit_rate_and_ceiling() -> None:
    l1 = L1Cache(128 * SPEC.nbytes, SPEC.nbytes, pinned=False)
    manager = StorageManager(l1, tiers=[], policy=ManagerConfig())
    keys = [f"k{i}" for i in range(1600)]
    for key in keys[:100]:
        obj = l1.reserve_write(key, SPEC)
        assert obj is not None
        l1.finish_write(obj)
    try:
        for _ in range(2):  # every chunk looked up twice: an unbounded cache would answer half the lookups
            for key in keys:
                await manager.lookup_prefix([key])
        seen = traffic(manager)
    finally:
        await manager.aclose()
    assert seen["chunks_looked_up"] == 3200
    assert seen["hit_rate"] == pytest.approx(200 / 3200)  # the 100 chunks in L1, twice
    assert seen["hit_rate_ceiling"] == pytest.approx(0.5, abs=0.06)  # sampled one key in 16


def test_summary_caption_shows_the_ceiling() -> None:
    row = {
        "case": "lookup",
        "size": 1024,
        "size_unit": "tokens",
        "value": 1.0,
        "unit": "Mtok/s",
        "raw": None,
        "ratio": None,
        "latency_s": {},
        "extra": {"hit_rate": 0.25, "hit_rate_ceiling": 0.75, "chunks_looked_up": 40},
    }
    other = {**row, "case": "store", "extra": {}}
    console = Console(width=300, record=True)
    console.print(summary_table([{"suite": "engine", "skipped": None, "rows": [row, other]}]))
    text = " ".join(console.export_text().split())  # the caption wraps to the table's width
    assert "engine lookup: hit rate 0.25, ceiling 0.75 over 40 chunks" in text
    assert "engine store:" not in text
