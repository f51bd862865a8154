"""Shared pieces of both connector sides: settings, metadata, layout from vLLM's config, engine opening.

Engines are kept in a process-wide registry so that, when vLLM runs its scheduler and worker in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` with the ``uni`` executor), the scheduler's lookups go to the worker's
engine and see its L1. In a multi-process engine the scheduler opens a lookup-only engine whose L1 stays
empty: its lookups see the L2 tiers only (docs/vllm.md, "Server mode").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from tiercache.sizes import in_range
from tiercache_vllm import _loop
from tiercache_vllm._groups import slot_mapping
from tiercache_vllm._identity import KEY_SOURCES, KeyArgs, vllm_key_source

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from tiercache.config import Config
    from tiercache.gpu.layouts import LayoutKind, PagedLayout
    from tiercache.keys import KeySpace
    from tiercache.store.engine import CacheEngine, LookupResult

__all__ = [
    "ConnectorSettings",
    "LoadOp",
    "SaveOp",
    "TierCacheMetadata",
    "WorkerState",
    "check_failure_policy",
    "engine_like",
    "keyspace_of",
    "layout_from_vllm",
    "model_fingerprint",
    "open_engine",
    "register_engine",
    "requested_kv_layout",
    "shared_engine",
    "slot_mapping",
]

logger = logging.getLogger(__name__.replace("tiercache_vllm", "tiercache.vllm", 1))

_EXTRA_KEYS: dict[str, tuple[type, ...]] = {
    "config": (str,),
    "model_id": (str,),
    "load_async": (bool,),
    "layerwise": (bool,),
    "lookup_timeout_s": (int, float),
    "load_timeout_s": (int, float),
    "save_timeout_s": (int, float),
    "open_timeout_s": (int, float),
    "key_source": (str,),
    "l1_codec": (str,),
    "server": (str,),
    "keyspace_file": (str,),
    "window_checkpoint_tokens": (int,),
    "kv_layout": (str,),
}
KV_LAYOUTS = ("layers", "blocks")
"""``kv_layout`` values: vLLM's per-layer allocation, or its block-outermost ``BLNHC`` one (whole blocks)."""

