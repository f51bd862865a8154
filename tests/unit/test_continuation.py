"""A request that continues an earlier one (a conversation's next turn: its cached prefix holds the earlier
request's last chunks) stores chunks that S3-FIFO takes as reused: they go to main and outlive a scan that
flushes the probationary queue. LRU ignores the mark."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_engine import CHUNK, POLICY, Engine, expected_kv, keyspace_of, layout_of
from tiercache.eviction import LRUPolicy, S3FIFOPolicy
from tiercache.spec import KVSpec
from tiercache.store.engine import CacheEngine
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", tokens=16)


def test_s3fifo_reused_insert_goes_to_main() -> None:
    p = S3FIFOPolicy(10)
    p.insert("kept", reused=True)
    p.insert("fresh")
    for i in range(30):  # a scan of one-off keys, one eviction each past the capacity
        p.insert(f"scan{i}")
        while len(p) > 10:
            assert p.victim(lambda k: True) != "kept"
    assert "kept" in p
    assert "fresh" not in p


def test_lru_ignores_reused() -> None:
    p = LRUPolicy()
    p.insert("a", reused=True)
    p.insert("b")
    assert p.victim(lambda k: True) == "a"


def _store(l1: L1Cache, keys: list[str]) -> list[bool]:
    """Store ``keys`` as one request (cached ones skipped); per newly stored key whether it ``continues``."""
    out = []
    for obj in l1.batched_reserve_write(keys, [SPEC] * len(keys)):
        if obj is not None:
            out.append(obj.continues)
            l1.finish_write(obj)
    return out


def test_continuation_is_marked_only_after_an_earlier_requests_end() -> None:
    l1 = L1Cache(64 * SPEC.nbytes, SPEC.nbytes, pinned=False, eviction="s3fifo")
    assert _store(l1, ["sys0", "sys1", "turn1a", "turn1b"]) == [False] * 4  # nothing before it
    assert _store(l1, ["sys0", "sys1", "other"]) == [False]  # shares a prefix, continues no request's end
    assert _store(l1, ["sys0", "sys1", "turn1a", "turn1b", "turn2a"]) == [True]  # the next turn
    assert _store(l1, ["sys0", "sys1", "turn1a", "x"]) == [True]  # a prefix holding "turn1a", a last-but-one
    assert _store(l1, ["solo"]) == [False]


def test_next_turn_outlives_a_scan_under_s3fifo() -> None:
    l1 = L1Cache(40 * SPEC.nbytes, SPEC.nbytes, pinned=False, eviction="s3fifo")
    _store(l1, [f"t1.{i}" for i in range(4)])
    turn2 = [f"t1.{i}" for i in range(4)] + [f"t2.{i}" for i in range(4)]
    _store(l1, turn2)
    _store(l1, [f"other.{i}" for i in range(4)])  # stored at the same time, continuing nothing
    for n in range(10):  # one-off prompts, 60 chunks in all: more than the cache
        _store(l1, [f"scan{n}.{i}" for i in range(6)])
    assert l1.batched_contains([f"t2.{i}" for i in range(4)]) == [True] * 4
    assert l1.batched_contains([f"other.{i}" for i in range(4)]) == [False] * 4


@pytest.mark.asyncio
@pytest.mark.parametrize("masked", [False, True])
async def test_engine_marks_a_conversations_next_turn(masked: bool) -> None:
    """Through the engine's store, with the next turn's earlier chunks cached in L1 or masked out (vLLM's
    own prefix cache held them): its new chunks continue the earlier turn, a stranger's do not."""
    layout = layout_of()
    slot = CacheEngine.slot_bytes(layout, CHUNK)
    l1 = L1Cache(64 * slot, slot, pinned=False, eviction="s3fifo")
    engine = CacheEngine(StorageManager(l1, [], POLICY), layout, keyspace_of(layout), chunk_size=CHUNK)
    gpu = Engine(layout, num_blocks=128, seed=13)
    turn1 = list(range(1000, 1000 + 2 * CHUNK))
    turn2 = turn1 + list(range(5000, 5000 + 2 * CHUNK))
    stranger = list(range(9000, 9000 + 2 * CHUNK))
    gpu.write(expected_kv(layout, len(turn2)), 0, len(turn2))
    try:
        await engine.store(turn1, gpu.kv, gpu.slots(len(turn1)))
        await engine.store(stranger, gpu.kv, gpu.slots(len(stranger)))
        mask = torch.tensor([False] * len(turn1) + [True] * (len(turn2) - len(turn1))) if masked else None
        assert await engine.store(turn2, gpu.kv, gpu.slots(len(turn2)), mask) == 2 * CHUNK
        keys = [str(k) for k in engine.token_db.keys(turn2)]
        others = [str(k) for k in engine.token_db.keys(stranger)]
        objects = l1._objects  # the stored objects, by key
        assert [objects[k].continues for k in keys[2:]] == [True, True]
        assert [objects[k].continues for k in keys[:2] + others] == [False] * 4
    finally:
        await engine.aclose()
