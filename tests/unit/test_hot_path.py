"""The engine's per-call host path: no runtime-Protocol ``isinstance`` per call (such a check walks the
Protocol's members, ~10 us each), labelled counters looked up once, one lookup answer either way.

Speed itself is measured by ``benchmarks/vs_lmcache.py cpu --tiny``; these tests pin the structure."""

from __future__ import annotations

import typing
from typing import Any

import pytest
import torch

from tiercache.adapters.memory import MemoryAdapter
from tiercache.config import ManagerConfig
from tiercache.gpu.layouts import LayoutKind, PagedLayout, object_spec
from tiercache.keys import KeySpace
from tiercache.serde import build_pipeline
from tiercache.store.engine import CacheEngine, LookupResult
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager

pytestmark = pytest.mark.asyncio

CHUNK = 256
LAYOUT = PagedLayout(
    LayoutKind.VLLM_FLASH, num_layers=2, num_kv_heads=1, head_dim=32, block_size=16, dtype="bfloat16"
)
PROTOCOL_META: Any = typing._ProtocolMeta  # type: ignore[attr-defined]


@pytest.fixture
def protocol_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every ``isinstance(obj, P)`` with a runtime-checkable Protocol ``P`` while the test runs (P's name)."""
    seen: list[str] = []
    original = PROTOCOL_META.__instancecheck__

    def counting(cls: type, instance: object) -> bool:
        if getattr(cls, "_is_runtime_protocol", False):
            seen.append(cls.__name__)
        return bool(original(cls, instance))

    monkeypatch.setattr(PROTOCOL_META, "__instancecheck__", counting)
    return seen


def engine_of(tiers: bool) -> tuple[CacheEngine, list[torch.Tensor], torch.Tensor]:
    spec = object_spec(LAYOUT, CHUNK)
    l1 = L1Cache(16 * spec.nbytes, spec.nbytes)
    l2 = [("mem", MemoryAdapter(), build_pipeline(["raw"]))] if tiers else []
    manager = StorageManager(l1, l2, ManagerConfig(l2_deadline_s=5.0, lookup_deadline_s=2.0))
    keyspace = KeySpace("test/hot", LAYOUT.dtype, LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    engine = CacheEngine(manager, LAYOUT, keyspace, chunk_size=CHUNK)
    blocks = 2 * CHUNK // LAYOUT.block_size + 1
    kv = [torch.randn(LAYOUT.layer_shape(blocks)).to(torch.bfloat16) for _ in range(LAYOUT.num_layers)]
    slots = torch.arange(2 * CHUNK) + LAYOUT.block_size
    return engine, kv, slots


@pytest.mark.parametrize("tiers", [False, True], ids=["l1_only", "with_l2"])
async def test_no_protocol_isinstance_per_call(protocol_checks: list[str], tiers: bool) -> None:
    """Built once (the server-mode check happens in the constructor), then store, lookup, retrieve and the
    manager's own calls run many times: not one runtime-Protocol check among them. The old manager
    checked ``isinstance(l1, LocatesL2)`` twice per lookup."""
    engine, kv, slots = engine_of(tiers)
    manager = engine.manager
    built = len(protocol_checks)
    tokens = list(range(2 * CHUNK))
    back = [torch.zeros_like(t) for t in kv]
    for _ in range(5):
        assert await engine.store(tokens, kv, slots) in (0, 2 * CHUNK)
        assert await engine.lookup(tokens) == 2 * CHUNK
        hit = await engine.lookup_hit(tokens)
        assert hit.tokens == 2 * CHUNK
        assert bool((await engine.retrieve(tokens, back, slots)).all())
        result = await engine.retrieve_result(tokens, back, slots, lookup=hit)
        assert result.tokens_written == 2 * CHUNK
        keys = list(hit.keys)
        assert [h is not None for h in await manager.batched_contains(keys)] == [True, True]
        assert (await manager.lookup_prefix(keys)).chunks == 2
        assert (await manager.lookup_prefixes([keys, keys[:1]]))[1].chunks == 1
        leases = await manager.batched_get(keys)
        manager.l1.batched_release([lease for lease in leases if lease is not None])
    await engine.drain()
    await engine.aclose()
    assert protocol_checks[built:] == []
    for layer, restored in zip(kv, back, strict=True):
        assert torch.equal(layer[1:].view(torch.int16), restored[1:].view(torch.int16))


async def test_lookup_counts_like_lookup_hit() -> None:
    """``lookup`` (the L1-only answer without hit objects) reports and counts what ``lookup_hit`` does:
    the prefix, one L1 hit per chunk of it, one L1 miss per chunk after it."""
    engine, kv, slots = engine_of(False)
    tokens = list(range(2 * CHUNK))
    await engine.store(tokens[:CHUNK], kv, slots)
    metrics = engine.manager.metrics

    def counts() -> tuple[float, float]:
        hits = metrics.hits.labels("L1")._value.get()
        misses = metrics.misses.labels("L1")._value.get()
        return hits, misses

    before = counts()
    assert await engine.lookup(tokens) == CHUNK
    after_lookup = counts()
    assert (await engine.lookup_hit(tokens)).tokens == CHUNK
    after_hit = counts()
    assert after_lookup[0] - before[0] == after_hit[0] - after_lookup[0] == 1
    assert after_lookup[1] - before[1] == after_hit[1] - after_lookup[1] == 1
    assert await engine.lookup(tokens[:CHUNK]) == CHUNK
    assert counts()[1] == after_hit[1]  # a full hit is no miss
    assert await engine.lookup(tokens[:100]) == 0
    await engine.aclose()


@pytest.mark.parametrize("tiers", [False, True], ids=["l1_only", "with_l2"])
async def test_lookup_hit_now_answers_from_l1_in_any_thread_and_defers_what_l2_must_answer(
    tiers: bool,
) -> None:
    """``lookup_hit_now`` answers without the event loop (from another thread here) exactly what
    ``lookup_hit`` answers when L1 alone decides it: always without L2 tiers, only on a whole-prompt L1 hit
    with them; else it hands back the hashed prompt, whose ``complete()`` asks L2 without hashing again."""
    import concurrent.futures

    from tiercache.store.engine import PendingLookup

    engine, kv, slots = engine_of(tiers)
    tokens = list(range(2 * CHUNK))
    await engine.store(tokens[:CHUNK], kv, slots)
    await engine.drain()
    if tiers:  # chunk 0 in L1 and L2; chunk 1 in L2 only
        await engine.store(tokens, kv, slots)
        await engine.drain()
        assert engine.manager.l1.delete((await engine.lookup_hit(tokens, prefetch=False)).keys[1])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        now = pool.submit(engine.lookup_hit_now, tokens).result()
        whole = pool.submit(engine.lookup_hit_now, tokens[:CHUNK]).result()
    assert isinstance(whole, LookupResult)
    assert (whole.tokens, whole.tiers, len(whole.keys)) == (CHUNK, ("L1",), 1)
    if tiers:
        assert isinstance(now, PendingLookup)
        hashes = engine.token_db.prefix_hashes
        engine.token_db.prefix_hashes = None  # type: ignore[assignment,method-assign]  # complete() never hashes
        done = await now.complete(prefetch=False)
        engine.token_db.prefix_hashes = hashes  # type: ignore[method-assign]
        assert (done.tokens, done.tiers) == (2 * CHUNK, ("L1", "mem"))
    else:
        assert isinstance(now, LookupResult)
        assert (now.tokens, now.tiers) == (CHUNK, ("L1",))
    assert await engine.lookup(tokens) == (2 * CHUNK if tiers else CHUNK)
    back = [torch.zeros_like(t) for t in kv]
    result = await engine.retrieve_result(tokens[:CHUNK], back, slots, lookup=whole)
    assert result.tokens_written == CHUNK
    await engine.aclose()
