"""vLLM's block-outermost allocation (``VLLM_BLOCKS``), made by vLLM's own allocation code: detected only when
asked for and only on that allocation; a block of every layer moves as one page, by the torch reference and by
the copy engines' plan (one copy per run of consecutive blocks) carried out on CPU tensors, both equal to the
allocation's raw bytes; scatters leave skipped pages, pages of slots < 0 and every other block alone; moves
of some layers and objects that are not contiguous are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout

from tiercache.gpu import (
    LayoutKind,
    Move,
    PagedLayout,
    block_pages,
    copy_engine,
    detect_layout,
    dispatch,
    reference,
)
from tiercache.gpu.layouts import object_spec

L, H, D, BS, NB = 3, 2, 4, 4, 10
PAGE = 2 * H * BS * D  # elements of one layer's page of a block
LAYOUT = PagedLayout(LayoutKind.VLLM_BLOCKS, L, H, D, BS, "float32")


def vllm_caches(layout: KVCacheLayout, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vLLM's allocation of ``NB`` blocks of ``L`` float32 layers in ``layout`` (random content): the raw
    buffer and the per-layer ``[NB, H, BS, 2*D]`` views vLLM registers with a connector."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    page = spec.page_size_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    if layout.is_block_outermost:
        tensor = KVCacheTensor(size=NB * L * page, layers=names, layer_stride=page, block_stride=L * page)
    else:
        tensor = KVCacheTensor(size=NB * L * page, layers=names, layer_stride=NB * page, block_stride=page)
    raw = torch.randn(NB * L * page // 4, generator=torch.Generator().manual_seed(seed)).view(torch.int8)
    views = create_kv_cache_views(raw, spec, NB, layout, tensor)
    return raw, dict(zip(names, views, strict=True))


def blocks_of(raw: torch.Tensor) -> torch.Tensor:
    """The raw allocation as [NB, L * page] float32 rows: block b's pages of every layer."""
    return raw.view(torch.float32).view(NB, L * PAGE)


