"""Fuzzing the frame parser and pipeline decode (short run; the long run is ``make fuzz``): a changed frame
is rejected with FrameError, never decoded to other bytes, never another exception."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache.testing.harness import fuzz

FRAMES = fuzz.FrameFuzz()
CASES = len(FRAMES.cases)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

edits = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=4)


def _apply(frame: bytes, changes: list[tuple[int, int]], cut: int | None, tail: bytes) -> bytes:
    data = bytearray(frame)
    for pos, value in changes:
        data[pos % len(data)] = value
    if cut is not None:
        del data[cut % (len(data) + 1) :]
    return bytes(data + tail)


@SETTINGS
@given(st.integers(0, CASES - 1), edits, st.none() | st.integers(0, 1 << 20), st.binary(max_size=8))
def test_a_changed_frame_is_rejected(case: int, changes: list[tuple[int, int]], cut: int | None,
                                     tail: bytes) -> None:  # fmt: skip
    frame = FRAMES.cases[case][3]
    data = _apply(frame, changes, cut, tail)
    outcome = FRAMES.check_frame(case, data)  # AssertionError if it decodes to other bytes
    assert outcome == ("same" if data == frame else "rejected")


@SETTINGS
@given(st.integers(0, CASES - 1), st.randoms(use_true_random=False))
def test_mutated_frames_never_decode_to_other_bytes(case: int, rng: object) -> None:
    frame = FRAMES.cases[case][3]
    data = FRAMES.mutate(rng, frame)
    assert FRAMES.check_frame(case, data) == ("same" if data == frame else "rejected")


@SETTINGS
@given(st.binary(max_size=256))
def test_read_header_of_random_bytes_is_a_header_or_frame_error(data: bytes) -> None:
    assert FRAMES.check_header(data) in ("rejected", "header")


@pytest.mark.parametrize("case", range(CASES))
def test_frames_do_not_decode_under_another_key_or_aes_key(case: int) -> None:
    FRAMES.check_isolation(case)
    assert FRAMES.check_frame(case, FRAMES.cases[case][3]) == "same"  # the oracle itself accepts the original


def test_short_fuzz_loop_has_no_findings() -> None:
    result = fuzz.run_target("frames", 3000, seed=1)
    assert result["findings"] == []
    assert (
        result["outcomes"]["rejected"]
        + result["outcomes"].get("unchanged", 0)
        + result["outcomes"].get("isolated", 0)
        + result["outcomes"].get("same", 0)
        == 3000
    )
