"""Shared pieces of both connector sides: settings, metadata, layout from vLLM's config, engine opening.

Engines are kept in a process-wide registry so that, when vLLM runs its scheduler and worker in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` with the ``uni`` executor), the scheduler's lookups go to the worker's
engine and see its L1. In a multi-process engine the scheduler opens a lookup-only engine whose L1 stays
empty: its lookups see the L2 tiers only (see the README).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from tiercache_vllm import _loop

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from tiercache.config import Config
    from tiercache.engine import CacheEngine
    from tiercache.gpu.layouts import PagedLayout

__all__ = [
    "ConnectorSettings",
    "LoadOp",
    "SaveOp",
    "TierCacheMetadata",
    "layout_from_vllm",
    "open_engine",
    "shared_engine",
    "slot_mapping",
]

logger = logging.getLogger("tiercache_vllm")

_EXTRA_KEYS: dict[str, tuple[type, ...]] = {
    "config": (str,),
    "model_id": (str,),
    "load_async": (bool,),
    "layerwise": (bool,),
    "lookup_timeout_s": (int, float),
    "load_timeout_s": (int, float),
    "save_timeout_s": (int, float),
    "open_timeout_s": (int, float),
}


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's ``kv_connector_extra_config``, validated (unknown keys are errors)."""

    config: str | None = None
    """Path of the tiercache TOML/YAML config; None = L1 only, 1 GiB."""
    model_id: str | None = None
    """Model identity in the keyspace; default: vLLM's ``model`` (plus its ``revision``)."""
    load_async: bool = False
    """Load asynchronously: the request waits (WAITING_FOR_REMOTE_KVS) and completes via ``get_finished``."""
    layerwise: bool = False
    """Store one object per chunk and layer; saves run layer by layer as the forward proceeds."""
    lookup_timeout_s: float = 2.0
    """How long the scheduler waits for a lookup before treating it as a miss, seconds."""
    load_timeout_s: float = 10.0
    """How long a synchronous load may take before its blocks are recomputed, seconds."""
    save_timeout_s: float = 30.0
    """How long shutdown and preemption wait for pending saves, seconds."""
    open_timeout_s: float = 60.0
    """How long opening the tiers may take before the connector runs disabled (all misses), seconds."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Validate ``kv_connector_extra_config``; ``ValueError`` naming a wrong or unknown key."""
        values: dict[str, Any] = {}
        for key, value in (extra or {}).items():
            kinds = _EXTRA_KEYS.get(key)
            if kinds is None:
                raise ValueError(
                    f"unknown tiercache kv_connector_extra_config key {key!r}; known: {sorted(_EXTRA_KEYS)}"
                )
            if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
                raise ValueError(f"kv_connector_extra_config[{key!r}] must be {kinds[0].__name__}: {value!r}")
            values[key] = float(value) if float in kinds else value  # type: ignore[arg-type]
        return cls(**values)

    def load_config(self) -> Config:
        """The tiercache config named by ``config`` (or the L1-only default)."""
        from tiercache.config import Config, load_config

        return load_config(self.config) if self.config else Config()

    @property
    def config_id(self) -> str:
        """Identity of the config file for the engine registry."""
        return str(Path(self.config).resolve()) if self.config else "<default>"


# ----- scheduler -> worker metadata ------------------------------------------------------------
@dataclass(slots=True)
class LoadOp:
    """Restore ``[skip_tokens, load_end)`` of a request (whole chunks of ``token_ids`` are read).

    ``token_ids`` ends at the end of the last chunk needed (its pages past ``load_end`` are written too and
    then recomputed by vLLM); ``block_ids`` are the request's blocks (group 0) at allocation.
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip_tokens: int
    load_end: int
    is_async: bool = False


@dataclass(slots=True)
class SaveOp:
    """Store the chunks of ``token_ids`` after the first ``skip_tokens`` (a multiple of the chunk size)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip_tokens: int


@dataclass
class TierCacheMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the worker does this step: loads, saves, and requests preempted (their saves are flushed)."""

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


def slot_mapping(block_ids: Sequence[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Slots of tokens ``0..num_tokens-1``: ``block_id * block_size + offset``; -1 past the given blocks."""
    import torch

    pos = torch.arange(num_tokens, dtype=torch.int64)
    index = pos // block_size
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    have = index < len(block_ids)
    if bool(have.any()):
        blocks = torch.tensor(list(block_ids), dtype=torch.int64)
        slots[have] = blocks[index[have]] * block_size + pos[have] % block_size
    return slots


