"""Network adapters behind a fault-injecting proxy (stall, reset, truncate): every failure is an
``AdapterTimeout`` or ``AdapterUnavailable`` (or a miss), never a raw client-library exception, never wrong
bytes, and every call ends within the adapter's own timeouts, with or without the storage manager."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from tiercache.adapters import Adapter
from tiercache.errors import AdapterError, AdapterTimeout, AdapterUnavailable
from tiercache.testing.harness import fault_proxy as fault_proxy_module
from tiercache.testing.harness import s3 as s3_servers

pytestmark = pytest.mark.asyncio

SAFETY_NET_S = 60
"""Only there so that a broken adapter fails the test instead of hanging it; never reached when correct."""


BUCKET = "tc-faults"


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("aioboto3")
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with s3_servers.aws_test_env(), s3_servers.moto_with_bucket(BUCKET, log) as server:
        yield server


async def _outcome(call: Awaitable[Any]) -> Any:
    """The call's result, or the AdapterError it raised; any other exception fails the test."""
    try:
        return await asyncio.wait_for(call, SAFETY_NET_S)
    except AdapterError as exc:
        return exc


@contextlib.asynccontextmanager
async def behind(proxy: Any, opening: Awaitable[Adapter]) -> AsyncIterator[Adapter]:
    """The adapter ``opening`` opens through ``proxy``; at the end the proxy passes again and it is closed."""
    adapter = await opening
    try:
        yield adapter
    finally:
        proxy.mode = "pass"
        await adapter.aclose()


Op = Callable[[Adapter], Awaitable[Any]]
SMALL = os.urandom(1000)
BIG = os.urandom(3 << 20)  # a PUT with a body large enough for "Expect: 100-continue"
OPS: dict[str, Op] = {
    "contains": lambda a: a.batched_contains(["a", "b"]),
    "get": lambda a: a.batched_get(["a"]),
    "put": lambda a: a.batched_put(["c"], [SMALL]),
    "put_big": lambda a: a.batched_put(["d"], [BIG]),
}


# -- S3 (moto) -------------------------------------------------------------------------------------------


async def _s3(moto: Any, proxy: Any, **options: Any) -> Adapter:
    from tiercache.adapters.s3 import S3Adapter

    options.setdefault("connect_timeout", 0.5)
    options.setdefault("read_timeout", 0.5)
    options.setdefault("max_attempts", 2)
    url = f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}"
    return await S3Adapter.open(url, endpoint_url=f"http://127.0.0.1:{proxy.port}", **options)


@pytest.mark.parametrize("op", sorted([*OPS, "put_multipart"]))
@pytest.mark.parametrize(("mode", "error"), [("stall", AdapterTimeout), ("reset", AdapterUnavailable)])
async def test_s3_stalled_or_reset_server(
    moto: Any, fault_proxy: Any, mode: str, error: type[AdapterError], op: str
) -> None:
    """Every S3 call, PUT included, ends with AdapterTimeout/AdapterUnavailable."""
    proxy = fault_proxy(moto.port)
    async with behind(proxy, _s3(moto, proxy, multipart_threshold="5MiB", part_size="5MiB")) as adapter:
        assert await adapter.batched_put(["a"], [SMALL]) == [True]
        proxy.mode = mode
        call = (
            adapter.batched_put(["m"], [os.urandom(11 << 20)]) if op == "put_multipart" else OPS[op](adapter)
        )
        result = await _outcome(call)
        assert isinstance(result, error), f"{op} under {mode}: {result!r}"
        proxy.mode = "pass"
        assert await adapter.batched_get(["a"]) == [SMALL]


async def test_s3_truncated_body_without_length_is_a_miss(moto: Any, fault_proxy: Any) -> None:
    """Half a body, no Content-Length, connection closed (valid HTTP/1.1): a miss, counted."""
    proxy = fault_proxy(moto.port)
    value = os.urandom(100_000)
    async with behind(proxy, _s3(moto, proxy)) as adapter:
        assert await adapter.batched_put(["a"], [value]) == [True]
        proxy.mode, proxy.strip_content_length, proxy.truncate_after = "truncate", True, 50_000
        result = await _outcome(adapter.batched_get(["a"]))
        assert result == [None], f"a truncated body was served: {result!r}"
        assert adapter.stats["short_bodies"] == 1
        proxy.mode = "pass"
        assert await adapter.batched_get(["a"]) == [value]


@pytest.mark.parametrize("op", sorted(OPS))
async def test_s3_truncated_answers(moto: Any, fault_proxy: Any, op: str) -> None:
    """Answers cut off after their first bytes: a miss or AdapterUnavailable, never wrong bytes."""
    proxy = fault_proxy(moto.port)
    async with behind(proxy, _s3(moto, proxy)) as adapter:
        assert await adapter.batched_put(["a"], [SMALL]) == [True]
        proxy.mode, proxy.truncate_after = "truncate", 40
        result = await _outcome(OPS[op](adapter))
        ok = isinstance(result, AdapterUnavailable | AdapterTimeout) or result in ([None], [False, False])
        assert ok, f"{op} with a truncated answer: {result!r}"


@pytest.mark.parametrize("op", sorted(OPS))
async def test_s3_slow_down_is_a_miss_or_refused_store(moto: Any, fault_proxy: Any, op: str) -> None:
    """Every request answered ``503 SlowDown`` (S3 out of capacity): an AdapterError, a miss or a refused
    put; nothing reaches the server; once it answers again the stored object is intact."""
    proxy = fault_proxy(moto.port)
    async with behind(proxy, _s3(moto, proxy)) as adapter:
        assert await adapter.batched_put(["a"], [SMALL]) == [True]
        proxy.mode = "http_503"
        result = await _outcome(OPS[op](adapter))
        ok = isinstance(result, AdapterError) or result in ([None], [False], [False, False])
        assert ok, f"{op} under 503 SlowDown: {result!r}"
        proxy.mode = "pass"
        assert await adapter.batched_get(["a", "c", "d"]) == [SMALL, None, None]


