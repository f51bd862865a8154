"""A request that continues an earlier one (a conversation's next turn: its cached prefix holds the earlier
request's last chunks) stores chunks that S3-FIFO takes as reused: they go to main and outlive a scan that
flushes the probationary queue. LRU ignores the mark."""

from __future__ import annotations

from tiercache.eviction import LRUPolicy, S3FIFOPolicy
from tiercache.spec import KVSpec
from tiercache.store.l1 import L1Cache

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
