"""Expiry of a Redis/Valkey tier with a TTL, told by the server's keyspace notifications: an object that
expires is announced as a ``BlockRemoved`` of the tier's medium (real redis-server and valkey-server)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration import test_redis_tls
from tests.integration.conftest import RedisServer, redis_command
from tests.unit.test_events import SPEC, _put, info, replay
from tiercache.adapters.redis import RedisAdapter
from tiercache.adapters.redis_expiry import notify_flags
from tiercache.config import ManagerConfig
from tiercache.events import MEDIUM_CPU, MEDIUM_REMOTE, Event, EventSink, Removed, Stored
from tiercache.serde import build_pipeline
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager

_PREFIXES = itertools.count()
pki = test_redis_tls.pki  # the TLS server's fixtures
tls_server = test_redis_tls.tls_server


def test_notify_flags_keep_what_the_server_announces() -> None:
    assert notify_flags("") == "Ex"
    assert notify_flags("Kg") == "KgEx"
    assert notify_flags("Ex") is None
    assert notify_flags("AKE") is None  # A holds x
    assert notify_flags("KA") == "KAE"
    assert notify_flags("E$") == "E$x"


def _subscribers(port: int, channel: str) -> int:
    reply = redis_command(port, "PUBSUB", "NUMSUB", channel)
    return int(reply.split(b"\r\n")[-2].lstrip(b":"))


async def _manager(server: RedisServer, ttl: float) -> tuple[StorageManager, RedisAdapter, str]:
    prefix = f"tc-expiry-{next(_PREFIXES)}-{time.monotonic_ns()}:"
    adapter = await RedisAdapter.open(server.url, ttl=ttl, prefix=prefix)
    policy = ManagerConfig(l2_deadline_s=5.0, lookup_deadline_s=5.0)
    manager = StorageManager(
        L1Cache(SPEC.nbytes * 8, SPEC.nbytes), [("redis", adapter, build_pipeline(["raw"]))], policy
    )
    return manager, adapter, prefix


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["redis_server", "valkey_server"])
async def test_expired_object_is_announced_removed(backend: str, request: pytest.FixtureRequest) -> None:
    """TTL 1 s: the object is announced stored on CPU and REMOTE, then, once the server expires it, removed
    from REMOTE only (the L1 copy stays); a key of another prefix expiring announces nothing."""
    server: RedisServer = request.getfixturevalue(backend)
    manager, _, _ = await _manager(server, ttl=1.0)
    sink = EventSink({"redis": MEDIUM_REMOTE})
    detach = sink.attach(manager)
    channel = "__keyevent@0__:expired"
    try:
        deadline = time.monotonic() + 30
        while _subscribers(server.port, channel) < 1:  # the watcher's thread has subscribed
            assert time.monotonic() < deadline, "the expiry watcher never subscribed"
            await asyncio.sleep(0.05)
        redis_command(server.port, "SET", "not-ours:ks.a", "x", "PX", "50")
        await _put(manager, sink, ["ks.a"], [0])
        await manager.drain()
        events: list[Event] = sink.take()
        both = {MEDIUM_CPU: set(info(0, 2).block_hashes), MEDIUM_REMOTE: set(info(0, 2).block_hashes)}
        assert replay(events) == both
        events += await _until_removed(sink, events, deadline, "after the TTL")
        assert replay(events) == {MEDIUM_CPU: set(info(0, 2).block_hashes)}
        assert sink.held("redis") == []
    finally:
        detach()
        await manager.aclose()


async def _until_removed(sink: EventSink, events: list[Event], deadline: float, when: str) -> list[Event]:
    """Take the sink's events until one (with ``events``, those seen so far) is a removal, by ``deadline``;
    assert the first chunk (ks at 0) left REMOTE and return the events taken here."""
    taken: list[Event] = []
    while not any(isinstance(e, Removed) for e in events + taken):
        assert time.monotonic() < deadline, f"no removal announced {when}"
        await asyncio.sleep(0.1)
        taken += sink.take()
    assert Removed(info(0, 2).block_hashes, MEDIUM_REMOTE) in events + taken
    return taken


async def _wait_subscribed(port: int) -> None:
    deadline = time.monotonic() + 30
    while _subscribers(port, "__keyevent@0__:expired") < 1:  # the watcher's thread has subscribed
        assert time.monotonic() < deadline, "the expiry watcher never subscribed"
        await asyncio.sleep(0.05)


@pytest.mark.asyncio
async def test_expiry_announced_after_the_server_restarts(redis_factory: object) -> None:
    """The server restarts (its notify-keyspace-events back to none): the watcher connects again, turns
    them on again, and the next expiry is announced."""
    server: RedisServer = redis_factory()  # type: ignore[operator]
    manager, _, _ = await _manager(server, ttl=1.0)
    sink = EventSink({"redis": MEDIUM_REMOTE})
    detach = sink.attach(manager)
    try:
        await _wait_subscribed(server.port)
        server.restart()
        assert b"Ex" not in redis_command(server.port, "CONFIG", "GET", "notify-keyspace-events")
        await _wait_subscribed(server.port)
        deadline = time.monotonic() + 30
        events: list[Event] = []
        while not any(isinstance(e, Stored) and e.medium == MEDIUM_REMOTE for e in events):
            assert time.monotonic() < deadline, "the tier never stored after the restart"
            await _put(manager, sink, [f"ks.{len(events)}"], [0])  # a put may fail while it reconnects
            await manager.drain()
            events += sink.take()
        events += await _until_removed(sink, events, deadline, "after the restart")
    finally:
        detach()
        await manager.aclose()


@pytest.mark.asyncio
async def test_config_refused_is_one_warning_line(
    redis_factory: object, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A server whose CONFIG command is disabled (managed services): one warning line says expiry is not
    announced; the tier works on."""
    server: RedisServer = redis_factory("--rename-command", "CONFIG", "")  # type: ignore[operator]
    manager, _, _ = await _manager(server, ttl=30.0)
    sink = EventSink({"redis": MEDIUM_REMOTE})
    with caplog.at_level(logging.WARNING, logger="tiercache.adapters.redis_expiry"):
        detach = sink.attach(manager)
        try:
            deadline = time.monotonic() + 30
            while not [r for r in caplog.records if "not announced" in r.getMessage()]:
                assert time.monotonic() < deadline, "no warning"
                await asyncio.sleep(0.05)
            await _put(manager, sink, ["ks.a"], [0])
            await manager.drain()
            assert replay(sink.take())[MEDIUM_REMOTE] == set(info(0, 2).block_hashes)
        finally:
            detach()
            await manager.aclose()
    lines = [r for r in caplog.records if "not announced" in r.getMessage()]
    assert len(lines) == 1
    assert "notify-keyspace-events" in lines[0].getMessage()


