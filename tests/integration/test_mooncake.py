"""The mooncake adapter against a live ``mooncake_master`` (HTTP metadata server) and a store client.

Servers come from tests/integration/conftest.py (Mooncake section): master + ``mooncake_client`` lending a
segment, all on free 127.0.0.1 ports with ``MC_TCP_BIND_ADDRESS=127.0.0.1``, stopped by PID.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import pytest

import tiercache
from tests.integration._manager_helpers import FAIL_FAST, SPEC, store_chunks
from tiercache.adapters.mooncake import MooncakeAdapter
from tiercache.errors import AdapterError, AdapterUnavailable, ConfigError
from tiercache.serde import build_pipeline
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager
from tiercache.testing.adapters import AdapterConformance, AdapterFactory, unique_keys

pytestmark = pytest.mark.asyncio

MiB = 1 << 20
SAFETY_NET_S = 60
"""Only there so that a hung call fails the test instead of hanging it; never reached when correct."""
KIT_BUFFER = "72MiB"  # the kit's largest object is 64 MiB (+1 trailer byte)


# -- conformance ---------------------------------------------------------------------------------------


class TestMooncakeConformance(AdapterConformance):
    @pytest.fixture
    def adapter_factory(self, mooncake_cluster: Any) -> AdapterFactory:
        return lambda: MooncakeAdapter.open(mooncake_cluster.url, buffer_size=KIT_BUFFER)


# -- Mooncake's own API behaviours (what the adapter maps onto the contract) -----------------------------


async def test_raw_api_behaviours(mooncake_cluster: Any) -> None:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    c = mooncake_cluster
    meta = f"http://127.0.0.1:{c.http_port}/metadata"
    assert store.setup("127.0.0.1", meta, 0, 8 * MiB, "tcp", "", f"127.0.0.1:{c.rpc_port}") == 0
    try:
        a, b, big, missing = unique_keys(4)
        assert store.put(a, b"old") == 0
        assert store.put(a, b"new!") == 0  # "succeeds" ...
        assert store.get(a) == b"old"  # ... but keeps the old value
        assert store.upsert(a, b"new!") == 0
        assert store.get(a) == b"new!"
        assert store.remove(a) == -706  # OBJECT_HAS_LEASE: the get above holds a read lease
        assert store.remove(a, True) == 0
        assert store.get(missing) == b""  # a miss is empty bytes (so is a dead master: not used)
        assert store.get_size(missing) == -704
        assert store.batch_is_exist([missing]) == [0]
        assert store.put(b, b"") != 0  # empty objects are refused (the adapter appends a trailer)
        assert store.put(big, b"x" * (9 * MiB)) == -600  # larger than the client buffer
        assert store.is_exist(big) == 0
    finally:
        store.close()


# -- adapter-specific behaviour ---------------------------------------------------------------------------


async def test_registry_url_and_options(mooncake_cluster: Any) -> None:
    adapter = await tiercache.open_adapter(
        mooncake_cluster.url + "&buffer_size=8MiB&timeout=3", capacity="1GiB"
    )
    try:
        assert type(adapter) is MooncakeAdapter
        assert adapter.max_value_bytes == 8 * MiB - 1
        assert adapter.timeout == 3.0
    finally:
        await adapter.aclose()
    assert os.environ["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
    with pytest.raises(ConfigError, match="bogus"):
        await MooncakeAdapter.open(mooncake_cluster.url, bogus=1)
    with pytest.raises(ConfigError, match="protocol"):
        await MooncakeAdapter.open(mooncake_cluster.url, protocol="udp")
    with pytest.raises(ConfigError, match="buffer_size"):
        await MooncakeAdapter.open(mooncake_cluster.url, buffer_size="lots")
    with pytest.raises(ConfigError, match="mooncake://"):
        await MooncakeAdapter.open("mooncake:///nohost")
    with pytest.raises(ConfigError, match="local_hostname"):
        await MooncakeAdapter.open("mooncake://10.1.2.3:50051")


async def test_too_large_put_fails_cleanly(mooncake_cluster: Any) -> None:
    async with await MooncakeAdapter.open(mooncake_cluster.url, buffer_size="4MiB") as adapter:
        keys = unique_keys(3)
        limit = adapter.max_value_bytes
        values = [b"a" * 100, b"b" * (limit + 1), b"c" * limit]
        assert await adapter.batched_put(keys, values) == [True, False, True]
        assert await adapter.batched_contains(keys) == [True, False, True]
        got = await adapter.batched_get(keys)
        assert got[0] == values[0]
        assert got[1] is None
        assert got[2] == values[2]


async def test_overwrite_and_delete_under_read_lease(mooncake_cluster: Any) -> None:
    async with await MooncakeAdapter.open(mooncake_cluster.url, buffer_size="8MiB") as adapter:
        (key,) = unique_keys(1)
        assert await adapter.batched_put([key], [b"one"]) == [True]
        assert await adapter.batched_get([key]) == [b"one"]  # takes a 10 s read lease
        assert await adapter.batched_put([key], [b"two"]) == [True]  # upsert: replaces
        assert await adapter.batched_get([key]) == [b"two"]
        assert await adapter.batched_delete([key]) == [True]  # forced: not blocked by the lease
        assert await adapter.batched_get([key]) == [None]


async def test_shared_and_kept_after_reopen(mooncake_cluster: Any) -> None:
    keys = unique_keys(3)
    values = [b"", b"v" * 4096, os.urandom(2 * MiB + 3)]
    a = await MooncakeAdapter.open(mooncake_cluster.url, buffer_size="8MiB")
    b = await MooncakeAdapter.open(mooncake_cluster.url, buffer_size="8MiB")
    try:
        assert await a.batched_put(keys, values) == [True] * 3
        assert await b.batched_get(keys) == values  # another client sees them
    finally:
        await a.aclose()
        await b.aclose()
    async with await MooncakeAdapter.open(mooncake_cluster.url, buffer_size="8MiB") as c:
        assert await c.batched_get(keys) == values  # the segment is the store client's, not the adapter's


async def test_foreign_object_is_a_miss(mooncake_cluster: Any) -> None:
    from mooncake.store import MooncakeDistributedStore

    (key,) = unique_keys(1)
    async with await MooncakeAdapter.open(mooncake_cluster.url, buffer_size="8MiB") as adapter:
        store = MooncakeDistributedStore()
        c = mooncake_cluster
        rc = store.setup(
            "127.0.0.1",
            f"http://127.0.0.1:{c.http_port}/metadata",
            0,
            MiB,
            "tcp",
            "",
            f"127.0.0.1:{c.rpc_port}",
        )
        assert rc == 0
        assert store.put(key, b"no trailer") == 0
        store.close()
        assert await adapter.batched_contains([key]) == [True]
        assert await adapter.batched_get([key]) == [None]


async def test_unreachable_master_fails_at_open() -> None:
    from tiercache.testing.harness.processes import free_port

    opening = MooncakeAdapter.open(
        f"mooncake://127.0.0.1:{free_port()}?metadata=http://127.0.0.1:{free_port()}/metadata",
        buffer_size="4MiB",
        timeout=2,
    )
    with pytest.raises(AdapterUnavailable, match="cannot connect"):  # the probe, before Mooncake's setup
        await asyncio.wait_for(opening, SAFETY_NET_S)


# -- failures: killed master ------------------------------------------------------------------------------


async def test_killed_master_is_unavailable_then_recovers(mooncake_factory: Callable[..., Any]) -> None:
    cluster = mooncake_factory()
    timeout = 1.0
    adapter = await MooncakeAdapter.open(cluster.url, buffer_size="8MiB", timeout=timeout, workers=8)
    try:
        keys = unique_keys(4)
        assert await adapter.batched_put(keys, [b"v" * 1000] * 4) == [True] * 4
        cluster.master.kill()
        for call in (
            lambda: adapter.batched_contains(keys),
            lambda: adapter.batched_get(keys),
            lambda: adapter.batched_put(keys, [b"w"] * 4),
            lambda: adapter.batched_delete(keys),
        ):
            # the adapter's own timeout or error ends the call (the safety net raises a plain TimeoutError)
            with pytest.raises(AdapterError):
                await asyncio.wait_for(call(), SAFETY_NET_S)
        cluster.restart_master()  # same ports, empty; the client and the store client re-register
        for _ in range(40):  # bounded poll: the client re-registers with the restarted master
            try:
                if await adapter.batched_put(keys[:1], [b"again"]) == [True]:
                    break
            except AdapterError:
                pass
            await asyncio.sleep(0.5)
        else:
            pytest.fail("no recovery after 40 polls following the master restart")
        # The master came back empty. The calls that timed out above may still land afterwards (their
        # Mooncake call retries in its thread), so the other keys hold nothing or the late b"w".
        got = await adapter.batched_get(keys)
        assert got[0] == b"again"
        assert all(g in (None, b"w") for g in got[1:]), got
        assert (await adapter.batched_contains(keys))[0] is True
    finally:
        await asyncio.wait_for(adapter.aclose(), SAFETY_NET_S)


async def test_manager_turns_a_killed_master_into_misses(mooncake_factory: Callable[..., Any]) -> None:
    cluster = mooncake_factory()
    raw = build_pipeline(["raw"])
    keys = unique_keys(4)
    writer = await MooncakeAdapter.open(cluster.url, buffer_size="8MiB")
    async with StorageManager(L1Cache(SPEC.nbytes * 8, SPEC.nbytes), [("mc", writer, raw)], FAIL_FAST) as m:
        await store_chunks(m, keys)
    reader = await MooncakeAdapter.open(cluster.url, buffer_size="8MiB", timeout=1, workers=8)
    async with StorageManager(L1Cache(SPEC.nbytes * 8, SPEC.nbytes), [("mc", reader, raw)], FAIL_FAST) as m:
        assert (await m.lookup_prefix(keys, [SPEC] * 4, prefetch=False)).chunks == 4
        cluster.master.kill()
        hit = await asyncio.wait_for(m.lookup_prefix(keys, [SPEC] * 4), SAFETY_NET_S)
        assert hit.chunks == 0
        leases = await asyncio.wait_for(m.batched_get(keys, [SPEC] * 4), SAFETY_NET_S)
        assert leases == [None] * 4
        assert m.metrics.value("tiercache_tier_errors_total", tier="mc", op="contains") >= 1
