"""KV events: per-medium block reference counts, a real manager's L1/L2 stores and removals, resets, and the
wire format decoded by vLLM's own msgspec decoder."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.adapters.posix import PosixAdapter
from tiercache.config import ManagerConfig
from tiercache.events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_REMOTE,
    ChunkInfo,
    Cleared,
    Event,
    EventSink,
    Removed,
    Stored,
    chunk_infos,
    encode_batch,
    external_hash,
    medium_of,
)
from tiercache.serde import build_pipeline
from tiercache.spec import KVSpec
from tiercache.store.control import clear_keyspaces, delete_keys
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", tokens=8)
BLOCK = 4


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block{i}".encode()).digest()


HASHES = [block_hash(i) for i in range(64)]
TOKENS = list(range(1000, 1000 + 64 * BLOCK))


def info(first: int, blocks: int) -> ChunkInfo:
    """The ChunkInfo of ``blocks`` blocks from block ``first``."""
    found = chunk_infos(TOKENS, HASHES, BLOCK, [(first * BLOCK, (first + blocks) * BLOCK)])[0]
    assert found is not None
    return found


def replay(events: Sequence[Event]) -> dict[str, set[object]]:
    """What a router holds per medium after applying ``events`` in order."""
    held: dict[str, set[object]] = {}
    for event in events:
        if isinstance(event, Stored):
            held.setdefault(event.medium, set()).update(event.block_hashes)
        elif isinstance(event, Removed):
            held.setdefault(event.medium, set()).difference_update(event.block_hashes)
        else:
            held.clear()
    return {m: s for m, s in held.items() if s}


def test_medium_of_schemes() -> None:
    assert medium_of("memory://") == MEDIUM_CPU
    assert medium_of("file:///mnt/x") == MEDIUM_DISK
    assert medium_of("nvme+slab:///dev/x") == MEDIUM_DISK
    assert medium_of("/plain/path") == MEDIUM_DISK
    for url in ("redis://h:1/0", "s3://b/p", "mooncake://m", "gs://x"):
        assert medium_of(url) == MEDIUM_REMOTE


def test_chunk_infos_whole_blocks_and_parent() -> None:
    first, tail, unaligned = chunk_infos(TOKENS, HASHES[:5], BLOCK, [(0, 8), (8, 22), (2, 8)])
    assert first is not None
    assert tail is not None
    assert first.block_hashes == (external_hash(HASHES[0], True), external_hash(HASHES[1], True))
    assert first.parent is None
    assert first.token_ids == tuple(TOKENS[:8])
    # the tail covers blocks 2..4 (block 5 is partial and has no hash)
    assert tail.block_hashes == tuple(external_hash(h, True) for h in HASHES[2:5])
    assert tail.parent == external_hash(HASHES[1], True)
    assert tail.token_ids == tuple(TOKENS[8:20])
    assert unaligned is None
    assert external_hash(HASHES[0], True) == int.from_bytes(HASHES[0][-8:], "big")
    assert external_hash(HASHES[0], False) == HASHES[0]


def test_sink_announces_each_block_once_per_medium() -> None:
    sink = EventSink({"disk": MEDIUM_DISK, "disk2": MEDIUM_DISK})
    sink.describe(["a", "b"], [info(0, 2), info(0, 3)])  # b extends a: blocks 0, 1 shared
    sink.on_tier("L1", "stored", ["a"])
    sink.on_tier("L1", "stored", ["b"])
    sink.on_tier("disk", "stored", ["a"])
    sink.on_tier("disk2", "stored", ["a"])  # same medium: nothing new
    events = sink.take()
    assert events == [
        Stored(info(0, 2).block_hashes, None, tuple(TOKENS[:8]), BLOCK, MEDIUM_CPU),
        Stored(info(2, 1).block_hashes, info(2, 1).parent, tuple(TOKENS[8:12]), BLOCK, MEDIUM_CPU),
        Stored(info(0, 2).block_hashes, None, tuple(TOKENS[:8]), BLOCK, MEDIUM_DISK),
    ]
    sink.on_tier("L1", "evicted", ["a"])  # b still holds blocks 0, 1 in CPU
    assert sink.take() == []
    sink.on_tier("L1", "evicted", ["b"])
    assert sink.take() == [Removed(info(0, 3).block_hashes, MEDIUM_CPU)]
    sink.on_tier("disk", "deleted", ["a"])
    assert sink.take() == []
    sink.on_tier("disk2", "deleted", ["a", "never-held"])
    assert sink.take() == [Removed(info(0, 2).block_hashes, MEDIUM_DISK)]
    assert sink.held("L1") == []
    assert sink.held("disk2") == []


def test_sink_without_description_or_emit_tracks_keys_only() -> None:
    sink = EventSink(emit=False)
    sink.describe(["a"], [info(0, 1)])
    sink.on_tier("L1", "stored", ["a", "p/x", "p/y"])
    assert sink.take() == []
    assert sink.held("L1", "p/") == ["p/x", "p/y"]
    quiet = EventSink()
    quiet.on_tier("L1", "stored", ["undescribed"])
    quiet.on_tier("L1", "evicted", ["undescribed"])
    assert quiet.take() == []


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["L1", "disk", "redis"]),
            st.booleans(),
            st.integers(0, 5),
        ),
        max_size=60,
    )
)
def test_sink_replay_matches_held_blocks(ops: list[tuple[str, bool, int]]) -> None:
    """Whatever order tiers store and drop overlapping keys in, replaying the events gives exactly the
    blocks some tier of each medium still holds."""
    media = {"disk": MEDIUM_DISK, "redis": MEDIUM_REMOTE}
    sink = EventSink(media)
    spans = {f"k{i}": info(i // 2, 1 + i % 3) for i in range(6)}  # overlapping block ranges
    sink.describe(list(spans), list(spans.values()))
    held: dict[str, set[str]] = {}
    events: list[Event] = []
    for tier, store, k in ops:
        key = f"k{k}"
        sink.on_tier(tier, "stored" if store else "evicted", [key])
        if store:
            held.setdefault(tier, set()).add(key)
        else:
            held.get(tier, set()).discard(key)
        events.extend(sink.take())
    expected: dict[str, set[object]] = {}
    for tier, keys in held.items():
        medium = {"L1": MEDIUM_CPU, **media}[tier]
        for key in keys:
            expected.setdefault(medium, set()).update(spans[key].block_hashes)
    assert replay(events) == {m: s for m, s in expected.items() if s}


def _payload(key: str) -> bytes:
    return (hashlib.sha256(key.encode()).digest() * (SPEC.nbytes // 32 + 1))[: SPEC.nbytes]


async def _put(manager: StorageManager, sink: EventSink, keys: list[str], firsts: list[int]) -> None:
    sink.describe(keys, [info(f, 2) for f in firsts])
    objects = await manager.batched_allocate(keys, [SPEC] * len(keys))
    for key, obj in zip(keys, objects, strict=True):
        assert obj is not None
        obj.buffer()[:] = _payload(key)
    await manager.batched_put([o for o in objects if o is not None])


@pytest.mark.asyncio
async def test_manager_stores_evictions_and_reset(tmp_path: Path) -> None:
    """A real L1 and POSIX tier: stores announced per medium, an L1 eviction removes CPU blocks only, a
    reset deletes the keyspace's keys from both and announces it."""
    adapter = await PosixAdapter.open(f"file://{tmp_path}/l2")
    policy = ManagerConfig(l2_deadline_s=2.0, lookup_deadline_s=1.0)
    l1 = L1Cache(SPEC.nbytes * 2, SPEC.nbytes)
    manager = StorageManager(l1, [("disk", adapter, build_pipeline(["raw"]))], policy)
    sink = EventSink({"disk": MEDIUM_DISK})
    detach = sink.attach(manager)
    try:
        await _put(manager, sink, ["ks1.a", "ks1.b"], [0, 2])
        await manager.drain()
        first = sink.take()
        assert replay(first) == {
            MEDIUM_CPU: set(info(0, 4).block_hashes),
            MEDIUM_DISK: set(info(0, 4).block_hashes),
        }
        await _put(manager, sink, ["ks2.c"], [10])  # L1 holds 2: evicts ks1.a
        await manager.drain()
        evicted = sink.take()
        assert Removed(info(0, 2).block_hashes, MEDIUM_CPU) in evicted
        assert not any(isinstance(e, Removed) and e.medium == MEDIUM_DISK for e in evicted)
        deleted = await clear_keyspaces(manager, sink, ["ks1."])
        assert deleted == 3  # ks1.b from L1, ks1.a and ks1.b from the disk tier
        events = sink.take()
        assert events[-1] == Cleared()
        # every ks1 block removed from both media; ks2.c's blocks still announced
        assert replay(first + evicted + events[:-1]) == {
            MEDIUM_CPU: set(info(10, 2).block_hashes),
            MEDIUM_DISK: set(info(10, 2).block_hashes),
        }
        assert await manager.batched_contains(["ks1.a", "ks1.b"]) == [None, None]
        assert (await manager.batched_contains(["ks2.c"]))[0] is not None  # other keyspace kept
        assert await delete_keys(manager, ["ks2.c"], sink) == 2
        assert replay(first + evicted + events[:-1] + sink.take()) == {}
    finally:
        detach()
        await manager.aclose()