_RANGES: dict[str, tuple[float, float]] = {
    "lookup_timeout_s": (0.001, 3600.0),
    "load_timeout_s": (0.001, 3600.0),
    "save_timeout_s": (0.001, 3600.0),
    "open_timeout_s": (0.001, 3600.0),
    "window_checkpoint_tokens": (0, 1 << 31),
}
"""Inclusive bounds of every numeric setting (seconds, tokens), checked when the settings are read."""


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's ``kv_connector_extra_config``, validated (unknown keys are errors)."""

    config: str | None = None
    """Path of the tiercache TOML/YAML config, absolute: a relative one is resolved against the working
    directory once, when the settings are read at start (a private server started in its own directory gets
    the same file); None = L1 only, 1 GiB."""
    model_id: str | None = None
    """Model identity in the keyspace; default: vLLM's ``model`` (plus its ``revision``)."""
    load_async: bool = False
    """Load asynchronously: the request waits (WAITING_FOR_REMOTE_KVS) and completes via ``get_finished``."""
    layerwise: bool = False
    """Store one object per chunk and layer; saves run layer by layer as the forward proceeds."""
    lookup_timeout_s: float = 2.0
    """How long the scheduler waits for a lookup before treating it as a miss, seconds. In server mode one
    request to the server may take three quarters of it, at most 5 s (then the connection ends: cache-off)."""
    load_timeout_s: float = 10.0
    """How long a load (sync or async) may take before it is cancelled and its blocks recomputed, seconds. In
    server mode one request of a worker to the server may take three quarters of it (and of
    ``lookup_timeout_s``)."""
    save_timeout_s: float = 30.0
    """How long shutdown and preemption wait for pending saves before cancelling them, seconds."""
    open_timeout_s: float = 60.0
    """How long opening the tiers may take before the connector runs disabled (all misses), seconds."""
    key_source: str = "auto"
    """``auto``: chunk keys from vLLM's block hashes when they are stable across processes (SHA-256 family
    ``prefix_caching_hash_algo``), else from the tokens; ``tokens``: always from the tokens. Both processes
    of a prefill/decode pair must resolve to the same source (each logs its own once)."""
    l1_codec: str | None = None
    """``"raw"`` or ``"fp8"``: overrides the config's ``[l1] codec`` (fp8: KV quantized while gathered into
    L1, dequantized while restored; every tier's chain must then start with ``fp8``). None: the config's."""
    server: str = "off"
    """``off`` (in-process), ``unix:///path`` (a node's server) or ``auto`` (see ``_server``)."""
    keyspace_file: str | None = None
    """Where the scheduler writes this instance's keyspace description at start (JSON, see
    ``tiercache.prompt_keys``): cache control computes a prompt's keys from it. None: not written."""
    window_checkpoint_tokens: int = 0
    """Windowed KV cache groups store only the chunks a load of a hit boundary reads: every multiple of this
    (a multiple of ``chunk_size``), and the prompt's last chunk boundary. 0: every chunk boundary."""
    kv_layout: str = "layers"
    """``layers``: vLLM's own choice of allocation; objects hold tokens, shared by every instance of the model
    whatever its block size. ``blocks``: ask vLLM for its block-outermost ``BLNHC`` allocation (on a GPU, one
    attention group, no MLA) and store whole blocks of every layer: a block moves to and from the pinned L1
    as one copy on the copy engines, no kernel; objects are then shared only with instances that store blocks
    of the same size. Where vLLM allocates otherwise, ``layers`` (one warning). Not with ``layerwise``."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Validate ``kv_connector_extra_config``; ``ValueError`` naming a wrong or unknown key, or a number
        outside its range (``_RANGES``). A relative ``config`` path is made absolute against the current
        working directory (vLLM's)."""
        values: dict[str, Any] = {}
        for key, value in (extra or {}).items():
            kinds = _EXTRA_KEYS.get(key)
            if kinds is None:
                raise ValueError(
                    f"unknown tiercache kv_connector_extra_config key {key!r}; known: {sorted(_EXTRA_KEYS)}"
                )
            if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
                raise ValueError(f"kv_connector_extra_config[{key!r}] must be {kinds[0].__name__}: {value!r}")
            if key in _RANGES and isinstance(value, int | float):
                in_range(value, *_RANGES[key], f"kv_connector_extra_config[{key!r}]")
            values[key] = float(value) if float in kinds else value
        if values.get("config"):
            values["config"] = os.path.abspath(values["config"])
        if values.get("keyspace_file"):
            values["keyspace_file"] = os.path.abspath(values["keyspace_file"])
        if values.get("kv_layout", "layers") not in KV_LAYOUTS:
            raise ValueError(f"kv_connector_extra_config['kv_layout'] must be one of {KV_LAYOUTS}")
        if values.get("kv_layout") == "blocks" and values.get("layerwise"):
            raise ValueError(
                "kv_connector_extra_config['kv_layout'] = 'blocks' moves whole blocks of every layer: "
                "it cannot be combined with 'layerwise'"
            )
        if values.get("key_source", "auto") not in KEY_SOURCES:
            raise ValueError(f"kv_connector_extra_config['key_source'] must be one of {KEY_SOURCES}")
        if "server" in values:
            from tiercache_vllm._server import check_server_setting

            check_server_setting(values["server"])
        return cls(**values)

    def load_config(self) -> Config:
        """The tiercache config named by ``config`` (or the L1-only default), with ``l1_codec`` applied
        (``ConfigError`` when the tiers cannot store it, or for an fp8 L1 with ``kv_layout = "blocks"``)."""
        from tiercache.config import Config, check_l1_codec, load_config
        from tiercache.errors import ConfigError

        config = load_config(self.config) if self.config else Config()
        if self.l1_codec is not None:
            check_l1_codec(self.l1_codec, config.tiers, "kv_connector_extra_config['l1_codec']")
            config = dataclasses.replace(config, l1=dataclasses.replace(config.l1, codec=self.l1_codec))
        if self.kv_layout == "blocks" and config.l1.codec == "fp8":
            raise ConfigError(
                "kv_connector_extra_config['kv_layout'] = 'blocks' stores whole blocks of every layer as "
                "they lie in memory, where an fp8 L1's channel scales would span layers: use l1 codec 'raw'"
            )
        return config

    @property
    def config_id(self) -> str:
        """Identity of the config file for the engine registry."""
        base = str(Path(self.config).resolve()) if self.config else "<default>"
        return base if self.l1_codec is None else f"{base}|l1_codec={self.l1_codec}"


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
    key_args: KeyArgs | None = None
    """The request's identity and block hashes, as the scheduler keyed its lookup (None: tokens alone)."""
    epoch: int = 0
    """The request's save epoch when the load was planned (see ``SaveOp.epoch``)."""
    lookup: LookupResult | None = None
    """The scheduler's lookup of the whole prompt, set only when it ran on this process's worker engine:
    the load reuses its keys and hits (no second hash, no second L2 query)."""
    more_block_ids: list[list[int]] = field(default_factory=list)
    """The block ids of KV cache groups 1.. (a hybrid model; vLLM's null block 0 where a window ended)."""

    def group_blocks(self, group: int) -> list[int]:
        """The request's block ids in KV cache group ``group``."""
        return self.block_ids if group == 0 else self.more_block_ids[group - 1]