# ----- layout and keyspace ----------------------------------------------------------------------
def layout_from_vllm(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> PagedLayout:
    """The paged layout vLLM will hand the worker, from its configs alone (the scheduler has no tensors).

    CPU platform -> ``CPU_BLOCKS`` (whole-block pages), MLA -> ``VLLM_MLA``, otherwise ``VLLM_FLASH``.
    """
    from vllm.platforms import current_platform

    from tiercache.gpu.layouts import LayoutKind, PagedLayout

    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        raise ValueError("tiercache needs vLLM's kv_cache_config (a KV connector with 3-argument __init__)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise NotImplementedError(
            f"tiercache supports one KV cache group (full attention); this model has {len(groups)}"
        )
    spec: Any = groups[0].kv_cache_spec
    use_mla = bool(getattr(vllm_config.model_config, "use_mla", False))
    if use_mla:
        kind, heads = LayoutKind.VLLM_MLA, 1
    else:
        kind = LayoutKind.CPU_BLOCKS if current_platform.is_cpu() else LayoutKind.VLLM_FLASH
        heads = int(spec.num_kv_heads)
    return PagedLayout(
        kind,
        num_layers=len(groups[0].layer_names),
        num_kv_heads=heads,
        head_dim=int(spec.head_size),
        block_size=int(spec.block_size),
        dtype=str(spec.dtype).removeprefix("torch."),
    )


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """Everything ``CacheEngine.open`` derives its keyspace from, plus the config file."""

    config_id: str
    model: str
    revision: str
    layout: PagedLayout
    world_size: int
    rank: int | str
    layerwise: bool


def identity(
    vllm_config: VllmConfig, settings: ConnectorSettings, layout: PagedLayout, rank: int | str
) -> EngineIdentity:
    """The engine identity for ``rank`` (``"shared"`` for MLA) of this vLLM config."""
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if int(getattr(parallel, "pipeline_parallel_size", 1)) > 1:
        raise NotImplementedError("tiercache does not support pipeline parallelism yet")
    return EngineIdentity(
        config_id=settings.config_id,
        model=settings.model_id or str(model_config.model),
        revision=str(getattr(model_config, "revision", None) or ""),
        layout=layout,
        world_size=int(parallel.tensor_parallel_size),
        rank=rank,
        layerwise=settings.layerwise,
    )


_registry_lock = threading.Lock()
_ENGINES: dict[EngineIdentity, CacheEngine] = {}


def shared_engine(ident: EngineIdentity) -> CacheEngine | None:
    """The engine a worker of this process opened for ``ident``, if any."""
    with _registry_lock:
        return _ENGINES.get(ident)


def forget_engine(engine: CacheEngine) -> None:
    """Drop ``engine`` from the registry (on close)."""
    with _registry_lock:
        for key in [k for k, v in _ENGINES.items() if v is engine]:
            del _ENGINES[key]


def open_engine(
    ident: EngineIdentity, config: Config, timeout_s: float, *, register: bool, lookup_only: bool = False
) -> CacheEngine:
    """Open a CacheEngine on the background loop (``register``: make it visible to this process's scheduler).

    ``lookup_only`` shrinks L1 to two slots (the scheduler of a multi-process engine never stores).
    """
    from tiercache.config import L1Config
    from tiercache.engine import CacheEngine

    if lookup_only:
        slot = CacheEngine.slot_bytes(ident.layout, config.chunk_size, ident.layerwise)
        config = dataclasses.replace(config, l1=L1Config(capacity=2 * slot + 64, pinned=False))

    def opener(cfg: Config) -> Coroutine[Any, Any, CacheEngine]:
        return CacheEngine.open(
            cfg,
            ident.layout,
            model=ident.model,
            revision=ident.revision,
            world_size=ident.world_size,
            rank=ident.rank,
            layerwise=ident.layerwise,
        )

    engine = _loop.call(opener(config), timeout_s)  # a tier down at start is re-opened by the manager
    if register:
        with _registry_lock:
            _ENGINES[ident] = engine
    return engine


def engine_for_rank(base: CacheEngine, rank: int | str) -> CacheEngine:
    """An engine sharing ``base``'s manager (L1 + tiers) with the keyspace of another TP rank."""
    from tiercache.engine import CacheEngine

    keyspace = dataclasses.replace(base.keyspace, rank=rank)  # type: ignore[arg-type]
    return CacheEngine(
        base.manager,
        base.layout,
        keyspace,
        chunk_size=base.chunk_size,
        save_unfull_chunk=base.token_db.save_unfull_chunk,
        layerwise=base.layerwise,
    )
