"""The redis adapter against real servers: Redis standalone, a 3-master Redis Cluster and Valkey.

Servers come from tests/integration/conftest.py (started once per session on free 127.0.0.1 ports).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aredis

import tiercache
from tests.integration._manager_helpers import FAIL_FAST, SPEC, store_chunks
from tiercache.adapters.redis import RedisAdapter, RedisClusterAdapter
from tiercache.config import TierConfig
from tiercache.errors import AdapterTimeout, AdapterUnavailable, ConfigError
from tiercache.serde import build_pipeline
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager
from tiercache.testing.adapters import AdapterConformance, AdapterFactory, unique_keys

pytestmark = pytest.mark.asyncio

MiB = 1 << 20


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}:"


# -- conformance ---------------------------------------------------------------------------------------


class TestRedisConformance(AdapterConformance):
    @pytest.fixture
    def adapter_factory(self, redis_server: Any) -> AdapterFactory:
        prefix = _prefix()  # one per test: the kit's tests never see each other's keys
        return lambda: RedisAdapter.open(redis_server.url, prefix=prefix, socket_timeout=10)


class TestRedisClusterConformance(AdapterConformance):
    @pytest.fixture
    def adapter_factory(self, redis_cluster: Any) -> AdapterFactory:
        prefix = _prefix()
        return lambda: RedisClusterAdapter.open(redis_cluster.url, prefix=prefix, socket_timeout=10)


class TestValkeyConformance(AdapterConformance):
    @pytest.fixture
    def adapter_factory(self, valkey_server: Any) -> AdapterFactory:
        prefix = _prefix()
        url = f"valkey://127.0.0.1:{valkey_server.port}/0"
        return lambda: tiercache.open_adapter(url, prefix=prefix, socket_timeout=10)


# -- URL, options and registry ---------------------------------------------------------------------------


async def test_registry_schemes_and_options(redis_server: Any, redis_cluster: Any) -> None:
    port = redis_server.port
    for scheme in ("redis", "valkey"):
        adapter = await tiercache.open_adapter(
            f"{scheme}://127.0.0.1:{port}/0?pool_size=4&ttl=30", capacity=1 << 30
        )
        assert type(adapter) is RedisAdapter
        assert adapter.ttl_ms == 30_000
        await adapter.aclose()
    cluster = await tiercache.open_adapter(redis_cluster.url)
    assert type(cluster) is RedisClusterAdapter
    await cluster.aclose()
    with pytest.raises(ConfigError, match="bogus"):
        await RedisAdapter.open(redis_server.url, bogus=1)
    with pytest.raises(ConfigError, match="password"):
        await RedisAdapter.open(f"redis://user:secret@127.0.0.1:{port}/0")
    with pytest.raises(ConfigError, match="ssl_ca_certs"):
        await RedisAdapter.open(redis_server.url, ssl_ca_certs="/x.pem")
    with pytest.raises(ConfigError, match="ttl"):
        await RedisAdapter.open(redis_server.url, ttl=0)
    with pytest.raises(ConfigError, match="database"):
        await RedisAdapter.open(f"redis://127.0.0.1:{port}/notanumber")


async def test_unreachable_server_fails_at_open() -> None:
    from tiercache.testing.harness.processes import free_port

    # The refusal itself ends the open (AdapterUnavailable naming the connection error), not a timeout:
    # one waiting for an answer would end, much later, in AdapterTimeout.
    with pytest.raises(AdapterUnavailable, match=r"ConnectionError: .*(Connect call failed|refused|111)"):
        await RedisAdapter.open(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=60)


# -- Redis-specific behaviour -------------------------------------------------------------------------


async def test_ttl_expires_objects(redis_server: Any) -> None:
    """Every put carries the TTL (read back with PTTL); once the server expires a key it is a miss (the
    test shortens the TTLs with PEXPIRE and polls, bounded, instead of sleeping out the real one)."""
    import redis.asyncio as aredis

    prefix = _prefix()
    raw = aredis.Redis(host="127.0.0.1", port=redis_server.port)
    async with await RedisAdapter.open(redis_server.url, prefix=prefix, ttl=3600) as adapter:
        keys = unique_keys(3)
        assert await adapter.batched_put(keys, [b"a", b"b" * 300_000, b"c"]) == [True] * 3
        assert await adapter.batched_contains(keys) == [True] * 3
        for key in keys:  # set with SET PX 3600000: left between an hour and a few minutes less
            assert 3_000_000 < await raw.pttl(prefix + key) <= 3_600_000
        assert [await raw.pexpire(prefix + key, 1) for key in keys] == [True] * 3
        for _ in range(1000):
            if await adapter.batched_contains(keys) == [False] * 3:
                break
            await asyncio.sleep(0.001)
        else:
            pytest.fail("keys with a 1 ms TTL were still there after 1000 polls")
        assert await adapter.batched_get(keys) == [None] * 3
    await raw.aclose()


async def test_prefix_isolation(redis_server: Any) -> None:
    a = await RedisAdapter.open(redis_server.url, prefix=_prefix())
    b = await RedisAdapter.open(redis_server.url, prefix=_prefix())
    try:
        keys = unique_keys(4)
        assert await a.batched_put(keys, [b"from-a"] * 4) == [True] * 4
        assert await b.batched_contains(keys) == [False] * 4
        assert await b.batched_get(keys) == [None] * 4
        assert await b.batched_delete(keys) == [False] * 4
        assert await b.batched_put(keys[:1], [b"from-b"]) == [True]
        assert await a.batched_get(keys[:1]) == [b"from-a"]
        assert await b.batched_get(keys[:1]) == [b"from-b"]
    finally:
        await a.aclose()
        await b.aclose()


async def test_maxmemory_eviction_gives_misses(redis_factory: Callable[..., Any]) -> None:
    server = redis_factory("--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru")
    async with await RedisAdapter.open(server.url) as adapter:
        keys = unique_keys(40)
        values = [bytes([i]) * MiB for i in range(40)]
        for i in range(0, 40, 4):
            assert await adapter.batched_put(keys[i : i + 4], values[i : i + 4]) == [True] * 4
        present = await adapter.batched_contains(keys)
        got = await adapter.batched_get(keys)
        assert not all(present), "40 MiB cannot fit in 8 MB"
        assert any(present[-4:]), "the last batch written is kept (sampled LRU may still take one of it)"
        # Over maxmemory Redis evicts while serving any command, reads included, so a key that EXISTS reported
        # may be gone by its GET: what must hold is that a read is the stored value or a miss, never an error
        # or another value, and that nothing evicted comes back.
        for g, v, p in zip(got, values, present, strict=True):
            assert g is None or g == v
            assert p or g is None
        assert any(g is None for g in got)


async def test_small_values_read_in_order_across_mget_groups(redis_server: Any) -> None:
    """Small values are read by a pipeline of MGETs of about 1 MiB each: every value comes back in key order
    across the groups, an absent key and a key of another type are misses (a GET of a list was an error that
    failed the whole batch)."""
    prefix = _prefix()
    async with await RedisAdapter.open(redis_server.url, prefix=prefix) as adapter:
        keys = unique_keys(12)
        values = [bytes([i]) * (200_000 + i) for i in range(12)]
        for _ in range(10):  # the running mean of sizes near 200 KB: ~5 values per MGET, three groups
            assert await adapter.batched_put(keys, values) == [True] * 12
        raw = aredis.Redis(host="127.0.0.1", port=redis_server.port)
        try:
            await raw.rpush(f"{prefix}lst", "x")
        finally:
            await raw.aclose()
        got = await adapter.batched_get([*keys[:6], "lst", "absent", *keys[6:]])
        assert [None if g is None else bytes(g) for g in got] == [*values[:6], None, None, *values[6:]]


_FOREIGN = {  # a key of another type under the tier's prefix, as another program might leave one
    "lst": lambda raw, key: raw.lpush(key, "x"),
    "hsh": lambda raw, key: raw.hset(key, "field", "value"),
    "st": lambda raw, key: raw.sadd(key, "member"),
}


async def _add_foreign(port: int, prefix: str) -> list[str]:
    raw = aredis.Redis(host="127.0.0.1", port=port)
    try:
        for name, add in _FOREIGN.items():
            await add(raw, prefix + name)
    finally:
        await raw.aclose()
    return list(_FOREIGN)


@pytest.mark.parametrize("kind", ["redis", "valkey"])
@pytest.mark.parametrize("via", ["resp", "redis-py"])
@pytest.mark.parametrize("size", [1000, 300_000])  # small: MGET pipelines; large: GETs one by one
async def test_a_key_of_another_type_is_a_counted_miss(
    request: pytest.FixtureRequest, kind: str, via: str, size: int
) -> None:
    """A list, hash or set under the prefix is a miss wherever it is met (contains, a batched get, a
    single-key get, a get of one key alone), counted in ``stats["foreign_keys"]``; the good keys beside it
    are served, and a put or delete of its name works (a GET of it raised a foreign RespError, its GETRANGE
    failed the whole contains and delete batch)."""
    server = request.getfixturevalue(f"{kind}_server")
    prefix = _prefix()
    adapter = await RedisAdapter.open(f"redis://127.0.0.1:{server.port}/0", prefix=prefix)
    if via == "redis-py":  # as on TLS: every call through redis-py
        assert adapter._resp is not None
        adapter._resp.close()
        adapter._resp = None
    try:
        good = unique_keys(7)
        values = [bytes([i + 1]) * size for i in range(7)]
        assert await adapter.batched_put(good, values) == [True] * 7
        foreign = await _add_foreign(server.port, prefix)
        mixed = [*good[:3], *foreign, *good[3:]]
        want = [*values[:3], None, None, None, *values[3:]]
        assert await adapter.batched_contains(mixed) == [v is not None for v in want]
        assert adapter.stats["foreign_keys"] == 3
        got = await adapter.batched_get(mixed)
        assert [None if g is None else bytes(g) for g in got] == want
        for name in foreign:  # one key alone: the single GET
            assert await adapter.batched_get([name]) == [None]
            assert await adapter.batched_contains([name]) == [False]
        assert adapter.stats["foreign_keys"] >= 3 + 3 + 3  # an MGET's nil does not tell a list from none
        assert await adapter.batched_delete(foreign[:1]) == [True]  # the name is ours to delete
        assert await adapter.batched_put(foreign[1:], [b"a", b"b" * size]) == [True, True]  # SET replaces
        assert await adapter.batched_get(foreign) == [None, b"a", b"b" * size]
    finally:
        await adapter.aclose()


@pytest.mark.parametrize("kind", ["redis", "valkey"])
async def test_a_key_of_another_type_never_takes_the_tier_offline(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """Through the storage manager, as vLLM drives it: a list, hash and set under the prefix beside 7 good
    objects. Every lookup finds the 7 (the foreign keys are misses), a read of a foreign key that a lookup
    had reported (replaced by another type since) is a miss, no call fails, the circuit (2 failures) never
    opens, and the 7 are served after it all. A value that is not a frame is a miss too, counted as a
    rejected frame. (A foreign key's GET raised RespError, its GETRANGE failed the whole contains: three
    reads opened the circuit and 0 of 7 good keys were then served.)"""
    from tiercache.store.hits import TierHit

    server = request.getfixturevalue(f"{kind}_server")
    prefix = _prefix()
    raw_pipeline = build_pipeline(["raw"])
    good = unique_keys(7)
    writer = await RedisAdapter.open(server.url, prefix=prefix, socket_timeout=5)
    async with StorageManager(
        L1Cache(SPEC.nbytes * 16, SPEC.nbytes), [("redis", writer, raw_pipeline)], FAIL_FAST
    ) as m:
        await store_chunks(m, good)
    foreign = await _add_foreign(server.port, prefix)
    raw = aredis.Redis(host="127.0.0.1", port=server.port)
    try:
        await raw.set(prefix + "notaframe", b"just some bytes, not a frame")
    finally:
        await raw.aclose()
    reader = await RedisAdapter.open(server.url, prefix=prefix, socket_timeout=5)
    async with StorageManager(
        L1Cache(SPEC.nbytes * 16, SPEC.nbytes), [("redis", reader, raw_pipeline)], FAIL_FAST
    ) as m:
        for name in foreign:  # 3 rounds, each a failed call before (2 open the circuit)
            hits = await m.batched_contains([*good, name])
            assert [h is not None for h in hits] == [True] * 7 + [False]
        for name in foreign:  # a read of a key the lookup had found: the single-key GET path
            assert await m.batched_get([name], [SPEC], hits=[TierHit("redis", 1)]) == [None]
        assert await m.batched_get(["notaframe"], [SPEC], hits=[TierHit("redis", 1)]) == [None]
        assert m.metrics.value("tiercache_frames_rejected_total", tier="redis") == 1
        for op in ("contains", "get"):
            assert m.metrics.value("tiercache_tier_errors_total", tier="redis", op=op) == 0
        assert m.metrics.value("tiercache_circuit_open", tier="redis") == 0
        assert reader.stats["foreign_keys"] == 6
        assert (await m.lookup_prefix([*good, foreign[0]], [SPEC] * 8, prefetch=False)).chunks == 7
        leases = await m.batched_get([*good, foreign[0]], [SPEC] * 8)
        assert [lease is not None for lease in leases] == [True] * 7 + [False]
        for i, lease in enumerate(leases[:7]):
            assert lease is not None
            assert bytes(lease.obj.buffer()) == bytes([i + 1]) * SPEC.nbytes
            lease.release()
        assert m.metrics.value("tiercache_circuit_open", tier="redis") == 0


async def test_a_string_over_the_value_limit_is_a_miss_refused_unread(
    redis_factory: Callable[..., Any],
) -> None:
    """A string over ``MAX_VALUE_BYTES`` (a server with a raised ``proto-max-bulk-len``) is no value of
    ours: a miss, counted, refused from its length alone (no buffer of its size, none of it read); the
    good key beside it is served (the RESP client allocated the whole value first)."""
    import tracemalloc

    from tiercache.adapters.redis import MAX_VALUE_BYTES

    server = redis_factory("--proto-max-bulk-len", "1gb")
    raw = aredis.Redis(host="127.0.0.1", port=server.port)
    try:
        await raw.setrange("t:huge", MAX_VALUE_BYTES, b"x")  # MAX_VALUE_BYTES + 1 bytes
    finally:
        await raw.aclose()
    async with await RedisAdapter.open(server.url, prefix="t:", socket_timeout=10) as adapter:
        assert await adapter.batched_put(["good"], [b"g" * 300_000]) == [True]
        tracemalloc.start()
        try:
            assert await adapter.batched_get(["huge"]) == [None]
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 16 * MiB, f"{peak} bytes allocated for a value refused unread"
        assert adapter.stats["foreign_keys"] == 1
        assert await adapter.batched_get(["good", "huge"]) == [b"g" * 300_000, None]


async def test_noeviction_refusal_is_a_failed_put(redis_factory: Callable[..., Any]) -> None:
    server = redis_factory("--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    async with await RedisAdapter.open(server.url) as adapter:
        keys = unique_keys(12)
        results = []
        for k in keys:  # one by one: large values are sent as single SETs
            results += await adapter.batched_put([k], [b"x" * MiB])
        small = await adapter.batched_put(unique_keys(3), [b"y"] * 3)  # pipelined path
        assert results[0] is True
        assert False in results
        assert all(isinstance(r, bool) for r in results + small)


async def test_password_auth(redis_factory: Callable[..., Any]) -> None:
    server = redis_factory("--requirepass", "s3cret")
    async with await RedisAdapter.open(server.url, password="s3cret") as adapter:
        assert await adapter.batched_put(["k1"], [b"v"]) == [True]
        big = bytes(range(256)) * 4096  # 1 MiB: the zero-copy RESP connections authenticate too
        assert await adapter.batched_put(["k2"], [big]) == [True]
        assert await adapter.batched_get(["k2"]) == [big]
    # Wrong or missing password: the open's PING fails, so the error comes at open, not at the first call.
    with pytest.raises(AdapterUnavailable):
        await RedisAdapter.open(server.url, password="wrong")
    with pytest.raises(AdapterUnavailable):
        await RedisAdapter.open(server.url)
    # Through the config: password_env is resolved before open.
    tier = TierConfig(name="r", url=server.url, capacity=1 << 30, options={"password_env": "TC_REDIS_PW"})
    opts = tier.adapter_options({"TC_REDIS_PW": "s3cret"})
    adapter = await tiercache.open_adapter(tier.url, **opts)
    assert await adapter.batched_get(["k1"]) == [b"v"]
    await adapter.aclose()


async def test_killed_server_is_unavailable_then_recovers(redis_factory: Callable[..., Any]) -> None:
    server = redis_factory()
    # A dead server is reported as unavailable at once (connection refused/reset), never by waiting out the
    # socket timeout: that would be AdapterTimeout, after 30 s.
    async with await RedisAdapter.open(server.url, socket_timeout=30, pool_size=4) as adapter:
        keys = unique_keys(4)
        assert await adapter.batched_put(keys, [b"v" * 1000] * 4) == [True] * 4
        server.proc.kill()
        for call in (
            lambda: adapter.batched_contains(keys),
            lambda: adapter.batched_get(keys),
            lambda: adapter.batched_put(keys, [b"w"] * 4),
            lambda: adapter.batched_put(keys[:1], [b"w" * MiB]),
            lambda: adapter.batched_delete(keys),
        ):
            with pytest.raises(AdapterUnavailable):
                await call()
        server.restart()  # same port, empty (no persistence)
        assert await adapter.batched_contains(keys) == [False] * 4
        assert await adapter.batched_put(keys, [b"again"] * 4) == [True] * 4
        assert await adapter.batched_get(keys) == [b"again"] * 4


async def test_hung_server_times_out_at_socket_timeout(redis_factory: Callable[..., Any]) -> None:
    server = redis_factory()
    timeout = 0.5
    async with await RedisAdapter.open(server.url, socket_timeout=timeout) as adapter:
        keys = unique_keys(2)
        assert await adapter.batched_put(keys, [b"v", b"w"]) == [True, True]
        server.proc.pause()
        try:
            for call in (
                lambda: adapter.batched_get(keys),
                lambda: adapter.batched_put(keys, [b"x", b"y"]),
                lambda: adapter.batched_get(keys[:1]),  # one key: the zero-copy RESP path
                lambda: adapter.batched_put(keys[:1], [b"z" * MiB]),  # a large value: the same
            ):
                with pytest.raises(AdapterTimeout, match="no answer within the socket timeout"):
                    await call()
        finally:
            server.proc.resume()
        first, second = await adapter.batched_get(keys)  # each timed-out put may land after the resume
        assert (first, second) in ((b"v", b"w"), (b"x", b"y")) or (
            first == b"z" * MiB and second in (b"w", b"y")
        )


async def test_large_values_go_to_the_selected_database(redis_server: Any) -> None:
    """Large values take the zero-copy RESP connections: they SELECT the URL's database as redis-py does."""
    url3 = redis_server.url.rsplit("/", 1)[0] + "/3"
    prefix = _prefix()
    async with (
        await RedisAdapter.open(url3, prefix=prefix) as db3,
        await RedisAdapter.open(redis_server.url, prefix=prefix) as db0,
    ):
        keys = unique_keys(3)
        values = [bytes([i]) * (2 * MiB + i) for i in range(3)]
        assert await db3.batched_put(keys, values) == [True] * 3
        assert await db3.batched_get(keys) == values
        assert await db3.batched_get(keys[1:2]) == values[1:2]
        assert await db0.batched_contains(keys) == [False] * 3
        assert await db0.batched_get(keys) == [None] * 3


