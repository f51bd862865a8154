"""Values over ``part_size`` stored as part keys plus a manifest head (adapters/_parts.py), on real servers.

Both client paths of the standalone adapter are covered: the zero-copy RESP client (plain TCP) and redis-py
(``via`` = ``"redis-py"``: the adapter's RESP pool switched off after open, as for TLS); the cluster adapter
always uses redis-py.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiercache
from tiercache.adapters._parts import MAGIC, MANIFEST_BYTES, NONCE_BYTES, Manifest
from tiercache.adapters._resp import RespError, RespPool
from tiercache.adapters.redis import RedisAdapter, RedisClusterAdapter
from tiercache.errors import ConfigError
from tiercache.testing.adapters import AdapterConformance, AdapterFactory

KiB, MiB = 1 << 10, 1 << 20
PART = 64 * KiB


def _prefix() -> str:
    return f"p{uuid.uuid4().hex[:12]}:"


def _value(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


async def _open(url: str, via: str, **options: Any) -> RedisAdapter:
    adapter = await RedisAdapter.open(url, socket_timeout=10, **options)
    if via == "redis-py":
        assert adapter._resp is not None
        adapter._resp.close()
        adapter._resp = None
    return adapter


async def _stored_keys(port: int, prefix: str) -> list[bytes]:
    raw = aredis.Redis(host="127.0.0.1", port=port)
    try:
        return sorted([k async for k in raw.scan_iter(match=prefix + "*")])
    finally:
        await raw.aclose()


VIAS = pytest.mark.parametrize("via", ["resp", "redis-py"])


async def _reads_back(adapter: RedisAdapter, key: str, want: bytes) -> None:
    (got,) = await adapter.batched_get([key])
    assert got is not None
    assert bytes(got) == want


# -- the conformance kit with small parts -------------------------------------------------------------


class TestRedisPartsConformance(AdapterConformance):
    max_object_bytes = 8 * MiB

    @pytest.fixture
    def adapter_factory(self, redis_server: Any) -> AdapterFactory:
        prefix = _prefix()
        return lambda: RedisAdapter.open(redis_server.url, prefix=prefix, socket_timeout=10, part_size=PART)


class TestValkeyPartsConformance(AdapterConformance):
    max_object_bytes = 8 * MiB

    @pytest.fixture
    def adapter_factory(self, valkey_server: Any) -> AdapterFactory:
        prefix, url = _prefix(), f"valkey://127.0.0.1:{valkey_server.port}/0"
        return lambda: tiercache.open_adapter(url, prefix=prefix, socket_timeout=10, part_size=PART)


class TestClusterPartsConformance(AdapterConformance):
    max_object_bytes = 8 * MiB

    @pytest.fixture
    def adapter_factory(self, redis_cluster: Any) -> AdapterFactory:
        prefix = _prefix()
        return lambda: RedisClusterAdapter.open(
            redis_cluster.url, prefix=prefix, socket_timeout=10, part_size=PART
        )


# -- round trips across the part boundary ------------------------------------------------------------

_BOUNDARY = 1024
_SIZES = st.one_of(
    st.integers(0, 4 * _BOUNDARY + 10),
    st.sampled_from([_BOUNDARY - 1, _BOUNDARY, _BOUNDARY + 1, 2 * _BOUNDARY, 2 * _BOUNDARY + 1]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(_SIZES, min_size=1, max_size=4), seed=st.integers(0, 2**32), magic=st.booleans())
@VIAS
def test_round_trip_across_part_boundaries(
    redis_server: Any, via: str, sizes: list[int], seed: int, magic: bool
) -> None:
    """Any sizes around multiples of the part size (and values that start like a manifest) come back
    exactly; contains sees them; delete leaves no key (head or part) behind."""
    values = [_value(n, seed + i) for i, n in enumerate(sizes)]
    if magic:
        values[0] = MAGIC + values[0]
    prefix = _prefix()
    keys = [f"k{i}" for i in range(len(values))]

    async def body() -> None:
        adapter = await _open(redis_server.url, via, prefix=prefix, part_size=_BOUNDARY)
        try:
            assert await adapter.batched_put(keys, values) == [True] * len(keys)
            got = await adapter.batched_get(keys)
            assert [None if g is None else bytes(g) for g in got] == values
            assert await adapter.batched_contains(keys) == [True] * len(keys)
            stored = await _stored_keys(redis_server.port, prefix)
            parted = [v for v in values if len(v) > _BOUNDARY or v.startswith(MAGIC)]
            want = len(values) + sum(max(1, -(-len(v) // _BOUNDARY)) for v in parted)
            assert len(stored) == want
            assert await adapter.batched_delete(keys) == [True] * len(keys)
            assert await adapter.batched_contains(keys) == [False] * len(keys)
            assert await _stored_keys(redis_server.port, prefix) == []
            assert adapter.stats == {
                "parts_missing": 0,
                "parts_stale": 0,
                "bad_manifests": 0,
                "foreign_keys": 0,
            }
        finally:
            await adapter.aclose()

    asyncio.run(body())


# -- layout on the server ------------------------------------------------------------------------------


@pytest.mark.asyncio
@VIAS
async def test_parts_then_head_layout_and_ttl(redis_server: Any, via: str) -> None:
    """A 1 MiB value with 64 KiB parts is 16 part keys of part + nonce and a manifest head; every key
    carries the TTL."""
    prefix = _prefix()
    value = _value(MiB, 1)
    adapter = await _open(redis_server.url, via, prefix=prefix, part_size=PART, ttl=3600)
    raw = aredis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        assert await adapter.batched_put(["obj"], [value]) == [True]
        head = await raw.get(prefix + "obj")
        manifest = Manifest.decode(head, 1 << 30)
        assert manifest is not None
        assert (manifest.total, manifest.part_size, manifest.count) == (MiB, PART, 16)
        for i in range(16):
            part = await raw.get(f"{prefix}obj#{i}")
            assert part == value[i * PART : (i + 1) * PART] + manifest.nonce
        assert len(await _stored_keys(redis_server.port, prefix)) == 17
        ttls = [await raw.pttl(k) for k in await _stored_keys(redis_server.port, prefix)]
        assert all(0 < t <= 3600_000 for t in ttls), ttls
    finally:
        await adapter.aclose()
        await raw.aclose()


@pytest.mark.asyncio
@VIAS
async def test_overwrite_with_fewer_parts_drops_the_rest(redis_server: Any, via: str) -> None:
    prefix = _prefix()
    adapter = await _open(redis_server.url, via, prefix=prefix, part_size=PART)
    try:
        assert await adapter.batched_put(["obj"], [_value(MiB, 2)]) == [True]
        small = _value(PART + 1, 3)
        assert await adapter.batched_put(["obj"], [small]) == [True]
        (got,) = await adapter.batched_get(["obj"])
        assert got is not None
        assert bytes(got) == small
        assert len(await _stored_keys(redis_server.port, prefix)) == 3  # head + 2 parts
        plain = _value(100, 4)
        assert await adapter.batched_put(["obj"], [plain]) == [True]
        (got,) = await adapter.batched_get(["obj"])
        assert got is not None
        assert bytes(got) == plain
    finally:
        await adapter.aclose()


@pytest.mark.asyncio
@VIAS
@pytest.mark.parametrize("plain", ["pipelined", "large"])
async def test_overwrite_with_a_plain_value_drops_every_part(redis_server: Any, via: str, plain: str) -> None:
    """A parted object overwritten by a value stored whole (a small, pipelined one; or a large one written
    by an adapter that does not split it) leaves no part behind (they used to stay until TTL or eviction)."""
    prefix = _prefix()
    adapter = await _open(redis_server.url, via, prefix=prefix, part_size=PART)
    whole = await _open(redis_server.url, via, prefix=prefix, part_size=0)
    try:
        assert await adapter.batched_put(["obj", "other"], [_value(3 * PART, 2), _value(2 * PART, 3)]) == [
            True,
            True,
        ]
        assert len(await _stored_keys(redis_server.port, prefix)) == 2 + 3 + 2
        value = _value(100, 4) if plain == "pipelined" else _value(5 * PART, 4)
        writer = adapter if plain == "pipelined" else whole
        assert await writer.batched_put(["obj"], [value]) == [True]
        assert await _stored_keys(redis_server.port, prefix) == sorted(
            [f"{prefix}obj".encode()] + [f"{prefix}other{s}".encode() for s in ("", "#0", "#1")]
        )
        for reader in (adapter, whole):
            await _reads_back(reader, "obj", value)
    finally:
        await adapter.aclose()
        await whole.aclose()


# -- broken objects are misses, counted --------------------------------------------------------------


@contextlib.asynccontextmanager
async def _parted(
    redis_server: Any, via: str
) -> AsyncIterator[tuple[RedisAdapter, aredis.Redis, str, bytes]]:
    """An adapter holding "obj" in five parts, a plain client of its server, the prefix and the value; both
    closed at the end."""
    prefix = _prefix()
    adapter = await _open(redis_server.url, via, prefix=prefix, part_size=PART)
    raw = aredis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        value = _value(4 * PART + 5, 5)
        assert await adapter.batched_put(["obj"], [value]) == [True]
        yield adapter, raw, prefix, value
    finally:
        await adapter.aclose()
        await raw.aclose()


@pytest.mark.asyncio
@VIAS
@pytest.mark.parametrize("op", ["get", "contains"])
async def test_missing_part_is_a_counted_miss_and_the_object_goes(
    redis_server: Any, via: str, op: str
) -> None:
    """One part gone (as an eviction or expiry would leave it): a miss, ``parts_missing`` counted, and
    the head and the other parts removed so the object is not half there any more."""
    async with _parted(redis_server, via) as (adapter, raw, prefix, _):
        assert await raw.delete(f"{prefix}obj#2") == 1
        if op == "get":
            assert await adapter.batched_get(["obj"]) == [None]
        else:
            assert await adapter.batched_contains(["obj"]) == [False]
        assert adapter.stats["parts_missing"] == 1
        assert await _stored_keys(redis_server.port, prefix) == []
        assert await adapter.batched_get(["obj"]) == [None]
        assert adapter.stats["parts_missing"] == 1  # nothing left to count


@pytest.mark.asyncio
@VIAS
async def test_part_of_another_length_is_a_stale_miss(redis_server: Any, via: str) -> None:
    """A part of another length (a rewrite with another size in progress) is a miss counted in
    ``parts_stale``; the keys stay for the rewrite's head, which comes next."""
    async with _parted(redis_server, via) as (adapter, raw, prefix, _):
        part = await raw.get(f"{prefix}obj#1")
        await raw.set(f"{prefix}obj#1", part[1:])
        assert await adapter.batched_get(["obj"]) == [None]
        assert adapter.stats == {"parts_missing": 0, "parts_stale": 1, "bad_manifests": 0, "foreign_keys": 0}
        assert len(await _stored_keys(redis_server.port, prefix)) == 6


