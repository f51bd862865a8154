"""Receive buffers are reused only once nothing references them (adapters/_recvbuf.py)."""

from __future__ import annotations

import numpy as np
import torch

from tiercache.adapters._recvbuf import RecvBuffers

MiB = 1 << 20


def test_a_block_is_reused_only_when_every_view_is_gone() -> None:
    pool = RecvBuffers(min_bytes=MiB)
    first = pool.take(2 * MiB)
    first[:4] = b"keep"
    second = pool.take(2 * MiB)  # first is still held: a new block
    assert pool.reused == 0
    second[:4] = b"over"
    assert bytes(first[:4]) == b"keep"
    del second
    third = pool.take(2 * MiB)
    assert pool.reused == 1
    third[:4] = b"next"
    assert bytes(first[:4]) == b"keep"


def test_slices_arrays_and_tensors_keep_their_block() -> None:
    pool = RecvBuffers(min_bytes=MiB)
    for make in (
        lambda v: v[10:20],
        lambda v: np.frombuffer(v, dtype=np.uint8)[5:],
        lambda v: torch.frombuffer(v, dtype=torch.uint8),
    ):
        view = pool.take(MiB)
        view[:3] = b"abc"
        held = make(view)
        del view
        other = pool.take(MiB)
        other[:3] = b"xyz"
        assert pool.reused == 0, "a block with a live derived object was handed out again"
        del held, other
        pool = RecvBuffers(min_bytes=MiB)


def test_sizes_and_bounds() -> None:
    pool = RecvBuffers(min_bytes=MiB, max_blocks=2, max_bytes=8 * MiB)
    small = pool.take(MiB - 1)
    assert small.nbytes == MiB - 1
    del small
    pool.take(MiB - 1)
    assert pool.reused == 0  # under min_bytes: never kept
    for _ in range(3):
        pool.take(MiB)  # dropped at once: the same block each time
    assert pool.reused == 2
    pool.take(3 * MiB)
    assert pool.take(MiB).nbytes == MiB  # another size: its own block
    assert len(pool._blocks) <= 2
    pool.take(7 * MiB)
    assert sum(b.nbytes for b in pool._blocks) <= 8 * MiB
