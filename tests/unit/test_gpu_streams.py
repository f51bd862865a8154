"""``tiercache.gpu.streams`` off CUDA: no stream, every fence already reached (its wait ends without yielding
to the event loop) and holding nothing (the vLLM connector takes and waits for fences on every step, CPU KV
included)."""

from __future__ import annotations

import pytest
import torch

from tiercache.gpu.streams import Fence, MoverStream, mover_stream


def test_off_cuda_the_mover_has_no_stream_and_its_fences_are_reached() -> None:
    for mover in (MoverStream(), MoverStream(torch.device("cpu")), mover_stream(torch.device("cpu"))):
        assert mover.stream is None
        mover.use_on_this_thread()
        for fence in (mover.caller_fence(), mover.moves_fence(), Fence()):
            assert fence.event is None
            fence.hold()
            with pytest.raises(StopIteration):
                fence.reached().send(None)  # done at its first step: nothing to wait for