@pytest.mark.asyncio
@VIAS
async def test_part_of_another_type_is_a_stale_miss(redis_server: Any, via: str) -> None:
    """A part key that holds a list (another program's key under the prefix) is a miss wherever it is met:
    counted in ``parts_stale`` and ``foreign_keys``, never an error (its WRONGTYPE failed the whole read or
    lookup); the keys stay, and a put of the object writes it whole again."""
    async with _parted(redis_server, via) as (adapter, raw, prefix, value):
        await raw.delete(f"{prefix}obj#2")
        await raw.rpush(f"{prefix}obj#2", "x")
        assert await adapter.batched_get(["obj"]) == [None]
        assert await adapter.batched_contains(["obj"]) == [False]
        assert adapter.stats == {"parts_missing": 0, "parts_stale": 2, "bad_manifests": 0, "foreign_keys": 2}
        assert len(await _stored_keys(redis_server.port, prefix)) == 6
        assert await adapter.batched_put(["obj"], [value]) == [True]
        await _reads_back(adapter, "obj", value)


@pytest.mark.asyncio
@VIAS
async def test_part_of_another_write_is_a_stale_miss_and_kept(redis_server: Any, via: str) -> None:
    """A part already rewritten by a newer put (same length, another nonce) is a miss counted in
    ``parts_stale``; nothing is deleted (the newer write's head is on its way), and that write reads back."""
    async with _parted(redis_server, via) as (adapter, raw, prefix, value):
        part = await raw.get(f"{prefix}obj#3")
        await raw.set(f"{prefix}obj#3", part[:-NONCE_BYTES] + b"n" * NONCE_BYTES)
        assert await adapter.batched_get(["obj"]) == [None]
        assert adapter.stats == {"parts_missing": 0, "parts_stale": 1, "bad_manifests": 0, "foreign_keys": 0}
        assert len(await _stored_keys(redis_server.port, prefix)) == 6  # head + 5 parts
        newer = _value(len(value), 6)
        assert await adapter.batched_put(["obj"], [newer]) == [True]
        await _reads_back(adapter, "obj", newer)