@dataclass(slots=True)
class SaveOp:
    """Store the chunks of ``token_ids`` after the first ``skip_tokens`` (a multiple of the chunk size).

    ``epoch`` counts the short loads of the request the scheduler has seen: a worker whose load of the request
    fell short at epoch ``e`` drops every save of it with ``epoch <= e`` (KV computed on failed blocks).
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip_tokens: int
    key_args: KeyArgs | None = None
    """The request's identity and block hashes (None: tokens alone)."""
    epoch: int = 0
    more_block_ids: list[list[int]] = field(default_factory=list)
    """The block ids of KV cache groups 1.. (see ``LoadOp.more_block_ids``)."""
    prompt_len: int = 0
    """The request's prompt length: its last hit boundary (window checkpoints)."""

    def group_blocks(self, group: int) -> list[int]:
        """The request's block ids in KV cache group ``group``."""
        return self.block_ids if group == 0 else self.more_block_ids[group - 1]


@dataclass
class TierCacheMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the worker does this step: loads, saves, and requests preempted (their saves are flushed)."""

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    reset_epoch: int = 0
    """Cache resets asked for so far: a worker that has done fewer clears its keyspace first (before any
    load of the step)."""


@dataclass
class WorkerState(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker -> scheduler, each step: ``disabled`` when a worker has no engine (its loads are misses);
    ``reset_epoch``: the cache resets it has done (``TierCacheMetadata.reset_epoch``)."""

    disabled: bool = False
    reset_epoch: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> WorkerState:
        """Disabled when any worker is (one rank without KV makes every load of the step a miss); the resets
        every worker has done."""
        return WorkerState(
            self.disabled or bool(getattr(other, "disabled", False)),
            min(self.reset_epoch, int(getattr(other, "reset_epoch", 0))),
        )


def check_failure_policy(vllm_config: VllmConfig, can_load: bool) -> None:
    """``ValueError`` unless a loading connector runs with ``kv_load_failure_policy="recompute"``.

    A load that falls short is reported as invalid blocks; vLLM's default policy ``"fail"`` would turn that
    cache miss into a failed request, which the connector cannot undo.
    """
    transfer = vllm_config.kv_transfer_config
    policy = str(getattr(transfer, "kv_load_failure_policy", "recompute"))
    if can_load and policy != "recompute":
        raise ValueError(
            f'tiercache: kv_load_failure_policy="{policy}" would fail a request on any cache read error; '
            'set kv_load_failure_policy="recompute" in --kv-transfer-config (or use kv_role="kv_producer")'
        )


