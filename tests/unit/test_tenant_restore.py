"""A file tier's per-tenant quotas survive a restart: the store tags each object with its tenant (an extended
attribute of its file) and the ledger counts the tier's tagged objects again at open."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.unit.test_engine import CHUNK, Engine, expected_kv, keyspace_of, layout_of
from tiercache.adapters.posix import TENANT_XATTR, PosixAdapter
from tiercache.config import config_from_dict
from tiercache.keys import RequestIdentity
from tiercache.store.engine import CacheEngine
from tiercache.store.manager import StorageManager
from tiercache.store.policy import TierLedger, tenant_id

LAYOUT = layout_of()
SLOT_BYTES = CacheEngine.slot_bytes(LAYOUT, CHUNK)
TA, TB = tenant_id("salt-a"), tenant_id("salt-b")


def _xattrs_work(path: Path) -> bool:
    probe = path / "probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, TENANT_XATTR, b"t")
    except OSError:
        return False
    finally:
        probe.unlink()
    return True


@pytest.mark.asyncio
async def test_posix_tags_and_lists_tenants(tmp_path: Path) -> None:
    if not _xattrs_work(tmp_path):
        pytest.skip("this filesystem keeps no user extended attributes")
    disk = await PosixAdapter.open(f"file://{tmp_path}")
    await disk.batched_put(["k1", "k2", "k3"], [b"a" * 10, b"b" * 20, b"c" * 30])
    assert await disk.batched_tag_tenants(["k1", "k3", "gone"], [TA, TB, TA]) == [True, True, False]
    assert await disk.batched_get(["k1"]) == [b"a" * 10]  # the object's bytes are untouched
    await disk.aclose()
    reopened = await PosixAdapter.open(f"file://{tmp_path}")
    try:
        usage = sorted(await reopened.tenant_usage())
        assert usage == [("k1", TA, 10), ("k2", "", 20), ("k3", TB, 30)]
    finally:
        await reopened.aclose()


def test_ledger_restore_counts_older_objects_first() -> None:
    ledger = TierLedger({TA: 100})
    assert ledger.make_room(TA, "new", 30) == []
    ledger.restore([("old1", TA, 40), ("old2", TA, 20), ("new", TA, 99), ("b1", TB, 5)])
    assert ledger.held(TA) == 90  # "new" was counted already: not twice
    assert ledger.held(TB) == 5
    assert ledger.make_room(TA, "next", 30) == ["old1"]  # restored objects are the oldest
    assert ledger.held(TA) == 80


@pytest.mark.asyncio
async def test_tier_quota_holds_across_a_restart(tmp_path: Path) -> None:
    if not _xattrs_work(tmp_path):
        pytest.skip("this filesystem keeps no user extended attributes")
    quota = 5 * SLOT_BYTES // 2  # two frames of a
    config = config_from_dict(
        {
            "l1": {"capacity": 16 * SLOT_BYTES, "pinned": False},
            "tiers": [{"name": "disk", "url": f"file://{tmp_path}", "quotas": {TA: quota}}],
        }
    )
    a, b = RequestIdentity(cache_salt="salt-a"), RequestIdentity(cache_salt="salt-b")
    gpu = Engine(LAYOUT, num_blocks=128, seed=11)
    tokens = list(range(3000, 3000 + 4 * CHUNK))
    gpu.write(expected_kv(LAYOUT, len(tokens)), 0, len(tokens))

    async def engine() -> CacheEngine:
        return CacheEngine(
            await StorageManager.open(config, SLOT_BYTES), LAYOUT, keyspace_of(LAYOUT), chunk_size=CHUNK
        )

    first = await engine()
    try:
        for n in (1, 2):
            await first.store(tokens[: n * CHUNK], gpu.kv, gpu.slots(n * CHUNK), identity=a)
            await first.drain()
        await first.store(tokens[:CHUNK], gpu.kv, gpu.slots(CHUNK), identity=b)
        await first.drain()
        held_a = first.manager.store.ledgers["disk"].held(TA)
        assert 0 < held_a <= quota
    finally:
        await first.aclose()
    second = await engine()  # a fresh process: the ledger counts what the tier holds
    try:
        ledger = second.manager.store.ledgers["disk"]
        assert ledger.held(TA) == held_a
        assert ledger.held(TB) > 0
        assert ledger.held("") == 0
        keys_a = [str(k) for k in second.token_db.keys(tokens, identity=a)]
        disk = second.manager.tiers[0].adapter
        await second.store(tokens[: 3 * CHUNK], gpu.kv, gpu.slots(3 * CHUNK), identity=a)
        await second.drain()
        assert await disk.batched_contains(keys_a[:3]) == [False, True, True]  # a's oldest, from before
        assert ledger.held(TA) <= quota
    finally:
        await second.aclose()