@pytest.mark.asyncio
@VIAS
@pytest.mark.parametrize("change", ["nonce", "length"])
async def test_contains_is_false_for_a_part_of_another_write(
    redis_server: Any, via: str, change: str
) -> None:
    """``contains`` checks each part's nonce and length as a read does: a part of another write (a rewrite
    in progress, or one that died between its parts and its head) is not contained (it was: every part
    existed), counted in ``parts_stale``, and kept; the read agrees."""
    async with _parted(redis_server, via) as (adapter, raw, prefix, _):
        part = await raw.get(f"{prefix}obj#3")
        if change == "nonce":
            await raw.set(f"{prefix}obj#3", part[:-NONCE_BYTES] + b"n" * NONCE_BYTES)
        else:
            await raw.set(f"{prefix}obj#3", part + b"x")
        assert await adapter.batched_contains(["obj"]) == [False]
        assert adapter.stats == {"parts_missing": 0, "parts_stale": 1, "bad_manifests": 0, "foreign_keys": 0}
        assert len(await _stored_keys(redis_server.port, prefix)) == 6  # head + 5 parts, kept
        assert await adapter.batched_get(["obj"]) == [None]
        assert adapter.stats["parts_stale"] == 2


@pytest.mark.asyncio
@VIAS
async def test_corrupt_manifest_is_a_counted_miss(redis_server: Any, via: str) -> None:
    async with _parted(redis_server, via) as (adapter, raw, prefix, _):
        head = await raw.get(f"{prefix}obj")
        assert len(head) == MANIFEST_BYTES
        await raw.set(f"{prefix}obj", head[: -NONCE_BYTES - 4] + b"\xff\xff\xff\xff" + head[-NONCE_BYTES:])
        assert await adapter.batched_get(["obj"]) == [None]
        assert await adapter.batched_contains(["obj"]) == [False]
        assert adapter.stats["bad_manifests"] == 2