# ----- layout and keyspace ----------------------------------------------------------------------
def layout_from_vllm(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, group: int = 0
) -> PagedLayout:
    """The paged layout vLLM will hand the worker for KV cache group ``group``, from its configs alone (the
    scheduler has no tensors); ``NotImplementedError`` naming what cannot be cached (``_groups``).

    CPU platform -> ``CPU_BLOCKS`` (whole-block pages), MLA -> ``VLLM_MLA``, ``kv_layout = "blocks"`` on
    vLLM's ``BLNHC`` allocation -> ``VLLM_BLOCKS``, otherwise ``VLLM_FLASH``; a recurrent state group -> its
    state pages (``_state.state_layout``). Every attention group must share one page format (heads, head
    size, dtype, vLLM's block size).
    """
    from vllm.platforms import current_platform

    from tiercache.gpu.layouts import LayoutKind, PagedLayout
    from tiercache_vllm._groups import kv_groups

    groups = kv_groups(vllm_config, kv_cache_config)
    assert kv_cache_config is not None  # kv_groups checked it
    specs: list[Any] = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    if groups[group].kind == "recurrent":
        from tiercache_vllm._state import state_layout

        return state_layout(specs[group], len(groups[group].layer_names))
    kv_specs = [s for s, g in zip(specs, groups, strict=True) if g.kind != "recurrent"]
    formats = {(int(s.num_kv_heads), int(s.head_size), str(s.dtype), int(s.block_size)) for s in kv_specs}
    block_size = int(vllm_config.cache_config.block_size)
    if len(formats) != 1 or next(iter(formats))[3] != block_size:
        raise NotImplementedError(
            "tiercache: cannot cache this model's KV: its KV cache groups differ in page format "
            f"(heads, head size, dtype, block size: {sorted(formats)}; vLLM block size {block_size})"
        )
    spec = specs[group]
    use_mla = bool(getattr(vllm_config.model_config, "use_mla", False))
    if use_mla:
        kind, heads = LayoutKind.VLLM_MLA, 1
    else:
        kind = LayoutKind.CPU_BLOCKS if current_platform.is_cpu() else _gpu_kind(vllm_config, len(groups))
        heads = int(spec.num_kv_heads)
    return PagedLayout(
        kind,
        num_layers=len(groups[group].layer_names),
        num_kv_heads=heads,
        head_dim=int(spec.head_size),
        block_size=int(spec.block_size),
        dtype=str(spec.dtype).removeprefix("torch."),
    )


def requested_kv_layout(vllm_config: VllmConfig) -> str | None:
    """The vLLM KV cache layout the connector asks for: ``BLNHC`` where ``kv_layout`` is ``blocks``, on a GPU
    platform (vLLM's CPU attention has one layout), for a model that can store blocks
    (``blocks_fit``), else None (vLLM's own choice)."""
    from vllm.platforms import current_platform

    if not _blocks_asked(vllm_config) or current_platform.is_cpu():
        return None
    return "BLNHC" if blocks_fit(vllm_config) else None


def _blocks_asked(vllm_config: VllmConfig) -> bool:
    """True where the connector's ``kv_layout`` setting is ``blocks``."""
    transfer = vllm_config.kv_transfer_config
    extra = getattr(transfer, "kv_connector_extra_config", None) if transfer is not None else None
    return ConnectorSettings.from_extra(extra).kv_layout == "blocks"


def blocks_fit(vllm_config: VllmConfig) -> bool:
    """True for a model whose KV can be stored as whole blocks: no MLA, no recurrent layers and one kind of
    attention in every layer (one KV cache group); logs once why not where ``kv_layout`` asked for blocks."""
    model = vllm_config.model_config
    hf = getattr(model, "hf_text_config", None)
    kinds = set(getattr(hf, "layer_types", None) or ())
    why = (
        "MLA"
        if getattr(model, "use_mla", False)
        else "recurrent layers"
        if getattr(model, "is_hybrid", False)
        else f"layers of several attention kinds ({sorted(kinds)})"
        if len(kinds) > 1
        else None
    )
    if why is not None and _blocks_asked(vllm_config):
        _warn_layout_once(f"kv_layout 'blocks' does not apply to a model with {why}: storing tokens")
    return why is None


