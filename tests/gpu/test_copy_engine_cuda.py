# mypy: disable-error-code="no-untyped-call"
"""The copy-engine path on CUDA (skipped without it): moves between CUDA paged KV and pinned L1 objects by 2D
copies alone are bit-exact against the torch reference, for layers at one pitch and apart, gathers and
scatters with skips and slots < 0, a run again after the slots changed, from another thread on another
stream; dispatch takes the path as ``HOST_PATH`` says; bad slots move nothing."""

from __future__ import annotations

import threading

import pytest
import torch

from tiercache.testing.harness.moves import bits, sentinel_left

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from tiercache.gpu import LayoutKind, Move, PagedLayout, copy_engine, dispatch, object_spec, reference
from tiercache.store.l1 import L1Cache

DEV = torch.device("cuda")
L, BS, NB, N, CHUNK = 6, 16, 64, 400, 128


def make_kv(kind: LayoutKind, one_buffer: bool, seed: int) -> tuple[PagedLayout, list[torch.Tensor]]:
    heads, dim = (1, 128) if kind is LayoutKind.VLLM_MLA else (4, 64)
    layout = PagedLayout(kind, L, heads, dim, BS, "bfloat16")
    shape = layout.layer_shape(NB)
    n = torch.Size(shape).numel()
    g = torch.Generator(device=DEV).manual_seed(seed)
    if one_buffer:
        buf = torch.randint(0, 30000, (L * n,), generator=g, device=DEV, dtype=torch.int16)
        raw = [buf[i * n : (i + 1) * n] for i in range(L)]
    else:  # separate allocations with gaps of different sizes: no common pitch
        raw = [
            torch.randint(0, 30000, (n + 4096 * (i + 1),), generator=g, device=DEV, dtype=torch.int16)[:n]
            for i in range(L)
        ]
    if kind is LayoutKind.VLLM_FLASH:  # vLLM's NHD allocation [NB, BS, H, K|V] seen as [NB, H, BS, 2D]
        return layout, [r.view(torch.bfloat16).view(NB, BS, heads, 2 * dim).permute(0, 2, 1, 3) for r in raw]
    return layout, [r.view(torch.bfloat16).view(shape) for r in raw]


