"""Worker side of the connector: restore cached chunks into vLLM's paged KV, save computed chunks from it.

Runs in each vLLM worker. All tiercache work runs on the process's background loop; the sync vLLM hooks
submit it and (for synchronous loads) wait with a deadline. A load that fails, times out or returns fewer
tokens than planned reports the affected blocks through ``get_block_ids_with_load_errors`` so vLLM
recomputes them (``kv_load_failure_policy="recompute"``); garbage is never used, and nothing the request
computes on top of a short load is stored (its saves are dropped until the scheduler re-plans them after
the recompute, see ``SaveOp.epoch``). On CUDA the moves run on a stream of their own (the process's
``tiercache.gpu.streams.mover_stream``, the loop thread's current stream), fenced against vLLM's: a step's
saves and loads start once the work vLLM had queued when its hook called them is done (waited for off the
loop), and vLLM's later work waits on the device for a load's moves once the load is settled. A load or save
that times out is cancelled and waited for until its coroutine no longer runs before its blocks are reported
invalid or given back. Saves are asynchronous: the scheduler delays a finished request's block free until
``get_finished`` reports its saves done, and preempted requests' saves are flushed in ``handle_preemptions``
before their blocks can be reused. A worker without an engine reports every load as a miss (async ones
finished at once) and tells the scheduler (``WorkerState``) so that it stops reporting hits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from tiercache.gpu.streams import Fence, MoverStream, mover_stream
from tiercache_vllm import _loop
from tiercache_vllm._common import (
    ConnectorSettings,
    LoadOp,
    SaveOp,
    TierCacheMetadata,
    WorkerState,
    engine_like,
    forget_engine,
    identity,
    keyspace_of,
    layout_from_vllm,
    mark_disabled,
    open_engine,
    register_engine,
    slot_mapping,
)
from tiercache_vllm._groups import (
    GroupSpec,
    checked_groups,
    live_slots,
    window_chunks,
)
from tiercache_vllm._layerwise import LayerProgress, load_layers
from tiercache_vllm._server import request_timeout_s, server_for
from tiercache_vllm._state import stored_state_chunks

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from tiercache.config import Config
    from tiercache.gpu.layouts import PagedLayout
    from tiercache.store.engine import CacheEngine, RetrieveResult
    from tiercache_vllm._identity import KeyArgs

__all__ = ["WorkerSide"]

T = TypeVar("T")

logger = logging.getLogger(__name__.replace("tiercache_vllm", "tiercache.vllm", 1))


@dataclass(slots=True)
class _PendingLoad:
    op: LoadOp
    slots: list[torch.Tensor]  # one per KV cache group
    job: _loop.Job[RetrieveResult | _GroupsResult] | None  # None: nothing to run (a miss)
    deadline: float = float("inf")
    layers: LayerProgress | None = None  # layerwise: the layers already written
    written: Fence | None = None  # after the load's moves on the mover stream, once its job has ended


@dataclass(slots=True)
class _WorkerStats:
    loads: int = 0
    load_failures: int = 0
    tokens_loaded: int = 0
    invalid_blocks: int = 0
    saves: int = 0
    save_failures: int = 0
    tokens_saved: int = 0
    saves_skipped_short_load: int = 0
    """Saves dropped because the request's load fell short (their KV was computed on failed blocks)."""
    copies_stopped: int = 0
    """Timed-out loads and saves cancelled and waited for before their blocks were given back."""
    kv_bytes_read: int = 0
    """Bytes of chunk objects the loads of a hybrid model read (a windowed group reads only the chunks its
    window needs)."""
    kv_bytes_read_full: int = 0
    """Bytes those loads would have read with full attention on every layer (every chunk of every group)."""
    kv_bytes_stored: int = 0
    """Bytes of chunk objects the saves of a hybrid model gathered (one object per group per chunk)."""
    extra: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _GroupsResult:
    """A hybrid model's load: the end of the prefix every KV cache group restored."""

    good_end: int


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
        """The engine of the largest KV cache group; it owns the manager every group's engine shares."""
        self.layout: PagedLayout | None = None
        self.groups = checked_groups(vllm_config, kv_cache_config, settings, config.chunk_size)
        self._group_engines: list[CacheEngine] = []
        self._group_caches: list[dict[str, torch.Tensor]] = []
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._sync_loads: list[_PendingLoad] = []
        self._async_loads: dict[str, _PendingLoad] = {}
        self._saving: dict[str, list[_loop.Job[Any]]] = {}
        self._finishing: set[str] = set()
        self._invalid: set[int] = set()
        self._failed_loads: set[str] = set()
        """Async loads of a model with several KV cache groups that fell short (``failed_recving``)."""
        self._short: dict[str, int] = {}
        self._layer_saves: list[tuple[str, AsyncIterator[int], list[_loop.Job[Any]]]] = []
        self._layer_tokens: dict[str, int] = {}  # a layerwise save's tokens, counted once its store ends
        self._deferred_saves: list[SaveOp] = []
        self.disabled = False
        self.reset_epoch = 0
        """Cache resets done (``TierCacheMetadata.reset_epoch``, see ``_events.reset_worker``)."""
        self.clock: Callable[[], float] = time.monotonic
        """Clock for async load deadlines (tests inject one)."""
        self._mover = MoverStream()
        """The stream the loop thread moves KV on, and its fences against vLLM's (inert off CUDA)."""
        self.stats = _WorkerStats()

    # ----- setup ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Detect the layout from the tensors (checked against vLLM's config) and open the engine (one per
        KV cache group, sharing one manager)."""
        from tiercache.gpu.layouts import detect_layout

        self.kv_caches = dict(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(self.kv_caches)}
        if len(self.groups) == 1:
            self._group_caches = [self.kv_caches]
        else:
            self._group_caches = [self._caches_of(g) for g in self.groups]
        layouts = [layout_from_vllm(self.vllm_config, self.kv_cache_config, g.index) for g in self.groups]
        expected = layouts[0]
        layout: PagedLayout | None = None
        try:
            for caches, want in zip(self._group_caches, layouts, strict=True):
                layout = detect_layout(
                    caches,
                    self.block_size,
                    kind=want.kind,
                    num_kv_heads=want.num_kv_heads,
                    head_dim=want.head_dim,
                )
                if layout != want:
                    logger.error("tiercache: detected layout %s != configured %s; disabled", layout, want)
                    layout = None
                    break
        except (ValueError, KeyError):
            logger.exception("tiercache: unexpected KV cache tensors; the connector is disabled")
            layout = None
        self.layout = expected if layout is not None else None
        rank: int | str = "shared" if expected.object_format.name == "KV_MLA" else _tp_rank()
        idents = [
            identity(self.vllm_config, self.settings, lay, rank, g.tag)
            for g, lay in zip(self.groups, layouts, strict=True)
        ]
        largest = max(range(len(idents)), key=lambda i: layouts[i].num_layers)
        if self.layout is not None:
            try:
                server = server_for(self.vllm_config, self.settings, self.config, layouts[largest])
                self.engine = open_engine(
                    idents[largest],
                    self.config,
                    self.settings.open_timeout_s,
                    register=True,
                    server=server.socket,
                    request_timeout_s=request_timeout_s(self.settings, "worker"),
                )
            except Exception:
                logger.exception("tiercache: opening the tiers failed; connector disabled (all misses)")
                self.engine = None
        if self.engine is None:
            self.disabled = True
            for ident in idents:
                mark_disabled(ident)
            return
        base = self.engine
        self._group_engines = [
            base if i == largest else engine_like(base, ident.layout, keyspace_of(self.config, ident))
            for i, ident in enumerate(idents)
        ]
        for i, (ident, engine) in enumerate(zip(idents, self._group_engines, strict=True)):
            if i != largest:
                register_engine(ident, engine)
        self._mover = mover_stream(next(iter(self.kv_caches.values())).device)
        _loop.call(_use_stream(self._mover), self.settings.open_timeout_s)

    def _caches_of(self, group: GroupSpec) -> dict[str, torch.Tensor]:
        """A group's layers as the engine moves them: a recurrent group's as whole state pages."""
        if group.kind != "recurrent":
            return {n: self.kv_caches[n] for n in group.layer_names}
        from tiercache_vllm._state import state_pages

        return {n: state_pages(self.kv_caches[n], self.block_size) for n in group.layer_names}

    @property
    def _plain(self) -> bool:
        """One KV cache group of plain full attention (or MLA): the engine's own paths, unchanged."""
        return len(self.groups) == 1 and not self.groups[0].hybrid

    # ----- loads ---------------------------------------------------------------------------------
    def start_load_kv(self, meta: TierCacheMetadata) -> None:
        """Start this step's loads; synchronous ones finish here, or (layerwise) layer by layer while the
        forward pass runs, each attention layer waiting only for its own layer (``wait_for_layer_load``)."""
        # vLLM clears new blocks on its stream, where the last forward may still run: loads write after that
        fence = self._mover.caller_fence() if meta.loads else Fence()
        for op in meta.loads:
            slots = self._load_slots(op)
            pending = _PendingLoad(op, slots, None, self.clock() + self.settings.load_timeout_s)
            load: Coroutine[Any, Any, RetrieveResult | _GroupsResult] | None = None
            if self.engine is not None and self.can_load and not self._plain:
                self.stats.loads += 1
                load = self._load_groups(op, slots)
            elif self.engine is not None and self.can_load:
                self.stats.loads += 1
                if self.settings.layerwise and not op.is_async:
                    pending.layers = LayerProgress()
                    load = load_layers(
                        self.engine,
                        op.token_ids,
                        self.kv_caches,
                        slots[0],
                        pending.layers,
                        self._mover,
                        skip_tokens=op.skip_tokens,
                        lookup=op.lookup,
                        **_keying(op),
                    )
                else:
                    load = self.engine.retrieve_result(
                        op.token_ids,
                        self.kv_caches,
                        slots[0],
                        skip_tokens=op.skip_tokens,
                        lookup=op.lookup,
                        **_keying(op),
                    )
            if load is not None:
                pending.job = _loop.start(self._load_after(fence, load, pending))
            if op.is_async:
                self._async_loads[op.req_id] = pending  # a miss is reported finished by get_finished
            else:
                self._sync_loads.append(pending)
        if not self.settings.layerwise:
            self._finish_sync_loads()

    async def _load_after(
        self, fence: Fence, load: Coroutine[Any, Any, RetrieveResult | _GroupsResult], pending: _PendingLoad
    ) -> RetrieveResult | _GroupsResult:
        """Run ``load`` after ``fence``; once it ends, ``pending.written`` fences its moves."""
        try:
            return await _after(fence, load)
        finally:
            pending.written = self._mover.moves_fence()

    def _load_slots(self, op: LoadOp) -> list[torch.Tensor]:
        """Each KV cache group's slots for a load (a null block's tokens -1: never written)."""
        n = len(op.token_ids)
        if self._plain:
            return [slot_mapping(op.block_ids, n, self.block_size)]
        return [live_slots(op.group_blocks(g.index), n, self.block_size, null_ok=False) for g in self.groups]

    async def _load_groups(self, op: LoadOp, slots: list[torch.Tensor]) -> _GroupsResult:
        """Restore every KV cache group of a hybrid model; a windowed group reads and writes only the chunks
        from the first token its window still needs at ``load_end``. The prefix every group restored."""
        from tiercache.gpu.layouts import object_spec

        good_end = op.load_end
        chunk = self._group_engines[0].chunk_size
        head = op.skip_tokens // chunk * chunk
        for group, engine, caches, group_slots in zip(
            self.groups, self._group_engines, self._group_caches, slots, strict=True
        ):
            needed = group.first_needed(op.load_end) // self.block_size * self.block_size  # whole pages
            skip = max(op.skip_tokens, needed)
            per_token = object_spec(engine.layout, chunk).nbytes // chunk
            self.stats.kv_bytes_read_full += (len(op.token_ids) - head) * per_token
            if skip >= op.load_end:
                continue  # this group's window needs nothing of the prefix
            result = await engine.retrieve_result(
                op.token_ids, caches, group_slots, skip_tokens=skip, lookup=None, **_keying(op)
            )
            self.stats.kv_bytes_read += result.tokens_read * per_token
            good_end = min(good_end, skip + result.tokens_written)
        return _GroupsResult(good_end)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layerwise mode: wait until this layer of every synchronous load is written (the last layer also
        settles the loads). A load that fails or passes its deadline is stopped and recomputed whole."""
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        failed = []
        for pending in self._sync_loads:
            if pending.layers is not None and not pending.layers.wait(layer, pending.deadline - self.clock()):
                failed.append(pending)
        for pending in failed:
            self._sync_loads.remove(pending)
            assert pending.job is not None
            if not pending.job.finished():
                logger.warning("tiercache: layerwise load of %s timed out; recomputing", pending.op.req_id)
                self._stop(pending.job, "load", pending.op.req_id)
            self._record(pending, None)
        if layer == len(self._layer_index) - 1:
            self._finish_sync_loads()

    def _finish_sync_loads(self) -> None:
        loads, self._sync_loads = self._sync_loads, []
        for pending in loads:
            result: RetrieveResult | _GroupsResult | None = None
            job = pending.job
            if job is not None:
                try:
                    result = job.future.result(self.settings.load_timeout_s)
                except concurrent.futures.TimeoutError:
                    logger.warning("tiercache: load of %s timed out; recomputing", pending.op.req_id)
                    self._stop(job, "load", pending.op.req_id)
                except Exception:
                    logger.exception("tiercache: load of %s failed; recomputing", pending.op.req_id)
            self._record(pending, result)

    def _stop(self, job: _loop.Job[Any], what: str, req_id: str) -> None:
        """Cancel ``job`` and wait until it no longer runs: only then may its blocks be given back to vLLM.

        Bounded by ``load_timeout_s`` per round; a copy that still runs after that keeps the step waiting
        (its blocks are never handed back while it may write or read them).
        """
        self.stats.copies_stopped += 1
        while not job.stop(self.settings.load_timeout_s):
            logger.error("tiercache: cancelled %s of %s is still running; waiting for it", what, req_id)

    def _record(self, pending: _PendingLoad, result: RetrieveResult | _GroupsResult | None) -> None:
        """Turn a load's outcome into invalid blocks: every block of [good_end, load_end) is recomputed
        (in every KV cache group).

        A short load also stops the request's saves until the scheduler re-plans them (``SaveOp.epoch``).
        vLLM's work queued from now on runs after the load's moves (a stopped load's last writes too).
        """
        if pending.written is not None:
            pending.written.hold()
        op, slots = pending.op, pending.slots
        good_end = op.skip_tokens
        if isinstance(result, _GroupsResult):
            good_end = max(good_end, result.good_end)
        elif result is not None and result.tokens_written > 0:
            good_end = op.skip_tokens + result.tokens_written
        if good_end >= op.load_end:
            self.stats.tokens_loaded += op.load_end - op.skip_tokens
            return
        self.stats.load_failures += 1
        self._short[op.req_id] = max(op.epoch, self._short.get(op.req_id, op.epoch))
        if len(self.groups) > 1 and op.is_async:
            # block ids repeat across groups: vLLM takes the whole request as failed and recomputes it
            self._failed_loads.add(op.req_id)
            return
        self.stats.tokens_loaded += max(0, good_end - op.skip_tokens)
        blocks: set[int] = set()
        for group_slots in slots:
            bad = group_slots[good_end : op.load_end]
            bad = bad[bad >= self.block_size] // self.block_size  # never the null block
            blocks.update(int(b) for b in bad.tolist())
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

    def _may_save(self, op: SaveOp) -> bool:
        """False for a save planned before the scheduler saw this request's short load (counted)."""
        short = self._short.get(op.req_id)
        if short is None:
            return True
        if op.epoch > short:
            del self._short[op.req_id]  # re-planned after the recompute
            return True
        self.stats.saves_skipped_short_load += 1
        logger.info("tiercache: not saving %s: computed after a short load", op.req_id)
        return False

    def save_kv_layer(self, meta: TierCacheMetadata, layer_name: str) -> None:
        """Layerwise mode: store this layer of every chunk saved this step (after its attention ran)."""
        if not self.settings.layerwise or self.engine is None or not self.can_save:
            return
        if layer_name not in self._layer_index:  # not a layer of the registered KV: no step of the stores
            return
        if self._layer_index[layer_name] == 0:
            self._start_layer_saves(meta)
        if not self._layer_saves:
            return
        fence = self._mover.caller_fence()  # this layer's gathers read KV its attention has written
        for req_id, agen, jobs in self._layer_saves:
            job = _loop.start(_after(fence, _advance(agen, jobs[-1].future if jobs else None)))
            jobs.append(job)
            self._saving[req_id].append(job)

    def _start_layer_saves(self, meta: TierCacheMetadata) -> None:
        """Start this step's layerwise saves; a request still loading this step saves after the forward
        pass (``wait_for_save``), once its load is known to be whole."""
        loading = {p.op.req_id for p in self._sync_loads if p.layers is not None}
        self._layer_saves = []
        self._deferred_saves = []
        for op in meta.saves:
            self._saving.setdefault(op.req_id, [])
            if op.req_id in loading:
                self._deferred_saves.append(op)
                continue
            agen = self._layer_store(op)
            if agen is not None:
                self._layer_saves.append((op.req_id, agen, []))

    def _layer_store(self, op: SaveOp) -> AsyncIterator[int] | None:
        """The layerwise store of ``op`` (None: not saved, see ``_may_save``)."""
        assert self.engine is not None
        if not self._may_save(op):
            return None
        slots, mask = self._save_args(op)
        self.stats.saves += 1
        self._layer_tokens[op.req_id] = len(op.token_ids) - op.skip_tokens
        return self.engine.store_layers(op.token_ids, self.kv_caches, slots, mask, **_keying(op))

    def wait_for_save(self, meta: TierCacheMetadata) -> None:
        """Submit this step's saves (non-layerwise) or close the layerwise ones; never blocks on storage.

        Settles any synchronous load that no layer hook settled (it runs after the forward pass)."""
        self._finish_sync_loads()
        if not self.can_save:
            return
        fence = self._mover.caller_fence() if meta.saves else Fence()  # after the forward's KV writes
        if self.settings.layerwise:
            for req_id, agen, jobs in self._layer_saves:
                last = jobs[-1].future if jobs else None
                self._track(req_id, _after(fence, _finish(agen, last)))
            deferred, self._deferred_saves = self._deferred_saves, []
            for op in deferred:
                layers = self._layer_store(op) if self.engine is not None else None
                if layers is not None:
                    self._track(op.req_id, _after(fence, _finish(layers, None)))
            self._layer_saves = []
            return
        started = []
        for op in meta.saves:
            self._saving.setdefault(op.req_id, [])
            if self.engine is None or not self._may_save(op):
                continue
            slots, mask = self._save_args(op)
            if self._plain:
                store = self.engine.store(op.token_ids, self.kv_caches, slots, mask, **_keying(op))
            else:
                store = self._store_groups(op)
            started.append(self._track(op.req_id, _after(fence, store), count_result=True))
            self.stats.saves += 1
        if any(g.windowed for g in self.groups):
            # vLLM frees a window's pages while the request runs (not after its finish hook), and hands them
            # to other requests from the next step on: gather this step's chunks before it ends
            for job in started:
                if not job.stopped.wait(self.settings.save_timeout_s) and not job.finished():
                    self._stop(job, "save", "a windowed request")

    async def _store_groups(self, op: SaveOp) -> int:
        """Store one object per KV cache group per chunk (a null block's page is gathered as is: no load
        ever writes it back; with window checkpoints a windowed group stores only the chunks a load of a
        hit boundary reads); the most tokens newly stored in one group."""
        from tiercache.gpu.layouts import object_spec

        stored = []
        n = len(op.token_ids)
        for group, engine, caches in zip(self.groups, self._group_engines, self._group_caches, strict=True):
            slots = live_slots(op.group_blocks(group.index), n, self.block_size, null_ok=True)
            chunk = engine.chunk_size
            new = 0
            for start, end in self._save_runs(group, op, chunk):
                run_mask = None if start == 0 else _mask_from(start, end)
                keying = {} if op.key_args is None else _keying_args(op.key_args.up_to(end))
                run = await engine.store(op.token_ids[:end], caches, slots[:end], run_mask, **keying)
                self.stats.kv_bytes_stored += -(-run // chunk) * object_spec(engine.layout, chunk).nbytes
                new += run
            stored.append(new)
        return max(stored)

    def _save_runs(self, group: GroupSpec, op: SaveOp, chunk: int) -> list[tuple[int, int]]:
        """The token ranges of ``op`` that ``group`` stores (runs of chunks after ``op.skip_tokens``)."""
        n = len(op.token_ids)
        first, last = op.skip_tokens // chunk, -(-n // chunk)
        keep = window_chunks(
            group,
            op.prompt_len or n,
            chunk,
            self.settings.window_checkpoint_tokens,
            unfull=self.config.save_unfull_chunk,
            block_size=self.block_size,
        )
        wanted = [c for c in range(first, last) if keep is None or c in keep]
        if group.kind == "recurrent":  # the chunks whose end state vLLM holds now (a step ended there)
            held = set(stored_state_chunks(op.group_blocks(group.index), n, chunk, self.block_size))
            wanted = [c for c in wanted if c in held]
        runs: list[tuple[int, int]] = []
        for c in wanted:
            if runs and runs[-1][1] == c * chunk:
                runs[-1] = (runs[-1][0], min(n, c * chunk + chunk))
            else:
                runs.append((max(c * chunk, op.skip_tokens), min(n, c * chunk + chunk)))
        return runs

    def _track(
        self, req_id: str, save: Coroutine[Any, Any, Any], *, count_result: bool = False
    ) -> _loop.Job[Any]:
        """Run and keep a save of ``req_id``; it counts, before its job is seen as stopped, its failure or
        its tokens in ``tokens_saved`` (``count_result``: the store's result, the tokens newly stored; else
        a layerwise store's tokens)."""
        layer_tokens = 0 if count_result else self._layer_tokens.pop(req_id, 0)

        async def counted() -> Any:
            try:
                result = await save
            except Exception as exc:
                self.stats.save_failures += 1
                logger.warning("tiercache: save of %s failed: %s", req_id, exc)
                raise
            self.stats.tokens_saved += int(result) if count_result else layer_tokens
            return result

        job = _loop.start(counted())
        self._saving.setdefault(req_id, []).append(job)
        return job

    def _wait_saves(self, req_ids: set[str] | None = None) -> None:
        """Wait for the saves of ``req_ids`` (all: None); one still running after ``save_timeout_s`` is
        cancelled and waited for until it no longer reads the blocks."""
        for req_id, jobs in list(self._saving.items()):
            if req_ids is not None and req_id not in req_ids:
                continue
            for job in jobs:
                if not job.stopped.wait(self.settings.save_timeout_s) and not job.finished():
                    logger.warning("tiercache: save of %s timed out; cancelling it", req_id)
                    self._stop(job, "save", req_id)

    def handle_preemptions(self, meta: TierCacheMetadata) -> None:
        """Finish saves of preempted requests before vLLM reuses their blocks."""
        if meta.preempted:
            self._wait_saves(set(meta.preempted))

    # ----- completion ----------------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose saves are done, requests whose async load is done)."""
        self._finishing |= finished_req_ids & self._saving.keys()
        for req_id in finished_req_ids - self._saving.keys():
            self._short.pop(req_id, None)
        sending = set()
        for req_id in list(self._finishing):
            jobs = self._saving.get(req_id, [])
            if all(job.finished() for job in jobs):
                sending.add(req_id)
                self._finishing.discard(req_id)
                self._saving.pop(req_id, None)
                self._short.pop(req_id, None)
        for jobs in self._saving.values():
            jobs[:] = [job for job in jobs if not job.finished()]
        recving = set()
        for req_id, pending in list(self._async_loads.items()):
            done, result = self._async_result(pending)
            if not done:
                continue
            del self._async_loads[req_id]
            self._record(pending, result)
            recving.add(req_id)
        return sending or None, recving or None

    def _async_result(self, pending: _PendingLoad) -> tuple[bool, RetrieveResult | _GroupsResult | None]:
        """(True, result or None for a miss) once an async load's copy no longer runs, else (False, None).

        Past its deadline the load is cancelled; it is reported only when the cancelled copy has stopped.
        """
        job = pending.job
        if job is None:
            return True, None
        if not job.finished():
            if self.clock() < pending.deadline:
                return False, None
            if not job.future.cancelled():
                logger.warning("tiercache: async load of %s timed out; recomputing", pending.op.req_id)
                self.stats.copies_stopped += 1
            job.cancel()
            if not job.finished():
                return False, None
        if job.future.cancelled():
            return True, None
        try:
            return True, job.future.result()
        except BaseException:
            logger.exception("tiercache: async load of %s failed; recomputing", pending.op.req_id)
            return True, None

    def build_connector_worker_meta(self) -> WorkerState | None:
        """Tell the scheduler that this worker has no engine, and the cache resets it has done (None while
        it has an engine and was never asked to reset)."""
        if self.disabled or self.reset_epoch:
            return WorkerState(disabled=self.disabled, reset_epoch=self.reset_epoch)
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished`` plus the async loads of a multi-group model that fell short (failed requests:
        vLLM recomputes them from their first token)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sending, recving = self.get_finished(finished_req_ids)
        failed, self._failed_loads = self._failed_loads, set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()), failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        invalid, self._invalid = self._invalid, set()
        return invalid

    def shutdown(self) -> None:
        """Finish pending saves, drain the L2 store queues, close the engine."""
        for pending in [*self._sync_loads, *self._async_loads.values()]:
            if pending.job is not None and not pending.job.finished():
                self._stop(pending.job, "load", pending.op.req_id)
        self._wait_saves()
        engine, self.engine = self.engine, None
        if engine is None:
            return
        for group_engine in self._group_engines:
            forget_engine(group_engine)
        forget_engine(engine)
        try:
            _loop.call(
                _drain_and_close(engine, self.settings.save_timeout_s), self.settings.save_timeout_s + 5
            )
        except Exception:
            logger.exception("tiercache: draining the engine at shutdown failed")


async def _use_stream(mover: MoverStream) -> None:
    """Make ``mover``'s stream the loop thread's current stream."""
    mover.use_on_this_thread()


async def _after(fence: Fence, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` once ``fence`` is reached (waited for off the loop); never started if cancelled before."""
    try:
        await fence.reached()
    except BaseException:
        work.close()
        raise
    return await work


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


def _keying(op: LoadOp | SaveOp) -> dict[str, Any]:
    """The engine keying arguments of a worker op: the identity and block hashes its lookup was keyed by."""
    return {} if op.key_args is None else _keying_args(op.key_args)


def _keying_args(keys: KeyArgs) -> dict[str, Any]:
    return {"identity": keys.identity, "block_hashes": keys.block_hashes}


def _mask_from(start: int, end: int) -> Any:
    """A store mask of ``end`` tokens whose first ``start`` are already held (not stored)."""
    import numpy as np

    mask = np.ones(end, dtype=bool)
    mask[:start] = False
    return mask
