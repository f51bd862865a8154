"""copy_bytes: exact copies, and large ones (the raw codec's frame copies) let other threads run meanwhile."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.buffers import GIL_FREE_COPY_BYTES, copy_bytes
from tiercache.serde._codec import CodecContext
from tiercache.serde.raw import RawCodec
from tiercache.spec import KVSpec


@settings(max_examples=30, deadline=None)
@given(
    size=st.sampled_from([0, 1, 4095, GIL_FREE_COPY_BYTES - 1, GIL_FREE_COPY_BYTES, GIL_FREE_COPY_BYTES + 7]),
    seed=st.integers(0, 255),
)
def test_copy_is_exact_on_both_sides_of_the_threshold(size: int, seed: int) -> None:
    src = bytes((seed + i * 31) & 0xFF for i in range(min(size, 4096))) * (size // 4096 + 1)
    src = src[:size]
    dst = bytearray(size + 2)  # guard bytes on both sides stay untouched
    copy_bytes(memoryview(dst)[1 : 1 + size], memoryview(src))
    assert dst[1 : 1 + size] == src
    assert dst[0] == 0
    assert dst[-1] == 0


def test_lengths_must_match() -> None:
    with pytest.raises(ValueError, match="copy of 3 bytes into 2"):
        copy_bytes(memoryview(bytearray(2)), memoryview(b"abc"))


def test_a_large_raw_encode_releases_the_gil_while_it_copies() -> None:
    """The main thread sees the destination half written while a codec thread copies into it: it ran during
    the copy. A slice assignment holds the GIL for the whole copy, so that state is never seen (the old raw
    codec stalled the event loop for every 32 MiB frame)."""
    size = 16 << 20
    spec = KVSpec(1, 1, size // 2, "bfloat16", tokens=1)
    codec, ctx = RawCodec(), CodecContext("k", b"")
    sources = [memoryview(bytes([v]) * size) for v in (0x11, 0x22)]
    dst = memoryview(bytearray(size))
    stop = threading.Event()

    def copies() -> None:
        for i in range(400):  # bounded: the main thread stops it as soon as it saw a copy in progress
            if stop.is_set():
                return
            codec.encode_into(sources[i % 2], dst, spec, ctx)

    worker = threading.Thread(target=copies)
    worker.start()
    seen_mid_copy = False
    try:
        while worker.is_alive() and not seen_mid_copy:
            seen_mid_copy = dst[0] != dst[size - 1]  # one end already holds the new byte, the other the old
    finally:
        stop.set()
        worker.join()
    assert seen_mid_copy