def test_wire_format_matches_vllm_msgspec() -> None:
    """Our msgpack bytes equal what vLLM's publisher encodes, and vLLM's decoder reads them back."""
    msgspec = pytest.importorskip("msgspec")
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    stored = Stored((11, 12), 10, (1, 2, 3, 4, 5, 6, 7, 8), 4, MEDIUM_DISK, "lora-a")
    stored_bytes = Stored((b"\x01" * 32,), None, (9, 9, 9, 9), 4, MEDIUM_CPU)
    events: list[Event] = [stored, stored_bytes, Removed((11,), MEDIUM_CPU), Cleared()]
    ours = encode_batch(events, ts=1234.5)
    theirs = kv_events.KVEventBatch(
        ts=1234.5,
        events=[
            kv_events.BlockStored(
                block_hashes=[11, 12],
                parent_block_hash=10,
                token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                block_size=4,
                lora_id=None,
                medium=MEDIUM_DISK,
                lora_name="lora-a",
            ),
            kv_events.BlockStored(
                block_hashes=[b"\x01" * 32],
                parent_block_hash=None,
                token_ids=[9, 9, 9, 9],
                block_size=4,
                lora_id=None,
                medium=MEDIUM_CPU,
                lora_name=None,
            ),
            kv_events.BlockRemoved(block_hashes=[11], medium=MEDIUM_CPU),
            kv_events.AllBlocksCleared(),
        ],
    )
    assert ours == msgspec.msgpack.Encoder().encode(theirs)
    decoded = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(ours)
    assert decoded == theirs
    ranked = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(encode_batch([], 1.0, 3))
    assert ranked.data_parallel_rank == 3
    assert ranked.events == []


