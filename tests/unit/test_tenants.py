"""Tenants end to end in one process and in the server's slot table: a request's cache_salt becomes a tenant
id (the salt never shows), stores count against that tenant's L1 quota through the engine, a tier that admits
after N lookups skips one-off chunks (counted), the hit-rate ceiling and tenant gauges are exported, the
config keys are validated, ALLOC carries the tenant, and the slot table holds each tenant to its quota."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_engine import CHUNK, POLICY, Engine, expected_kv, keyspace_of, layout_of
from tiercache.adapters.posix import PosixAdapter
from tiercache.config import config_from_dict
from tiercache.errors import ConfigError
from tiercache.keys import RequestIdentity
from tiercache.serde import build_pipeline
from tiercache.server.protocol import Op, ProtocolError, decode, encode
from tiercache.server.segment import MIN_SLOT, Geometry, Segment
from tiercache.server.slots import Caps, SlotTable
from tiercache.store.engine import CacheEngine
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager
from tiercache.store.policy import HitRateCeiling, TierLedger, tenant_id

LAYOUT = layout_of()
SLOT_BYTES = CacheEngine.slot_bytes(LAYOUT, CHUNK)


def test_tenant_id_hides_the_salt() -> None:
    assert tenant_id("") == ""
    tid = tenant_id("secret-salt-of-a")
    assert tid.startswith("t-")
    assert len(tid) == 18
    assert "secret" not in tid
    assert tid == tenant_id("secret-salt-of-a")
    assert tid != tenant_id("secret-salt-of-b")


def _engine(l1: L1Cache, tiers: list[tuple[str, object, object]] | None = None) -> CacheEngine:
    manager = StorageManager(l1, tiers or [], POLICY)  # type: ignore[arg-type]
    return CacheEngine(manager, LAYOUT, keyspace_of(LAYOUT), chunk_size=CHUNK)


async def _disk_engine(tmp_path: Path) -> tuple[CacheEngine, PosixAdapter]:
    """An engine on an L1 of 16 slots (no quotas) and a file tier "disk" at ``tmp_path``; that tier."""
    disk = await PosixAdapter.open(f"file://{tmp_path}")
    l1 = L1Cache(16 * SLOT_BYTES, SLOT_BYTES, pinned=False)
    return _engine(l1, [("disk", disk, build_pipeline(["raw"]))]), disk


@pytest.mark.asyncio
async def test_engine_stores_count_against_the_salts_quota() -> None:
    a, b = RequestIdentity(cache_salt="salt-a"), RequestIdentity(cache_salt="salt-b")
    l1 = L1Cache(16 * SLOT_BYTES, SLOT_BYTES, pinned=False, quotas={tenant_id("salt-a"): 2 * SLOT_BYTES})
    engine = _engine(l1)
    gpu = Engine(LAYOUT, num_blocks=128, seed=3)
    tokens = list(range(5000, 5000 + 4 * CHUNK))
    gpu.write(expected_kv(LAYOUT, len(tokens)), 0, len(tokens))
    try:
        assert await engine.store(tokens, gpu.kv, gpu.slots(len(tokens)), identity=b) == 4 * CHUNK
        stored_a = await engine.store(tokens, gpu.kv, gpu.slots(len(tokens)), identity=a)
        assert stored_a == 2 * CHUNK  # a's quota holds 2 chunks; its own are still being written: refused
        assert l1.stats().quota_refusals == 2
        assert l1.held_bytes(tenant_id("salt-a")) == 2 * SLOT_BYTES
        assert l1.held_bytes(tenant_id("salt-b")) == 4 * SLOT_BYTES
        other = list(range(7000, 7000 + 2 * CHUNK))
        assert await engine.store(other, gpu.kv, gpu.slots(2 * CHUNK), identity=a) == 2 * CHUNK
        assert l1.stats().quota_evictions == 2  # a made room among its own chunks
        assert (await engine.lookup_hit(tokens, identity=a)).tokens == 0
        assert (await engine.lookup_hit(other, identity=a)).tokens == 2 * CHUNK
        assert (await engine.lookup_hit(tokens, identity=b)).tokens == 4 * CHUNK  # b untouched by a's quota
        text = engine.manager.metrics.render()
        assert f'tiercache_tenant_l1_bytes{{tenant="{tenant_id("salt-a")}"}} {float(2 * SLOT_BYTES)}' in text
        assert "salt-a" not in text
        assert engine.manager.metrics.value("tiercache_hit_rate_ceiling") >= 0.0
    finally:
        await engine.aclose()


@pytest.mark.asyncio
async def test_tier_admits_after_two_lookups(tmp_path: Path) -> None:
    engine, disk = await _disk_engine(tmp_path)
    engine.manager.store.admit_after = {"disk": 2}
    gpu = Engine(LAYOUT, num_blocks=128, seed=4)
    one_off = list(range(100, 100 + 2 * CHUNK))
    reused = list(range(9000, 9000 + 2 * CHUNK))
    gpu.write(expected_kv(LAYOUT, 2 * CHUNK), 0, 2 * CHUNK)
    engine.manager.ceiling = HitRateCeiling()  # every key counted (the default samples one in 16)
    try:
        await engine.lookup_hit(one_off)
        await engine.store(one_off, gpu.kv, gpu.slots(2 * CHUNK))
        for _ in range(2):
            await engine.lookup_hit(reused)
        await engine.store(reused, gpu.kv, gpu.slots(2 * CHUNK))
        await engine.drain()
        m = engine.manager.metrics
        assert m.value("tiercache_stores_dropped_total", tier="disk", reason="not_admitted") == 2
        assert m.value("tiercache_stores_total", tier="disk") == 2
        assert await disk.batched_contains(keys_of(engine, reused)) == [True, True]
        assert await disk.batched_contains(keys_of(engine, one_off)) == [False, False]
        ceiling = engine.manager.ceiling
        assert ceiling.lookups == 6  # one lookup of 2 chunks, two of the other 2: each counted once
        assert abs(ceiling.ceiling() - (1 - 4 / 6)) < 0.01
        assert m.value("tiercache_hit_rate_ceiling") == ceiling.ceiling()
    finally:
        await engine.aclose()


def keys_of(engine: CacheEngine, tokens: list[int]) -> list[str]:
    return [str(k) for k in engine.token_db.keys(tokens)]


def test_config_keys() -> None:
    cfg = config_from_dict(
        {
            "l1": {
                "capacity": "1GiB",
                "eviction": "s3fifo",
                "quotas": {"t-0123456789abcdef": "256MiB"},
                "default_quota": "128MiB",
                "max_pinned_share": 0.25,
                "max_tenant_labels": 8,
            },
            "tiers": [{"name": "disk", "url": "file:///tmp/x", "admit_after": 2}],
        }
    )
    assert cfg.l1.eviction == "s3fifo"
    assert dict(cfg.l1.quotas) == {"t-0123456789abcdef": 256 << 20}
    assert (cfg.l1.default_quota, cfg.l1.max_pinned_share, cfg.l1.max_tenant_labels) == (128 << 20, 0.25, 8)
    assert cfg.tiers[0].admit_after == 2
    cases: list[tuple[dict[str, Any], str]] = [
        ({"l1": {"eviction": "arc"}}, "l1.eviction must be one of 'lru', 's3fifo', not 'arc'"),
        ({"l1": {"quotas": {"t-x": -1}}}, "l1.quotas.t-x"),
        ({"l1": {"max_pinned_share": 2}}, "l1.max_pinned_share"),
        ({"tiers": [{"name": "d", "url": "file:///tmp/x", "admit_after": 0}]}, "admit_after"),
    ]
    for bad, fragment in cases:
        with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            config_from_dict(bad)


def test_alloc_carries_the_tenant() -> None:
    body = {"keys": ["a"], "nbytes": [64], "meta": [b"\x01"], "tenant": tenant_id("s")}
    assert decode(encode(Op.ALLOC, 1, 2, body)).body["tenant"] == tenant_id("s")
    with pytest.raises(ProtocolError, match="tenant"):
        decode(encode(Op.ALLOC, 1, 2, {**body, "tenant": "x" * 65}))
    with pytest.raises(ProtocolError, match="tenant"):
        decode(encode(Op.ALLOC, 1, 2, {**body, "tenant": 7}))


def _table(regions: int, caps: Caps) -> SlotTable:
    seg, data_fd, header_fd = Segment.create(Geometry(4 * MIN_SLOT, regions), epoch=1)
    os.close(data_fd)
    os.close(header_fd)
    return SlotTable(seg, caps)


def _store(t: SlotTable, key: str, tenant: str, conn: int = 1) -> bool:
    [ref] = t.alloc(conn, [key], [1], [b""], tenant)
    if not isinstance(ref, list):
        return False
    assert t.commit(conn, [(ref[0], ref[1])]) == [True]
    return True


def test_slot_table_holds_each_tenant_to_its_quota() -> None:
    t = _table(4, Caps(max_share=1.0, quotas={"a": 2 * MIN_SLOT}))  # 16 slots; a may hold 2
    for i in range(4):
        assert _store(t, f"b{i}", "b")
    for i in range(5):
        assert _store(t, f"a{i}", "a")
        assert t.held_bytes("a") <= 2 * MIN_SLOT
    present = [h is not None for h in t.lookup(0, [f"a{i}" for i in range(5)], pin=False, prefix=False)[0]]
    assert present == [False, False, False, True, True]  # a's oldest went, its newest stayed
    assert all(t.lookup(0, [f"b{i}" for i in range(4)], pin=False, prefix=False)[0])  # b untouched
    assert t.stats()["quota_evictions"] == 3
    hits, _ = t.lookup(9, ["a3", "a4"], pin=True, prefix=False)  # both of a's slots leased
    assert not _store(t, "a5", "a")
    assert t.stats()["quota_refusals"] == 1
    t.release(9, [h.lease for h in hits if h is not None])
    assert _store(t, "a5", "a")
    assert t.held_bytes("a") == 2 * MIN_SLOT


def test_slot_table_quota_counts_reservations_and_frees() -> None:
    t = _table(2, Caps(max_share=1.0, default_quota=MIN_SLOT))
    [ref] = t.alloc(1, ["x"], [1], [b""], "t")
    assert isinstance(ref, list)
    [refused] = t.alloc(1, ["y"], [1], [b""], "t")  # the reservation counts; nothing published to evict
    assert refused is None
    assert t.abort(1, [(ref[0], ref[1])]) == [True]
    assert t.held_bytes("t") == 0
    assert _store(t, "y", "t")


def test_slot_table_ceiling_counts_presence_lookups_not_reads() -> None:
    t = _table(2, Caps(max_share=1.0))
    t.ceiling = HitRateCeiling()  # every key (the default samples one in 16)
    for _ in range(3):
        t.lookup(1, ["a", "b", "c", "d"], pin=False, prefix=True)
    t.lookup(1, ["a", "b"], pin=True, prefix=True)  # a read of what a lookup found: not counted again
    assert t.ceiling.lookups == 12
    assert abs(t.ceiling.ceiling() - (1 - 4 / 12)) < 0.01


@pytest.mark.asyncio
async def test_tier_quota_deletes_the_tenants_oldest_objects(tmp_path: Path) -> None:
    engine, disk = await _disk_engine(tmp_path)
    ta = tenant_id("salt-a")
    ledger = TierLedger({ta: 5 * SLOT_BYTES // 2})  # room for two frames of a (a frame: a chunk + header)
    engine.manager.store.ledgers = {"disk": ledger}
    a, b = RequestIdentity(cache_salt="salt-a"), RequestIdentity(cache_salt="salt-b")
    gpu = Engine(LAYOUT, num_blocks=128, seed=5)
    tokens = list(range(3000, 3000 + 4 * CHUNK))
    gpu.write(expected_kv(LAYOUT, len(tokens)), 0, len(tokens))
    try:
        for who in (a, b):
            for n in (1, 2, 3, 4):  # one chunk more each time: one background store batch per chunk
                stored = await engine.store(tokens[: n * CHUNK], gpu.kv, gpu.slots(n * CHUNK), identity=who)
                assert stored == CHUNK
                await engine.drain()
        keys_a = [str(k) for k in engine.token_db.keys(tokens, identity=a)]
        keys_b = [str(k) for k in engine.token_db.keys(tokens, identity=b)]
        assert await disk.batched_contains(keys_a) == [False, False, True, True]  # a's oldest deleted
        assert await disk.batched_contains(keys_b) == [True] * 4  # b has no quota
        assert ledger.held(ta) <= 5 * SLOT_BYTES // 2
        assert engine.manager.metrics.value("tiercache_evictions_total", tier="disk") == 2
        more = list(range(8000, 8000 + 2 * CHUNK))  # two in one background batch
        gpu.write(expected_kv(LAYOUT, 2 * CHUNK, seed=9), 0, 2 * CHUNK)
        assert await engine.store(more, gpu.kv, gpu.slots(2 * CHUNK), identity=a) == 2 * CHUNK
        await engine.drain()
        keys_more = [str(k) for k in engine.token_db.keys(more, identity=a)]
        assert await disk.batched_contains(keys_a + keys_more) == [False] * 4 + [True] * 2
        dropped = engine.manager.metrics.value("tiercache_stores_dropped_total", tier="disk", reason="quota")
        assert dropped == 0  # both fit once a's two older objects went
        assert engine.manager.metrics.value("tiercache_evictions_total", tier="disk") == 4
    finally:
        await engine.aclose()


@pytest.mark.asyncio
async def test_tier_quota_within_one_batch_sends_only_what_fits(tmp_path: Path) -> None:
    engine, disk = await _disk_engine(tmp_path)
    ta = tenant_id("salt-a")
    engine.manager.store.ledgers = {"disk": TierLedger({ta: 5 * SLOT_BYTES // 2})}
    gpu = Engine(LAYOUT, num_blocks=128, seed=6)
    tokens = list(range(4000, 4000 + 4 * CHUNK))
    gpu.write(expected_kv(LAYOUT, len(tokens)), 0, len(tokens))
    ident = RequestIdentity(cache_salt="salt-a")
    try:
        assert await engine.store(tokens, gpu.kv, gpu.slots(len(tokens)), identity=ident) == 4 * CHUNK
        await engine.drain()
        keys = [str(k) for k in engine.token_db.keys(tokens, identity=ident)]
        assert await disk.batched_contains(keys) == [False, False, True, True]
        m = engine.manager.metrics
        assert m.value("tiercache_stores_dropped_total", tier="disk", reason="quota") == 2  # never sent
        assert m.value("tiercache_stores_total", tier="disk") == 2
    finally:
        await engine.aclose()


def test_ledger_refuses_an_object_larger_than_the_quota() -> None:
    ledger = TierLedger({"t": 100})
    assert ledger.make_room("t", "k1", 60) == []
    assert ledger.make_room("t", "k2", 60) == ["k1"]
    assert ledger.make_room("t", "big", 101) is None
    assert ledger.held("t") == 60
    assert ledger.make_room("t", "k2", 90) == []  # an overwrite replaces its own count
    ledger.forget("k2")
    assert ledger.held("t") == 0
    assert ledger.make_room("u", "x", 10**9) == []  # no budget: unlimited


def test_tenant_id_of_a_lora_adapter() -> None:
    assert tenant_id("salt-a", "") == tenant_id("salt-a")  # no adapter: the salt's id, as before
    with_lora = tenant_id("salt-a", "adapter-1")
    assert with_lora.startswith("t-")
    assert len(with_lora) == 18
    assert (
        len({with_lora, tenant_id("salt-a"), tenant_id("salt-a", "adapter-2"), tenant_id("", "adapter-1")})
        == 4
    )
    assert tenant_id("", "adapter-1") != ""  # an adapter alone names a tenant
    assert tenant_id("salt-a\0lora\0x") != tenant_id("salt-a", "x")  # the two fields never run together
    assert "adapter" not in with_lora


def test_tenant_by_config() -> None:
    assert config_from_dict({}).l1.tenant_by == "salt"
    assert config_from_dict({"l1": {"tenant_by": "salt+lora"}}).l1.tenant_by == "salt+lora"
    with pytest.raises(ConfigError, match=r"l1.tenant_by must be one of 'salt', 'salt\+lora', not 'lora'"):
        config_from_dict({"l1": {"tenant_by": "lora"}})
    with pytest.raises(ValueError, match="tenant_by"):
        CacheEngine(
            StorageManager(L1Cache(4 * SLOT_BYTES, SLOT_BYTES, pinned=False), [], POLICY),
            LAYOUT,
            keyspace_of(LAYOUT),
            chunk_size=CHUNK,
            tenant_by="adapter",
        )


@pytest.mark.asyncio
@pytest.mark.parametrize("tenant_by", ["salt", "salt+lora"])
async def test_lora_adapters_as_tenants(tenant_by: str) -> None:
    """With ``salt+lora`` each adapter of a salt has its own quota; with ``salt`` they share the salt's."""
    a1 = RequestIdentity(cache_salt="salt-a", lora_name="adapter-1", lora_path="/lora/1")
    a2 = RequestIdentity(cache_salt="salt-a", lora_name="adapter-2", lora_path="/lora/2")
    quotas = {
        tenant_id("salt-a"): 2 * SLOT_BYTES,
        tenant_id("salt-a", "adapter-1"): 2 * SLOT_BYTES,
        tenant_id("salt-a", "adapter-2"): 2 * SLOT_BYTES,
    }
    l1 = L1Cache(16 * SLOT_BYTES, SLOT_BYTES, pinned=False, quotas=quotas)
    manager = StorageManager(l1, [], POLICY)
    engine = CacheEngine(manager, LAYOUT, keyspace_of(LAYOUT), chunk_size=CHUNK, tenant_by=tenant_by)
    gpu = Engine(LAYOUT, num_blocks=128, seed=7)
    tokens = list(range(6000, 6000 + 2 * CHUNK))
    gpu.write(expected_kv(LAYOUT, len(tokens)), 0, len(tokens))
    try:
        for who in (a1, a2):
            assert await engine.store(tokens, gpu.kv, gpu.slots(len(tokens)), identity=who) == 2 * CHUNK
        if tenant_by == "salt+lora":
            assert l1.held_bytes(tenant_id("salt-a", "adapter-1")) == 2 * SLOT_BYTES
            assert l1.held_bytes(tenant_id("salt-a", "adapter-2")) == 2 * SLOT_BYTES
            assert l1.held_bytes(tenant_id("salt-a")) == 0
            assert (await engine.lookup_hit(tokens, identity=a1)).tokens == 2 * CHUNK  # a2 evicted none of a1
            assert l1.stats().quota_evictions == 0
        else:
            assert l1.held_bytes(tenant_id("salt-a")) == 2 * SLOT_BYTES  # both adapters count as the salt
            assert l1.held_bytes(tenant_id("salt-a", "adapter-1")) == 0
            assert (await engine.lookup_hit(tokens, identity=a1)).tokens == 0  # a2 made room among a1's
            assert l1.stats().quota_evictions == 2
    finally:
        await engine.aclose()
