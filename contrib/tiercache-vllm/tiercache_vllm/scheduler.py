"""Scheduler side of the connector: lookups, load planning, per-chunk save planning, delayed block frees.

Runs in vLLM's EngineCore. Lookups are the only tiercache calls made here (on the background loop, with a
deadline; a timeout or failure is a miss). Everything else is bookkeeping that turns the scheduler's output
into :class:`~tiercache_vllm._common.TierCacheMetadata` for the worker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from tiercache_vllm import _loop
from tiercache_vllm._common import (
    ConnectorSettings,
    EngineIdentity,
    LoadOp,
    SaveOp,
    TierCacheMetadata,
    engine_like,
    identity,
    keyspace_of,
    layout_from_vllm,
    open_engine,
    shared_engine,
    worker_disabled,
)
from tiercache_vllm._groups import checked_groups, window_boundary
from tiercache_vllm._identity import KeyArgs, UnkeyableRequest, hash_block_size, key_args
from tiercache_vllm._server import request_timeout_s, server_for

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from tiercache.config import Config
    from tiercache.store.engine import CacheEngine, LookupResult
    from tiercache.store.hits import TierHit
    from tiercache.store.l1_surface import LocatesL2
    from tiercache.store.manager import StorageManager

__all__ = ["KEYSPACE_PARAM", "SchedulerSide"]

KEYSPACE_PARAM = "tiercache_keyspace"
"""Key of the ``kv_transfer_params`` entry a producer returns for a request it saved: its keyspace digest and
key source. A consumer given it (a P/D proxy forwards these params) compares it with its own and reports a
mismatch, which would otherwise be an unexplained miss on every request."""

logger = logging.getLogger(__name__.replace("tiercache_vllm", "tiercache.vllm", 1))


@dataclass(slots=True)
class _Tracker:
    """A scheduled request's save progress: its prompt, current blocks, tokens computed and saved."""

    prompt: list[int]
    block_ids: list[list[int]]
    """Per KV cache group."""
    computed: int = 0
    saved: int = 0
    epoch: int = 0
    """Short loads of the request seen so far (``SaveOp.epoch``)."""


@dataclass(slots=True)
class _Lookup:
    """A cached lookup: the stored prefix end (tokens) and the last answer given to vLLM."""

    hit: int
    local: int = 0
    count: int = 0
    result: LookupResult | None = None
    """The engine's answer, kept only when the lookup ran on the worker's engine (same process)."""
    step: int = -1
    """The scheduler step that looked it up (server mode: a batched answer serves that step only)."""
    tiers: tuple[str, ...] = ()
    """The tier serving each chunk of the hit ("L1" or an L2 tier's name), where the lookup said."""


@dataclass(slots=True)
class _Stats:
    lookups: int = 0
    lookup_failures: int = 0
    hit_tokens: int = 0
    loads: int = 0
    saves: int = 0
    unkeyable_requests: int = 0
    """Requests whose identity has no stable key (never looked up nor stored)."""
    keyspace_mismatches: int = 0
    """Requests whose producer keyed them under another keyspace or key source (they cannot hit)."""
    prefetched_objects: int = 0
    """Objects a lookup started loading from L2 into L1 (a windowed group: only those its load reads)."""
    short_loads: int = 0
    """Requests whose load a worker reported short (their saves are re-planned from the valid prefix)."""
    worker_disabled: bool = False
    extra: dict[str, int] = field(default_factory=dict)


