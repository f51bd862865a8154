"""Move: one validated gather or scatter, passed as one value to the reference and the dispatch."""

from __future__ import annotations

import pytest
import torch

from tiercache.gpu import Checks, LayoutKind, Move, PagedLayout, dispatch, object_spec, reference

L, H, D, BS, NB = 3, 2, 8, 4, 10
LAYOUT = PagedLayout(LayoutKind.VLLM_FLASH, L, H, D, BS, "bfloat16")


def engine(seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv = [torch.randn(LAYOUT.layer_shape(NB), generator=gen).add_(3).bfloat16() for _ in range(L)]
    table = torch.randperm(NB, generator=gen)[:6]
    pos = torch.arange(20)
    return kv, table[pos // BS] * BS + pos % BS


def objects(spans: list[tuple[int, int]], layers: range | None = None) -> list[torch.Tensor]:
    out = []
    for s, e in spans:
        spec = object_spec(LAYOUT, e - s)
        if layers is not None:
            spec = spec.with_layers(layers.start, layers.stop)
        out.append(torch.full(spec.shape, -1.0, dtype=torch.bfloat16))
    return out


def test_build_validates_once_and_says_what_is_wrong() -> None:
    _, slots = engine(1)
    spans = [(0, 8), (8, 20)]
    with pytest.raises(ValueError, match=r"out\[1\] has shape"):
        Move.gather(LAYOUT, slots, spans, [objects(spans)[0], objects([(0, 8)])[0]])
    with pytest.raises(ValueError, match="dtype"):
        Move.gather(LAYOUT, slots, spans, [o.float() for o in objects(spans)])
    with pytest.raises(ValueError, match="layers"):
        Move.gather(LAYOUT, slots, spans, objects(spans), layers=range(2, 5))
    with pytest.raises(ValueError, match="span"):
        Move.scatter(LAYOUT, slots, [(0, 8), (8, 30)], objects([(0, 8), (8, 20)]))
    with pytest.raises(ValueError, match="host_slots"):
        Move.gather(LAYOUT, slots, spans, objects(spans), host_slots=slots[:-1])
    with pytest.raises(ValueError, match="skip"):
        Move.scatter(LAYOUT, slots, spans, objects(spans), [1, 2, 3])


def test_fields_checks_and_counts() -> None:
    _, slots = engine(2)
    spans = [(0, 8), (8, 20)]
    g = Move.gather(LAYOUT, slots, spans, objects(spans))
    s = Move.scatter(LAYOUT, slots, spans, objects(spans), [3, 12], trusted=True)
    assert (g.is_scatter, s.is_scatter) == (False, True)
    assert g.span_skips == (0, 0)
    assert s.span_skips == (3, 12)
    assert (g.tokens_past_skips, s.tokens_past_skips) == (20, 5)
    assert g.checks is Checks.HOST  # a CPU slot mapping is checked where it lives
    assert s.checks is Checks.NONE
    assert g.layers == range(L)
    assert g.spans == ((0, 8), (8, 20))
    assert repr(g).startswith("Move.gather")
    assert repr(s).startswith("Move.scatter")
    with pytest.raises(ValueError, match="is a scatter"):
        dispatch.gather([], s)
    with pytest.raises(ValueError, match="is a gather"):
        reference.scatter([], g)


def test_a_move_run_again_reads_the_slot_values_of_each_run() -> None:
    """The move keeps the slot-mapping tensor, not its values: changed in place, the next run moves the new
    tokens; a slot made bad is refused."""
    kv, slots = engine(3)
    spans = [(0, 8), (8, 20)]
    out = objects(spans)
    move = Move.gather(LAYOUT, slots, spans, out)
    dispatch.gather(kv, move)
    first = [o.clone() for o in out]
    original = slots.clone()
    slots.copy_(original.flip(0))
    dispatch.gather(kv, move)
    want = objects(spans)
    reference.gather(kv, Move.gather(LAYOUT, slots, spans, want))
    assert all(torch.equal(a, b) for a, b in zip(want, out, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, out, strict=True))
    slots[4] = -1
    with pytest.raises(ValueError, match="slots < 0"):
        dispatch.gather(kv, move)


def test_one_layer_moves_and_scatter_counts() -> None:
    kv, slots = engine(4)
    spans = [(0, 8), (8, 20)]
    full = objects(spans)
    reference.gather(kv, Move.gather(LAYOUT, slots, spans, full))
    one = objects(spans, range(1, 2))
    dispatch.gather(kv, Move.gather(LAYOUT, slots, spans, one, layers=range(1, 2)))
    assert all(torch.equal(o, f[:, 1:2]) for o, f in zip(one, full, strict=True))
    dst, _ = engine(5)
    other = slots.clone()
    other[10] = -1
    written = dispatch.scatter(dst, Move.scatter(LAYOUT, other, spans, one, [2, 0], layers=range(1, 2)))
    assert written == 20 - 2 - 1
    back = objects(spans, range(1, 2))
    reference.gather(dst, Move.gather(LAYOUT, slots, [(0, 8)], back[:1], layers=range(1, 2)))
    assert torch.equal(back[0][:, :, 2:], one[0][:, :, 2:])


def payloads(spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    from tiercache.gpu import fp8_payload_nbytes

    return [torch.full((fp8_payload_nbytes(LAYOUT, e - s),), 255, dtype=torch.uint8) for s, e in spans]


def test_fp8_moves_validate_payloads_once_and_run_through_gather_and_scatter() -> None:
    """An fp8 move checks its payloads (contiguous uint8 of the payload size) and the layout's dtype when
    built; ``dispatch.gather`` / ``dispatch.scatter`` run it (the reference here): a round trip within fp8
    error that leaves the skipped tokens alone and counts what it wrote."""
    kv, slots = engine(5)
    spans = [(0, 8), (8, 20)]
    good = payloads(spans)
    with pytest.raises(ValueError, match=r"payloads\[1\] must be a contiguous uint8 tensor"):
        Move.gather_fp8(LAYOUT, slots, spans, [good[0], good[1][:-1]])
    with pytest.raises(ValueError, match=r"payloads\[0\] must be"):
        Move.scatter_fp8(LAYOUT, slots, spans, [good[0].view(torch.int8), good[1]])
    with pytest.raises(ValueError, match=r"payloads\[0\] must be"):
        Move.gather_fp8(
            LAYOUT, slots, spans, [torch.empty(2 * good[0].numel(), dtype=torch.uint8)[::2], good[1]]
        )
    int8 = PagedLayout(LayoutKind.VLLM_FLASH, L, H, D, BS, "int8")
    with pytest.raises(ValueError, match="fp8 moves encode"):
        Move.gather_fp8(int8, slots, spans, good)
    with pytest.raises(ValueError, match="skip"):
        Move.scatter_fp8(LAYOUT, slots, spans, good, [1, 2, 3])
    g = Move.gather_fp8(LAYOUT, slots, spans, good, trusted=True)
    s = Move.scatter_fp8(LAYOUT, slots, spans, good, [3, 0])
    assert (g.fp8, g.is_scatter, g.checks, s.fp8, s.is_scatter) == (True, False, Checks.NONE, True, True)
    assert repr(g).startswith("Move.gather_fp8(2 spans")
    with pytest.raises(ValueError, match="is a gather"):
        dispatch.scatter(kv, g)
    dispatch.gather(kv, g)
    assert all(bool((p != 255).any()) for p in good)  # filled
    dst = [torch.full_like(t, float("nan")) for t in kv]
    assert dispatch.scatter(dst, s) == 20 - 3
    back, want = objects(spans), objects(spans)
    reference.gather(kv, Move.gather(LAYOUT, slots, spans, want))
    head = objects([(0, 3)])
    reference.gather(dst, Move.gather(LAYOUT, slots, [(0, 3)], head))
    assert bool(head[0].isnan().all())  # the skipped tokens were not written
    reference.gather(dst, Move.gather(LAYOUT, slots, [(8, 20)], back[1:]))
    err = (back[1].float() - want[1].float()).norm() / want[1].float().norm()
    assert float(err) < 0.05
    fresh = payloads(spans)
    reference.gather(kv, Move.gather_fp8(LAYOUT, slots, spans, fresh))
    assert all(torch.equal(a, b) for a, b in zip(good, fresh, strict=True))  # the reference's bytes
