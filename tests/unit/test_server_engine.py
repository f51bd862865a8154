"""CacheEngine unchanged on the shared L1 of a real ``tiercache.server`` process (L1-only, no L2 tier):
one engine stores, an engine on another connection (and one in another process) hits and reads the same bits;
a dead server is cache-off (misses, skipped stores), never an error.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from tests.unit.test_engine import CHUNK, POLICY, Engine, expected_kv, keyspace_of, layout_of, same_bits
from tests.unit.test_server_processes import Server
from tiercache.server.client import SharedL1
from tiercache.store.engine import CacheEngine

pytestmark = pytest.mark.asyncio

LAYOUT = layout_of()
SLOT_BYTES = CacheEngine.slot_bytes(LAYOUT, CHUNK)


@pytest.fixture
def server(sock_dir: Path) -> Iterator[Server]:
    import tests.unit.test_server_processes as sp

    old = (sp.SLOT_BYTES, sp.SLOTS)
    sp.SLOT_BYTES, sp.SLOTS = SLOT_BYTES, 16
    try:
        srv = Server(str(sock_dir / "l1.sock"))
    finally:
        sp.SLOT_BYTES, sp.SLOTS = old
    assert srv.ready
    yield srv
    srv.stop()


def engine_on(path: str) -> CacheEngine:
    from tiercache.store.manager import StorageManager

    manager = StorageManager(SharedL1(path), [], POLICY)  # type: ignore[arg-type]
    return CacheEngine(manager, LAYOUT, keyspace_of(LAYOUT), chunk_size=CHUNK)


@pytest_asyncio.fixture
async def producer(server: Server) -> AsyncIterator[CacheEngine]:
    engine = engine_on(server.path)
    yield engine
    await engine.aclose()


async def test_store_on_one_connection_retrieve_on_another(server: Server, producer: CacheEngine) -> None:
    tokens = list(range(2000, 2600))
    kv = expected_kv(LAYOUT, len(tokens))
    src = Engine(LAYOUT, num_blocks=64, seed=1)
    src.write(kv, 0, len(tokens))
    assert await producer.store(tokens, src.kv, src.slots(len(tokens))) == 600
    consumer = engine_on(server.path)
    try:
        hit = await consumer.lookup_hit(tokens)
        assert hit.tokens == 600
        dst = Engine(LAYOUT, num_blocks=64, seed=2)
        result = await consumer.retrieve_result(tokens, dst.kv, dst.slots(len(tokens)))
        assert result.tokens_read == 600
        assert same_bits(dst.read(0, 600), kv)
        stats = consumer.manager.l1.stats()
        assert (stats.ready, stats.writing, stats.leased) == (3, 0, 0)  # the retrieve released its leases
    finally:
        await consumer.aclose()


CHILD = r"""
import asyncio, sys
sys.path.append(sys.argv[2])  # after the installed tiercache: only `tests` comes from the repo
from tests.unit.test_engine import expected_kv, Engine, same_bits
from tests.unit.test_server_engine import engine_on, LAYOUT

async def main():
    tokens = list(range(2000, 2600))
    kv = expected_kv(LAYOUT, len(tokens))
    engine = engine_on(sys.argv[1])
    dst = Engine(LAYOUT, num_blocks=64, seed=5)
    result = await engine.retrieve_result(tokens, dst.kv, dst.slots(len(tokens)))
    ok = same_bits(dst.read(0, 600), kv)
    await engine.aclose()
    print(result.tokens_read, ok)

asyncio.run(main())
"""


def _run_child(tmp_path: Path, socket_path: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    repo = str(Path(__file__).resolve().parents[2])
    cmd = [sys.executable, str(script), socket_path, repo]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False)


async def test_another_process_reads_the_shared_l1(
    server: Server, producer: CacheEngine, tmp_path: Path
) -> None:
    tokens = list(range(2000, 2600))
    src = Engine.holding(LAYOUT, len(tokens), seed=1)
    assert await producer.store(tokens, src.kv, src.slots(len(tokens))) == 600
    out = await asyncio.to_thread(_run_child, tmp_path, server.path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["600", "True"]


async def test_dead_server_means_cache_off(server: Server, producer: CacheEngine) -> None:
    tokens = list(range(3000, 3512))
    src = Engine.holding(LAYOUT, len(tokens), seed=1)
    assert await producer.store(tokens, src.kv, src.slots(512)) == 512
    server.kill()
    hit = await producer.lookup_hit(tokens)
    assert hit.tokens == 0
    dst = Engine(LAYOUT, num_blocks=64, seed=2)
    result = await producer.retrieve_result(tokens, dst.kv, dst.slots(512))
    assert result.tokens_read == 0
    assert dst.read(0, 512).isnan().all()
    assert await producer.store(list(range(9000, 9512)), src.kv, src.slots(512)) == 0  # skipped, no error
    l1 = producer.manager.l1
    assert isinstance(l1, SharedL1)
    assert l1.skipped_stores >= 1
    assert not l1.connected()
    assert torch.isnan(dst.kv[0]).all()


async def test_one_round_trip_per_batch_not_per_chunk(server: Server, producer: CacheEngine) -> None:
    """ALLOC, COMMIT, LOOKUP and RELEASE go once per engine call whatever the number of chunks."""
    l1 = producer.manager.l1
    assert isinstance(l1, SharedL1)
    tokens = list(range(5000, 6800))  # 8 chunks (7 x 256 + 8)
    kv = expected_kv(LAYOUT, len(tokens))
    src = Engine(LAYOUT, num_blocks=128, seed=1)
    src.write(kv, 0, len(tokens))

    def trips() -> dict[str, int]:
        out = dict(l1.requests)
        l1.requests.clear()
        return out

    trips()
    assert await producer.store(tokens, src.kv, src.slots(len(tokens))) == len(tokens)
    assert trips() == {"ALLOC": 1, "COMMIT": 1}
    assert await producer.store(tokens, src.kv, src.slots(len(tokens))) == 0  # all present: deduplicated
    assert trips() == {"ALLOC": 1}  # "present" or "no room": the server counts, no second round trip
    hit = await producer.lookup_hit(tokens)
    assert hit.tokens == len(tokens)
    assert trips() == {"LOOKUP": 1}  # one round trip per scheduler step
    dst = Engine(LAYOUT, num_blocks=128, seed=2)
    result = await producer.retrieve_result(tokens, dst.kv, dst.slots(len(tokens)))
    assert result.tokens_read == len(tokens)
    assert same_bits(dst.read(0, len(tokens)), kv)
    assert trips() == {"LOOKUP": 1, "RELEASE": 1}  # pinned lookup, then one release of all 8 leases
