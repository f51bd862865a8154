"""The connector's event and hit-source glue: tiercache events as vLLM's structs, the per-step aggregation of
several workers' events, and loaded tokens split by the tier of their chunk."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from tiercache_vllm._events import EventRelay, HitSources, TierCacheKVEvents, hit_source, to_vllm
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiercache.events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_REMOTE, Cleared, Removed, Stored


def test_to_vllm_structs() -> None:
    out = to_vllm(
        [Stored((1, 2), 0, (5, 6, 7, 8), 2, MEDIUM_DISK, "ad"), Removed((1,), MEDIUM_CPU), Cleared()]
    )
    assert out[0] == BlockStored(
        block_hashes=[1, 2],
        parent_block_hash=0,
        token_ids=[5, 6, 7, 8],
        block_size=2,
        lora_id=None,
        medium=MEDIUM_DISK,
        lora_name="ad",
    )
    assert out[1] == BlockRemoved(block_hashes=[1], medium=MEDIUM_CPU)
    assert isinstance(out[2], AllBlocksCleared)


def test_relay_keeps_events_every_worker_sent() -> None:
    """Two tensor-parallel workers announce the same blocks: published once; an event only one worker sent
    is dropped (vLLM's aggregation rule)."""
    both = to_vllm([Stored((1,), None, (3,), 1, MEDIUM_CPU), Cleared()])
    only_one = to_vllm([Removed((9,), MEDIUM_CPU)])
    relay = EventRelay(2)
    first = TierCacheKVEvents(both + only_one)
    # what vLLM's output aggregator does with the second worker's output
    first.add_events(
        TierCacheKVEvents(to_vllm([Stored((1,), None, (3,), 1, MEDIUM_CPU), Cleared()])).get_all_events()
    )
    first.increment_workers(1)
    relay.collect(SimpleNamespace(kv_cache_events=first))  # type: ignore[arg-type]
    taken = relay.take()
    assert len(taken) == 2
    assert taken[0] == both[0]
    assert isinstance(taken[1], AllBlocksCleared)
    assert relay.take() == []
    relay.collect(SimpleNamespace(kv_cache_events=None))  # type: ignore[arg-type]
    assert relay.take() == []


def test_relay_waits_for_every_worker_across_steps() -> None:
    """Two workers whose backends expire their own rank's object of the same blocks in different steps (the
    other worker has no events then, so vLLM's aggregate counts one worker): the removal goes out once, in
    the step the second worker sent it."""
    gone = to_vllm([Removed((7, 8), MEDIUM_REMOTE)])
    relay = EventRelay(2)
    relay.collect(SimpleNamespace(kv_cache_events=TierCacheKVEvents(gone)))  # type: ignore[arg-type]
    assert relay.take() == []
    relay.collect(
        SimpleNamespace(kv_cache_events=TierCacheKVEvents(to_vllm([Stored((1,), None, (3,), 1, MEDIUM_CPU)])))
    )  # type: ignore[arg-type]
    assert relay.take() == []  # one worker's store waits too
    relay.collect(SimpleNamespace(kv_cache_events=TierCacheKVEvents(list(gone))))  # type: ignore[arg-type]
    assert relay.take() == gone
    assert relay.take() == []
    # one worker (the uniprocess executor): everything goes out as it comes
    single = EventRelay(1)
    single.collect(SimpleNamespace(kv_cache_events=TierCacheKVEvents(gone)))  # type: ignore[arg-type]
    assert single.take() == gone


def test_hit_source_per_medium() -> None:
    assert hit_source(MEDIUM_CPU) is CacheHitSource.HOST
    assert hit_source(MEDIUM_DISK) is CacheHitSource.DISK
    assert hit_source(MEDIUM_REMOTE) is CacheHitSource.EXTERNAL_UNSPECIFIED


def _side(req_id: str, local: int, tiers: tuple[str, ...], *, batched: bool = False) -> Any:
    """A scheduler side whose lookup of ``req_id`` found ``tiers`` (``batched``: a server's batched lookup,
    which keeps the tiers but no engine result)."""
    result = None if batched else SimpleNamespace(tiers=tiers)
    lookup = SimpleNamespace(local=local, result=result, tiers=tiers if batched else ())
    return SimpleNamespace(_lookups={req_id: lookup})


def test_hit_sources_split_by_chunk_tier() -> None:
    """Tokens 32..250 loaded from chunks of 64: chunk 0 in L1, chunks 1-2 on disk, chunk 3 in Redis."""
    sources = HitSources({"L1": MEDIUM_CPU, "nvme": MEDIUM_DISK, "redis": MEDIUM_REMOTE}, 64)
    request = SimpleNamespace(request_id="r")
    sources.remember(_side("r", 32, ("L1", "nvme", "nvme", "redis")), request, 218)  # type: ignore[arg-type]
    split = sources.split(request, 218)  # type: ignore[arg-type]
    assert split == {
        CacheHitSource.HOST: 32,
        CacheHitSource.DISK: 128,
        CacheHitSource.EXTERNAL_UNSPECIFIED: 58,
    }
    assert sum(split.values()) == 218
    # no plan kept for the request: all unspecified, still summing up
    assert sources.split(request, 10) == {CacheHitSource.EXTERNAL_UNSPECIFIED: 10}  # type: ignore[arg-type]
    # a server's batched lookup: the tiers it reported per chunk
    sources.remember(_side("r", 0, ("L1", "nvme"), batched=True), request, 100)  # type: ignore[arg-type]
    assert sources.split(request, 100) == {CacheHitSource.HOST: 64, CacheHitSource.DISK: 36}  # type: ignore[arg-type]
    assert sources.split(request, 0) == {}  # type: ignore[arg-type]
