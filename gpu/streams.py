# mypy: disable-error-code="no-untyped-call"
"""The stream a process's cache moves run on, and fences that order them against the model they serve.

An inference engine queues its forward pass on its thread's current stream (vLLM: a non-blocking stream of
torch's pool when a model spans several GPUs, the legacy default stream otherwise), while the cache's moves
are issued from another thread. Nothing orders the two unless the caller does: a save could read KV its
forward has not written yet, a forward could read blocks before a load's last kernel wrote them, a load could
write blocks the engine is still clearing. Every path of ``tiercache.gpu.dispatch`` runs on the current stream
(its side streams start after it), so ``mover_stream(device)`` gives the process one non-blocking stream per
device for them (``use_on_this_thread`` on the moves' thread), and ``Fence`` marks a point in a stream's
queued work (an event recorded there):

- ``mover.caller_fence()`` on the model's thread, then ``await fence.reached()`` in the job before its moves:
  they read / write only after the work queued before the fence is done, and the job waits without blocking
  its event loop (the wait runs in a worker thread);
- ``mover.moves_fence()`` on the moves' thread after a job's last move, then ``fence.hold()`` on the model's
  thread: its later work waits on the device for that job's moves alone; the host never waits.

Off CUDA every fence is already reached and holds nothing. Never take a fence while a CUDA graph is being
captured on the stream it is recorded on or held by: an event would join the capture.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Fence", "MoverStream", "mover_stream"]


class Fence:
    """A point in one stream's queued work (``event`` recorded there; None: nothing to wait for)."""

    __slots__ = ("event",)

    def __init__(self, event: Any = None) -> None:
        self.event = event

    async def reached(self) -> None:
        """Return once the device has done the work queued before the fence; the event loop keeps running."""
        if self.event is not None and not self.event.query():
            await asyncio.to_thread(self.event.synchronize)

    def hold(self) -> None:
        """Make the calling thread's current stream wait (on the device) until the fence is reached."""
        if self.event is not None:
            import torch

            torch.cuda.current_stream(self.event.device).wait_event(self.event)


class MoverStream:
    """A non-blocking stream on ``device`` for the cache's moves and the fences around them (see the module
    docstring); inert when ``device`` is None or not a CUDA device. Share one per device: ``mover_stream``."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.stream: Any = None
        if device is not None and device.type == "cuda":
            import torch

            self.stream = torch.cuda.Stream(device)  # from torch's pool: non-blocking

    def use_on_this_thread(self) -> None:
        """Make the stream the calling thread's current stream on its device (call it on the moves'
        thread)."""
        if self.stream is not None:
            import torch

            torch.cuda.set_stream(self.stream)

    def caller_fence(self) -> Fence:
        """A fence after the work queued on the calling thread's current stream (the model's, when the model's
        thread calls it)."""
        if self.stream is None:
            return Fence()
        import torch

        return self._fence_on(torch.cuda.current_stream(self.stream.device))

    def moves_fence(self) -> Fence:
        """A fence after the moves issued on this stream so far."""
        return Fence() if self.stream is None else self._fence_on(self.stream)

    @staticmethod
    def _fence_on(stream: Any) -> Fence:
        """A fence after the work queued on ``stream`` so far."""
        import torch

        event = torch.cuda.Event()
        event.record(stream)
        return Fence(event)


_MOVERS: dict[tuple[int, int], MoverStream] = {}  # (pid, CUDA device index): a forked child makes its own


def mover_stream(device: torch.device | None) -> MoverStream:
    """The process's ``MoverStream`` for ``device`` (one per device, so that every user of a thread that
    issues moves fences the stream they run on); inert off CUDA."""
    if device is None or device.type != "cuda":
        return MoverStream()
    import torch

    index: int | None = device.index
    if index is None:  # "cuda": the current device
        index = torch.cuda.current_device()
    key = (os.getpid(), index)
    mover = _MOVERS.get(key)
    if mover is None:
        mover = _MOVERS[key] = MoverStream(torch.device("cuda", index))
    return mover
