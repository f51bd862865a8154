"""``MoverStream`` off CUDA: no stream, and its fences and ``use_on_this_thread`` do nothing (the vLLM
connector calls them on every step, CPU KV included)."""

from __future__ import annotations

import torch

from tiercache.gpu.streams import MoverStream


def test_off_cuda_the_mover_has_no_stream_and_its_calls_do_nothing() -> None:
    for mover in (MoverStream(), MoverStream(torch.device("cpu"))):
        assert mover.stream is None
        mover.use_on_this_thread()
        mover.after_caller()
        mover.before_caller()
        assert mover.stream is None
