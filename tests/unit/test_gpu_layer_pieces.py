"""The layer-piece cut and its 2D copies (``tiercache.gpu.layer_pieces``), on the CPU: copying each piece's
rows as the ``PieceCopy`` says, between an object and contiguous per-piece staging, rebuilds the object both
ways, byte for byte. The GPU path that issues those copies is tested in tests/gpu."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.gpu.layer_pieces import LEAD_DIVISOR, PieceCopy, piece_copies, piece_layers


@given(layers=st.integers(1, 80), pieces=st.integers(1, 9), lead_last=st.booleans())
def test_pieces_cover_the_layers_in_order(layers: int, pieces: int, lead_last: bool) -> None:
    cuts = piece_layers(layers, pieces, lead_last=lead_last)
    assert len(cuts) == min(layers, pieces)
    assert [i for c in cuts for i in c] == list(range(layers))
    sizes = [len(c) for c in cuts]
    assert min(sizes) >= 1
    if len(cuts) > 1:  # a short lead piece, first or last; the rest even, the longer ones first
        lead, rest = (sizes[-1], sizes[:-1]) if lead_last else (sizes[0], sizes[1:])
        assert lead == min(max(1, layers // LEAD_DIVISOR), layers - len(rest))
        assert max(rest) - min(rest) <= 1
        assert rest == sorted(rest, reverse=True)


@given(layers=st.integers(1, 80), pieces=st.integers(1, 9), most=st.integers(0, 40), lead_last=st.booleans())
def test_bounded_pieces_hold_at_most_most_layers(
    layers: int, pieces: int, most: int, lead_last: bool
) -> None:
    """With a bound (the layers a staging buffer holds), every piece holds at most ``most`` layers (at least
    one), and no more pieces are cut than the bound and ``pieces`` need."""
    cuts = piece_layers(layers, pieces, lead_last=lead_last, most=most)
    assert [i for c in cuts for i in c] == list(range(layers))
    sizes = [len(c) for c in cuts]
    cap = max(1, most)
    assert min(sizes) >= 1
    assert max(sizes) <= cap
    want = min(pieces, layers)
    if len(cuts) == 1:
        assert want == 1
        assert layers <= cap
        return
    lead, rest = (sizes[-1], sizes[:-1]) if lead_last else (sizes[0], sizes[1:])
    assert lead == min(max(1, layers // LEAD_DIVISOR), cap, layers - max(1, want - 1))
    assert len(rest) == max(want - 1, -(-(layers - lead) // cap))  # as few as the bound allows
    assert max(rest) - min(rest) <= 1
    assert rest == sorted(rest, reverse=True)


def test_a_512_mib_move_is_cut_to_fit_64_mib_buffers() -> None:
    """32 layers of 16 MiB (4096 tokens of a Llama-8B shape) in 64 MiB staging buffers: 4 layers a piece."""
    assert piece_layers(32, 2, most=4) == [range(4 * i, 4 * i + 4) for i in range(8)]
    assert piece_layers(32, 2, most=16) == [range(0, 4), range(4, 18), range(18, 32)]
    assert piece_layers(32, 2, lead_last=True, most=28) == [range(0, 28), range(28, 32)]


def test_the_lead_piece_of_32_layers_is_4() -> None:
    assert piece_layers(32, 2) == [range(0, 4), range(4, 32)]
    assert piece_layers(32, 2, lead_last=True) == [range(0, 28), range(28, 32)]
    assert piece_layers(32, 1) == [range(32)]


def _apply(obj: bytearray, staging: bytearray, pc: PieceCopy, to_host: bool) -> None:
    for r in range(pc.height):
        h = pc.host_offset + r * pc.host_pitch
        s = r * pc.width
        if to_host:
            obj[h : h + pc.width] = staging[s : s + pc.width]
        else:
            staging[s : s + pc.width] = obj[h : h + pc.width]


@settings(max_examples=150)
@given(
    planes=st.sampled_from([(), (2,)]),
    layers=st.integers(1, 12),
    tokens=st.integers(1, 9),
    width=st.integers(1, 7),
    itemsize=st.sampled_from([1, 2, 4]),
    pieces=st.integers(1, 5),
    seed=st.integers(0, 2**31),
)
def test_piece_copies_move_exactly_the_piece(
    planes: tuple[int, ...], layers: int, tokens: int, width: int, itemsize: int, pieces: int, seed: int
) -> None:
    shape = (*planes, layers, tokens, width)
    obj = np.random.default_rng(seed).integers(0, 256, size=(*shape, itemsize), dtype=np.uint8)
    src = bytearray(obj.tobytes())
    rebuilt = bytearray(len(src))
    for cut in piece_layers(layers, pieces, lead_last=seed % 2 == 1):
        pc = piece_copies(shape, itemsize, cut)
        # the staging of this piece: the object's layers ``cut``, contiguous
        want = np.ascontiguousarray(obj[..., cut.start : cut.stop, :, :, :]).tobytes()
        staging = bytearray(len(want))
        _apply(src, staging, pc, to_host=False)
        assert bytes(staging) == want
        _apply(rebuilt, staging, pc, to_host=True)
    assert rebuilt == src


def test_a_piece_outside_the_object_is_refused() -> None:
    with pytest.raises(ValueError, match="out of range"):
        piece_copies((2, 4, 8, 16), 2, range(3, 5))
    with pytest.raises(ValueError, match="out of range"):
        piece_copies((4, 8, 16), 2, range(2, 2))