def test_sink_bounds_forget_oldest_keys_consistently() -> None:
    """Past max_held (an L2 tier) or max_described the oldest key is forgotten: counted in ``lost``, its
    removal never announced, and the counts of the blocks it shared with other keys stay consistent."""
    sink = EventSink({"disk": MEDIUM_DISK}, max_held=2, max_described=3)
    sink.describe(["a", "b", "c"], [info(0, 1), info(1, 1), info(2, 1)])
    sink.on_tier("disk", "stored", ["a", "b", "c"])
    assert sink.held("disk") == ["b", "c"]
    assert sink.lost == 1
    events = sink.take()
    sink.on_tier("disk", "deleted", ["a"])  # forgotten: nothing to announce
    assert sink.take() == []
    sink.describe(["d", "e"], [info(1, 2), info(1, 1)])  # forgets a's and b's descriptions: b is held
    assert sink.lost == 2
    sink.on_tier("disk", "stored", ["d"])
    sink.on_tier("disk", "deleted", ["d", "c", "b"])
    events += sink.take()
    h0, h1, h2 = (info(i, 1).block_hashes[0] for i in range(3))
    # a was forgotten while held: still announced; b's hold of h1 stopped counting when it was forgotten,
    # so d's removal took h1 back (a router then under-counts: a miss, never wrong data)
    assert replay(events) == {MEDIUM_DISK: {h0}}
    assert Removed((h1,), MEDIUM_DISK) in events
    assert Removed((h2,), MEDIUM_DISK) in events
    assert sink.held("disk") == []