def test_server_stream_announces_expiry(redis_server: RedisServer, tmp_path: Path, sock_dir: Path) -> None:
    """A node server with an events endpoint and a Redis tier (ttl 1 s): a stored prompt's blocks are
    published on CPU and REMOTE, then removed from REMOTE once the server expires them."""
    pytest.importorskip("zmq")
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    from tests.unit.test_engine import CHUNK, Engine
    from tests.unit.test_events_server import LAYOUT, SLOT_BYTES, block_hashes, engine_on
    from tiercache.testing.harness.kv_events import receive, subscribe
    from tiercache.testing.harness.processes import ConfigServer, free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    prefix = f"tc-expiry-server-{time.monotonic_ns()}:"
    cfg = tmp_path / "server.toml"
    cfg.write_text(
        f'[l1]\ncapacity = {SLOT_BYTES * 16}\n\n[server]\nevents_endpoint = "{endpoint}"\n'
        f"slot_bytes = {SLOT_BYTES}\n\n[manager]\nl2_deadline_s = 5.0\n\n"
        f'[[tiers]]\nname = "redis"\nurl = "{redis_server.url}?ttl=1&prefix={prefix}"\ncodecs = ["raw"]\n'
    )
    tokens = list(range(7000, 7000 + 2 * CHUNK))
    blocks = block_hashes(tokens)
    want = [int.from_bytes(h[-8:], "big") for h in blocks.hashes]
    with ConfigServer(cfg, str(sock_dir / "l1.sock")) as server:
        deadline = time.monotonic() + 30
        while _subscribers(redis_server.port, "__keyevent@0__:expired") < 1:
            assert time.monotonic() < deadline, "the server's expiry watcher never subscribed"
            time.sleep(0.05)
        sub = subscribe(endpoint)
        src = Engine.holding(LAYOUT, len(tokens), seed=1)

        async def store() -> int:
            engine = engine_on(server.path)
            try:
                return await engine.store(tokens, src.kv, src.slots(len(tokens)), block_hashes=blocks)
            finally:
                await engine.aclose()

        assert asyncio.run(store()) == len(tokens)

        def removed_remote(events: list[object]) -> bool:
            gone = [e for e in events if isinstance(e, kv_events.BlockRemoved) and e.medium == "REMOTE"]
            return sum(len(e.block_hashes) for e in gone) >= len(want)

        events = receive(sub, removed_remote)
        sub.close(linger=0)
    stored = [e for e in events if isinstance(e, kv_events.BlockStored)]
    for medium in ("CPU", "REMOTE"):
        assert [h for e in stored if e.medium == medium for h in e.block_hashes] == want, medium
    removed = [e for e in events if isinstance(e, kv_events.BlockRemoved)]
    assert sorted(h for e in removed if e.medium == "REMOTE" for h in e.block_hashes) == sorted(want)
    assert not [e for e in removed if e.medium == "CPU"]  # the shared L1 keeps its copies


@pytest.mark.asyncio
async def test_expiry_over_tls(tls_server: str, pki: Any) -> None:
    """rediss:// (a TLS-only server, verified against the test CA): the watcher connects with the tier's TLS
    settings and the expiry is announced."""
    import redis

    prefix = f"tc-expiry-tls-{time.monotonic_ns()}:"
    adapter = await RedisAdapter.open(tls_server, ttl=1.0, prefix=prefix, ssl_ca_certs=str(pki.ca))
    policy = ManagerConfig(l2_deadline_s=5.0, lookup_deadline_s=5.0)
    manager = StorageManager(
        L1Cache(SPEC.nbytes * 8, SPEC.nbytes), [("redis", adapter, build_pipeline(["raw"]))], policy
    )
    port = int(tls_server.rsplit(":", 1)[1].split("/")[0])
    probe = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(pki.ca))
    sink = EventSink({"redis": MEDIUM_REMOTE})
    detach = sink.attach(manager)
    try:
        deadline = time.monotonic() + 30
        while not dict(probe.pubsub_numsub("__keyevent@0__:expired")).get(b"__keyevent@0__:expired"):
            assert time.monotonic() < deadline, "the expiry watcher never subscribed over TLS"
            await asyncio.sleep(0.05)
        await _put(manager, sink, ["ks.a"], [0])
        await manager.drain()
        events: list[Event] = sink.take()
        events += await _until_removed(sink, events, deadline, "after the TTL")
    finally:
        detach()
        probe.close()
        await manager.aclose()
