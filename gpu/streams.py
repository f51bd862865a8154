# mypy: disable-error-code="no-untyped-call"
"""The stream a process's cache moves run on, and their order against the stream of the model they serve.

An inference engine runs its forward pass on a stream of its own (vLLM makes a non-blocking stream per
process: it shares no implicit order with any other stream, the legacy default stream included), while the
cache's moves are issued from another thread. Nothing orders the two unless the caller does, so a save could
read KV its forward has not written yet, and a forward could read blocks before a load's last kernel wrote
them. ``MoverStream`` holds one non-blocking stream for the moves (``use_on_this_thread`` makes it the
current stream of the thread that issues them; every path of ``tiercache.gpu.dispatch`` runs on the
current stream, and its side streams start after it) and the two fences, called from the model's thread:

- ``after_caller``: moves issued from now on start after the work the calling thread's current stream holds
  now (a save reads the KV of the forward just enqueued; a load writes blocks no earlier forward still uses);
- ``before_caller``: the calling thread's later work starts after the moves issued so far (the next forward
  reads a load's KV only once it is written, a failed load's too before vLLM recomputes those blocks).

Each fence is one event recorded and waited for on the device; the host never waits. For KV off CUDA every
call does nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["MoverStream"]


class MoverStream:
    """A non-blocking stream on ``device`` for the cache's moves, and its fences against the caller's stream
    (see the module docstring); inert when ``device`` is None or not a CUDA device."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
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

    def after_caller(self) -> None:
        """Moves issued from now on start after the work queued on the calling thread's current stream."""
        if self.stream is not None:
            import torch

            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def before_caller(self) -> None:
        """The calling thread's later work on its current stream starts after the moves issued so far."""
        if self.stream is not None:
            import torch

            torch.cuda.current_stream(self.device).wait_stream(self.stream)