async def test_put_lanes_beyond_those_in_flight_queue_one_call_each(
    redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's large values in lanes of at most ``PUT_PIPELINE_BYTES``: as many lanes as run at once go to
    the RESP client's threads together (one ``pipelines`` call); more queue for the lane slots one
    ``pipeline`` call each, at most ``_put_lane_count`` at a time (a lane starts when another ends, no group
    waits for its slowest lane), and every value is stored."""
    import tiercache.adapters.redis as redis_adapter

    monkeypatch.setattr(redis_adapter, "PUT_PIPELINE_BYTES", MiB)
    async with await RedisAdapter.open(redis_server.url, prefix=_prefix()) as adapter:
        adapter._put_lane_count, adapter._put_lanes = 2, asyncio.Semaphore(2)
        resp = adapter._resp
        assert resp is not None
        calls = {"pipelines": 0, "pipeline": 0, "running": 0, "most": 0}
        together, one = resp.pipelines, resp.pipeline

        async def pipelines(*args: Any, **kwargs: Any) -> Any:
            calls["pipelines"] += 1
            return await together(*args, **kwargs)

        async def pipeline(*args: Any, **kwargs: Any) -> Any:
            calls["pipeline"] += 1
            calls["running"] += 1
            calls["most"] = max(calls["most"], calls["running"])
            try:
                return await one(*args, **kwargs)
            finally:
                calls["running"] -= 1

        monkeypatch.setattr(resp, "pipelines", pipelines)
        monkeypatch.setattr(resp, "pipeline", pipeline)
        for count, lanes in ((4, 2), (8, 4)):  # 400 KiB values: two to a lane
            calls.update(pipelines=0, pipeline=0, most=0)
            keys = unique_keys(count)
            values = [bytes([i + 1]) * (400 << 10) for i in range(count)]
            assert await adapter.batched_put(keys, values) == [True] * count
            if lanes <= 2:
                assert (calls["pipelines"], calls["pipeline"]) == (1, 0), calls
            else:
                assert (calls["pipelines"], calls["pipeline"], calls["most"]) == (0, lanes, 2), calls
            assert await adapter.batched_get(keys) == values


async def test_pool_exhaustion_completes(redis_server: Any) -> None:
    async with await RedisAdapter.open(redis_server.url, prefix=_prefix(), pool_size=2) as adapter:
        batches = [unique_keys(3) for _ in range(20)]
        values = [[bytes([b]) * (300_000 + 1000 * i) for i in range(3)] for b in range(20)]

        async def one(b: int) -> None:
            assert await adapter.batched_put(batches[b], values[b]) == [True] * 3
            assert await adapter.batched_contains(batches[b]) == [True] * 3
            assert await adapter.batched_get(batches[b]) == values[b]

        await asyncio.wait_for(asyncio.gather(*(one(b) for b in range(20))), 15)  # a deadlock guard


async def test_cluster_spreads_keys_over_masters(redis_cluster: Any) -> None:
    import redis.asyncio as aredis

    prefix = _prefix()
    async with await RedisClusterAdapter.open(redis_cluster.url, prefix=prefix) as adapter:
        keys = unique_keys(60)
        assert await adapter.batched_put(keys, [k.encode() for k in keys]) == [True] * 60
        assert await adapter.batched_get(keys) == [k.encode() for k in keys]
        counts = []
        for node in redis_cluster.nodes:
            client = aredis.Redis(host="127.0.0.1", port=node.port)
            counts.append(len([k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]))
            await client.aclose()
        assert sum(counts) == 60
        assert all(c > 0 for c in counts), counts
        assert await adapter.batched_delete(keys) == [True] * 60


# -- through the storage manager ----------------------------------------------------------------------


async def test_manager_turns_a_killed_server_into_misses(redis_factory: Callable[..., Any]) -> None:
    server = redis_factory()
    raw = build_pipeline(["raw"])
    keys = unique_keys(4)
    writer = await RedisAdapter.open(server.url, socket_timeout=1)
    async with StorageManager(
        L1Cache(SPEC.nbytes * 8, SPEC.nbytes), [("redis", writer, raw)], FAIL_FAST
    ) as m:
        await store_chunks(m, keys)
    reader = await RedisAdapter.open(server.url, socket_timeout=1)
    async with StorageManager(
        L1Cache(SPEC.nbytes * 8, SPEC.nbytes), [("redis", reader, raw)], FAIL_FAST
    ) as m:
        assert (await m.lookup_prefix(keys, [SPEC] * 4, prefetch=False)).chunks == 4
        server.proc.kill()
        hit = await m.lookup_prefix(keys, [SPEC] * 4)
        assert hit.chunks == 0
        leases = await m.batched_get(keys, [SPEC] * 4)
        assert leases == [None] * 4
        # one failed contains each (lookup, then the read's own check): the second opens the circuit
        assert m.metrics.value("tiercache_tier_errors_total", tier="redis", op="contains") == 2
        assert m.metrics.value("tiercache_circuit_open", tier="redis") == 1
        assert (await m.lookup_prefix(keys, [SPEC] * 4)).chunks == 0  # open: no call, still a miss
        assert m.metrics.value("tiercache_tier_errors_total", tier="redis", op="contains") == 2


# -- cluster errors and retries ---------------------------------------------------------------


async def test_cluster_adapter_on_a_standalone_server_is_unavailable(redis_server: Any) -> None:
    """redis-py raises RedisClusterException (not a RedisError) here; the adapter maps it."""
    with pytest.raises(AdapterUnavailable):
        await RedisClusterAdapter.open(f"redis+cluster://127.0.0.1:{redis_server.port}", socket_timeout=2)


async def test_cluster_never_retries_a_timeout(redis_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A paused master gets each command once: a timeout is an AdapterTimeout, never a second try. (The
    timeout leaves a loaded machine room for the first put; a paused master outlasts any.)"""
    from redis.asyncio.connection import AbstractConnection

    prefix = _prefix()
    adapter = await RedisClusterAdapter.open(redis_cluster.url, prefix=prefix, socket_timeout=1.5)
    try:
        (key,) = unique_keys(1)
        assert await adapter.batched_put([key], [b"v"]) == [True]
        client = adapter._client
        node = client.nodes_manager.get_node_from_slot(client.keyslot(prefix + key))
        paused = next(n for n in redis_cluster.nodes if n.port == node.port)
        sends: list[int] = []
        original = AbstractConnection.send_packed_command

        async def spy(self: Any, command: Any, check_health: bool = True) -> None:
            if self.port == node.port:
                sends.append(1)
            await original(self, command, check_health)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", spy)
        paused.proc.pause()
        try:
            with pytest.raises(AdapterTimeout):
                await adapter.batched_get([key])
        finally:
            paused.proc.resume()
        assert len(sends) == 1, f"the GET was sent {len(sends)} times to the paused master"
    finally:
        await adapter.aclose()