def slots_for(blocks: list[int], tokens: int) -> torch.Tensor:
    pos = np.arange(tokens)
    return torch.from_numpy(np.asarray(blocks)[pos // BS] * BS + pos % BS).to(torch.int64)


def empty_objects(spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [torch.full(object_spec(LAYOUT, e - s).shape, -7.0) for s, e in spans]


def test_detected_on_vllms_blnhc_allocation_only_when_asked() -> None:
    _, blnhc = vllm_caches(KVCacheLayout.BLNHC)
    _, lbnhc = vllm_caches(KVCacheLayout.LBNHC)
    assert detect_layout(blnhc, BS, kind=LayoutKind.VLLM_BLOCKS) == LAYOUT
    assert detect_layout(blnhc, BS, kind=LayoutKind.VLLM_FLASH).kind is LayoutKind.VLLM_FLASH
    with pytest.raises(ValueError, match=r"not vLLM's BLNHC allocation.*back to back"):
        detect_layout(lbnhc, BS, kind=LayoutKind.VLLM_BLOCKS)
    _, blhnc = vllm_caches(KVCacheLayout.BLHNC)  # heads outside tokens in a page: other bytes
    with pytest.raises(ValueError, match=r"not dense in \[BS, H, 2\*D\] order"):
        detect_layout(blhnc, BS, kind=LayoutKind.VLLM_BLOCKS)


def test_fingerprint_keeps_block_pages_apart() -> None:
    flash = PagedLayout(LayoutKind.VLLM_FLASH, L, H, D, BS, "float32")
    assert LAYOUT.fingerprint != flash.fingerprint
    assert LAYOUT.fingerprint != PagedLayout(LayoutKind.VLLM_BLOCKS, L, H, D, 2 * BS, "float32").fingerprint
    assert LAYOUT.fingerprint != PagedLayout(LayoutKind.CPU_BLOCKS, L, H, D, BS, "float32").fingerprint
    assert LAYOUT.block_aligned
    assert LAYOUT.object_tokens(5) == 2 * BS


@pytest.mark.parametrize("run", ["reference", "dispatch", "copy_engine_plan"])
def test_gather_and_scatter_move_whole_blocks(run: str) -> None:
    raw, kv = vllm_caches(KVCacheLayout.BLNHC, seed=1)
    table = [7, 9, 2, 3, 5]  # 2 -> 3 in one span: one run of two blocks
    tokens = 4 * BS + 1  # the last block partly filled
    slots = slots_for(table, tokens)
    spans = [(0, 2 * BS), (2 * BS, tokens)]
    outs = empty_objects(spans)
    gather = Move.gather(LAYOUT, slots, spans, outs)
    if run == "copy_engine_plan":
        pages_kv, page_move = block_pages.as_pages(kv, gather)
        geo = copy_engine.geometry(pages_kv, page_move)
        assert geo is not None
        copies, _ = copy_engine.plan(geo, page_move, slots.numpy())
        assert len(copies) == 4  # 7 | 9 || 2,3 | 5: the run of two blocks is one copy
        copy_engine.run_on_host(copies, to_kv=False)
    elif run == "dispatch":
        dispatch.gather(kv, gather)
    else:
        reference.gather(kv, gather)
    rows = blocks_of(raw)
    assert torch.equal(outs[0].view(2, -1), rows[[7, 9]])
    assert torch.equal(outs[1].view(3, -1), rows[[2, 3, 5]])

    raw2, kv2 = vllm_caches(KVCacheLayout.BLNHC, seed=2)
    before = blocks_of(raw2).clone()
    slots2 = slots_for([4, 1, 8, 6, 0], tokens)
    slots2[2 * BS + BS : 2 * BS + 2 * BS] = -1  # block 6's tokens: not on the GPU
    scatter = Move.scatter(LAYOUT, slots2, spans, outs, [BS, 0])  # block 4 already there
    if run == "copy_engine_plan":
        pages_kv, page_move = block_pages.as_pages(kv2, scatter)
        geo = copy_engine.geometry(pages_kv, page_move)
        assert geo is not None
        copies, written = copy_engine.plan(geo, page_move, slots2.numpy())
        copy_engine.run_on_host(copies, to_kv=True)
    elif run == "dispatch":
        written = dispatch.scatter(kv2, scatter)
    else:
        written = reference.scatter(kv2, scatter)
    assert written == tokens - BS - BS
    after = blocks_of(raw2)
    for block, row in ((1, 9), (8, 2), (0, 5)):
        assert torch.equal(after[block], rows[row])
    for b in (2, 3, 4, 5, 6, 7, 9):  # skipped, slots < 0, or not in the table
        assert torch.equal(after[b], before[b])


def test_moves_of_some_layers_and_strided_objects_are_refused() -> None:
    _, kv = vllm_caches(KVCacheLayout.BLNHC)
    slots = slots_for([1, 2], 2 * BS)
    spec = object_spec(LAYOUT, 2 * BS).with_layers(0, 1)
    some = Move.gather(LAYOUT, slots, [(0, 2 * BS)], [torch.empty(spec.shape)], layers=range(1))
    with pytest.raises(ValueError, match="whole blocks of every layer"):
        reference.gather(kv, some)
    strided = torch.empty((2, L, 4 * BS, H * D))[:, :, : 2 * BS]
    with pytest.raises(ValueError, match="must be contiguous"):
        dispatch.gather(kv, Move.gather(LAYOUT, slots, [(0, 2 * BS)], [strided]))


def test_block_gaps_copy_a_row_per_page() -> None:
    """Blocks further apart than every layer's pages (vLLM pads a packed block to an alignment): one 2D copy
    per run, a row per page, and the padding is never read or written."""
    big = torch.randn(NB * (L * PAGE + 8), generator=torch.Generator().manual_seed(5))
    kv = [big.as_strided((NB, H, BS, 2 * D), (L * PAGE + 8, 2 * D, H * 2 * D, 1), i * PAGE) for i in range(L)]
    slots = slots_for([3, 4, 5], 3 * BS)
    out = empty_objects([(0, 3 * BS)])
    move = Move.gather(LAYOUT, slots, [(0, 3 * BS)], out)
    pages_kv, page_move = block_pages.as_pages(kv, move)
    geo = copy_engine.geometry(pages_kv, page_move)
    assert geo is not None
    copies, _ = copy_engine.plan(geo, page_move, slots.numpy())
    assert [(c.width, c.height) for c in copies] == [(L * PAGE * 4, 3)]
    copy_engine.run_on_host(copies, to_kv=False)
    rows = big.view(NB, L * PAGE + 8)[:, : L * PAGE]
    assert torch.equal(out[0].view(3, -1), rows[[3, 4, 5]])


@settings(max_examples=40, deadline=None)
@given(
    order=st.permutations(list(range(1, NB))),
    tokens=st.integers(1, 6 * BS),
    chunk_blocks=st.integers(1, 3),
    skip_blocks=st.integers(0, 2),
    missing=st.sets(st.integers(0, 5), max_size=2),
)
def test_copy_engine_plan_equals_reference(
    order: list[int], tokens: int, chunk_blocks: int, skip_blocks: int, missing: set[int]
) -> None:
    """Any table, chunking, skip and blocks not on the GPU: the plan's copies write exactly the reference's
    bytes, object and paged KV, and count the same tokens."""
    _, kv = vllm_caches(KVCacheLayout.BLNHC, seed=3)
    slots = slots_for(order, tokens)
    c = chunk_blocks * BS
    spans = [(s, min(s + c, tokens)) for s in range(0, tokens, c)]
    want, got = empty_objects(spans), empty_objects(spans)
    reference.gather(kv, Move.gather(LAYOUT, slots, spans, want))
    pages_kv, page_move = block_pages.as_pages(kv, Move.gather(LAYOUT, slots, spans, got))
    geo = copy_engine.geometry(pages_kv, page_move)
    assert geo is not None
    copies, _ = copy_engine.plan(geo, page_move, slots.numpy())
    copy_engine.run_on_host(copies, to_kv=False)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))

    skips = [min(skip_blocks * BS, (e - s) // BS * BS) if i == 0 else 0 for i, (s, e) in enumerate(spans)]
    back = slots.clone()
    for b in missing:
        back[b * BS : (b + 1) * BS] = -1
    raw_ref, kv_ref = vllm_caches(KVCacheLayout.BLNHC, seed=4)
    raw_ce, kv_ce = vllm_caches(KVCacheLayout.BLNHC, seed=4)
    n_ref = reference.scatter(kv_ref, Move.scatter(LAYOUT, back, spans, want, skips))
    pages_kv, page_move = block_pages.as_pages(kv_ce, Move.scatter(LAYOUT, back, spans, want, skips))
    geo = copy_engine.geometry(pages_kv, page_move)
    assert geo is not None
    copies, n_ce = copy_engine.plan(geo, page_move, back.numpy())
    copy_engine.run_on_host(copies, to_kv=True)
    assert n_ce == n_ref
    assert torch.equal(raw_ce, raw_ref)


@pytest.mark.asyncio
async def test_engine_stores_and_restores_whole_blocks_through_a_file_tier(tmp_path: Path) -> None:
    """Store from one BLNHC allocation, close, restore into another holding the first block (a local hit)
    from the file tier alone: every later block of the prompt arrives byte for byte, the keyspace is its own
    and a skip that is not whole blocks is refused."""
    from tiercache.adapters.posix import PosixAdapter
    from tiercache.config import ManagerConfig, config_from_dict
    from tiercache.serde import build_pipeline
    from tiercache.store.engine import CacheEngine
    from tiercache.store.l1 import L1Cache
    from tiercache.store.manager import StorageManager

    chunk = 2 * BS
    flash = PagedLayout(LayoutKind.VLLM_FLASH, L, H, D, BS, "float32")
    keyspace = CacheEngine.keyspace_for(config_from_dict({}), LAYOUT, model="test/model")
    assert keyspace.digest != CacheEngine.keyspace_for(config_from_dict({}), flash, model="test/model").digest

    async def engine(l1_slots: int) -> CacheEngine:
        slot = CacheEngine.slot_bytes(LAYOUT, chunk, False)
        tier = ("disk", await PosixAdapter.open(f"file://{tmp_path}"), build_pipeline(["raw"]))
        manager = StorageManager(L1Cache(slot * l1_slots, slot), [tier], ManagerConfig(l2_deadline_s=5.0))
        return CacheEngine(manager, LAYOUT, keyspace, chunk_size=chunk)

    tokens = list(range(100, 100 + 4 * BS + 3))  # two whole chunks, a tail of one block and 3 tokens
    raw, kv = vllm_caches(KVCacheLayout.BLNHC, seed=7)
    src_table = [6, 2, 9, 4, 1]
    prefill = await engine(8)
    try:
        assert await prefill.store(tokens, kv, slots_for(src_table, len(tokens))) == len(tokens)
        await prefill.drain()
    finally:
        await prefill.aclose()
    raw2, kv2 = vllm_caches(KVCacheLayout.BLNHC, seed=8)
    dst_table = [3, 8, 5, 7, 2]
    blocks_of(raw2)[3] = blocks_of(raw)[6]  # the local hit: the first block, computed the same
    before = blocks_of(raw2).clone()
    decode = await engine(8)
    try:
        result = await decode.retrieve_result(tokens, kv2, slots_for(dst_table, len(tokens)), skip_tokens=BS)
        assert result.tokens_written == len(tokens) - BS
        got, want = blocks_of(raw2), blocks_of(raw)
        for d, s in zip(dst_table, src_table, strict=True):
            assert torch.equal(got[d], want[s])
        for b in set(range(NB)) - set(dst_table):
            assert torch.equal(got[b], before[b])
        with pytest.raises(ValueError, match="block_size"):
            await decode.retrieve_result(tokens, kv2, slots_for(dst_table, len(tokens)), skip_tokens=BS + 1)
    finally:
        await decode.aclose()


def test_tensors_that_are_not_one_blnhc_allocation_are_named() -> None:
    """Each way per-layer views can miss vLLM's BLNHC allocation is refused with its reason."""
    _, kv = vllm_caches(KVCacheLayout.BLNHC)
    layers = list(kv.values())
    swapped = [layers[1], layers[0], *layers[2:]]  # the dict's order is not the memory's
    with pytest.raises(ValueError, match="back to back"):
        detect_layout(swapped, BS, kind=LayoutKind.VLLM_BLOCKS)
    base = layers[0]
    close = [  # blocks one page apart: every layer's pages of a block cannot fit
        base.as_strided(base.shape, (PAGE, *base.stride()[1:]), base.storage_offset() + i * PAGE)
        for i in range(L)
    ]
    with pytest.raises(ValueError, match="less than every layer's pages"):
        detect_layout(close, BS, kind=LayoutKind.VLLM_BLOCKS)
    mixed = [layers[0], layers[1].contiguous(), *layers[2:]]
    with pytest.raises(ValueError, match="strides differ"):
        detect_layout(mixed, BS, kind=LayoutKind.VLLM_BLOCKS)
    short = [layers[0], layers[1][: NB - 1], *layers[2:]]
    with pytest.raises(ValueError, match="shapes or dtypes differ"):
        dispatch.gather(short, Move.gather(LAYOUT, slots_for([1], BS), [(0, BS)], empty_objects([(0, BS)])))


def test_a_move_run_again_follows_the_tensors_its_caches_hold_now() -> None:
    """A move kept and run again after its KV dict was refilled with another allocation reads that one."""
    raw, kv = vllm_caches(KVCacheLayout.BLNHC, seed=11)
    slots = slots_for([2, 5], 2 * BS)
    out = empty_objects([(0, 2 * BS)])
    move = Move.gather(LAYOUT, slots, [(0, 2 * BS)], out)
    dispatch.gather(kv, move)
    assert torch.equal(out[0].view(2, -1), blocks_of(raw)[[2, 5]])
    raw2, kv2 = vllm_caches(KVCacheLayout.BLNHC, seed=12)
    kv.clear()
    kv.update(kv2)
    dispatch.gather(kv, move)
    assert torch.equal(out[0].view(2, -1), blocks_of(raw2)[[2, 5]])


def test_copy_engine_plan_of_several_layers_of_pages_equals_the_reference() -> None:
    """Whole pages of several layers (CPU_BLOCKS, each layer its own tensor): the plan puts layer j's pages at
    its place in the object, as the reference does."""
    layout = PagedLayout(LayoutKind.CPU_BLOCKS, L, H, D, BS, "float32")
    g = torch.Generator().manual_seed(13)
    kv = [torch.randn(layout.layer_shape(NB), generator=g) for _ in range(L)]
    slots = slots_for([4, 5, 1], 3 * BS - 2)
    spans = [(0, 2 * BS), (2 * BS, 3 * BS - 2)]
    want = [torch.full(object_spec(layout, e - s).shape, -7.0) for s, e in spans]
    got = [torch.full(object_spec(layout, e - s).shape, -7.0) for s, e in spans]
    reference.gather(kv, Move.gather(layout, slots, spans, want))
    move = Move.gather(layout, slots, spans, got)
    geo = copy_engine.geometry(kv, move)
    assert geo is not None
    copies, _ = copy_engine.plan(geo, move, slots.numpy())
    assert len(copies) == 2 * L  # per layer: blocks 4, 5 in one copy; block 1
    copy_engine.run_on_host(copies, to_kv=False)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.asyncio
async def test_engine_refuses_layerwise_objects_and_an_fp8_l1_of_whole_blocks() -> None:
    from tiercache.config import ManagerConfig, config_from_dict
    from tiercache.store.engine import CacheEngine
    from tiercache.store.l1 import L1Cache
    from tiercache.store.manager import StorageManager

    keyspace = CacheEngine.keyspace_for(config_from_dict({}), LAYOUT, model="test/model")
    slot = CacheEngine.slot_bytes(LAYOUT, 2 * BS, False)
    raw_l1 = StorageManager(L1Cache(slot * 4, slot), [], ManagerConfig())
    try:
        with pytest.raises(ValueError, match="whole blocks of every layer"):
            CacheEngine(raw_l1, LAYOUT, keyspace, chunk_size=2 * BS, layerwise=True)
    finally:
        await raw_l1.aclose()
    fp8_l1 = StorageManager(L1Cache(slot * 4, slot, codec="fp8"), [], ManagerConfig())
    try:
        with pytest.raises(ValueError, match="fp8 L1"):
            CacheEngine(fp8_l1, LAYOUT, keyspace, chunk_size=2 * BS)
    finally:
        await fp8_l1.aclose()


def test_a_skip_of_part_of_a_block_is_refused_by_the_plan_and_the_reference() -> None:
    raw, kv = vllm_caches(KVCacheLayout.BLNHC, seed=14)
    before = raw.clone()
    slots = slots_for([3, 6], 2 * BS)
    objs = empty_objects([(0, 2 * BS)])
    move = Move.scatter(LAYOUT, slots, [(0, 2 * BS)], objs, BS + 1)
    pages_kv, page_move = block_pages.as_pages(kv, move)
    geo = copy_engine.geometry(pages_kv, page_move)
    assert geo is not None
    with pytest.raises(ValueError, match="multiple of block_size"):
        copy_engine.plan(geo, page_move, slots.numpy())
    with pytest.raises(ValueError, match="multiple of block_size"):
        reference.scatter(kv, move)
    assert torch.equal(raw, before)