def slots_of(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(NB - 1, generator=g)[: -(-N // BS)] + 1
    pos = torch.arange(N)
    return table[pos // BS] * BS + pos % BS


def pinned_objects(layout: PagedLayout, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    spec = object_spec(layout, CHUNK)
    l1 = L1Cache(len(spans) * spec.nbytes * 2, spec.nbytes, pinned=True)
    objs = [l1.reserve_write(f"k{i}", object_spec(layout, e - s)) for i, (s, e) in enumerate(spans)]
    out = [o.tensor() for o in objs if o is not None]
    for o in out:
        bits(o).fill_(-1)
    return out


SPANS = [(s, min(s + CHUNK, N)) for s in range(0, N, CHUNK)]


@pytest.mark.parametrize(
    ("layer_rows", "batched", "streams"),
    [(True, False, 1), (False, False, 1), (True, True, 1), (True, True, 3)],
    ids=["2d-layer-rows", "2d-plane-rows", "batched", "batched-3-streams"],
)
@pytest.mark.parametrize("one_buffer", [True, False], ids=["one-pitch", "apart"])
@pytest.mark.parametrize("kind", [LayoutKind.VLLM_LEGACY, LayoutKind.VLLM_MLA, LayoutKind.VLLM_FLASH])
def test_copy_engine_moves_match_the_reference(
    kind: LayoutKind, one_buffer: bool, layer_rows: bool, batched: bool, streams: int
) -> None:
    layout, kv = make_kv(kind, one_buffer, 1)
    slots = slots_of(2)
    outs = pinned_objects(layout, SPANS)
    move = Move.gather(layout, slots, SPANS, outs)
    ce = copy_engine.prepare(kv, move, layer_rows=layer_rows, batched=batched, streams=streams)
    assert ce is not None
    assert ce.batched == batched
    assert len(ce.batches) == (streams if batched else 0)
    assert (ce.geo.layer_pitch is not None) == one_buffer
    side = torch.cuda.Stream()  # batches refuse the legacy default stream: the runs there take 2D copies
    with torch.cuda.stream(side):
        ce.run()
    want = [torch.empty_like(o) for o in outs]
    reference.gather(kv, Move.gather(layout, slots.to(DEV), SPANS, want))
    for w, o in zip(want, outs, strict=True):
        assert not sentinel_left(o)
        assert torch.equal(bits(w), bits(o))
    # a scatter with a skip and a hole, into other KV
    _, dst = make_kv(kind, one_buffer, 3)
    dst_ref = [t.clone() for t in dst]
    holes = slots.clone()
    holes[200] = -1
    s_move = Move.scatter(layout, holes, SPANS, outs, 40)
    sce = copy_engine.prepare(dst, s_move, layer_rows=layer_rows, batched=batched, streams=streams)
    assert sce is not None
    for t in dst_ref:
        bits(t).bitwise_not_()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for t in dst:
            bits(t).bitwise_not_()  # queued before the scatter on its stream: every batch must come after it
        assert sce.run() == N - 41
    assert reference.scatter(dst_ref, Move.scatter(layout, holes.to(DEV), SPANS, outs, 40)) == N - 41
    for a, b in zip(dst_ref, dst, strict=True):
        assert torch.equal(bits(a), bits(b))
    # run again after the slots changed in place: planned again
    slots.copy_(slots_of(5))
    ce.run()
    reference.gather(kv, Move.gather(layout, slots.to(DEV), SPANS, want))
    assert all(torch.equal(bits(w), bits(o)) for w, o in zip(want, outs, strict=True))


def test_dispatch_takes_the_copy_engines_as_set(monkeypatch: pytest.MonkeyPatch) -> None:
    layout, kv = make_kv(LayoutKind.VLLM_LEGACY, True, 1)
    slots = slots_of(2)
    want = [torch.empty(object_spec(layout, e - s).shape, dtype=torch.bfloat16) for s, e in SPANS]
    reference.gather(kv, Move.gather(layout, slots, SPANS, want))
    for setting, taken in (("copy_engine", True), ("kernel", False), ("auto", False)):
        monkeypatch.setattr(dispatch, "HOST_PATH", setting)
        outs = pinned_objects(layout, SPANS)
        move = Move.gather(layout, slots, SPANS, outs)
        dispatch.gather(kv, move)
        picked = [p for p in move.prepared.values() if isinstance(p, tuple) and len(p) > 2]
        assert any(isinstance(p[2], copy_engine.CopyMove) for p in picked) == taken, setting
        assert all(torch.equal(bits(w), bits(o)) for w, o in zip(want, outs, strict=True))
    # auto takes them where the copies are large (6 layers of 16-token blocks of 512-byte rows are not)
    monkeypatch.setattr(dispatch, "COPY_ENGINE_MIN_ROW_BYTES", 1)
    outs = pinned_objects(layout, SPANS)
    move = Move.gather(layout, slots, SPANS, outs)
    dispatch.gather(kv, move)
    picked = [p for p in move.prepared.values() if isinstance(p, tuple) and len(p) > 2]
    assert any(isinstance(p[2], copy_engine.CopyMove) for p in picked)


def test_2d_copies_by_default_batches_where_the_driver_has_them() -> None:
    from tiercache.gpu import launch

    nat = launch.native_copies()
    assert nat is not None
    layout, kv = make_kv(LayoutKind.VLLM_LEGACY, True, 1)
    move = Move.gather(layout, slots_of(2), SPANS, pinned_objects(layout, SPANS))
    ce = copy_engine.prepare(kv, move)
    assert ce is not None
    assert not ce.batched
    batched = copy_engine.prepare(kv, move, batched=True)
    assert (batched is not None) == copy_engine.batches_supported(nat)


def test_bad_slots_move_nothing() -> None:
    layout, kv = make_kv(LayoutKind.VLLM_LEGACY, True, 1)
    bad = slots_of(2)
    bad[300] = -1
    outs = pinned_objects(layout, SPANS)
    with pytest.raises(ValueError, match="has slots < 0"):
        copy_engine.prepare(kv, Move.gather(layout, bad, SPANS, outs))
    assert all(bool((bits(o) == -1).all()) for o in outs)


def test_runs_from_another_thread_on_its_stream() -> None:
    layout, kv = make_kv(LayoutKind.VLLM_LEGACY, False, 1)
    slots = slots_of(2)
    outs = pinned_objects(layout, SPANS)
    want = [torch.empty_like(o) for o in outs]
    reference.gather(kv, Move.gather(layout, slots, SPANS, want))
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                for _ in range(3):
                    dispatch.gather(kv, Move.gather(layout, slots, SPANS, outs))
        except BaseException as exc:
            errors.append(exc)

    old = dispatch.HOST_PATH
    dispatch.HOST_PATH = "copy_engine"
    try:
        t = threading.Thread(target=work)
        t.start()
        t.join(60)
    finally:
        dispatch.HOST_PATH = old
    assert not t.is_alive()
    assert not errors
    assert all(torch.equal(bits(w), bits(o)) for w, o in zip(want, outs, strict=True))


def blnhc(seed: int, gap: int = 0) -> tuple[PagedLayout, list[torch.Tensor], torch.Tensor]:
    """vLLM's block-outermost BLNHC allocation of ``L`` layers (4 heads of 64, bf16): per-layer
    ``[NB, H, BS, 2D]`` views of one buffer whose blocks hold every layer's page back to back, then ``gap``
    elements of padding; and the buffer as [NB, block] rows."""
    heads, dim = 4, 64
    layout = PagedLayout(LayoutKind.VLLM_BLOCKS, L, heads, dim, BS, "bfloat16")
    page = heads * BS * 2 * dim
    block = L * page + gap
    g = torch.Generator(device=DEV).manual_seed(seed)
    buf = torch.randint(0, 30000, (NB * block,), generator=g, device=DEV, dtype=torch.int16).view(
        torch.bfloat16
    )
    kv = [
        buf.as_strided((NB, heads, BS, 2 * dim), (block, 2 * dim, heads * 2 * dim, 1), i * page)
        for i in range(L)
    ]
    return layout, kv, buf.view(NB, block)


@pytest.mark.parametrize("gap", [0, 64], ids=["packed", "padded"])
def test_block_pages_take_the_copy_engines(gap: int) -> None:
    """A shuffled table on vLLM's BLNHC allocation: dispatch moves whole blocks to and from pinned L1 objects
    on the copy engines (no kernel), bit-exact against the reference, a scatter's skip, a hole and the
    blocks' padding left alone."""
    from tiercache.gpu import block_pages, launch

    layout, kv, _ = blnhc(1, gap)
    n = N - 8  # the last block half filled
    spans = [(s, min(s + CHUNK, n)) for s in range(0, n, CHUNK)]
    slots = slots_of(2)[:n].contiguous()
    outs = pinned_objects(layout, spans)
    move = Move.gather(layout, slots, spans, outs)
    dispatch.gather(kv, move)
    view, pages = block_pages.as_pages(kv, move)
    picked = pages.prepared[id(view)]
    assert isinstance(picked[2], copy_engine.CopyMove)
    nat = launch.native_copies()
    assert picked[2].batched == copy_engine.batches_supported(nat)
    want = [torch.empty(o.shape, dtype=o.dtype, device=DEV) for o in outs]
    reference.gather(kv, Move.gather(layout, slots.to(DEV), spans, want))
    for w, o in zip(want, outs, strict=True):
        assert not sentinel_left(o)
        assert torch.equal(bits(w.cpu()), bits(o))
    _, dst, dst_rows = blnhc(3, gap)
    _, ref, ref_rows = blnhc(3, gap)
    holes = slots.clone()
    holes[208:224] = -1  # one block not on the GPU
    skips = [BS] + [0] * (len(spans) - 1)
    s_move = Move.scatter(layout, holes, spans, outs, skips)
    written = dispatch.scatter(dst, s_move)
    s_view, s_pages = block_pages.as_pages(dst, s_move)
    assert isinstance(s_pages.prepared[id(s_view)][2], copy_engine.CopyMove)
    assert written == reference.scatter(ref, Move.scatter(layout, holes.to(DEV), spans, outs, skips))
    assert written == n - BS - BS
    assert torch.equal(bits(dst_rows), bits(ref_rows))