# -- Redis ------------------------------------------------------------------------------------------------


STALL_S = 2.0
"""The Redis adapter's socket timeout through the fault proxy: a stall always outlasts it, while a 3 MiB value
relayed by the proxy's thread on a loaded 2-core machine stays well within it."""


async def _redis(proxy: Any) -> Adapter:
    from tiercache.adapters.redis import RedisAdapter

    prefix = f"t{uuid.uuid4().hex[:12]}:"
    return await RedisAdapter.open(f"redis://127.0.0.1:{proxy.port}/0", prefix=prefix, socket_timeout=STALL_S)


CORRECT: dict[str, object] = {"contains": [True, False], "get": [BIG], "put": [True], "put_big": [True]}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize(("mode", "error"), [("stall", AdapterTimeout), ("reset", AdapterUnavailable)])
async def test_redis_stalled_or_reset_server(
    redis_server: Any, fault_proxy: Any, mode: str, error: type[AdapterError], op: str
) -> None:
    proxy = fault_proxy(redis_server.port)
    async with behind(proxy, _redis(proxy)) as adapter:
        assert await adapter.batched_put(["a"], [BIG]) == [True]
        proxy.mode = mode
        result = await _outcome(OPS[op](adapter))
        assert isinstance(result, error), f"{op} under {mode}: {result!r}"
        proxy.mode = "pass"
        assert await adapter.batched_get(["a"]) == [BIG]


@pytest.mark.parametrize("op", sorted(OPS))
async def test_redis_truncating_server(redis_server: Any, fault_proxy: Any, op: str) -> None:
    """Replies cut after 1000 bytes: the right answer (short replies fit) or an AdapterError, never a part."""
    proxy = fault_proxy(redis_server.port)
    async with behind(proxy, _redis(proxy)) as adapter:
        assert await adapter.batched_put(["a"], [BIG]) == [True]
        proxy.mode, proxy.truncate_after = "truncate", 1000
        result = await _outcome(OPS[op](adapter))
        assert isinstance(result, AdapterUnavailable | AdapterTimeout) or result == CORRECT[op], (
            f"{op} with truncated replies: {str(result)[:200]}"
        )
        if op == "get":
            assert isinstance(result, AdapterError), "3 MiB cannot arrive in 1000 bytes"
        proxy.mode = "pass"
        assert await adapter.batched_get(["a"]) == [BIG]


# -- Mooncake (master RPC through a proxy in its own process) ---------------------------------------------
# Mooncake's store binding holds the GIL inside ``setup``: an in-process proxy thread could not forward, so
# the first connection hung until the client's 30 s RPC timeout (20 times). Hence ProcessFaultProxy. Only the
# master's RPC traffic goes through the proxy; the data path goes to the store client's address, which the
# metadata server hands out.


@pytest.fixture
def master_proxy(mooncake_cluster: Any) -> Iterator[Any]:
    """A ProcessFaultProxy in front of the session master's RPC port."""
    proxy = fault_proxy_module.ProcessFaultProxy("127.0.0.1", mooncake_cluster.rpc_port).start()
    yield proxy
    proxy.stop()


async def _mooncake(cluster: Any, proxy: Any) -> Adapter:
    from tiercache.adapters.mooncake import MooncakeAdapter

    metadata = f"http://127.0.0.1:{cluster.http_port}/metadata"
    url = f"mooncake://127.0.0.1:{proxy.port}?metadata={metadata}&protocol=tcp"
    return await MooncakeAdapter.open(url, timeout=1.0, buffer_size="16MiB")


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("mode", ["stall", "reset", "truncate"])
async def test_mooncake_faulty_master(mooncake_cluster: Any, master_proxy: Any, mode: str, op: str) -> None:
    """A stalled master is AdapterTimeout; a reset or cut-off answer is AdapterUnavailable or
    AdapterTimeout, never wrong bytes; the same adapter serves the stored value once the master answers."""
    adapter = await _mooncake(mooncake_cluster, master_proxy)
    key = f"k{uuid.uuid4().hex[:12]}"
    try:
        assert await adapter.batched_put([key], [BIG]) == [True]
        master_proxy.truncate_after = 10
        master_proxy.mode = mode
        result = await _outcome(OPS[op](adapter))
        if mode == "stall":
            assert isinstance(result, AdapterTimeout), f"{op} under stall: {result!r}"
        else:
            assert isinstance(result, AdapterUnavailable | AdapterTimeout), f"{op} under {mode}: {result!r}"
        master_proxy.mode = "pass"
        for _ in range(50):  # the client reconnects by itself; bounded poll
            got = await _outcome(adapter.batched_get([key]))
            if not isinstance(got, AdapterError):
                break
        assert got == [BIG]
    finally:
        master_proxy.mode = "pass"
        await _outcome(adapter.aclose())


async def test_mooncake_open_against_a_mute_master(mooncake_cluster: Any, master_proxy: Any) -> None:
    """A master that accepts connections but never answers fails ``open`` with AdapterUnavailable from the
    probe, before Mooncake's ``setup`` (which holds the GIL for 20 x 30 s) can freeze the process."""
    master_proxy.mode = "stall"
    result = await _outcome(_mooncake(mooncake_cluster, master_proxy))
    assert isinstance(result, AdapterUnavailable), repr(result)
    assert "does not answer" in str(result)
    master_proxy.mode = "pass"
    adapter = await _mooncake(mooncake_cluster, master_proxy)
    await adapter.aclose()