def test_describe_announces_keys_tiers_already_hold() -> None:
    """A key stored before it was described (a prefetch racing the lookup that describes it) is announced
    when the description comes; a second description changes nothing."""
    sink = EventSink()
    sink.on_tier("L1", "stored", ["a"])
    assert sink.take() == []
    sink.describe(["a"], [info(0, 2)])
    assert replay(sink.take()) == {MEDIUM_CPU: set(info(0, 2).block_hashes)}
    sink.describe(["a"], [info(0, 2)])
    assert sink.take() == []


@pytest.mark.asyncio
async def test_lookup_announces_what_its_prefetch_brings_into_l1(tmp_path: Path) -> None:
    """A consumer that never stored a prompt looks it up (vLLM block hashes given): the chunks its prefetch
    loads from the shared file tier into its L1 are announced as CPU blocks."""
    from tests.unit.test_engine import CHUNK, Engine, keyspace_of, layout_of
    from tiercache.keys import BlockHashes
    from tiercache.store.engine import CacheEngine

    layout = layout_of()
    slot = CacheEngine.slot_bytes(layout, CHUNK)
    tokens = list(range(500, 500 + 2 * CHUNK))
    blocks = BlockHashes(
        [block_hash(100 + i) for i in range(len(tokens) // layout.block_size)], layout.block_size
    )
    policy = ManagerConfig(l2_deadline_s=5.0, lookup_deadline_s=2.0)

    async def engine_on_tier() -> CacheEngine:
        adapter = await PosixAdapter.open(f"file://{tmp_path}/l2")
        manager = StorageManager(
            L1Cache(slot * 4, slot), [("disk", adapter, build_pipeline(["raw"]))], policy
        )
        return CacheEngine(manager, layout, keyspace_of(layout), chunk_size=CHUNK)

    producer, consumer = await engine_on_tier(), await engine_on_tier()
    try:
        src = Engine.holding(layout, len(tokens), seed=1)
        assert await producer.store(tokens, src.kv, src.slots(len(tokens)), block_hashes=blocks) == len(
            tokens
        )
        await producer.drain()
        sink = EventSink({"disk": MEDIUM_DISK})
        detach = sink.attach(consumer.manager)
        consumer.events = sink
        hit = await consumer.lookup_hit(tokens, block_hashes=blocks)
        assert hit.tiers == ("disk", "disk")
        await consumer.manager.prefetch.wait(list(hit.keys), 5.0)
        assert consumer.manager.l1.batched_contains(list(hit.keys)) == [True, True]
        want = {external_hash(h, True) for h in blocks.hashes}
        assert replay(sink.take()) == {MEDIUM_CPU: want}
        detach()
    finally:
        await producer.aclose()
        await consumer.aclose()


async def check_two_object_disk_evicts_first(manager: StorageManager, sink: EventSink) -> None:
    """Store ks.a, ks.b, ks.c through a manager whose "disk" tier holds two objects: the sink announces ks.a's
    DISK removal, all three stay announced as CPU, and the disk holds ks.b and ks.c."""
    events: list[Event] = []
    for i, key in enumerate(["ks.a", "ks.b", "ks.c"]):
        await _put(manager, sink, [key], [2 * i])
        await manager.drain()
        events += sink.take()
    assert Removed(info(0, 2).block_hashes, MEDIUM_DISK) in events  # ks.a left the full file tier
    assert replay(events) == {
        MEDIUM_CPU: set(info(0, 6).block_hashes),
        MEDIUM_DISK: set(info(2, 4).block_hashes),
    }
    assert sink.held("disk") == ["ks.b", "ks.c"]


@pytest.mark.asyncio
async def test_file_tier_evictions_are_announced(tmp_path: Path) -> None:
    """A file tier with a capacity of two objects evicts for room: the sink hears it from the adapter and
    announces the DISK removal (the L1 copy stays announced as CPU)."""
    # two frames (the object plus a header of well under 750 bytes) fit, three do not
    adapter = await PosixAdapter.open(f"file://{tmp_path}/l2", capacity=2 * SPEC.nbytes + 1500)
    policy = ManagerConfig(l2_deadline_s=2.0, lookup_deadline_s=1.0)
    manager = StorageManager(
        L1Cache(SPEC.nbytes * 8, SPEC.nbytes), [("disk", adapter, build_pipeline(["raw"]))], policy
    )
    sink = EventSink({"disk": MEDIUM_DISK})
    detach = sink.attach(manager)
    try:
        await check_two_object_disk_evicts_first(manager, sink)
    finally:
        detach()
        await manager.aclose()


def _chunk_infos_reference(
    tokens: Sequence[int], hashes: Sequence[bytes], block: int, spans: list[tuple[int, int]], as_int: bool
) -> list[ChunkInfo | None]:
    """chunk_infos by its definition, block by block."""
    out: list[ChunkInfo | None] = []
    for start, end in spans:
        first, last = start // block, min(end // block, len(hashes))
        if start % block or last <= first:
            out.append(None)
            continue
        out.append(
            ChunkInfo(
                tuple(external_hash(h, as_int) for h in hashes[first:last]),
                external_hash(hashes[first - 1], as_int) if first else None,
                tuple(int(t) for t in tokens[first * block : last * block]),
                block,
            )
        )
    return out


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.integers(0, 12),
    block=st.sampled_from([1, 2, 4]),
    cuts=st.lists(st.integers(0, 60), max_size=8),
    as_int=st.booleans(),
    as_array=st.booleans(),
)
def test_chunk_infos_match_their_definition(
    blocks: int, block: int, cuts: list[int], as_int: bool, as_array: bool
) -> None:
    """Any spans (aligned or not, past the hashes, empty), tokens as a list or a numpy array, hashes as ints
    or bytes: the blocks, parents and token ids the definition gives (tokens as Python ints)."""
    import numpy as np

    tokens: Sequence[int] = TOKENS[: blocks * block + 3]
    if as_array:
        tokens = np.asarray(tokens, dtype=np.int64)  # type: ignore[assignment]
    bounds = sorted(cuts)
    spans = list(itertools.pairwise(bounds))
    got = chunk_infos(tokens, HASHES[:blocks], block, spans, int_hashes=as_int)
    assert got == _chunk_infos_reference(tokens, HASHES[:blocks], block, spans, as_int)
    assert all(type(t) is int for info in got if info is not None for t in info.token_ids)


def test_a_described_key_keeps_its_blocks() -> None:
    """Describing a key again (a later lookup or store of the same prompt) changes nothing it announces."""
    sink = EventSink()
    sink.describe_request(["k"], TOKENS, HASHES, BLOCK, [(0, 2 * BLOCK)])
    sink.describe_request(["k"], TOKENS, HASHES, BLOCK, [(0, 2 * BLOCK)])
    sink.on_tier("L1", "stored", ["k"])
    sink.on_tier("L1", "evicted", ["k"])
    assert sink.take() == [
        Stored(info(0, 2).block_hashes, None, info(0, 2).token_ids, BLOCK, MEDIUM_CPU),
        Removed(info(0, 2).block_hashes, MEDIUM_CPU),
    ]
