"""Worker side of the connector: restore cached chunks into vLLM's paged KV, save computed chunks from it.

Runs in each vLLM worker. All tiercache work runs on the process's background loop; the sync vLLM hooks
submit it and (for synchronous loads) wait with a deadline. A load that fails, times out or returns fewer
tokens than planned reports the affected blocks through ``get_block_ids_with_load_errors`` so vLLM
recomputes them (``kv_load_failure_policy="recompute"``); garbage is never used. Saves are asynchronous:
the scheduler delays a finished request's block free until ``get_finished`` reports its saves done, and
preempted requests' saves are flushed in ``handle_preemptions`` before their blocks can be reused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiercache_vllm import _loop
from tiercache_vllm._common import (
    ConnectorSettings,
    LoadOp,
    SaveOp,
    TierCacheMetadata,
    forget_engine,
    identity,
    layout_from_vllm,
    open_engine,
    slot_mapping,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from tiercache.config import Config
    from tiercache.engine import CacheEngine, RetrieveResult
    from tiercache.gpu.layouts import PagedLayout

__all__ = ["WorkerSide"]

logger = logging.getLogger("tiercache_vllm")


@dataclass(slots=True)
class _PendingLoad:
    op: LoadOp
    slots: torch.Tensor
    future: concurrent.futures.Future[RetrieveResult]


@dataclass(slots=True)
class _WorkerStats:
    loads: int = 0
    load_failures: int = 0
    tokens_loaded: int = 0
    invalid_blocks: int = 0
    saves: int = 0
    save_failures: int = 0
    tokens_saved: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class WorkerSide:
    """The worker half of ``TierCacheConnector`` (one per vLLM worker)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None,
        settings: ConnectorSettings,
        config: Config,
        *,
        can_load: bool,
        can_save: bool,
    ) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.settings = settings
        self.config = config
        self.can_load = can_load
        self.can_save = can_save
        self.block_size = int(vllm_config.cache_config.block_size)
        self.engine: CacheEngine | None = None
        self.layout: PagedLayout | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._sync_loads: list[_PendingLoad] = []
        self._async_loads: dict[str, _PendingLoad] = {}
        self._abandoned: list[concurrent.futures.Future[Any]] = []
        self._saving: dict[str, list[concurrent.futures.Future[Any]]] = {}
        self._finishing: set[str] = set()
        self._invalid: set[int] = set()
        self._layer_saves: list[tuple[str, AsyncIterator[int], list[concurrent.futures.Future[Any]]]] = []
        self.stats = _WorkerStats()

    # ----- setup ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Detect the layout from the tensors (checked against vLLM's config) and open the engine."""
        from tiercache.gpu.layouts import detect_layout

        self.kv_caches = dict(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(self.kv_caches)}
        expected = layout_from_vllm(self.vllm_config, self.kv_cache_config)
        try:
            layout = detect_layout(
                self.kv_caches,
                self.block_size,
                kind=expected.kind,
                num_kv_heads=expected.num_kv_heads,
                head_dim=expected.head_dim,
            )
        except ValueError:
            logger.exception("tiercache: unexpected KV cache tensors; the connector is disabled")
            return
        if layout != expected:
            logger.error("tiercache: detected layout %s != configured %s; disabled", layout, expected)
            return
        self.layout = layout
        rank: int | str = "shared" if layout.object_format.name == "KV_MLA" else _tp_rank()
        ident = identity(self.vllm_config, self.settings, layout, rank)
        try:
            self.engine = open_engine(ident, self.config, self.settings.open_timeout_s, register=True)
        except Exception:
            logger.exception("tiercache: opening the tiers failed; the connector is disabled (all misses)")
            self.engine = None

    # ----- loads ---------------------------------------------------------------------------------
    def _settle_abandoned(self) -> None:
        """Wait for timed-out loads still running, so none writes into blocks after vLLM reuses them."""
        for future in self._abandoned:
            with contextlib.suppress(BaseException):  # cancelled or failed: either way it has stopped
                future.result(self.settings.load_timeout_s)
        self._abandoned.clear()

    def start_load_kv(self, meta: TierCacheMetadata) -> None:
        """Start this step's loads; synchronous ones finish here (or, layerwise, before the first layer)."""
        self._settle_abandoned()
        for op in meta.loads:
            slots = slot_mapping(op.block_ids, len(op.token_ids), self.block_size)
            if self.engine is None or not self.can_load:
                self._record(op, slots, None)
                continue
            self.stats.loads += 1
            keys = op.key_args
            future = _loop.submit(
                self.engine.retrieve_result(
                    op.token_ids,
                    self.kv_caches,
                    slots,
                    skip_tokens=op.skip_tokens,
                    identity=None if keys is None else keys.identity,
                    block_hashes=None if keys is None else keys.block_hashes,
                )
            )
            pending = _PendingLoad(op, slots, future)
            if op.is_async:
                self._async_loads[op.req_id] = pending
            else:
                self._sync_loads.append(pending)
        if not self.settings.layerwise:
            self._finish_sync_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layerwise mode: the first attention layer waits for the step's synchronous loads."""
        self._finish_sync_loads()

    def _finish_sync_loads(self) -> None:
        loads, self._sync_loads = self._sync_loads, []
        for pending in loads:
            result: RetrieveResult | None
            try:
                result = pending.future.result(self.settings.load_timeout_s)
            except concurrent.futures.TimeoutError:
                pending.future.cancel()
                self._abandoned.append(pending.future)
                logger.warning("tiercache: load of %s timed out; recomputing", pending.op.req_id)
                result = None
            except Exception:
                logger.exception("tiercache: load of %s failed; recomputing", pending.op.req_id)
                result = None
            self._record(pending.op, pending.slots, result)

    def _record(self, op: LoadOp, slots: torch.Tensor, result: RetrieveResult | None) -> None:
        """Turn a load's outcome into invalid blocks: every block of [good_end, load_end) is recomputed."""
        good_end = op.skip_tokens
        if result is not None and result.tokens_written > 0:
            good_end = op.skip_tokens + result.tokens_written
        if good_end >= op.load_end:
            self.stats.tokens_loaded += op.load_end - op.skip_tokens
            return
        self.stats.load_failures += 1
        self.stats.tokens_loaded += max(0, good_end - op.skip_tokens)
        bad = slots[good_end : op.load_end]
        bad = bad[bad >= 0] // self.block_size
        blocks = {int(b) for b in bad.tolist()}
        self.stats.invalid_blocks += len(blocks)
        self._invalid |= blocks

    # ----- saves ---------------------------------------------------------------------------------
    def _save_args(self, op: SaveOp) -> tuple[torch.Tensor, Any]:
        import numpy as np

        slots = slot_mapping(op.block_ids, len(op.token_ids), self.block_size)
        mask = None
        if op.skip_tokens:
            mask = np.ones(len(op.token_ids), dtype=bool)
            mask[: op.skip_tokens] = False
        return slots, mask

    def save_kv_layer(self, meta: TierCacheMetadata, layer_name: str) -> None:
        """Layerwise mode: store this layer of every chunk saved this step (after its attention ran)."""
        if not self.settings.layerwise or self.engine is None or not self.can_save:
            return
        if self._layer_index.get(layer_name) == 0:
            self._start_layer_saves(meta)
        for _, agen, futures in self._layer_saves:
            futures.append(_loop.submit(_advance(agen, futures[-1] if futures else None)))

    def _start_layer_saves(self, meta: TierCacheMetadata) -> None:
        assert self.engine is not None
        self._layer_saves = []
        for op in meta.saves:
            slots, mask = self._save_args(op)
            keys = op.key_args
            agen = self.engine.store_layers(
                op.token_ids,
                self.kv_caches,
                slots,
                mask,
                identity=None if keys is None else keys.identity,
                block_hashes=None if keys is None else keys.block_hashes,
            )
            self._layer_saves.append((op.req_id, agen, []))
            self._saving.setdefault(op.req_id, [])
            self.stats.saves += 1
            self.stats.tokens_saved += len(op.token_ids) - op.skip_tokens

    def wait_for_save(self, meta: TierCacheMetadata) -> None:
        """Submit this step's saves (non-layerwise) or close the layerwise ones; never blocks on storage."""
        if not self.can_save:
            return
        if self.settings.layerwise:
            for req_id, agen, futures in self._layer_saves:
                last = futures[-1] if futures else None
                self._track(req_id, _loop.submit(_finish(agen, last)))
            self._layer_saves = []
            return
        for op in meta.saves:
            self._saving.setdefault(op.req_id, [])
            if self.engine is None:
                continue
            slots, mask = self._save_args(op)
            keys = op.key_args
            store = self.engine.store(
                op.token_ids,
                self.kv_caches,
                slots,
                mask,
                identity=None if keys is None else keys.identity,
                block_hashes=None if keys is None else keys.block_hashes,
            )
            self._track(op.req_id, _loop.submit(store))
            self.stats.saves += 1
            self.stats.tokens_saved += len(op.token_ids) - op.skip_tokens

    def _track(self, req_id: str, future: concurrent.futures.Future[Any]) -> None:
        self._saving.setdefault(req_id, []).append(future)

        def done(f: concurrent.futures.Future[Any]) -> None:
            if not f.cancelled() and f.exception() is not None:
                self.stats.save_failures += 1
                logger.warning("tiercache: save of %s failed: %s", req_id, f.exception())

        future.add_done_callback(done)

    def _wait_saves(self, req_ids: set[str] | None = None) -> None:
        for req_id, futures in list(self._saving.items()):
            if req_ids is not None and req_id not in req_ids:
                continue
            for future in futures:
                with contextlib.suppress(BaseException):  # failures are logged by the done callback
                    future.result(self.settings.save_timeout_s)

    def handle_preemptions(self, meta: TierCacheMetadata) -> None:
        """Finish saves of preempted requests before vLLM reuses their blocks."""
        if meta.preempted:
            self._wait_saves(set(meta.preempted))

    # ----- completion ----------------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose saves are done, requests whose async load is done)."""
        self._finishing |= finished_req_ids & self._saving.keys()
        sending = set()
        for req_id in list(self._finishing):
            futures = self._saving.get(req_id, [])
            if all(f.done() for f in futures):
                sending.add(req_id)
                self._finishing.discard(req_id)
                self._saving.pop(req_id, None)
        for futures in self._saving.values():
            futures[:] = [f for f in futures if not f.done()]
        recving = set()
        for req_id, pending in list(self._async_loads.items()):
            if not pending.future.done():
                continue
            del self._async_loads[req_id]
            result: RetrieveResult | None = None
            try:
                result = pending.future.result()
            except BaseException:
                logger.exception("tiercache: async load of %s failed; recomputing", req_id)
            self._record(pending.op, pending.slots, result)
            recving.add(req_id)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        invalid, self._invalid = self._invalid, set()
        return invalid

    def shutdown(self) -> None:
        """Finish pending saves, drain the L2 store queues, close the engine."""
        self._settle_abandoned()
        self._wait_saves()
        engine, self.engine = self.engine, None
        if engine is None:
            return
        forget_engine(engine)
        try:
            _loop.call(
                _drain_and_close(engine, self.settings.save_timeout_s), self.settings.save_timeout_s + 5
            )
        except Exception:
            logger.exception("tiercache: draining the engine at shutdown failed")


async def _advance(agen: AsyncIterator[int], previous: concurrent.futures.Future[Any] | None) -> int | None:
    """One layer of a layerwise store, after the previous layer's step."""
    if previous is not None:
        await asyncio.wrap_future(previous)
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return None


async def _finish(agen: AsyncIterator[int], previous: concurrent.futures.Future[Any] | None) -> None:
    """Run a layerwise store's remaining layers (none when every layer's hook ran)."""
    if previous is not None:
        await asyncio.wrap_future(previous)
    async for _ in agen:
        pass


async def _drain_and_close(engine: CacheEngine, timeout_s: float) -> None:
    try:
        await engine.manager.drain(timeout_s)
    finally:
        await engine.aclose()


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0