def _gpu_kind(vllm_config: VllmConfig, n_groups: int) -> LayoutKind:
    """``VLLM_BLOCKS`` where the connector asked for ``BLNHC`` and vLLM allocated it for a model of one KV
    cache group, else ``VLLM_FLASH`` (with one warning where blocks were asked for)."""
    from tiercache.gpu.layouts import LayoutKind

    if not _blocks_asked(vllm_config):
        return LayoutKind.VLLM_FLASH
    resolved = vllm_config.cache_config.kv_cache_layout
    if resolved == "BLNHC" and n_groups == 1:
        return LayoutKind.VLLM_BLOCKS
    _warn_layout_once(
        f"kv_layout 'blocks' needs vLLM's BLNHC allocation and one KV cache group; vLLM allocated {resolved} "
        f"for {n_groups} group(s): storing tokens (kv_layout 'layers')"
    )
    return LayoutKind.VLLM_FLASH


_LAYOUT_WARNINGS: set[str] = set()  # the kv_layout warnings logged in this process


def _warn_layout_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process sees it."""
    if message not in _LAYOUT_WARNINGS:
        _LAYOUT_WARNINGS.add(message)
        logger.warning("tiercache: %s", message)


def model_fingerprint(vllm_config: VllmConfig) -> str:
    """16 hex digits identifying what the model's KV depends on beyond its name and revision.

    Covers: the KV cache dtype as vLLM names it (``auto``, ``bfloat16``, ``fp8_e4m3``, ``fp8_e5m2`` ...), the
    model dtype, the HF config after ``hf_overrides`` (rope settings, quantization and checkpoint k/v scale
    settings included), and, for a local model directory, each weight file's (and weight index's) name and
    size plus a SHA-256 of its first and last MiB (a safetensors header, every tensor's name, dtype, shape
    and offset, sits at the start). Stable across hosts (no paths or mtimes); a hub model id relies on its
    revision instead.
    """
    import hashlib
    import json

    model_config = vllm_config.model_config
    digest = hashlib.sha256()
    hf_config: Any = getattr(model_config, "hf_config", None)
    config = hf_config.to_dict() if hf_config is not None else {}
    for volatile in ("_name_or_path", "transformers_version", "_commit_hash", "name_or_path"):
        config.pop(volatile, None)
    head = {
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "dtype": str(getattr(model_config, "dtype", "")),
        "hf_config": config,
    }
    digest.update(json.dumps(head, sort_keys=True, default=str).encode())
    root = Path(str(model_config.model))
    if root.is_dir():
        digest.update(_weights_digest(root))
    return digest.hexdigest()[:16]


_WEIGHTS_SEEN: dict[tuple[str, tuple[tuple[str, int, int], ...]], bytes] = {}


def _weights_digest(root: Path) -> bytes:
    """Digest of a model directory's weight files (names, sizes, first and last MiB); cached per process
    while no file's size or mtime changes (mtimes only key the cache, they are not hashed)."""
    import hashlib

    files = sorted(p for p in root.iterdir() if _is_weight_file(p))
    stats = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    key = (str(root.resolve()), stats)
    found = _WEIGHTS_SEEN.get(key)
    if found is None:
        digest = hashlib.sha256()
        for path, (name, size, _) in zip(files, stats, strict=True):
            digest.update(f"|{name}:{size}:".encode())
            digest.update(_ends_digest(path))
        found = _WEIGHTS_SEEN[key] = digest.digest()
    return found


_WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf"})
_END_BYTES = 1 << 20


