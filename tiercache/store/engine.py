"""The cache engine: tokens + paged KV in, chunk objects through the storage manager, paged KV out.

It glues the token database (keys), the gpu layer (gather/scatter between paged KV and L1 objects) and the
storage manager (L1 + L2). The vLLM connector and the demo use it. In layerwise mode every chunk is stored as
one object per layer, and a chunk counts as cached only when all its layers are present.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from tiercache.config import TENANT_BY
from tiercache.gpu.layouts import LayoutKind, PagedLayout, ReadPlan, object_spec, plan_read
from tiercache.gpu.move import Move
from tiercache.keys import BlockHashes, ChunkSpan, KeySpace, RequestIdentity, TokenDatabase, contiguous_prefix
from tiercache.spec import KVFormat
from tiercache.store.l1 import stored_nbytes
from tiercache.store.l1_frames import l1_codec
from tiercache.store.manager import L1_TIER, PrefixHit, StorageManager, TierHit
from tiercache.store.policy import tenant_id

if TYPE_CHECKING:
    import torch

    from tiercache.config import Config
    from tiercache.events import EventSink
    from tiercache.gpu.layouts import KVCaches
    from tiercache.metrics import Metrics
    from tiercache.spec import KVSpec
    from tiercache.store.l1 import L1Lease

__all__ = ["CacheEngine", "LookupResult", "PreparedRetrieve", "RetrieveResult"]

_PLANS = 4096
"""Read plans an engine keeps (a plan depends only on the local and hit token counts)."""


@dataclass(slots=True)  # not frozen: built once per lookup on the hot path (a frozen init costs ~0.4 us)
class LookupResult:
    """A lookup's answer (never modified): cached prefix length in tokens and chunks, and the tier serving
    each chunk.

    It also keeps what the lookup computed (object keys and specs, where each key was found), so that a
    retrieve of the same request (``prepare_retrieve(..., lookup=result)``) neither hashes the tokens again
    nor asks the L2 tiers again."""

    tokens: int
    chunks: int
    tiers: tuple[str, ...]
    num_tokens: int = 0
    """Length of the prompt that was looked up."""
    keys: tuple[str, ...] = field(default=(), compare=False, repr=False)
    specs: tuple[KVSpec, ...] = field(default=(), compare=False, repr=False)
    hits: tuple[TierHit | None, ...] = field(default=(), compare=False, repr=False)

    def chunks_in(self, tier: str) -> int:
        """Chunks of the prefix served by ``tier`` (``"L1"`` or an L2 tier's name)."""
        return self.tiers.count(tier)


@dataclass(frozen=True, slots=True)
class PendingLookup:
    """A lookup whose prompt is hashed but whose answer needs L2 tiers or the server: await :meth:`complete`
    (on the engine's event loop)."""

    engine: CacheEngine
    num_tokens: int
    keys: list[str]
    specs: Sequence[KVSpec]

    async def complete(self, prefetch: bool = True) -> LookupResult:
        """The lookup's answer across L1 and L2 (and a prefetch of its L2 part when ``prefetch``)."""
        engine = self.engine
        hit = await engine.manager.lookup_prefix(
            self.keys, self.specs, prefetch=prefetch, group=engine._group
        )
        return engine._lookup_result(self.num_tokens, self.keys, self.specs, hit)


@dataclass(frozen=True, slots=True)
class RetrieveResult:
    """What a retrieve did: tokens read from the cache (whole chunks) and tokens written into paged KV."""

    ret_mask: torch.Tensor
    tokens_read: int
    tokens_written: int
    skip_prefix: int


class CacheEngine:
    """store / lookup / retrieve of paged KV for one engine layout and keyspace (async; one event loop)."""

    def __init__(
        self,
        manager: StorageManager,
        layout: PagedLayout,
        keyspace: KeySpace,
        *,
        chunk_size: int = 256,
        save_unfull_chunk: bool = True,
        layerwise: bool = False,
        tenant_by: str = "salt",
    ) -> None:
        if tenant_by not in TENANT_BY:
            raise ValueError(f"tenant_by must be one of {', '.join(TENANT_BY)}, not {tenant_by!r}")
        if layout.block_aligned and chunk_size % layout.block_size:
            raise ValueError(f"chunk_size {chunk_size} must be a multiple of block_size {layout.block_size}")
        self.manager = manager
        self.layout = layout
        self.keyspace = keyspace
        self.token_db = TokenDatabase(keyspace, chunk_size, save_unfull_chunk)
        self.chunk_size = chunk_size
        self.layerwise = layerwise
        self.tenant_by = tenant_by
        """What names a request's tenant: ``"salt"``, or ``"salt+lora"`` (its LoRA adapter too)."""
        self.l1_codec = l1_codec(manager.l1)
        """What L1 holds (``[l1] codec``); ``"fp8"``: quantized on gather, dequantized on scatter."""
        if layout.kind is LayoutKind.VLLM_BLOCKS and (layerwise or self.l1_codec == "fp8"):
            raise ValueError(
                "VLLM_BLOCKS objects hold whole blocks of every layer as they lie in memory: not layerwise "
                'objects, nor an fp8 L1 (l1.codec = "fp8"), whose channel scales would span layers'
            )
        if self.l1_codec == "fp8":
            if layerwise:
                raise ValueError('an fp8 L1 (l1.codec = "fp8") does not support layerwise objects yet')
            if layout.dtype not in ("bfloat16", "float16", "float32"):
                raise ValueError(f"an fp8 L1 quantizes bfloat16, float16 or float32 KV, not {layout.dtype}")
        self._specs: dict[tuple[int, int | None], KVSpec] = {}
        self._chunk_spec_lists: dict[tuple[int, int], tuple[KVSpec, ...]] = {}
        self._plans: dict[tuple[int, int], tuple[ReadPlan, tuple[int, ...]]] = {}
        self._plan_block = layout.block_size if layout.block_aligned else None
        self.events: EventSink | None = None
        """Told which vLLM blocks each stored chunk covers (KV events); None: nobody listens."""

    @staticmethod
    def slot_bytes(layout: PagedLayout, chunk_size: int, layerwise: bool = False, codec: str = "raw") -> int:
        """L1 slot size: one full-chunk object (per layer in layerwise mode) as an L1 of ``codec`` stores it
        (``"fp8"``: its fp8 payload, about half)."""
        spec = object_spec(layout, chunk_size)
        return stored_nbytes(codec, spec.with_layers(0, 1) if layerwise else spec)

    @classmethod
    async def open(
        cls,
        config: Config,
        layout: PagedLayout,
        *,
        model: str,
        revision: str = "",
        world_size: int = 1,
        rank: int | str = 0,
        layerwise: bool = False,
        metrics: Metrics | None = None,
        key_source: str = "",
    ) -> CacheEngine:
        """Build the keyspace from the layout, open L1 and every configured tier, and return the engine.

        The process-wide salt (``config.cache_salt_env``) goes into the keyspace; a request's own identity
        is passed per call (``identity=``). ``key_source`` names a non-token key source (vLLM block hashes).
        """
        keyspace = cls.keyspace_for(
            config,
            layout,
            model=model,
            revision=revision,
            world_size=world_size,
            rank=rank,
            key_source=key_source,
        )
        slot = cls.slot_bytes(layout, config.chunk_size, layerwise, config.l1.codec)
        manager = await StorageManager.open(config, slot, metrics=metrics)
        return cls(
            manager,
            layout,
            keyspace,
            chunk_size=config.chunk_size,
            save_unfull_chunk=config.save_unfull_chunk,
            layerwise=layerwise,
            tenant_by=config.l1.tenant_by,
        )

    @staticmethod
    def keyspace_for(
        config: Config,
        layout: PagedLayout,
        *,
        model: str,
        revision: str = "",
        world_size: int = 1,
        rank: int | str = 0,
        key_source: str = "",
    ) -> KeySpace:
        """The keyspace ``open`` gives an engine (the process salt read from ``config.cache_salt_env``)."""
        salt = os.environ.get(config.cache_salt_env, "") if config.cache_salt_env else ""
        return KeySpace(
            model=model,
            kv_dtype=layout.dtype,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            kv_format=layout.object_format,
            revision=revision,
            world_size=world_size,
            rank=rank,  # type: ignore[arg-type]
            cache_salt=salt,
            layout_tag=layout.fingerprint if layout.block_aligned else "",
            key_source=key_source,
        )

    async def aclose(self) -> None:
        """Close the manager (background stores are cancelled; call ``drain`` first to finish them)."""
        await self.manager.aclose()

    async def drain(self) -> None:
        """Wait for background L2 stores to finish."""
        await self.manager.drain()

    # ----- keys and specs -----------------------------------------------------------------------------------
    def _spec(self, span: ChunkSpan, layer: int | None = None) -> KVSpec:
        """The object spec of a span."""
        return self._spec_of(span.end - span.start, layer)

    def _spec_of(self, num_tokens: int, layer: int | None = None) -> KVSpec:
        """The object spec of a chunk of ``num_tokens`` tokens (cached: specs are immutable and almost all
        chunks are full)."""
        cache_key = (num_tokens, layer)
        spec = self._specs.get(cache_key)
        if spec is None:
            spec = object_spec(self.layout, num_tokens)
            if layer is not None:
                spec = spec.with_layers(layer, layer + 1)
            self._specs[cache_key] = spec
        return spec

    def _chunk_specs(self, num_chunks: int, num_tokens: int) -> tuple[KVSpec, ...]:
        """Specs of the first ``num_chunks`` chunks of a ``num_tokens`` prompt (whole objects; kept, at most
        ``_PLANS`` shapes: they depend on these two numbers only)."""
        found = self._chunk_spec_lists.get((num_chunks, num_tokens))
        if found is not None:
            return found
        if not num_chunks:
            return ()
        chunk = self.chunk_size
        full = self._spec_of(chunk)
        last = self._spec_of(min(num_chunks * chunk, num_tokens) - (num_chunks - 1) * chunk)
        if len(self._chunk_spec_lists) >= _PLANS:
            self._chunk_spec_lists.clear()
        found = self._chunk_spec_lists[num_chunks, num_tokens] = (full,) * (num_chunks - 1) + (last,)
        return found

    def _chunk_keys(
        self,
        tokens: object,
        mask: object | None = None,
        *,
        identity: RequestIdentity | None,
        block_hashes: BlockHashes | None,
        before: bool = False,
    ) -> tuple[int, list[str]]:
        """Whole-chunk objects: the first keyed chunk at or after the mask's first True, and the storage keys
        of it and every later keyed chunk (with ``before``, of every chunk from the first), straight from the
        chunk hashes (the hot paths: no spans)."""
        hashes = self.token_db.prefix_hashes(tokens, identity=identity, block_hashes=block_hashes)
        num_tokens = len(tokens)  # type: ignore[arg-type]
        first = 0 if mask is None else self.token_db.mask_start(mask, num_tokens) // self.chunk_size
        prefix = self.token_db.key_prefix
        return first, [prefix + h.hex() for h in (hashes if before else hashes[first:])]

    def _layer_keys(self, span: ChunkSpan) -> list[str]:
        return [str(span.key.with_layer(layer)) for layer in range(self.layout.num_layers)]

    def _prompt_objects(
        self, tokens: object, *, identity: RequestIdentity | None, block_hashes: BlockHashes | None
    ) -> tuple[list[str], Sequence[KVSpec]]:
        """Storage keys and specs of every object of every keyed chunk of ``tokens`` (chunk-major, then
        layer in layerwise mode)."""
        if not self.layerwise:
            _, chunk_keys = self._chunk_keys(tokens, identity=identity, block_hashes=block_hashes)
            return chunk_keys, self._chunk_specs(len(chunk_keys), len(tokens))  # type: ignore[arg-type]
        spans = self.token_db.process_tokens(tokens, identity=identity, block_hashes=block_hashes)
        keys: list[str] = []
        specs: list[KVSpec] = []
        for span in spans:
            keys.extend(self._layer_keys(span))
            specs.extend(self._spec(span, layer) for layer in range(self.layout.num_layers))
        return keys, specs

    # ----- store --------------------------------------------------------------------------------------------
    async def store(
        self,
        tokens: object,
        kv_caches: KVCaches,
        slot_mapping: torch.Tensor,
        mask: object | None = None,
        *,
        identity: RequestIdentity | None = None,
        block_hashes: BlockHashes | None = None,
    ) -> int:
        """Gather the KV of every keyed chunk of ``tokens`` (after the mask's False prefix) into L1, queue it
        for the L2 tiers; returns the tokens newly stored (chunks already cached are skipped).

        ``identity``: the request's salt, LoRA adapter and non-token inputs (None: the tokens alone);
        ``block_hashes``: vLLM's stable block hashes of the same request. Every call of a request must pass
        the same ones, or its keys differ (a miss, never wrong KV)."""
        from tiercache.gpu import dispatch

        if self.layerwise:
            spans = self.token_db.process_tokens(tokens, mask, identity=identity, block_hashes=block_hashes)
            fresh = [False] * len(spans)
            for layer in range(self.layout.num_layers):
                stored = await self._store_layer(
                    layer, spans, kv_caches, slot_mapping, self.tenant_of(identity)
                )
                fresh = [a or b for a, b in zip(fresh, stored, strict=True)]
            return sum(span.end - span.start for span, new in zip(spans, fresh, strict=True) if new)
        first, keys = self._chunk_keys(
            tokens, mask, identity=identity, block_hashes=block_hashes, before=True
        )
        before, keys = keys[:first], keys[first:]
        if not keys:
            return 0
        num_tokens, chunk = len(tokens), self.chunk_size  # type: ignore[arg-type]
        specs = self._chunk_specs(first + len(keys), num_tokens)[first:]
        if self.events is not None and block_hashes is not None:
            self._describe(tokens, first, keys, identity, block_hashes)
        async with self.manager.writing(keys, specs, self.tenant_of(identity), before) as objects:
            todo = [(c, o) for c, o in enumerate(objects, start=first) if o is not None]
            ranges = [(c * chunk, min(c * chunk + chunk, num_tokens)) for c, _ in todo]
            if todo and self.l1_codec == "fp8":  # quantized while gathered: L1 gets the fp8 payloads
                outs = [o.payload() for _, o in todo]
                dispatch.gather(kv_caches, Move.gather_fp8(self.layout, slot_mapping, ranges, outs))
            elif todo:
                outs = [o.tensor() for _, o in todo]
                dispatch.gather(kv_caches, Move.gather(self.layout, slot_mapping, ranges, outs))
        return sum(end - start for start, end in ranges)

    def _describe(
        self,
        tokens: object,
        first: int,
        keys: list[str],
        identity: RequestIdentity | None,
        blocks: BlockHashes,
    ) -> None:
        """Tell ``events`` which vLLM blocks the chunks ``first``.. (``keys``) of ``tokens`` cover."""
        assert self.events is not None
        chunk, num_tokens = self.chunk_size, len(tokens)  # type: ignore[arg-type]
        bounds = [(c * chunk, min(c * chunk + chunk, num_tokens)) for c in range(first, first + len(keys))]
        lora = identity.lora_name if identity is not None and identity.lora_name else None
        seq = cast("Sequence[int]", tokens)
        self.events.describe_request(keys, seq, blocks.hashes, blocks.block_size, bounds, lora)

    def tenant_of(self, identity: RequestIdentity | None) -> str:
        """The tenant whose quota a store counts against: :func:`~tiercache.store.policy.tenant_id` of the
        request's ``cache_salt``, else of the process-wide one (with ``tenant_by = "salt+lora"``, and of the
        request's LoRA adapter name)."""
        salt = (
            identity.cache_salt if identity is not None and identity.cache_salt else self.keyspace.cache_salt
        )
        lora = identity.lora_name if identity is not None and self.tenant_by == "salt+lora" else ""
        return tenant_id(salt, lora)

    async def _store_layer(
        self,
        layer: int,
        spans: Sequence[ChunkSpan],
        kv_caches: KVCaches,
        slot_mapping: torch.Tensor,
        tenant: str = "",
    ) -> list[bool]:
        """Gather one layer of ``spans`` into fresh per-layer L1 objects and queue them; True where stored."""
        from tiercache.gpu import dispatch

        keys = [str(s.key.with_layer(layer)) for s in spans]
        async with self.manager.writing(keys, [self._spec(s, layer) for s in spans], tenant) as objects:
            todo = [(s, o) for s, o in zip(spans, objects, strict=True) if o is not None]
            if todo:
                move = Move.gather(
                    self.layout,
                    slot_mapping,
                    [(s.start, s.end) for s, _ in todo],
                    [o.tensor() for _, o in todo],
                    layers=range(layer, layer + 1),
                )
                dispatch.gather(kv_caches, move)
        return [o is not None for o in objects]

    async def store_layers(
        self,
        tokens: object,
        kv_caches: KVCaches,
        slot_mapping: torch.Tensor,
        mask: object | None = None,
        *,
        identity: RequestIdentity | None = None,
        block_hashes: BlockHashes | None = None,
    ) -> AsyncIterator[int]:
        """Layerwise store, one layer per step (yields the layer index after it is in L1 and queued)."""
        if not self.layerwise:
            raise ValueError("store_layers needs an engine built with layerwise=True")
        spans = self.token_db.process_tokens(tokens, mask, identity=identity, block_hashes=block_hashes)
        tenant = self.tenant_of(identity)
        for layer in range(self.layout.num_layers):
            await self._store_layer(layer, spans, kv_caches, slot_mapping, tenant)
            yield layer

    # ----- lookup -------------------------------------------------------------------------------------------
    async def lookup_hit(
        self,
        tokens: object,
        *,
        prefetch: bool = True,
        identity: RequestIdentity | None = None,
        block_hashes: BlockHashes | None = None,
    ) -> LookupResult:
        """Cached prefix of ``tokens`` (under ``identity``) across L1 and L2, with the tier of each chunk;
        starts prefetching."""
        found = self.lookup_hit_now(tokens, identity=identity, block_hashes=block_hashes)
        return await found.complete(prefetch) if isinstance(found, PendingLookup) else found

    def lookup_hit_now(
        self,
        tokens: object,
        *,
        identity: RequestIdentity | None = None,
        block_hashes: BlockHashes | None = None,
    ) -> LookupResult | PendingLookup:
        """:meth:`lookup_hit` in the calling thread, with no I/O and no event loop: the answer when L1 alone
        decides it (no L2 tier to ask, no server; ``StorageManager.local_prefix``), else the hashed prompt
        as a :class:`PendingLookup` to await. Safe from any thread."""
        keys, specs = self._prompt_objects(tokens, identity=identity, block_hashes=block_hashes)
        if not keys:
            return LookupResult(0, 0, (), len(tokens))  # type: ignore[arg-type]
        events = self.events
        if (
            events is not None
            and events.emit
            and events.describes_lookups
            and block_hashes
            and not self.layerwise
        ):
            self._describe(
                tokens, 0, keys, identity, block_hashes
            )  # its chunks prefetched into L1 are announced
        hit = self.manager.local_prefix(keys, self._group)
        if hit is None:
            return PendingLookup(self, len(tokens), keys, specs)  # type: ignore[arg-type]
        return self._lookup_result(len(tokens), keys, specs, hit)  # type: ignore[arg-type]

    @property
    def _group(self) -> int:
        """Objects per chunk: one per layer when layerwise, else one."""
        return self.layout.num_layers if self.layerwise else 1

    def _lookup_result(
        self, num_tokens: int, keys: list[str], specs: Sequence[KVSpec], hit: PrefixHit
    ) -> LookupResult:
        end = min(hit.chunks * self.chunk_size, num_tokens)
        return LookupResult(end, hit.chunks, hit.tiers, num_tokens, tuple(keys), tuple(specs), hit.hits)

    async def lookup(
        self,
        tokens: object,
        *,
        identity: RequestIdentity | None = None,
        block_hashes: BlockHashes | None = None,
    ) -> int:
        """Tokens of the longest contiguous cached prefix of ``tokens`` (and prefetch of its L2 part).

        The per-call path of ``lookup_hit`` without its result object (the keys, specs and hits that a later
        retrieve could reuse): specs only where a prefetch may need them (L2 tiers)."""
        if self.layerwise:
            return (await self.lookup_hit(tokens, identity=identity, block_hashes=block_hashes)).tokens
        _, keys = self._chunk_keys(tokens, identity=identity, block_hashes=block_hashes)
        if not keys:
            return 0
        num_tokens = len(tokens)  # type: ignore[arg-type]
        manager = self.manager
        hit = manager.local_prefix(keys)
        if hit is None:
            specs = self._chunk_specs(len(keys), num_tokens) if manager.tiers else None
            hit = await manager.lookup_prefix(keys, specs)
        return min(hit.chunks * self.chunk_size, num_tokens)

    # ----- retrieve -----------------------------------------------------------------------------------------
    async def prepare_retrieve(
        self,
        tokens: object,
        mask: object | None = None,
        *,
        skip_tokens: int = 0,
        identity: RequestIdentity | None = None,
        block_hashes: BlockHashes | None = None,
        lookup: LookupResult | None = None,
    ) -> PreparedRetrieve:
        """Lease the cached prefix of ``tokens`` beyond what the engine holds, ready to be scattered.

        The engine holds the first ``max(skip_tokens, mask's False count)`` tokens: chunks wholly below
        that are not read, the chunk containing it is read whole and only its tail will be written. L2
        chunks are loaded into L1 first (contiguous prefix only). Always ``finish()`` the result.
        ``lookup``: this engine's ``lookup_hit`` of the same tokens and identity, or of a longer prompt
        that ``tokens`` start at a chunk boundary: its keys and hits are reused (no second hash of the
        tokens, no second L2 query).
        """
        num_tokens = len(tokens)  # type: ignore[arg-type]
        layers = self.layout.num_layers if self.layerwise else 1
        chunk = self.chunk_size
        if (
            lookup is not None
            and lookup.num_tokens != num_tokens
            and (num_tokens > lookup.num_tokens or num_tokens % chunk)
        ):
            raise ValueError(
                f"the lookup was of {lookup.num_tokens} tokens, this retrieve has {num_tokens} (a shorter "
                f"retrieve must end at a chunk boundary, a multiple of {chunk})"
            )
        specs: Sequence[KVSpec]
        if lookup is not None:
            n = (
                -(-num_tokens // chunk) * layers
            )  # the keys of the retrieve's chunks: a prefix of the lookup's
            keys, specs, hits = list(lookup.keys[:n]), lookup.specs[:n], list(lookup.hits[:n])
        else:
            keys, specs = self._prompt_objects(tokens, identity=identity, block_hashes=block_hashes)
            hits = None
        num_chunks = len(keys) // layers
        local = skip_tokens
        if mask is not None:
            false_count = self.token_db.mask_start(mask, num_tokens)
            local = max(local, false_count if false_count < num_chunks * chunk else num_tokens)
        first = local // chunk
        wanted = [
            (c * chunk, end)
            for c in range(first, num_chunks)
            if (end := min(c * chunk + chunk, num_tokens)) > local
        ]
        leases: list[L1Lease | None] = []
        if wanted:
            window = slice(first * layers, (first + len(wanted)) * layers)
            leases = await self.manager.batched_get(
                keys[window], specs[window], hits=None if hits is None else hits[window]
            )
        if layers == 1:  # batched_get answers a prefix: leases up to the first None
            chunks = contiguous_prefix(leases)
            used = cast("list[L1Lease]", leases[:chunks])
            if chunks < len(leases) and (beyond := [lease for lease in leases[chunks:] if lease is not None]):
                self.manager.l1.batched_release(beyond)
        else:
            chunks = contiguous_prefix(
                all(leases[c * layers + layer] is not None for layer in range(layers))
                for c in range(len(wanted))
            )
            beyond = [lease for lease in leases[chunks * layers :] if lease is not None]
            if beyond:  # beyond the prefix: not needed (one release call)
                self.manager.l1.batched_release(beyond)
            used = [lease for lease in leases[: chunks * layers] if lease is not None]
        hit_end = wanted[chunks - 1][1] if chunks else local
        plan, skips = self._plan(local, hit_end)
        return PreparedRetrieve(self, num_tokens, local, wanted[:chunks], used, plan, skips)

    def _plan(self, local: int, hit_end: int) -> tuple[ReadPlan, tuple[int, ...]]:
        """``plan_read`` of ``[local, hit_end)`` and its per-span skips (kept: a plan is immutable and
        depends on these two numbers only; at most ``_PLANS`` of them)."""
        found = self._plans.get((local, hit_end))
        if found is None:
            plan = plan_read(local, hit_end, self.chunk_size, block_size=self._plan_block)
            if len(self._plans) >= _PLANS:
                self._plans.clear()
            found = self._plans[(local, hit_end)] = (plan, plan.skips)
        return found

    async def retrieve_result(
        self,
        tokens: object,
        kv_caches: KVCaches,
        slot_mapping: torch.Tensor,
        mask: object | None = None,
        *,
        skip_tokens: int = 0,
        identity: RequestIdentity | None = None,
        block_hashes: BlockHashes | None = None,
        lookup: LookupResult | None = None,
    ) -> RetrieveResult:
        """Restore the cached prefix of ``tokens`` beyond what the engine holds into its paged KV
        (``prepare_retrieve``, reusing ``lookup`` when given, then every layer at once, then ``finish``)."""
        prepared = await self.prepare_retrieve(
            tokens, mask, skip_tokens=skip_tokens, identity=identity, block_hashes=block_hashes, lookup=lookup
        )
        try:
            prepared.scatter(kv_caches, slot_mapping)
        finally:
            result = prepared.finish()
        return result

    async def retrieve(
        self,
        tokens: object,
        kv_caches: KVCaches,
        slot_mapping: torch.Tensor,
        mask: object | None = None,
        *,
        skip_tokens: int = 0,
        identity: RequestIdentity | None = None,
        block_hashes: BlockHashes | None = None,
    ) -> torch.Tensor:
        """Like ``retrieve_result``; returns the boolean ret_mask (True for tokens written from the cache)."""
        result = await self.retrieve_result(
            tokens,
            kv_caches,
            slot_mapping,
            mask,
            skip_tokens=skip_tokens,
            identity=identity,
            block_hashes=block_hashes,
        )
        return result.ret_mask

    @property
    def l1_tier(self) -> str:
        """Name under which L1 hits are reported."""
        return L1_TIER


class PreparedRetrieve:
    """Leased L1 objects of a request's cached prefix and the plan to write them into paged KV.

    Scatter all layers at once (``scatter``) or one layer at a time (``scatter_layer``, to overlap with the
    forward pass), then ``finish()``: it checks that no lease lapsed during the copies (a lapsed one may have
    served reused memory, so its tokens are reported as not retrieved), builds the ret_mask and releases.
    """

    def __init__(
        self,
        engine: CacheEngine,
        num_tokens: int,
        local: int,
        chunks: list[tuple[int, int]],
        leases: list[L1Lease],
        plan: ReadPlan,
        skips: tuple[int, ...] | None = None,
    ) -> None:
        self.engine = engine
        self.num_tokens = num_tokens
        self.local = local
        self.chunks = chunks
        self.leases = leases
        self.plan = plan
        self.skips = plan.skips if skips is None else skips
        """``plan.skips`` (per span)."""
        self._result: RetrieveResult | None = None

    @property
    def tokens_to_write(self) -> int:
        """Tokens the scatter will write (the hit beyond what the engine holds)."""
        return self.plan.tokens_to_write

    def _objects(self, layer: int | None) -> list[torch.Tensor]:
        """The objects to scatter: whole chunks, or one layer of each (a view for non-layerwise objects)."""
        if self.engine.layerwise:
            if layer is None:
                raise ValueError("a layerwise retrieve is scattered layer by layer")
            layers = self.engine.layout.num_layers
            return [self.leases[c * layers + layer].obj.tensor() for c in range(len(self.chunks))]
        tensors = [lease.obj.tensor() for lease in self.leases]
        if layer is None:
            return tensors
        if self.engine.layout.object_format is KVFormat.KV_MLA:
            return [t[layer : layer + 1] for t in tensors]
        return [t[:, layer : layer + 1] for t in tensors]

    def scatter(self, kv_caches: KVCaches, slot_mapping: torch.Tensor) -> None:
        """Write every layer of the prefix into the paged KV."""
        from tiercache.gpu import dispatch

        if not self.chunks:
            return
        if self.engine.layerwise:
            for layer in range(self.engine.layout.num_layers):
                self.scatter_layer(layer, kv_caches, slot_mapping)
            return
        plan = self.plan
        if self.engine.l1_codec == "fp8":  # dequantized while scattered
            payloads = [lease.obj.payload() for lease in self.leases]
            move = Move.scatter_fp8(self.engine.layout, slot_mapping, plan.spans, payloads, self.skips)
            dispatch.scatter(kv_caches, move)
            return
        move = Move.scatter(self.engine.layout, slot_mapping, plan.spans, self._objects(None), self.skips)
        dispatch.scatter(kv_caches, move)

    def scatter_layer(self, layer: int, kv_caches: KVCaches, slot_mapping: torch.Tensor) -> None:
        """Write one layer of the prefix into the paged KV (layer-by-layer loading)."""
        from tiercache.gpu import dispatch

        if not self.chunks:
            return
        if self.engine.l1_codec == "fp8":
            raise ValueError("an fp8 L1's objects are scattered whole (scatter), not layer by layer")
        plan = self.plan
        move = Move.scatter(
            self.engine.layout,
            slot_mapping,
            plan.spans,
            self._objects(layer),
            self.skips,
            layers=range(layer, layer + 1),
        )
        dispatch.scatter(kv_caches, move)

    def finish(self) -> RetrieveResult:
        """Check the leases, release them and report what was retrieved; idempotent."""
        import numpy as np
        import torch

        if self._result is not None:
            return self._result
        if self.engine.layerwise:
            layers = self.engine.layout.num_layers
            valid = contiguous_prefix(
                all(self.leases[c * layers + layer].valid() for layer in range(layers))
                for c in range(len(self.chunks))
            )
        else:
            valid = 0
            for lease in self.leases:
                if not lease.valid():
                    break
                valid += 1
        if self.leases:
            self.engine.manager.l1.batched_release(self.leases)  # one RELEASE round trip on the shared L1
        good_end = self.chunks[valid - 1][1] if valid else self.local
        mask = np.zeros(self.num_tokens, dtype=np.bool_)  # numpy, then one torch op: this runs right after
        mask[self.local : good_end] = True  # the copies, when every torch op starts from cold caches
        ret_mask = torch.from_numpy(mask)
        tokens_read = sum(end - start for start, end in self.chunks[:valid])
        skip = self.plan.skip_prefix if valid else 0
        self._result = RetrieveResult(ret_mask, tokens_read, max(0, good_end - self.local), skip)
        return self._result
