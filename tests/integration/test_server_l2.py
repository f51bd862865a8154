"""Server mode with an L2 tier: a real ``tiercache serve`` process in front of a real redis-server.

The server owns the tier: a chunk a client publishes in the shared L1 is written behind to Redis by the
server's StoreController (the client has no tier of its own); a LOOKUP that misses in L1 but hits in Redis
starts the server's PrefetchController, and the read that follows gets the chunks bit-exact from the shared
L1. SIGTERM drains the write-behind before the process exits.
"""

from __future__ import annotations

import signal
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_engine import CHUNK, POLICY, Engine, expected_kv, keyspace_of, layout_of, same_bits
from tiercache.adapters.redis import RedisAdapter
from tiercache.serde import build_pipeline
from tiercache.server.client import SharedL1
from tiercache.server.segment import stride_of
from tiercache.store.engine import CacheEngine
from tiercache.store.manager import StorageManager
from tiercache.testing.harness.processes import ConfigServer

pytestmark = pytest.mark.asyncio

LAYOUT = layout_of()
SLOT_BYTES = CacheEngine.slot_bytes(LAYOUT, CHUNK)
SLOTS = 16
TOKENS = list(range(4000, 4600))  # 3 chunks (256 + 256 + 88 tokens)
LONG = list(range(10_000, 13_000))  # 12 chunks


def write_config(
    directory: Path, port: int, prefix: str, *, drain_s: float = 30.0, metrics: bool = False
) -> Path:
    stride = stride_of(SLOT_BYTES)
    cfg = directory / "serve.toml"
    cfg.write_text(
        f"chunk_size = {CHUNK}\n"
        f"[l1]\ncapacity = {stride * SLOTS}\n"
        f"[server]\nslot_bytes = {SLOT_BYTES}\ndrain_s = {drain_s}\n"
        + ("metrics_port = 0\n" if metrics else "")
        + "[manager]\nl2_deadline_s = 60.0\nlookup_deadline_s = 3.0\n"  # within a client request's 5 s
        f'[[tiers]]\nname = "redis"\nurl = "redis://127.0.0.1:{port}/0"\ncodecs = ["raw", "zstd"]\n'
        f'[tiers.options]\nprefix = "{prefix}"\n'
    )
    return cfg


def engine_on(path: str) -> CacheEngine:
    """A client engine on the server's shared L1: no tier of its own (the server owns L2)."""
    return CacheEngine(
        StorageManager(SharedL1(path), [], POLICY), LAYOUT, keyspace_of(LAYOUT), chunk_size=CHUNK
    )


async def store_prompt(path: str, tokens: list[int] = TOKENS) -> list[str]:
    """Client A stores ``tokens`` through the shared L1; returns the chunk keys."""
    src = Engine.holding(LAYOUT, len(tokens), seed=1, num_blocks=256)
    engine = engine_on(path)
    try:
        assert await engine.store(tokens, src.kv, src.slots(len(tokens))) == len(tokens)
        return list((await engine.lookup_hit(tokens, prefetch=False)).keys)
    finally:
        await engine.aclose()


async def in_redis(port: int, prefix: str, keys: list[str]) -> list[bool]:
    adapter = await RedisAdapter.open(f"redis://127.0.0.1:{port}/0", prefix=prefix)
    try:
        return await adapter.batched_contains(keys)
    finally:
        await adapter.aclose()