class SchedulerSide:
    """The scheduler half of ``TierCacheConnector`` (one per EngineCore)."""

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
        self.settings = settings
        self.config = config
        self.can_load = can_load
        self.can_save = can_save
        self.chunk_size = config.chunk_size
        self.save_unfull_chunk = config.save_unfull_chunk
        self.block_size = int(vllm_config.cache_config.block_size)
        self.groups = checked_groups(vllm_config, kv_cache_config, settings, self.chunk_size)
        layouts = [layout_from_vllm(vllm_config, kv_cache_config, g.index) for g in self.groups]
        self.layout = layouts[0]
        self._largest = max(range(len(layouts)), key=lambda i: layouts[i].num_layers)
        # MLA restores whole blocks only, as vLLM's prefix cache does: a restore leaving a one-token first
        # step runs MLA's absorbed decode path, whose tokens differ from a cold prefill even with exact KV.
        self._recurrent = any(g.kind == "recurrent" for g in self.groups)
        """A group holds recurrent state: a hit ends at a chunk boundary before the prompt's end."""
        self.whole_blocks = self.layout.object_format.name == "KV_MLA" or self._recurrent
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
        ranks: list[int | str] = ["shared"] if self.layout.object_format.name == "KV_MLA" else list(range(tp))
        self._idents = [
            identity(vllm_config, settings, layout, r, g.tag)
            for r in ranks
            for g, layout in zip(self.groups, layouts, strict=True)
        ]
        """One engine identity per TP rank and KV cache group (rank-major); a chunk is a hit only when every
        one of them holds its object."""
        self._ident_groups = [g for _ in ranks for g in self.groups]
        """The KV cache group of each identity."""
        self._windowed = any(g.windowed for g in self.groups)
        """A hit is chosen by ``window_boundary``: a windowed group needs only the chunks its window reads."""
        self.server = server_for(vllm_config, settings, config, layouts[self._largest])
        """The server this instance runs on (decided once; ``socket`` None = in-process)."""
        self._hash_block_size = hash_block_size(vllm_config, self._idents[0].key_source)
        self._requests: dict[str, Request] = {}
        self._key_args: dict[str, KeyArgs | None] = {}
        self._unkeyable_reasons: set[str] = set()
        self._stamp = _keyspace_stamp(config, self._idents[0])
        if settings.keyspace_file:
            _write_keyspace_file(settings.keyspace_file, config, self._idents)
        self._mismatches_seen: set[str] = set()
        self._engines: list[CacheEngine] | None = None
        self._own_engine: CacheEngine | None = None
        self._shared = False
        self._disabled = False
        self._lookups: dict[str, _Lookup] = {}
        self._step = 0
        """Scheduler steps seen (``build_connector_meta`` ends one)."""
        self._max_batch = int(vllm_config.scheduler_config.max_num_seqs)
        """Requests one batched lookup covers at most (vLLM schedules no more in a step)."""
        self._pending_loads: dict[str, LoadOp] = {}
        self._async_loading: set[str] = set()
        self._trackers: dict[str, _Tracker] = {}
        self._epochs: dict[str, int] = {}
        self._load_blocks: dict[str, set[int]] = {}
        self._save_issued: set[str] = set()
        self._kv_manager: KVCacheManager | None = None
        self._loads_async = settings.load_async or len(self.groups) > 1
        """Loads run asynchronously: always with several KV cache groups, where vLLM takes a failed load
        only as a failed request (``failed_recving``), never as invalid blocks (ids repeat across groups)."""
        self._failed_loads: set[str] = set()
        """Requests whose load vLLM took as failed: recomputed, never offered a hit again."""
        self.reset_epoch = 0
        """Cache resets asked of the workers (``request_reset``)."""
        self._resets_done = 0
        """The resets every worker has reported done; while fewer than asked, every lookup is a miss."""
        self.stats = _Stats()

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        """The scheduler's KV cache manager: the truth about a request's blocks in every group (a windowed
        group's freed pages become the null block while the request runs)."""
        self._kv_manager = manager

    # ----- engine --------------------------------------------------------------------------------
    def _get_engines(self) -> list[CacheEngine] | None:
        """The engines to look up in (one per TP rank): the worker's when it lives in this process."""
        if self._engines is not None or self._disabled:
            return self._engines
        if any(worker_disabled(ident) for ident in self._idents):
            self._disable("the worker in this process could not open its engine")
            return None
        shared = [shared_engine(ident) for ident in self._idents]
        if all(e is not None for e in shared):
            self._engines = [e for e in shared if e is not None]
            self._shared = True
            return self._engines
        largest = self._idents[self._largest]
        try:
            base = open_engine(
                largest,
                self.config,
                self.settings.open_timeout_s,
                register=False,
                lookup_only=True,
                server=self.server.socket,
                role="scheduler",
                request_timeout_s=request_timeout_s(self.settings, "scheduler"),
            )
        except Exception:
            logger.exception("tiercache: the scheduler could not open its tiers; every lookup is a miss")
            self._disabled = True
            return None
        self._own_engine = base
        self._engines = [
            base if ident is largest else engine_like(base, ident.layout, keyspace_of(self.config, ident))
            for ident in self._idents
        ]
        return self._engines

    def _disable(self, why: str) -> None:
        """Fail closed: every later lookup is a miss and nothing is saved."""
        if not self._disabled:
            logger.warning("tiercache: %s; the connector is disabled (all misses)", why)
        self._disabled = True
        self._engines = None
        self.stats.worker_disabled = True

    def request_reset(self) -> None:
        """Have every worker clear this engine's keyspace at its next step (the workers' L1 and stores are in
        other processes); until all of them report it done, lookups answer a miss, so nothing stored before
        the reset is offered."""
        self.reset_epoch += 1
        self._lookups.clear()

    @property
    def resetting(self) -> bool:
        """Whether a reset asked of the workers is not done by all of them yet."""
        return self._resets_done < self.reset_epoch

    @property
    def shares_worker_engine(self) -> bool:
        """True when lookups go to the worker's engine in this process (they then see its L1)."""
        return self._shared

    async def _lookup(self, engines: list[CacheEngine], tokens: list[int], keys: KeyArgs) -> _Lookup:
        """The prefix every rank holds: all ranks' keys in one batched lookup (one round trip to a server),
        a chunk counting only when every rank's object of it is present. On the worker's own engine (one, in
        this process) the load reuses the lookup (no second hash or query)."""
        base = engines[0]
        same_manager = all(e.manager is base.manager for e in engines)
        if self._windowed and same_manager and not base.layerwise:
            return await self._lookup_windowed(engines, tokens, keys)
        if len(engines) == 1 or base.layerwise or not same_manager:
            hits = [
                await e.lookup_hit(
                    tokens, prefetch=self._shared, identity=keys.identity, block_hashes=keys.block_hashes
                )
                for e in engines
            ]
            reusable = hits[0] if self._shared and len(hits) == 1 else None
            shortest = min(hits, key=lambda h: h.tokens)
            return _Lookup(shortest.tokens, result=reusable, tiers=shortest.tiers)
        batch = _rank_keys(engines, tokens, keys)
        if not batch:
            return _Lookup(0)
        hit = await base.manager.lookup_prefix(batch, prefetch=self._shared, group=len(engines))
        return _Lookup(min(hit.chunks * self.chunk_size, len(tokens)), tiers=hit.tiers)

    async def _lookup_windowed(self, engines: list[CacheEngine], tokens: list[int], keys: KeyArgs) -> _Lookup:
        """The longest prefix a load can restore in a model with a windowed group (every rank's keys in one
        query); on the worker's engine, a prefetch of the L2 objects that load reads, and no others."""
        batch = _rank_keys(engines, tokens, keys)
        if not batch:
            return _Lookup(0)
        manager = engines[0].manager
        hit = (await manager.lookup_prefixes([batch], group=len(engines), count=False))[0]
        found, wanted = self._window_hit(hit.hits, len(tokens))
        self._count_window_hit(manager, found, len(batch))
        below = [(batch[i], h.tier) for i in wanted if (h := hit.hits[i]) is not None and h.level > 0]
        if self._shared and below:
            self.stats.prefetched_objects += len(below)
            if manager.remote:  # the server loads them into its shared L1
                cast("LocatesL2", manager.l1).batched_locate([key for key, _ in below], prefetch=True)
            elif manager.tiers:
                manager.start_prefetch([key for key, _ in below], [tier for _, tier in below])
        return found

    def _window_hit(self, hits: tuple[TierHit | None, ...], num_tokens: int) -> tuple[_Lookup, list[int]]:
        """A lookup's answer (chunk-major keys of every identity) as the boundary a load can restore, and the
        indices of the keys that load reads."""
        n = len(self._ident_groups)
        present = [[h is not None for h in hits[c : c + n]] for c in range(0, len(hits), n)]
        if self._recurrent:  # a state snapshot ends a whole chunk; vLLM never restores the whole prompt
            whole = max(0, num_tokens - 1) // self.chunk_size
            present, num_tokens = present[:whole], whole * self.chunk_size
        end = window_boundary(self._ident_groups, present, num_tokens, self.chunk_size, self.block_size)
        chunks = -(-end // self.chunk_size)
        wanted = [
            c * n + i
            for i, g in enumerate(self._ident_groups)
            for c in range(g.read_from(end, self.block_size) // self.chunk_size, chunks)
        ]
        read: dict[int, list[TierHit]] = {}
        for i in wanted:
            found = hits[i]
            if found is not None:
                read.setdefault(i // n, []).append(found)
        # each chunk the load reads: its slowest tier among the objects read
        tiers = tuple(max(read[c], key=lambda h: h.level).tier for c in sorted(read))
        return _Lookup(end, tiers=tiers), sorted(wanted)

    def _count_window_hit(self, manager: StorageManager, found: _Lookup, num_keys: int) -> None:
        """Count a windowed lookup in the metrics: a hit per chunk its load reads, a miss per chunk after
        its boundary."""
        chunks = num_keys // len(self._ident_groups)
        manager.count_lookup(found.tiers, chunks - -(-found.hit // self.chunk_size))

    def _lookup_sync(self, engines: list[CacheEngine], tokens: list[int], keys: KeyArgs) -> _Lookup:
        """:meth:`_lookup` from vLLM's thread: one engine whose L1 alone decides it answers here (no hop to
        the loop thread); otherwise the loop thread finishes it (the prompt hashed once either way)."""
        from tiercache.store.engine import PendingLookup

        timeout = self.settings.lookup_timeout_s
        if len(engines) != 1 or self._windowed:
            return _loop.call(self._lookup(engines, tokens, keys), timeout)
        found = engines[0].lookup_hit_now(tokens, identity=keys.identity, block_hashes=keys.block_hashes)
        if isinstance(found, PendingLookup):
            found = _loop.call(found.complete(prefetch=self._shared), timeout)
        return _Lookup(found.tokens, result=found if self._shared else None, tiers=found.tiers)

    def _batches_requests(self, engines: list[CacheEngine]) -> bool:
        """Whether lookups go to a server from this scheduler's own engine: then one batched lookup answers
        every waiting request of the step (the in-process and shared-engine paths look up per request)."""
        base = engines[0]
        return (
            self.server.socket is not None
            and not self._shared
            and not base.layerwise
            and all(e.manager is base.manager for e in engines)
        )

    async def _lookup_many(
        self, engines: list[CacheEngine], requests: list[tuple[str, list[int], KeyArgs]]
    ) -> dict[str, _Lookup]:
        """Each request's prefix held by every rank, all requests' keys in one ``lookup_prefixes`` call (one
        LOOKUP per 128 keys, the protocol's limit per message, instead of one per request)."""
        key_lists = [_rank_keys(engines, tokens, keys) for _, tokens, keys in requests]
        manager = engines[0].manager
        hits = await manager.lookup_prefixes(key_lists, group=len(engines), count=not self._windowed)
        if self._windowed:
            found = {}
            for (req_id, tokens, _), keys, hit in zip(requests, key_lists, hits, strict=True):
                one = found[req_id] = self._window_hit(hit.hits, len(tokens))[0]
                one.step = self._step
                self._count_window_hit(manager, one, len(keys))
            return found
        return {
            req_id: _Lookup(min(hit.chunks * self.chunk_size, len(tokens)), step=self._step, tiers=hit.tiers)
            for (req_id, tokens, _), hit in zip(requests, hits, strict=True)
        }

    # ----- request identity ----------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        """Remember the request: its identity keys its lookups and every save planned for it."""
        self._requests[request.request_id] = request

    def request_keys(self, request: Request) -> KeyArgs | None:
        """The request's identity and block hashes for keying (cached); None when it cannot be keyed."""
        req_id = request.request_id
        if req_id in self._key_args:
            return self._key_args[req_id]
        self._check_producer_stamp(request)
        found: KeyArgs | None
        try:
            found = key_args(request, self.chunk_size, self._hash_block_size)
        except UnkeyableRequest as exc:
            self.stats.unkeyable_requests += 1
            if str(exc) not in self._unkeyable_reasons:  # one line per reason; the count says how many
                self._unkeyable_reasons.add(str(exc))
                logger.warning("tiercache: request %s and others like it are not cached: %s", req_id, exc)
            found = None
        self._key_args[req_id] = found
        return found

    def _check_producer_stamp(self, request: Request) -> None:
        """Count and log (once per kind) a producer whose keyspace differs from this instance's."""
        params = request.kv_transfer_params
        stamp = params.get(KEYSPACE_PARAM) if isinstance(params, dict) else None
        if stamp is None or stamp == self._stamp:
            return
        self.stats.keyspace_mismatches += 1
        text = f"{stamp} != {self._stamp}"
        if text not in self._mismatches_seen:
            self._mismatches_seen.add(text)
            logger.warning(
                "tiercache: request %s was stored by a producer with another keyspace (producer %s, this "
                "instance %s): it cannot hit; align prefix_caching_hash_algo, block size, PYTHONHASHSEED, "
                "key_source and the model settings of both instances",
                request.request_id,
                stamp,
                self._stamp,
            )

    def _keys_of(self, req_id: str) -> KeyArgs | None:
        """Keying of a request the scheduler announced (None: unknown or unkeyable, so never stored)."""
        if req_id in self._key_args:
            return self._key_args[req_id]
        request = self._requests.get(req_id)
        return None if request is None else self.request_keys(request)

    def _hit_tokens(self, request: Request) -> int:
        """The stored prefix of the request's prompt, in tokens (cached per request; in server mode the first
        lookup of a step also answers every other waiting request, for this step)."""
        cached = self._lookups.get(request.request_id)
        if cached is not None and (cached.step < 0 or cached.step == self._step):
            return cached.hit
        keys = self.request_keys(request)
        engines = self._get_engines() if keys is not None else None
        found = _Lookup(0)
        if engines and keys is not None and self._batches_requests(engines):
            return self._hit_tokens_batched(engines, request, keys)
        if engines and keys is not None:
            self.stats.lookups += 1
            try:
                found = self._lookup_sync(engines, request.prompt_token_ids or [], keys)
            except Exception as exc:
                self.stats.lookup_failures += 1
                logger.warning(
                    "tiercache: lookup for %s failed (%s); treated as a miss", request.request_id, exc
                )
        self._lookups[request.request_id] = found
        return found.hit

    def _hit_tokens_batched(self, engines: list[CacheEngine], request: Request, keys: KeyArgs) -> int:
        """Look ``request`` up together with every other known request that has no answer for this step yet
        (in arrival order, at most ``max_num_seqs``); cache all the answers. A failure is a miss for all."""
        wanted = [(request.request_id, list(request.prompt_token_ids or ()), keys)]
        for req_id, other in self._requests.items():
            if len(wanted) >= self._max_batch:
                break
            cached = self._lookups.get(req_id)
            if req_id == request.request_id or req_id in self._trackers:
                continue  # asked for already, or scheduled (a preempted one is asked for again)
            if cached is not None and (cached.step < 0 or cached.step == self._step):
                continue
            other_keys = self.request_keys(other)
            if other_keys is not None:
                wanted.append((req_id, list(other.prompt_token_ids or ()), other_keys))
        self.stats.lookups += len(wanted)
        try:
            found = _loop.call(self._lookup_many(engines, wanted), self.settings.lookup_timeout_s)
        except Exception as exc:
            self.stats.lookup_failures += len(wanted)
            logger.warning(
                "tiercache: lookup of %d requests failed (%s); treated as misses", len(wanted), exc
            )
            found = {req_id: _Lookup(0, step=self._step) for req_id, _, _ in wanted}
        self._lookups.update(found)
        return found[request.request_id].hit

    # ----- vLLM scheduler API --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens loadable beyond ``num_computed_tokens`` (never the whole request; MLA: up to a block
        boundary), and whether async."""
        if not self.can_load or self._disabled or request.request_id in self._failed_loads or self.resetting:
            return 0, False
        hit = self._hit_tokens(request)
        end = min(hit, request.num_tokens - 1)
        if self.whole_blocks:
            end = end // self.block_size * self.block_size
        count = max(0, end - num_computed_tokens)
        cached = self._lookups[request.request_id]
        cached.local, cached.count = num_computed_tokens, count
        return count, bool(count) and self._loads_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of the ``num_external_tokens`` vLLM accepted (0: nothing to load)."""
        cached = self._lookups.pop(request.request_id, None)
        if num_external_tokens <= 0 or cached is None:
            return
        local = cached.local
        load_end = local + num_external_tokens
        chunk = self.chunk_size
        read_end = min(cached.hit, -(-load_end // chunk) * chunk)
        prompt = list(request.prompt_token_ids or ())
        op = LoadOp(
            req_id=request.request_id,
            token_ids=prompt[:read_end],
            block_ids=list(blocks.get_block_ids()[0]),
            more_block_ids=[list(ids) for ids in blocks.get_block_ids()[1:]],
            skip_tokens=local,
            load_end=load_end,
            is_async=self._loads_async,
            epoch=self._epochs.get(request.request_id, 0),
            lookup=cached.result,
        )
        keys = self.request_keys(request)
        op.key_args = None if keys is None else keys.up_to(read_end)
        self._pending_loads[request.request_id] = op
        first, last = local // self.block_size, -(-load_end // self.block_size)
        self._load_blocks[request.request_id] = {
            b for g in self.groups for b in op.group_blocks(g.index)[first:last] if b
        }
        if op.is_async:
            self._async_loading.add(request.request_id)
        self.stats.loads += 1
        self.stats.hit_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TierCacheMetadata:
        """This step's loads, the saves of chunks that this step completes, and the preempted requests."""
        self._step += 1  # the next lookups belong to the next step
        meta = TierCacheMetadata(loads=list(self._pending_loads.values()), reset_epoch=self.reset_epoch)
        self._pending_loads.clear()
        meta.preempted = sorted(scheduler_output.preempted_req_ids or ())
        num_scheduled = scheduler_output.num_scheduled_tokens
        touched: list[tuple[str, _Tracker]] = []
        for new in scheduler_output.scheduled_new_reqs:
            tracker = _Tracker(
                prompt=list(new.prompt_token_ids or ()),
                block_ids=[list(ids) for ids in new.block_ids] if new.block_ids else [],
                computed=new.num_computed_tokens + num_scheduled.get(new.req_id, 0),
                saved=new.num_computed_tokens // self.chunk_size * self.chunk_size,
                epoch=self._epochs.get(new.req_id, 0),
            )
            self._trackers[new.req_id] = tracker
            touched.append((new.req_id, tracker))
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = set(getattr(cached, "resumed_req_ids", None) or ())
        for i, req_id in enumerate(cached.req_ids):
            found = self._trackers.get(req_id)
            if found is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed:
                found.block_ids = [list(ids) for ids in new_blocks] if new_blocks else []
            elif new_blocks:
                if not found.block_ids:
                    found.block_ids = [[] for _ in new_blocks]
                for ids, more in zip(found.block_ids, new_blocks, strict=True):
                    ids.extend(more)
            found.computed = cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0)
            touched.append((req_id, found))
        if self.can_save and not self._disabled:
            for req_id, tracker in touched:
                self._refresh_blocks(req_id, tracker)
                op = self._plan_save(req_id, tracker)
                if op is not None:
                    meta.saves.append(op)
        return meta

    def _refresh_blocks(self, req_id: str, tracker: _Tracker) -> None:
        """A windowed model's blocks as the KV cache manager holds them now: the pages its windows left are
        the null block (vLLM may already have handed them to another request)."""
        if self._kv_manager is None or not any(g.windowed for g in self.groups):
            return
        try:
            tracker.block_ids = [list(ids) for ids in self._kv_manager.get_block_ids(req_id)]
        except KeyError:
            tracker.block_ids = []  # not allocated: nothing to save from

    def _plan_save(self, req_id: str, tracker: _Tracker) -> SaveOp | None:
        """A save of every chunk completed by the tokens computed so far and not saved yet."""
        prompt_len = len(tracker.prompt)
        done = min(tracker.computed, prompt_len)
        end = done // self.chunk_size * self.chunk_size
        if done == prompt_len and self.save_unfull_chunk:
            end = prompt_len
        if end <= tracker.saved:
            return None
        blocks = -(-end // self.block_size)
        if len(tracker.block_ids) != len(self.groups) or any(len(ids) < blocks for ids in tracker.block_ids):
            return None  # cannot happen for computed tokens; never save from blocks we do not know
        keys = self._keys_of(req_id)
        if keys is None:
            return None  # unknown or unkeyable identity: never keyed on its tokens alone
        op = SaveOp(
            req_id,
            tracker.prompt[:end],
            tracker.block_ids[0][:blocks],
            tracker.saved,
            key_args=keys.up_to(end),
            epoch=tracker.epoch,
            more_block_ids=[ids[:blocks] for ids in tracker.block_ids[1:]],
            prompt_len=prompt_len,
        )
        tracker.saved = end
        self._save_issued.add(req_id)
        self.stats.saves += 1
        return op

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forget finished async loads; learn of short loads (re-plan saves) and of a disabled worker."""
        for req_id in connector_output.finished_recving or ():
            self._async_loading.discard(req_id)
        state = connector_output.kv_connector_worker_meta
        if getattr(state, "disabled", False):
            self._disable("a worker runs without an engine")
        self._resets_done = max(self._resets_done, int(getattr(state, "reset_epoch", 0)))
        invalid = set(connector_output.invalid_block_ids or ())
        if invalid:
            for req_id, blocks in list(self._load_blocks.items()):
                if blocks & invalid:
                    self._short_load(req_id, invalid)
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            self._failed_loads.add(req_id)  # vLLM recomputes it from its first token
            if req_id in self._load_blocks:
                self._short_load(req_id, set(self._load_blocks[req_id]))

    def _short_load(self, req_id: str, invalid: set[int]) -> None:
        """A load of ``req_id`` fell short: bump its save epoch (the worker drops older saves) and save again
        from the chunk holding the first failed block once vLLM has recomputed it."""
        self.stats.short_loads += 1
        del self._load_blocks[req_id]
        self._epochs[req_id] = self._epochs.get(req_id, 0) + 1
        tracker = self._trackers.get(req_id)
        if tracker is None:
            return  # an async load: its tracker starts from the recomputed prefix vLLM rewound to
        tracker.epoch = self._epochs[req_id]
        bad = [i for ids in tracker.block_ids for i, block in enumerate(ids) if block and block in invalid]
        bad.sort()
        first_bad = (bad[0] if bad else 0) * self.block_size
        tracker.saved = min(tracker.saved, first_bad // self.chunk_size * self.chunk_size)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delay the block free while a save may still read the blocks or an async load write them."""
        req_id = request.request_id
        self._lookups.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
        self._trackers.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._key_args.pop(req_id, None)
        self._epochs.pop(req_id, None)
        self._load_blocks.pop(req_id, None)
        self._failed_loads.discard(req_id)
        saved = req_id in self._save_issued
        delay = saved or req_id in self._async_loading
        self._save_issued.discard(req_id)
        return delay, ({KEYSPACE_PARAM: dict(self._stamp)} if saved else None)

    def shutdown(self) -> None:
        """Close the lookup-only engine (a shared one belongs to the worker)."""
        engine, self._own_engine = self._own_engine, None
        if engine is not None:
            try:
                _loop.call(engine.aclose(), self.settings.save_timeout_s)
            except Exception:
                logger.exception("tiercache: closing the scheduler's engine failed")


def _rank_keys(engines: list[CacheEngine], tokens: list[int], keys: KeyArgs) -> list[str]:
    """Every rank's key of every chunk of ``tokens``, chunk-major then rank (each rank's keyspace seeds its
    own hash chain)."""
    per_rank = [
        [
            e.token_db.key_prefix + h.hex()
            for h in e.token_db.prefix_hashes(tokens, identity=keys.identity, block_hashes=keys.block_hashes)
        ]
        for e in engines
    ]
    return [key for chunk in zip(*per_rank, strict=True) for key in chunk]


def _keyspace_stamp(config: Config, ident: EngineIdentity) -> dict[str, str]:
    """This instance's keyspace digest and key source, as a producer reports them in kv_transfer_params."""
    keyspace = keyspace_of(config, ident)
    return {"keyspace": keyspace.digest_hex, "key_source": keyspace.key_source or "tokens"}


def _write_keyspace_file(path: str, config: Config, idents: list[EngineIdentity]) -> None:
    """Write this instance's keyspace description to ``path`` (replaced whole): what cache control needs to
    compute a prompt's keys outside this process. A failure is logged; the connector runs on."""
    import json
    import os

    from tiercache.prompt_keys import KeyspaceDescription

    description = KeyspaceDescription(
        tuple(keyspace_of(config, ident) for ident in idents), config.chunk_size, config.save_unfull_chunk
    )
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(description.to_json(), f, indent=1)
        os.replace(tmp, path)
    except OSError:
        logger.exception("tiercache: could not write the keyspace description to %s", path)
    else:
        logger.info(
            "tiercache: keyspace description written to %s (key prefixes %s)", path, description.prefixes
        )