def _is_weight_file(path: Path) -> bool:
    """Weight files and weight indexes (``*.index.json``) of a model directory."""
    weights = path.suffix in _WEIGHT_SUFFIXES or path.name.endswith(".index.json")
    return weights and path.is_file()


def _ends_digest(path: Path) -> bytes:
    """SHA-256 of a file's first and last MiB (the whole file when smaller than 2 MiB)."""
    import hashlib

    digest = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as f:
        digest.update(f.read(_END_BYTES))
        if size > _END_BYTES:
            f.seek(max(_END_BYTES, size - _END_BYTES))
            digest.update(f.read(_END_BYTES))
    return digest.digest()


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
    key_source: str = ""
    group: str = ""
    """The KV cache group's tag (``GroupSpec.tag``, ``KeySpace.kv_group``); empty for plain full attention."""

    def keyspace_args(self) -> KeyspaceArgs:
        """The keyword arguments that key this identity in ``CacheEngine.open`` and ``keyspace_for``."""
        return KeyspaceArgs(
            model=self.model,
            revision=self.revision,
            world_size=self.world_size,
            rank=self.rank,
            key_source=self.key_source,
        )


class KeyspaceArgs(TypedDict):
    """An identity's keyspace fields, named as ``CacheEngine.open`` and ``keyspace_for`` take them."""

    model: str
    revision: str
    world_size: int
    rank: int | str
    key_source: str


def identity(
    vllm_config: VllmConfig,
    settings: ConnectorSettings,
    layout: PagedLayout,
    rank: int | str,
    group: str = "",
) -> EngineIdentity:
    """The engine identity for ``rank`` (``"shared"`` for MLA) and KV cache group ``group`` (its tag) of this
    vLLM config.

    The keyspace's revision holds the model revision and ``model_fingerprint`` (``"REV+kv-FINGERPRINT"``), so
    a different KV cache dtype, config override or weight file is a different keyspace (all misses).
    """
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if int(getattr(parallel, "pipeline_parallel_size", 1)) > 1:
        raise NotImplementedError("tiercache does not support pipeline parallelism yet")
    revision = str(getattr(model_config, "revision", None) or "")
    return EngineIdentity(
        config_id=settings.config_id,
        model=settings.model_id or str(model_config.model),
        revision=f"{revision}+kv-{model_fingerprint(vllm_config)}",
        layout=layout,
        world_size=int(parallel.tensor_parallel_size),
        rank=rank,
        layerwise=settings.layerwise,
        key_source=vllm_key_source(vllm_config, settings.key_source),
        group=group,
    )


_registry_lock = threading.Lock()
_ENGINES: dict[EngineIdentity, CacheEngine] = {}


_DISABLED: set[EngineIdentity] = set()


def mark_disabled(ident: EngineIdentity) -> None:
    """Record that this process's worker for ``ident`` runs without an engine (its scheduler fails closed)."""
    with _registry_lock:
        _DISABLED.add(ident)


def worker_disabled(ident: EngineIdentity) -> bool:
    """True when a worker of this process could not open its engine for ``ident``."""
    with _registry_lock:
        return ident in _DISABLED