@pytest.mark.asyncio
@VIAS
async def test_batched_delete_removes_every_part(redis_server: Any, via: str) -> None:
    prefix = _prefix()
    adapter = await _open(redis_server.url, via, prefix=prefix, part_size=PART)
    try:
        keys = ["a", "b", "c", "gone"]
        values = [_value(3 * PART, 7), b"small", _value(PART + 1, 8)]
        assert await adapter.batched_put(keys[:3], values) == [True] * 3
        assert len(await _stored_keys(redis_server.port, prefix)) == 3 + 3 + 2
        assert await adapter.batched_delete(keys) == [True, True, True, False]
        assert await _stored_keys(redis_server.port, prefix) == []
    finally:
        await adapter.aclose()


@pytest.mark.asyncio
async def test_evicted_parts_never_give_wrong_bytes(redis_factory: Callable[..., Any]) -> None:
    """Under ``allkeys-random`` eviction single parts go alone: every read is the stored value or a miss."""
    server = redis_factory("--maxmemory", "8mb", "--maxmemory-policy", "allkeys-random")
    async with await RedisAdapter.open(server.url, part_size=PART) as adapter:
        keys = [f"k{i}" for i in range(24)]
        values = [_value(MiB + i, 100 + i) for i in range(24)]
        for i in range(0, 24, 4):
            assert await adapter.batched_put(keys[i : i + 4], values[i : i + 4]) == [True] * 4
        got = await adapter.batched_get(keys)
        for g, v in zip(got, values, strict=True):
            assert g is None or bytes(g) == v
        assert any(g is None for g in got), "24 MiB cannot fit in 8 MB"


