"""Layerwise loads, pipelined per layer: the background loop writes one layer after another into vLLM's paged
KV while the forward pass runs, and each attention layer waits only for its own layer.

:class:`LayerProgress` is shared by the loop thread (the writer: ``written`` after each layer, ``end`` when
the load stops for any reason) and the forward thread (``wait``). On CUDA each written layer carries an event
recorded on the writer's stream, and ``wait`` makes the forward's stream wait on it, so the attention kernel
never reads a layer before its copy has run on the device.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tiercache.keys import BlockHashes, RequestIdentity
    from tiercache.store.engine import CacheEngine, LookupResult, RetrieveResult

__all__ = ["LayerProgress", "load_layers"]


class LayerProgress:
    """How many layers of one load are in the paged KV (in layer order), and whether the load has ended."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._events: list[Any] = []  # one per written layer: a CUDA event, or None on CPU
        self._ended = False

    @property
    def layers_written(self) -> int:
        with self._cond:
            return len(self._events)

    def written(self, event: Any = None) -> None:
        """The next layer is written (``event``: its CUDA copy's completion event)."""
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def end(self) -> None:
        """The load stopped (done, failed or cancelled): no more layers will be written."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait(self, layer: int, timeout: float) -> bool:
        """Wait until ``layer`` is written (True); False: the load ended without it or ``timeout`` passed."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._events) > layer or self._ended, max(0.0, timeout))
            if len(self._events) <= layer:
                return False
            event = self._events[layer]
        if event is not None:
            import torch

            torch.cuda.current_stream(event.device).wait_event(event)
        return True


def _copy_event(kv_caches: dict[str, torch.Tensor]) -> Any:
    """A CUDA event after the layer's copy on the writer's stream; None for CPU tensors."""
    first = next(iter(kv_caches.values()))
    if first.device.type != "cuda":
        return None
    import torch

    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(first.device))
    return event


async def load_layers(
    engine: CacheEngine,
    token_ids: list[int],
    kv_caches: dict[str, torch.Tensor],
    slots: torch.Tensor,
    progress: LayerProgress,
    *,
    skip_tokens: int,
    lookup: LookupResult | None = None,
    identity: RequestIdentity | None = None,
    block_hashes: BlockHashes | None = None,
) -> RetrieveResult:
    """Lease the cached prefix, then write it into ``kv_caches`` one layer at a time (reporting each to
    ``progress``, yielding to the loop in between); the result is ``PreparedRetrieve.finish()``'s.
    ``lookup``: the scheduler's lookup of the same tokens in this engine, reused (``prepare_retrieve``)."""
    try:
        prepared = await engine.prepare_retrieve(
            token_ids, skip_tokens=skip_tokens, identity=identity, block_hashes=block_hashes, lookup=lookup
        )
        try:
            for layer in range(engine.layout.num_layers):
                prepared.scatter_layer(layer, kv_caches, slots)
                progress.written(_copy_event(kv_caches))
                await asyncio.sleep(0)  # saves and a cancel get their turn between layers
        finally:
            result = prepared.finish()
        return result
    finally:
        progress.end()