def register_engine(ident: EngineIdentity, engine: CacheEngine) -> None:
    """Make ``engine`` the one of ``ident`` for this process's scheduler (a KV cache group's engine)."""
    with _registry_lock:
        _ENGINES[ident] = engine


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
    ident: EngineIdentity,
    config: Config,
    timeout_s: float,
    *,
    register: bool,
    lookup_only: bool = False,
    server: str | None = None,
    role: str = "worker",
    request_timeout_s: float = 5.0,
) -> CacheEngine:
    """Open a CacheEngine on the background loop (``register``: make it visible to this process's scheduler).

    ``lookup_only`` shrinks L1 to two slots (the scheduler of a multi-process engine never stores).
    ``server``: a socket path; the engine then runs on the server's shared L1 (``role`` in its HELLO), with
    no L2 tier of its own, each request to the server limited to ``request_timeout_s``.
    """
    from tiercache.config import L1Config
    from tiercache.store.engine import CacheEngine

    if server is not None:
        return _open_on_server(
            ident, config, timeout_s, register=register, server=server, role=role, request_s=request_timeout_s
        )
    if lookup_only:
        codec = config.l1.codec
        slot = CacheEngine.slot_bytes(ident.layout, config.chunk_size, ident.layerwise, codec)
        config = dataclasses.replace(config, l1=L1Config(capacity=2 * slot + 64, pinned=False, codec=codec))

    async def opener(cfg: Config) -> CacheEngine:
        engine = await CacheEngine.open(cfg, ident.layout, layerwise=ident.layerwise, **ident.keyspace_args())
        if not ident.group:
            return engine
        return engine_like(engine, ident.layout, keyspace_of(cfg, ident))

    # a tier down at start is re-opened by the manager
    return _open_on_loop(opener(config), ident, timeout_s, register=register)


def _open_on_loop(
    opening: Coroutine[Any, Any, CacheEngine], ident: EngineIdentity, timeout_s: float, *, register: bool
) -> CacheEngine:
    """Run ``opening`` on the background loop; with ``register``, make its engine the one of ``ident`` for
    this process's scheduler."""
    engine = _loop.call(opening, timeout_s)
    if register:
        with _registry_lock:
            _ENGINES[ident] = engine
    return engine


def keyspace_of(config: Config, ident: EngineIdentity) -> KeySpace:
    """The keyspace the engine of ``ident`` keys its chunks in under ``config``."""
    from tiercache.store.engine import CacheEngine

    keyspace = CacheEngine.keyspace_for(config, ident.layout, **ident.keyspace_args())
    return dataclasses.replace(keyspace, kv_group=ident.group) if ident.group else keyspace


def _open_on_server(
    ident: EngineIdentity,
    config: Config,
    timeout_s: float,
    *,
    register: bool,
    server: str,
    role: str,
    request_s: float,
) -> CacheEngine:
    """``open_engine`` on the server's shared L1 (keys computed here, from the same keyspace)."""
    from tiercache.errors import ConfigError
    from tiercache.store.engine import CacheEngine
    from tiercache_vllm._server import open_server_manager

    if config.l1.codec != "raw":
        raise ConfigError(
            f'server mode holds raw KV in the shared L1: l1 codec "{config.l1.codec}" (the config\'s [l1] '
            "codec or kv_connector_extra_config['l1_codec']) needs server=\"off\""
        )

    keyspace = keyspace_of(config, ident)
    slot = CacheEngine.slot_bytes(ident.layout, config.chunk_size, ident.layerwise)

    async def opener() -> CacheEngine:
        manager = open_server_manager(server, config, role=role, slot_bytes=slot, timeout_s=request_s)
        return CacheEngine(
            manager,
            ident.layout,
            keyspace,
            chunk_size=config.chunk_size,
            save_unfull_chunk=config.save_unfull_chunk,
            layerwise=ident.layerwise,
            tenant_by=config.l1.tenant_by,
        )

    return _open_on_loop(opener(), ident, timeout_s, register=register)


def engine_for_rank(base: CacheEngine, rank: int | str) -> CacheEngine:
    """An engine sharing ``base``'s manager (L1 + tiers) with the keyspace of another TP rank."""
    return engine_like(base, base.layout, dataclasses.replace(base.keyspace, rank=rank))  # type: ignore[arg-type]


def engine_like(base: CacheEngine, layout: PagedLayout, keyspace: KeySpace) -> CacheEngine:
    """An engine sharing ``base``'s manager (L1 + tiers) with another layout and keyspace (another TP rank
    or KV cache group)."""
    from tiercache.store.engine import CacheEngine

    return CacheEngine(
        base.manager,
        layout,
        keyspace,
        chunk_size=base.chunk_size,
        save_unfull_chunk=base.token_db.save_unfull_chunk,
        layerwise=base.layerwise,
        tenant_by=base.tenant_by,
    )
