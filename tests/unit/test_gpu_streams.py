"""``tiercache.gpu.streams`` off CUDA: no stream, every fence already reached and holding nothing (the vLLM
connector takes and waits for fences on every step, CPU KV included)."""

from __future__ import annotations

import asyncio

import torch

from tiercache.gpu.streams import Fence, MoverStream, mover_stream


async def all_reached(fences: list[Fence]) -> None:
    await asyncio.wait_for(asyncio.gather(*(f.reached() for f in fences)), timeout=5)


def test_off_cuda_the_mover_has_no_stream_and_its_fences_are_reached() -> None:
    for mover in (MoverStream(), MoverStream(torch.device("cpu")), mover_stream(torch.device("cpu"))):
        assert mover.stream is None
        mover.use_on_this_thread()
        fences = [mover.caller_fence(), mover.moves_fence(), Fence()]
        for fence in fences:
            assert fence.event is None
            fence.hold()
        asyncio.run(all_reached(fences))
