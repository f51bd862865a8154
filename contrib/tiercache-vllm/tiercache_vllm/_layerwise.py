"""Layerwise loads, pipelined per layer: the background loop writes one layer after another into vLLM's paged
KV while the forward pass runs, and each attention layer waits only for its own layer.

:class:`LayerProgress` is shared by the loop thread (the writer: ``written`` after each layer, ``end`` when
the load stops for any reason) and the forward thread (``wait``). Each written layer carries a fence after its
moves on the mover stream (``tiercache.gpu.streams``), and ``wait`` makes the forward's stream hold it, so the
attention kernel never reads a layer before its copy has run on the device.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tiercache.gpu.streams import Fence, MoverStream
    from tiercache.keys import BlockHashes, RequestIdentity
    from tiercache.store.engine import CacheEngine, LookupResult, RetrieveResult

__all__ = ["LayerProgress", "load_layers"]


class LayerProgress:
    """How many layers of one load are in the paged KV (in layer order), and whether the load has ended."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._fences: list[Fence] = []  # one per written layer
        self._ended = False

    @property
    def layers_written(self) -> int:
        with self._cond:
            return len(self._fences)

    def written(self, fence: Fence) -> None:
        """The next layer is written (``fence``: after its moves)."""
        with self._cond:
            self._fences.append(fence)
            self._cond.notify_all()

    def end(self) -> None:
        """The load stopped (done, failed or cancelled): no more layers will be written."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait(self, layer: int, timeout: float) -> bool:
        """Wait until ``layer`` is written (True); False: the load ended without it or ``timeout`` passed."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._fences) > layer or self._ended, max(0.0, timeout))
            if len(self._fences) <= layer:
                return False
            fence = self._fences[layer]
        fence.hold()
        return True


async def load_layers(
    engine: CacheEngine,
    token_ids: list[int],
    kv_caches: dict[str, torch.Tensor],
    slots: torch.Tensor,
    progress: LayerProgress,
    mover: MoverStream,
    *,
    skip_tokens: int,
    lookup: LookupResult | None = None,
    identity: RequestIdentity | None = None,
    block_hashes: BlockHashes | None = None,
) -> RetrieveResult:
    """Lease the cached prefix, then write it into ``kv_caches`` one layer at a time, reporting each to
    ``progress`` with a fence on ``mover`` (the stream the moves run on) and yielding to the loop in between;
    the result is ``PreparedRetrieve.finish()``'s.
    ``lookup``: the scheduler's lookup of the same tokens in this engine, reused (``prepare_retrieve``)."""
    try:
        prepared = await engine.prepare_retrieve(
            token_ids, skip_tokens=skip_tokens, identity=identity, block_hashes=block_hashes, lookup=lookup
        )
        try:
            for layer in range(engine.layout.num_layers):
                prepared.scatter_layer(layer, kv_caches, slots)
                progress.written(mover.moves_fence())
                await asyncio.sleep(0)  # saves and a cancel get their turn between layers
        finally:
            result = prepared.finish()
        return result
    finally:
        progress.end()