async def read_back(path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Client B: lookup (tiers of the answer), retrieve bit-exact, lookup again (tiers now)."""
    engine = engine_on(path)
    try:
        first = await engine.lookup_hit(TOKENS)
        assert first.tokens == len(TOKENS)
        dst = Engine(LAYOUT, num_blocks=64, seed=2)
        result = await engine.retrieve_result(TOKENS, dst.kv, dst.slots(len(TOKENS)))
        assert result.tokens_read == len(TOKENS)
        assert same_bits(dst.read(0, len(TOKENS)), expected_kv(LAYOUT, len(TOKENS)))
        again = await engine.lookup_hit(TOKENS, prefetch=False)
        return first.tiers, again.tiers
    finally:
        await engine.aclose()


def scrape(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        text: str = response.read().decode()
    return text


@pytest.fixture
def sock(sock_dir: Path) -> str:
    return str(sock_dir / "l1.sock")


@pytest.fixture
def prefix() -> str:
    return f"srv{uuid.uuid4().hex[:10]}:"


async def test_write_behind_then_prefetch_after_a_restart(
    redis_server: Any, tmp_path: Path, sock: str, prefix: str
) -> None:
    cfg = write_config(tmp_path, redis_server.port, prefix)
    first = ConfigServer(cfg, sock)
    try:
        keys = await store_prompt(sock)
        admin = SharedL1(sock, role="admin")
        assert admin.drain(60.0)  # DRAIN: the write-behind queue is empty
        assert await in_redis(redis_server.port, prefix, keys) == [True] * 3  # written by the server
        admin.close()
    finally:
        code = first.stop()
    assert code == 0, first.log()[-2000:]
    second = ConfigServer(cfg, sock)  # a new epoch with an empty L1
    try:
        assert second.epoch != first.epoch
        stats = SharedL1(sock).server_stats()
        assert stats is not None
        assert stats["published"] == 0
        tiers_then, tiers_now = await read_back(sock)
        assert tiers_then == ("redis",) * 3  # found in L2, prefetched by the server
        assert tiers_now == ("L1",) * 3  # now in the shared L1
    finally:
        code = second.stop()
    assert code == 0, second.log()[-2000:]


async def test_clear_then_a_lookup_prefetches_from_redis(
    redis_server: Any, tmp_path: Path, sock: str, prefix: str
) -> None:
    server = ConfigServer(write_config(tmp_path, redis_server.port, prefix, metrics=True), sock)
    try:
        await store_prompt(sock)
        admin = SharedL1(sock, role="admin")
        assert admin.drain(60.0)
        metrics = scrape(server.metrics_url)
        assert 'tiercache_stores_total{tier="redis"} 3.0' in metrics  # the server's tier metrics
        assert "tiercache_server_pending_stores 0.0" in metrics
        assert admin.clear() == 3  # CLEAR: every unleased published chunk dropped
        worker = SharedL1(sock)
        assert worker.clear() is None  # CLEAR needs the admin role: refused (cache-off answer, no raise)
        tiers_then, tiers_now = await read_back(sock)
        assert tiers_then == ("redis",) * 3
        assert tiers_now == ("L1",) * 3
        assert 'tiercache_prefetched_total{tier="redis"} 3.0' in scrape(server.metrics_url)
    finally:
        code = server.stop()
    assert code == 0, server.log()[-2000:]


async def test_the_client_never_writes_to_l2_itself(sock: str, tmp_path: Path, redis_server: Any) -> None:
    server = ConfigServer(write_config(tmp_path, redis_server.port, "x:"), sock)
    adapter = await RedisAdapter.open(redis_server.url)
    try:
        with pytest.raises(ValueError, match="server owns the L2 tiers"):
            StorageManager(SharedL1(sock), [("redis", adapter, build_pipeline(["raw"]))], POLICY)
    finally:
        await adapter.aclose()
        server.stop()


def serve_behind_a_gate(
    proxy: Any, tmp_path: Path, sock: str, prefix: str, drain_s: float
) -> tuple[ConfigServer, threading.Event]:
    """A server whose Redis is behind ``proxy``; once started every request to Redis is held until the
    returned event is set (the proxy's 'slow' wait, no timing)."""
    server = ConfigServer(write_config(tmp_path, proxy.port, prefix, drain_s=drain_s), sock)
    released = threading.Event()

    async def wait(_delay: float) -> None:
        import asyncio

        await asyncio.get_running_loop().run_in_executor(None, released.wait)

    proxy.sleep = wait
    proxy.delay_direction = "up"
    proxy.mode = "slow"
    return server, released


async def test_sigterm_drains_the_write_behind_into_redis(
    redis_server: Any, fault_proxy: Any, tmp_path: Path, sock: str, prefix: str
) -> None:
    server, released = serve_behind_a_gate(fault_proxy(redis_server.port), tmp_path, sock, prefix, 120.0)
    try:
        keys = await store_prompt(sock, LONG)  # 12 chunks: two put batches (8 + 4), both held at the proxy
        stats = SharedL1(sock).server_stats()
        assert stats is not None
        assert stats["pending_stores"] >= 2  # a store worker per batch (store_parallel), both waiting
        assert await in_redis(redis_server.port, prefix, keys) == [False] * 12
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.stdout is not None
        line = server.proc.stdout.readline()  # printed when the stop begins
        assert line.startswith("tiercache server stopping; draining"), line
        assert int(line.split()[4]) >= 1
        assert server.proc.poll() is None  # stopping, but draining the queued stores
        released.set()
        code = server.wait()
    finally:
        released.set()
        server.stop()
    assert code == 0, server.log()[-2000:]
    assert await in_redis(redis_server.port, prefix, keys) == [True] * 12  # all stored before the exit


async def test_sigterm_with_a_short_drain_deadline_exits_and_reports_the_drop(
    redis_server: Any, fault_proxy: Any, tmp_path: Path, sock: str, prefix: str
) -> None:
    server, released = serve_behind_a_gate(fault_proxy(redis_server.port), tmp_path, sock, prefix, 0.0)
    try:
        keys = await store_prompt(sock)
        code = server.stop()  # the gate stays shut: the stores cannot finish
        assert await in_redis(redis_server.port, prefix, keys) == [False] * 3  # it exited without them
    finally:
        released.set()
        server.stop()
    assert code == 0, server.log()[-2000:]
    assert "L2 stores still pending after 0.0 s; dropped" in server.log()