# -- the option -------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_part_size_option(redis_server: Any) -> None:
    async with await RedisAdapter.open(redis_server.url + "?part_size=8MiB") as adapter:
        assert adapter.part_size == 8 * MiB
    async with await RedisAdapter.open(redis_server.url) as adapter:
        assert adapter.part_size == 4 * MiB
    for bad in (-1, 1000, (512 << 20) + 1):
        with pytest.raises(ConfigError, match="part_size"):
            await RedisAdapter.open(redis_server.url, part_size=bad)
    prefix = _prefix()
    async with await RedisAdapter.open(redis_server.url, prefix=prefix, part_size=0) as adapter:
        value = _value(3 * MiB, 9)
        assert await adapter.batched_put(["obj"], [value]) == [True]  # 0: never split
        assert await _stored_keys(redis_server.port, prefix) == [f"{prefix}obj".encode()]


# -- GETRANGE + SET on one connection (the RESP client's replace) ------------------------------------------


@pytest.mark.asyncio
async def test_replace_peeks_then_sets_and_keeps_the_connection_in_step(
    redis_factory: Callable[..., Any],
) -> None:
    """``RespPool.replace`` returns the old value's first bytes (``b""`` for no key or a non-string) and
    reads both replies, also when the GETRANGE or the SET is refused, so the pooled connection's next
    reply is its own."""
    server = redis_factory("--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    pool = RespPool("127.0.0.1", server.port, size=1)  # one connection: every call reuses it
    raw = aredis.Redis(host="127.0.0.1", port=server.port)
    try:
        assert await pool.replace(b"k", memoryview(b"first value"), peek=5) == b""
        assert await pool.replace(b"k", memoryview(b"second"), peek=5) == b"first"
        await raw.rpush("lst", "x")
        assert await pool.replace(b"lst", memoryview(b"now a string"), peek=5) == b""  # WRONGTYPE peek
        assert bytes(await pool.get(b"lst") or b"") == b"now a string"
        with pytest.raises(RespError, match="OOM"):
            await pool.replace(b"big", memoryview(bytes(6 * MiB)), peek=5)
        assert bytes(await pool.get(b"k") or b"") == b"second"
    finally:
        pool.close()
        await raw.aclose()


@pytest.mark.asyncio
async def test_pipeline_replies_in_order_with_errors_in_place(redis_factory: Callable[..., Any]) -> None:
    """``RespPool.pipeline`` (the pipelined small puts on plain TCP) returns every reply in order, an error
    reply as its ``RespError`` in place; a put refused for memory on that path is False, not an error."""
    server = redis_factory("--maxmemory-policy", "noeviction")
    pool = RespPool("127.0.0.1", server.port, size=1)
    raw = aredis.Redis(host="127.0.0.1", port=server.port)
    try:
        await raw.rpush("lst", "x")
        got = await pool.pipeline([[b"GETRANGE", b"lst", b"0", b"3"], [b"SET", b"k", b"v"], [b"GET", b"k"]])
        assert isinstance(got[0], RespError)
        assert got[1:] == [b"OK", b"v"]
        async with await RedisAdapter.open(server.url, prefix="t:") as adapter:
            assert await adapter.batched_put(["a", "b"], [b"x" * 100, b"y"]) == [True, True]
            await raw.config_set("maxmemory", "1")  # over the limit: every write is refused
            assert await adapter.batched_put(["c", "d"], [b"x" * 100, b"y"]) == [False, False]
            await raw.config_set("maxmemory", "0")
            assert await adapter.batched_get(["a", "b", "c"]) == [b"x" * 100, b"y", None]
        assert await pool.pipeline([[b"GET", b"k"]]) == [b"v"]
    finally:
        pool.close()
        await raw.aclose()
