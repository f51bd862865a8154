"""The copy-engine path's plans (tiercache.gpu.copy_engine) carried out on CPU tensors move exactly what the
torch reference moves: gathers and scatters, skips, slots < 0, layer subsets, layers at one pitch (a copy per
run and plane) or apart (a copy per run and layer); bad slots fail before anything moves; the dispatch
setting that picks the path is checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tiercache.gpu import LayoutKind, Move, PagedLayout, copy_engine, dispatch, object_spec, reference

BS, NB, L = 4, 12, 3


def kv_caches(kind: LayoutKind, one_buffer: bool, seed: int) -> tuple[PagedLayout, list[torch.Tensor]]:
    """Random paged KV of ``kind`` (2 heads of 8, or one latent of 16): layers as views of one buffer (at
    one pitch) or as separate tensors with gaps between them."""
    heads, dim = (1, 16) if kind is LayoutKind.VLLM_MLA else (2, 8)
    layout = PagedLayout(kind, L, heads, dim, BS, "float32")
    shape = layout.layer_shape(NB)
    n = int(np.prod(shape))
    g = torch.Generator().manual_seed(seed)
    if one_buffer:
        flat = torch.randn(L * n, generator=g)
        raw = [flat[i * n : (i + 1) * n] for i in range(L)]
    else:
        raw = [torch.randn(n + 40 * (i + 1), generator=g)[:n] for i in range(L)]
    if kind is LayoutKind.VLLM_FLASH:  # vLLM's NHD allocation [NB, BS, H, K|V] seen as [NB, H, BS, 2D]
        return layout, [r.view(NB, BS, heads, 2 * dim).permute(0, 2, 1, 3) for r in raw]
    return layout, [r.view(shape) for r in raw]


def blocks_table(rng: np.random.Generator, tokens: int, shuffled: bool) -> torch.Tensor:
    """Slots of ``tokens`` tokens over distinct blocks, in order or shuffled."""
    nblk = -(-tokens // BS)
    blocks = rng.permutation(NB)[:nblk] if shuffled else np.arange(1, nblk + 1)
    pos = np.arange(tokens)
    return torch.from_numpy(blocks[pos // BS] * BS + pos % BS).to(torch.int64)


def objects(layout: PagedLayout, spans: list[tuple[int, int]], layers: range) -> list[torch.Tensor]:
    out = []
    for s, e in spans:
        spec = object_spec(layout, e - s)
        shape = list(spec.shape)
        shape[-3] = len(layers)
        out.append(torch.full(shape, -7.0))
    return out


def one_run(
    kind: LayoutKind, tokens: int
) -> tuple[list[torch.Tensor], torch.Tensor, Move, copy_engine.Geometry]:
    """A gather of every layer of ``tokens`` tokens, one span over blocks in order, from one buffer's KV of
    ``kind``: the KV, slots, move and the geometry the copy engine takes for it."""
    layout, kv = kv_caches(kind, True, 1)
    slots = blocks_table(np.random.default_rng(1), tokens, shuffled=False)
    move = Move.gather(layout, slots, [(0, tokens)], objects(layout, [(0, tokens)], range(L)))
    geo = copy_engine.geometry(kv, move)
    assert geo is not None
    return kv, slots, move, geo


def run_plan(kv: list[torch.Tensor], move: Move, slots: torch.Tensor, layer_rows: bool) -> int:
    geo = copy_engine.geometry(kv, move)
    assert geo is not None
    copies, count = copy_engine.plan(geo, move, slots.numpy(), layer_rows=layer_rows)
    copy_engine.run_on_host(copies, to_kv=move.is_scatter)
    return count


CASES = [
    pytest.param(
        kind, one, rows, id=f"{kind.value}-{'one' if one else 'apart'}-{'layers' if rows else 'planes'}"
    )
    for kind in (LayoutKind.VLLM_LEGACY, LayoutKind.VLLM_MLA, LayoutKind.VLLM_FLASH)
    for one in (True, False)
    for rows in (True, False)
]


@pytest.mark.parametrize(("kind", "one_buffer", "layer_rows"), CASES)
@pytest.mark.parametrize("shuffled", [True, False])
def test_gather_and_scatter_match_the_reference(
    kind: LayoutKind, one_buffer: bool, layer_rows: bool, shuffled: bool
) -> None:
    rng = np.random.default_rng(5)
    layout, kv = kv_caches(kind, one_buffer, 1)
    slots = blocks_table(rng, 22, shuffled)
    spans = [(0, 8), (8, 16), (16, 22)]
    for layers in (range(L), range(1, 3)):
        want, got = objects(layout, spans, layers), objects(layout, spans, layers)
        reference.gather(kv, Move.gather(layout, slots, spans, want, layers=layers))
        run_plan(kv, Move.gather(layout, slots, spans, got, layers=layers), slots, layer_rows)
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w, g)
        # a scatter of other values, skipping the first 3 tokens, with one slot < 0 left alone
        _, want_kv = kv_caches(kind, one_buffer, 2)
        _, got_kv = kv_caches(kind, one_buffer, 2)
        holes = slots.clone()
        holes[12] = -1
        src = [torch.randn(o.shape, generator=torch.Generator().manual_seed(9)) for o in want]
        n_ref = reference.scatter(want_kv, Move.scatter(layout, holes, spans, src, 3, layers=layers))
        n = run_plan(got_kv, Move.scatter(layout, holes, spans, src, 3, layers=layers), holes, layer_rows)
        assert n == n_ref == 22 - 3 - 1
        for w, g in zip(want_kv, got_kv, strict=True):
            assert torch.equal(w, g)


def test_layers_at_one_pitch_make_a_copy_per_run_and_plane() -> None:
    kv, slots, move, geo = one_run(LayoutKind.VLLM_LEGACY, 16)  # 4 blocks
    assert geo.layer_pitch == kv[1].data_ptr() - kv[0].data_ptr()
    copies, _ = copy_engine.plan(geo, move, slots.numpy())
    assert [(c.height, c.width) for c in copies] == [(L, 16 * geo.row)] * 2
    per_layer, _ = copy_engine.plan(geo, move, slots.numpy(), layer_rows=False)
    assert [(c.height, c.width) for c in per_layer] == [(2, 16 * geo.row)] * L
    _, apart = kv_caches(LayoutKind.VLLM_LEGACY, False, 1)
    geo2 = copy_engine.geometry(apart, move)
    assert geo2 is not None
    assert geo2.layer_pitch is None


@pytest.mark.parametrize("kind", [LayoutKind.VLLM_LEGACY, LayoutKind.VLLM_FLASH])
def test_a_plan_as_one_batch_of_1d_copies_moves_the_same_bytes(kind: LayoutKind) -> None:
    rng = np.random.default_rng(3)
    layout, kv = kv_caches(kind, True, 1)
    slots = blocks_table(rng, 22, shuffled=True)
    spans = [(0, 8), (8, 22)]
    want, got = objects(layout, spans, range(L)), objects(layout, spans, range(L))
    reference.gather(kv, Move.gather(layout, slots, spans, want))
    move = Move.gather(layout, slots, spans, got)
    geo = copy_engine.geometry(kv, move)
    assert geo is not None
    copies, _ = copy_engine.plan(geo, move, slots.numpy())
    kv_at, obj_at, sizes = copy_engine.flat_copies(copies)
    assert len(sizes) == sum(c.height for c in copies)
    assert int(sizes.sum()) == sum(o.numel() * o.element_size() for o in got)
    copy_engine.run_on_host(
        [
            copy_engine.Copy2D(int(k), 0, int(o), 0, int(z), 1)
            for k, o, z in zip(kv_at, obj_at, sizes, strict=True)
        ],
        to_kv=False,
    )
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


@given(start=st.integers(0, 5000), count=st.integers(0, 5000))
@example(start=0, count=1)
@example(start=7, count=copy_engine.SUB_BATCH_FIRST)
def test_sub_batches_cover_a_batch_in_order_short_first(start: int, count: int) -> None:
    cuts = copy_engine.sub_batches(start, start + count)
    assert [a for a, _ in cuts] == [start, *(z for _, z in cuts)][: len(cuts)]  # back to back, in order
    assert (cuts[-1][1] if cuts else start) == start + count
    sizes = [z - a for a, z in cuts]
    assert all(0 < n <= copy_engine.SUB_BATCH_MAX for n in sizes)
    assert not sizes or sizes[0] == min(count, copy_engine.SUB_BATCH_FIRST)
    full = sizes[:-1]  # every one but the last as long as the doubling allows
    assert full == [
        min(copy_engine.SUB_BATCH_FIRST << i, copy_engine.SUB_BATCH_MAX) for i in range(len(full))
    ]


class _BatchAddresses:
    """The launch extension's batch maker, on CPU: each sub-batch's destination, source and size arrays."""

    def make_batch(self, dst: bytes, src: bytes, size: bytes) -> tuple[np.ndarray, ...]:
        return tuple(np.frombuffer(b, dtype=np.uint64) for b in (dst, src, size))


@pytest.mark.parametrize("streams", [1, 3])
def test_a_batched_plan_cuts_its_copies_in_host_order_into_sub_batches_per_stream(streams: int) -> None:
    layout, kv = kv_caches(LayoutKind.VLLM_LEGACY, True, 1)
    slots = blocks_table(np.random.default_rng(5), 22, shuffled=True)
    spans = [(0, 8), (8, 22)]
    move = Move.gather(layout, slots, spans, objects(layout, spans, range(L)))
    geo = copy_engine.geometry(kv, move)
    assert geo is not None
    prepared = copy_engine.CopyMove(kv, move, geo, 0, True, _BatchAddresses(), True, streams)
    kv_at, obj_at, size = copy_engine.flat_copies(copy_engine.plan(geo, move, slots.numpy())[0])
    assert len(size) > copy_engine.SUB_BATCH_FIRST  # more than one sub-batch
    order = np.argsort(obj_at, kind="stable")
    assert len(prepared.batches) == streams
    issued = [np.concatenate([b[i] for per in prepared.batches for b in per]) for i in range(3)]
    for got, want in zip(issued, (obj_at[order], kv_at[order], size[order]), strict=True):
        assert np.array_equal(got, want)  # a gather: to the objects, from the KV, in host address order
    for per in prepared.batches:
        n = sum(len(b[2]) for b in per)
        assert [len(b[2]) for b in per] == [z - a for a, z in copy_engine.sub_batches(0, n)]


def test_a_batched_move_with_nothing_to_copy_has_no_batches() -> None:
    layout, kv = kv_caches(LayoutKind.VLLM_LEGACY, True, 1)
    slots = torch.full((8,), -1, dtype=torch.int64)  # a scatter leaves slots < 0 alone
    move = Move.scatter(layout, slots, [(0, 8)], objects(layout, [(0, 8)], range(L)))
    geo = copy_engine.geometry(kv, move)
    assert geo is not None
    prepared = copy_engine.CopyMove(kv, move, geo, 0, True, _BatchAddresses(), True, 2)
    assert (prepared.batches, prepared.issued) == ([], 0)


def test_bad_slots_fail_before_anything_moves() -> None:
    layout, kv = kv_caches(LayoutKind.VLLM_LEGACY, True, 1)
    slots = torch.arange(8, dtype=torch.int64)
    out = objects(layout, [(0, 4), (4, 8)], range(L))
    geo = copy_engine.geometry(kv, Move.gather(layout, slots, [(0, 4), (4, 8)], out))
    assert geo is not None
    bad = slots.clone()
    bad[6] = -1
    with pytest.raises(ValueError, match=r"span \(4, 8\) has slots < 0"):
        copy_engine.plan(geo, Move.gather(layout, bad, [(0, 4), (4, 8)], out), bad.numpy())
    bad[6] = NB * BS
    with pytest.raises(ValueError, match=f"slot {NB * BS} outside the paged KV of {NB * BS} slots"):
        copy_engine.plan(geo, Move.scatter(layout, bad, [(0, 4), (4, 8)], out), bad.numpy())


def test_flash_rows_are_a_copy_per_run_plane_and_layer_with_the_heads_as_rows() -> None:
    _, slots, move, geo = one_run(LayoutKind.VLLM_FLASH, 8)  # 2 blocks
    assert not geo.contiguous
    copies, _ = copy_engine.plan(geo, move, slots.numpy())
    assert [(c.height, c.width, c.kv_pitch) for c in copies] == [(8 * 2, 8 * 4, 16 * 4)] * (2 * L)


def test_layouts_whose_rows_are_not_at_one_pitch_are_not_taken() -> None:
    layout = PagedLayout(LayoutKind.VLLM_FLASH, L, 2, 8, BS, "float32")
    kv = [torch.zeros(layout.layer_shape(NB)) for _ in range(L)]  # HND: a head's tokens back to back
    slots = torch.arange(4, dtype=torch.int64)
    move = Move.gather(layout, slots, [(0, 4)], objects(layout, [(0, 4)], range(L)))
    assert copy_engine.geometry(kv, move) is None
    assert copy_engine.prepare(kv, move) is None  # CPU objects, no CUDA: another path


@settings(max_examples=60, deadline=None)
@example([-1, 0, 1, 2, 5, -2, 6, 7], 0, True, True, LayoutKind.VLLM_LEGACY)  # a hole just before slot 0
@given(
    st.lists(st.integers(-3, NB * BS - 1), min_size=1, max_size=24, unique=True),
    st.integers(0, 3),
    st.booleans(),
    st.booleans(),
    st.sampled_from([LayoutKind.VLLM_LEGACY, LayoutKind.VLLM_FLASH, LayoutKind.VLLM_MLA]),
)
def test_any_slot_mapping_scatters_like_the_reference(
    raw: list[int], skip: int, one_buffer: bool, layer_rows: bool, kind: LayoutKind
) -> None:
    slots = torch.tensor(raw, dtype=torch.int64).clamp(min=-1)  # distinct slots, up to three holes
    n = len(raw)
    spans = [(0, n // 2), (n // 2, n)]
    skips = [min(skip, n // 2), 0]
    layout, want_kv = kv_caches(kind, one_buffer, 3)
    _, got_kv = kv_caches(kind, one_buffer, 3)
    src = [torch.randn(o.shape) for o in objects(layout, spans, range(L))]
    n_ref = reference.scatter(want_kv, Move.scatter(layout, slots, spans, src, skips))
    n_got = run_plan(got_kv, Move.scatter(layout, slots, spans, src, skips), slots, layer_rows)
    assert n_got == n_ref
    for w, g in zip(want_kv, got_kv, strict=True):
        assert torch.equal(w, g)


def test_the_host_path_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dispatch.host_path() == "auto"
    monkeypatch.setattr(dispatch, "HOST_PATH", "dma")
    with pytest.raises(ValueError, match="TIERCACHE_GPU_HOST_PATH must be one of auto, copy_engine, kernel"):
        dispatch.host_path()


def test_auto_takes_the_copy_engines_for_long_block_runs_and_leaves_shuffled_blocks_to_the_kernels() -> None:
    block_plane = 16 * 8 * 128 * 2  # 16 tokens x 8 KV heads x 128 dims, bf16: a shuffled table's piece
    assert not dispatch.copy_engine_ahead(True, block_plane)  # measured behind the kernel paths
    assert dispatch.copy_engine_ahead(True, dispatch.COPY_ENGINE_MIN_ROW_BYTES)  # runs of 128 such blocks
    assert not dispatch.copy_engine_ahead(True, dispatch.COPY_ENGINE_MIN_ROW_BYTES - 1)
    assert not dispatch.copy_engine_ahead(False, dispatch.COPY_ENGINE_MIN_ROW_BYTES)  # a piece per head
