"""The server's L2 side in-process: an ``L1Server`` with an in-memory tier on this test's event loop, clients
in threads (their calls block). COMMIT writes behind, LOOKUP with ``l2`` reports levels and prefetches the
contiguous L2 prefix, a read waits for it; CLEAR / DRAIN are admin ops.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tiercache.adapters.memory import MemoryAdapter
from tiercache.errors import AdapterUnavailable
from tiercache.serde import build_pipeline
from tiercache.server.client import ServerConnection, ServerRefused, SharedL1
from tiercache.server.protocol import Op
from tiercache.server.server import L1Server, ServerOptions
from tiercache.spec import KVSpec
from tiercache.store.hits import L1_TIER, TierHit
from tiercache.store.manager import StorageManager

pytestmark = pytest.mark.asyncio

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens=16)  # 2048 bytes
KEYS = [f"chunk-{i}" for i in range(3)]


def payload(i: int) -> bytes:
    return bytes((i * 31 + j) % 251 for j in range(SPEC.nbytes))


@pytest_asyncio.fixture
async def served(sock_dir: Path) -> AsyncIterator[tuple[L1Server, MemoryAdapter]]:
    tier = MemoryAdapter()
    options = ServerOptions(str(sock_dir / "l1.sock"), 4 * 4096, (4096,), region_bytes=4096, drain_s=5.0)
    server = L1Server(options, tiers=[("mem", tier, build_pipeline(["raw", "zstd"]))])
    await server.start()
    yield server, tier
    await server.stop()
    with pytest.raises(AdapterUnavailable, match="closed"):  # stop closes the tiers
        await tier.batched_contains(KEYS)


async def clients(server: L1Server) -> tuple[SharedL1, SharedL1]:
    """A client of ``server`` and an admin client (connected in a thread: the server runs on this loop)."""
    l1 = await asyncio.to_thread(SharedL1, server.options.socket_path)
    admin = await asyncio.to_thread(SharedL1, server.options.socket_path, role="admin")
    return l1, admin


def store(l1: SharedL1, keys: list[str], tenant: str = "") -> None:
    """Write and commit ``SPEC`` objects for ``keys`` (key i holds ``payload(i)``) as ``tenant``."""
    objects = l1.batched_reserve_write(keys, [SPEC] * len(keys), tenant)
    for i, obj in enumerate(objects):
        assert obj is not None
        obj.buffer()[:] = payload(i)
    l1.batched_finish_write([o for o in objects if o is not None])


async def test_commit_writes_behind_clear_then_read_prefetches(
    served: tuple[L1Server, MemoryAdapter],
) -> None:
    server, tier = served
    l1, admin = await clients(server)
    await asyncio.to_thread(store, l1, KEYS)
    assert await asyncio.to_thread(admin.drain, 5.0)
    # written behind by the server, through its codec chain
    assert (await tier.batched_contains(KEYS), len(tier)) == ([True] * 3, 3)
    assert await asyncio.to_thread(admin.clear) == 3
    assert await asyncio.to_thread(l1.batched_contains, KEYS) == [False] * 3
    located = await asyncio.to_thread(l1.batched_locate, [*KEYS, "nowhere"], prefetch=False)
    assert located == [TierHit("mem", 1)] * 3 + [None]
    leases = await asyncio.to_thread(l1.batched_acquire_loaded, KEYS, 5.0)  # loads the L2 prefix, then leases
    for i, lease in enumerate(leases):
        assert lease is not None
        assert lease.valid()
        assert bytes(lease.obj.buffer()) == payload(i)
    await asyncio.to_thread(l1.batched_release, [x for x in leases if x is not None])
    located = await asyncio.to_thread(l1.batched_locate, KEYS, prefetch=False)
    assert located == [TierHit(L1_TIER, 0)] * 3
    stats = await asyncio.to_thread(l1.server_stats)
    assert stats is not None
    assert (stats["leases"], stats["pending_stores"]) == (0, 0)


async def test_lookup_prefetches_only_the_contiguous_prefix(served: tuple[L1Server, MemoryAdapter]) -> None:
    server, tier = served
    raw = build_pipeline(["raw", "zstd"])
    frames = [bytes(raw.encode(memoryview(payload(i)), SPEC, key)) for i, key in enumerate(KEYS)]
    assert await tier.batched_put(KEYS, frames) == [True] * 3
    l1 = await asyncio.to_thread(SharedL1, server.options.socket_path)
    order = [KEYS[0], "missing", KEYS[1]]
    located = await asyncio.to_thread(l1.batched_locate, order, prefetch=True)
    assert located == [TierHit("mem", 1), None, TierHit("mem", 1)]  # answered at once, L2 part marked
    assert server.storage is not None
    loading = server.storage.manager.prefetch.loading
    # the server starts the load before it answers: the prefix is loading, or its load is done already
    assert set(loading) <= {KEYS[0]}  # only the prefix before the hole
    await asyncio.gather(*loading.values())
    assert await asyncio.to_thread(l1.batched_contains, KEYS) == [True, False, False]


async def test_stores_are_written_by_the_server_only(served: tuple[L1Server, MemoryAdapter]) -> None:
    server, tier = served
    l1 = await asyncio.to_thread(SharedL1, server.options.socket_path)
    with pytest.raises(ValueError, match="server owns the L2 tiers"):
        StorageManager(l1, [("mem", tier, build_pipeline(["raw"]))])


async def test_clear_and_drain_need_the_admin_role(served: tuple[L1Server, MemoryAdapter]) -> None:
    server, _ = served
    for op, body in ((Op.CLEAR, {}), (Op.DRAIN, {"timeout_s": 1.0})):
        conn = await asyncio.to_thread(ServerConnection, server.options.socket_path, role="worker")
        with pytest.raises(ServerRefused) as err:
            await asyncio.to_thread(conn.request, op, body)
        assert err.value.code == "forbidden"
        conn.close()


async def test_a_socket_opened_while_the_server_stops_connects(sock_dir: Path) -> None:
    """What a store worker does while the server stops: open a new socket and connect it. The number the
    closed listener had is free again then; stop() must have withdrawn the listener from the event loop
    before closing it, or the loop still watches that number and the new socket's connect fails (the L2
    store was dropped, the drain saw nothing pending: the SIGTERM tests of test_server_l2.py, under load)."""
    loop = asyncio.get_running_loop()
    target = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = target.sockets[0].getsockname()[1]
    server = L1Server(ServerOptions(str(sock_dir / "l1.sock"), 4 * 4096, (4096,), region_bytes=4096))
    await server.start()
    assert server._listener is not None
    listener = server._listener
    await asyncio.sleep(0)  # the accept loop is waiting on the listener
    errors: list[BaseException] = []
    connected: list[int] = []

    async def connect_once_the_listener_closes() -> None:
        for _ in range(100_000):  # bounded: yield to stop() until it has closed the listener
            if listener.fileno() == -1:
                break
            await asyncio.sleep(0)
        else:
            errors.append(AssertionError("stop() never closed the listener"))
            return

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port))
            connected.append(sock.fileno())
        except OSError as exc:
            errors.append(exc)
        finally:
            sock.close()

    racer = asyncio.ensure_future(connect_once_the_listener_closes())
    await server.stop()
    await racer
    target.close()
    await target.wait_closed()
    assert errors == []
    assert len(connected) == 1


async def test_stats_count_write_behind_drops(sock_dir: Path) -> None:
    """Stores the write-behind drops (here: every put of the tier fails) are in STATS, not only in
    Prometheus."""
    from tiercache.testing.fakes import FaultInjectingAdapter

    tier = FaultInjectingAdapter(fail_rate=1.0, fail_ops=frozenset({"put"}))
    options = ServerOptions(str(sock_dir / "l1.sock"), 4 * 4096, (4096,), region_bytes=4096, drain_s=5.0)
    server = L1Server(options, tiers=[("flaky", tier, build_pipeline(["raw"]))])
    await server.start()
    try:
        l1 = await asyncio.to_thread(SharedL1, options.socket_path)
        admin = await asyncio.to_thread(SharedL1, options.socket_path, role="admin")
        await asyncio.to_thread(store, l1, KEYS)
        assert await asyncio.to_thread(admin.drain, 5.0)
        stats = await asyncio.to_thread(l1.server_stats)
        assert stats is not None
        assert stats["stores_dropped"] == len(KEYS)
        assert server.storage is not None
        assert server.storage.dropped_stores() == {"failed": len(KEYS)}
        assert stats["published"] == len(KEYS)  # L1 keeps them
    finally:
        await server.stop()
