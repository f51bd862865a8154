"""Deployment config: a TOML (or YAML) file -> typed, frozen objects -> the constructors the Python API uses.

Unknown keys are errors naming the key and the file. Secrets never live in the file: options ending in
``_env`` name environment variables that are read when a tier is opened.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tiercache._secrets import SECRET_NAMES as _SECRET_NAMES
from tiercache._secrets import check_url_secrets, redact_text, redact_url
from tiercache.errors import ConfigError
from tiercache.eviction import EVICTION_POLICIES
from tiercache.sizes import MAX_SIZE as _MAX_SIZE
from tiercache.sizes import in_range as _in_range
from tiercache.sizes import parse_size

__all__ = [
    "EVICTION_POLICIES",
    "L1_CODECS",
    "LOG_LEVELS",
    "TENANT_BY",
    "Config",
    "L1Config",
    "ManagerConfig",
    "ServerConfig",
    "TierConfig",
    "check_events_endpoint",
    "check_l1_codec",
    "check_url_secrets",
    "config_from_dict",
    "load_config",
    "redact_text",
    "redact_url",
    "resolve_secrets",
]

L1_CODECS = ("raw", "fp8")
"""What an L1 slot may hold: the KV's bytes, or its fp8 (e4m3, float32 channel scales) payload."""
_EVENTS_SCHEMES = ("tcp://", "ipc://")
MIN_SECONDS = 0.001
"""The shortest deadline or cool-down a config may set (1 ms)."""
MAX_CHUNK_SIZE = 1 << 20
"""The most tokens per chunk a config may set."""
_MAX_ID = (1 << 32) - 2  # the largest uid or gid ((uid_t) -1 means "none")
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _parse_size(value: object, where: str) -> int:
    try:
        return parse_size(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _size_in_range(value: object, low: int, high: int, where: str) -> int:
    """A size (bytes or ``"8GiB"``) in ``[low, high]``; ConfigError naming ``where`` otherwise."""
    size = _parse_size(value, where)
    _in_range(size, low, high, where)
    return size


@dataclass(frozen=True, slots=True)
class L1Config:
    """Host-memory tier."""

    capacity: int = 1 << 30
    """Bytes of host memory for KV objects (``"8GiB"`` accepted in files). Default 1 GiB."""
    pinned: bool | None = None
    """Pin the pool (page-locked) for fast GPU copies; None = pin when CUDA is available."""
    codec: str = "raw"
    """What L1 holds: ``"raw"`` KV bytes, or ``"fp8"``: the ``fp8`` codec's payload (e4m3 + float32 channel
    scales, about half the bytes), quantized while gathered and dequantized while scattered. With ``"fp8"``
    every tier's chain must start with ``fp8`` (channel granularity): tiers store L1's bytes as they are."""
    eviction: str = "lru"
    """Which object L1 evicts for room: ``"lru"`` (least recently used) or ``"s3fifo"`` (scan-resistant:
    one-off prompts leave before the chunks conversations come back for)."""
    quotas: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Tenant id (``tiercache.store.policy.tenant_id(salt)``) -> bytes of L1 its objects may take; a tenant at
    its quota evicts its own least recently used objects first."""
    default_quota: int = 0
    """L1 bytes of each tenant not in ``quotas`` (0: no limit)."""
    max_pinned_share: float = 0.5
    """Share of L1's slots one tenant may keep pinned."""
    max_tenant_labels: int = 32
    """Tenants named in per-tenant metrics; the others are counted under ``"other"``."""
    tenant_by: str = "salt"
    """What names a tenant in quotas and metrics: ``"salt"`` (the request's ``cache_salt``) or
    ``"salt+lora"`` (its salt and LoRA adapter name: each adapter a tenant of its own)."""


TENANT_BY = ("salt", "salt+lora")
"""The values of ``l1.tenant_by``."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """``[server]``: the node's shared-L1 server (``tiercache serve``); the CLI's ``--socket`` wins."""

    socket: str | None = None
    """Unix socket path the server listens on (clients: where ``"auto"`` looks for the node's server)."""
    slot_bytes: int | None = None
    """Optional: an object size to make a size class for at start. Without it classes come from the clients'
    object sizes (every model on the node is served)."""
    mode: int = 0o600
    """Socket file mode (``"0660"`` in files)."""
    group: int | str | None = None
    """Group (gid or name) owning the socket; its members may connect."""
    allowed_uids: tuple[int, ...] = ()
    """Peer uids allowed besides the group and the server's own uid."""
    metrics_port: int | None = None
    """Serve Prometheus ``/metrics`` on this port (0 = any free port); None = off."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds."""
    drain_s: float = 10.0
    """On SIGTERM, how long the write-behind of chunks to the L2 tiers may take to drain before exit."""
    region_bytes: int | None = None
    """Bytes of one region, the unit a size class takes from ``l1.capacity`` and the largest object the server
    holds; default ``l1.capacity / 16`` within [64 MiB, 1 GiB] (at least ``slot_bytes``)."""
    admin_group: int | str | None = None
    """Group (gid or name) whose members may CLEAR and DRAIN; the server's own uid always may."""
    server_uid: int | str | None = None
    """Clients: the uid (or user name) the server must run as; default this process's uid or root."""
    max_clients: int = 1024
    """Connections served at once; more are refused with a ``busy`` error."""
    max_leases_per_client: int = 16384
    """Read leases one connection may hold; pinned hits beyond it are answered as misses (counted)."""
    max_share_per_client: float = 0.9
    """Fraction of the segment one client process may hold reserved or leased, all its connections together
    (0 < x <= 1; always at least one slot)."""
    orphan_grace_s: float = 60.0
    """A lost client whose process cannot be watched (no pidfd): its unfinished writes' slots come back after
    this many seconds (their keys are free at once)."""
    events_endpoint: str | None = None
    """ZMQ PUB address (``tcp://host:port`` or ``ipc://path``) of the node's KV event stream in vLLM's format;
    None = off. Needs pyzmq (``pip install 'tiercache[events]'``)."""
    events_topic: str = ""
    """Topic frame of every event message (vLLM's ``kv_events_config.topic``)."""
    log_level: str = "info"
    """Lowest level the server logs to stderr: debug, info, warning, error or critical (``tiercache serve
    --log-level`` wins)."""


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
"""Level names of ``server.log_level`` (and the server's ``--log-level``)."""


def _number(r: _Reader, key: str, kinds: tuple[type, ...], default: Any, low: float, high: float) -> Any:
    """``r.take(key, kinds, default)`` checked to lie in ``[low, high]`` (ConfigError naming the key)."""
    value = r.take(key, kinds, default)
    if isinstance(value, int | float):  # the kinds may allow a name too (a group)
        _in_range(value, low, high, f"{r.source}: {r._name(key)}")
    return value


def _server_config(data: Mapping[str, Any], source: str) -> ServerConfig:
    """Parse the ``[server]`` table."""
    r = _Reader(data, "server", source)
    slot_bytes = r.take("slot_bytes", (str, int), None)
    region_bytes = r.take("region_bytes", (str, int), None)
    mode = r.take("mode", (str, int), 0o600)
    try:
        mode = int(mode, 8) if isinstance(mode, str) else mode
    except ValueError:
        raise ConfigError(
            f'{source}: server.mode must be an octal string like "0660", got {mode!r}'
        ) from None
    uids = r.take("allowed_uids", (list,), [])
    if not all(type(u) is int for u in uids):
        raise ConfigError(f"{source}: server.allowed_uids must be a list of non-negative ints")
    for i, uid in enumerate(uids):
        _in_range(uid, 0, _MAX_ID, f"{source}: server.allowed_uids[{i}]")
    ids = {
        key: _number(r, key, (int, str), None, 0, _MAX_ID) for key in ("group", "admin_group", "server_uid")
    }
    out = ServerConfig(
        socket=r.take("socket", (str,), None),
        slot_bytes=None if slot_bytes is None else _parse_size(slot_bytes, f"{source}: server.slot_bytes"),
        region_bytes=None
        if region_bytes is None
        else _parse_size(region_bytes, f"{source}: server.region_bytes"),
        mode=mode,
        group=ids["group"],
        allowed_uids=tuple(uids),
        admin_group=ids["admin_group"],
        server_uid=ids["server_uid"],
        max_clients=_number(r, "max_clients", (int,), 1024, 1, 1 << 20),
        max_leases_per_client=_number(r, "max_leases_per_client", (int,), 16384, 1, 1 << 24),
        max_share_per_client=float(_number(r, "max_share_per_client", (int, float), 0.9, 1e-6, 1)),
        orphan_grace_s=float(_number(r, "orphan_grace_s", (int, float), 60.0, 0, 86400)),
        metrics_port=_number(r, "metrics_port", (int,), None, 0, 65535),
        metrics_host=r.take("metrics_host", (str,), "127.0.0.1"),
        drain_s=float(_number(r, "drain_s", (int, float), 10.0, 0, 3600)),
        events_endpoint=r.take("events_endpoint", (str,), None),
        events_topic=r.take("events_topic", (str,), ""),
        log_level=r.take("log_level", (str,), "info").lower(),
    )
    r.finish()
    if not 0 <= out.mode <= 0o777:
        raise ConfigError(f"{source}: server.mode {oct(out.mode)} is not a file mode")
    where = f"{source}: server"
    if out.log_level not in LOG_LEVELS:
        raise ConfigError(f"{where}.log_level must be one of {', '.join(LOG_LEVELS)}, got {out.log_level!r}")
    if out.slot_bytes is not None:
        _in_range(out.slot_bytes, 1, 1 << 40, f"{where}.slot_bytes")
    if out.region_bytes is not None:
        _in_range(out.region_bytes, 4096, 1 << 40, f"{where}.region_bytes")
    if out.events_endpoint is not None:
        try:
            check_events_endpoint(out.events_endpoint, f"{where}.events_endpoint")
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    return out


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    """Storage-manager policies for the L2 tiers (deadlines, queues, circuit breaker)."""

    l2_deadline_s: float = 2.0
    """Deadline of one L2 batch call (contains/get/put), seconds."""
    lookup_deadline_s: float = 0.5
    """Deadline of an L2 lookup (batched_contains) on the inference path, seconds."""
    store_queue_size: int = 256
    """Background store batches waiting per tier; when full, new stores are dropped and counted."""
    circuit_failures: int = 5
    """Consecutive failures of a tier that open its circuit (the tier is skipped)."""
    circuit_cooldown_s: float = 10.0
    """Seconds an open circuit waits before letting one probe call through."""
    l2_read_floor_s: float = 2.0
    """Fixed part of an L2 read's deadline, seconds (a read of B bytes gets floor + B / bandwidth)."""
    l2_read_mib_per_s: float = 64.0
    """Expected L2 read bandwidth in MiB/s (2**20 bytes per second) that scales a read's deadline."""
    l2_read_parallel: int = 4
    """Chunk gets of one L2 read in flight at once (requested in prefix order, delivered as they land)."""
    store_parallel: int = 4
    """Background store batches (encode + put) in flight per tier at once."""

    def l2_read_deadline_s(self, nbytes: int) -> float:
        """Deadline of an L2 read of ``nbytes`` bytes: ``l2_read_floor_s + nbytes / l2_read_mib_per_s``."""
        return self.l2_read_floor_s + nbytes / (self.l2_read_mib_per_s * 2**20)


MANAGER_RANGES: dict[str, tuple[float, float]] = {
    "l2_deadline_s": (MIN_SECONDS, 3600.0),
    "lookup_deadline_s": (MIN_SECONDS, 3600.0),
    "store_queue_size": (1, 1 << 20),
    "circuit_failures": (1, 1 << 20),
    "circuit_cooldown_s": (MIN_SECONDS, 86400.0),
    "l2_read_floor_s": (MIN_SECONDS, 3600.0),
    "l2_read_mib_per_s": (0.001, float(1 << 20)),
    "l2_read_parallel": (1, 1024),
    "store_parallel": (1, 1024),
}
"""Inclusive bounds of each ``[manager]`` number (seconds, counts, MiB/s), checked when a config loads."""


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One L2 tier: where (URL), how much, through which codec chain, with which adapter options."""

    name: str
    url: str
    capacity: int | None = None
    """Bytes this tier may hold (None: the backend's own limit)."""
    codecs: tuple[str | Mapping[str, Any], ...] = ("raw",)
    """Codec chain: one array->bytes codec, then bytes->bytes codecs, encryption last."""
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Adapter options; ``*_env`` options name environment variables holding secrets."""
    adapter: str | None = None
    """Explicit adapter class ``"module:Class"`` (settles a scheme claimed by two plugins)."""
    admit_after: int = 1
    """Store a chunk in this tier only once lookups have asked for it this many times (1: always; a
    frequency sketch counts, so one-off prompts cost this tier no bandwidth)."""
    quotas: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Tenant id -> bytes of frames this tier may hold for it (counted over what this process stored); a
    tenant at its quota has its oldest objects here deleted first."""
    default_quota: int = 0
    """Bytes in this tier of each tenant not in ``quotas`` (0: no limit)."""

    def adapter_options(self, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Options to pass to ``Adapter.open``: secrets resolved from the environment, capacity included."""
        options = resolve_secrets(self.options, f"tier {self.name!r}", environ)
        if self.capacity is not None:
            options["capacity"] = self.capacity
        return options


@dataclass(frozen=True, slots=True)
class Config:
    """A whole deployment: chunking, L1, ordered L2 tiers and manager policies."""

    chunk_size: int = 256
    """Tokens per chunk object."""
    save_unfull_chunk: bool = True
    """Whether a prompt's short tail chunk is stored too."""
    l1: L1Config = L1Config()
    tiers: tuple[TierConfig, ...] = ()
    """L2 tiers, searched in this order."""
    manager: ManagerConfig = ManagerConfig()
    cache_salt_env: str | None = None
    """Environment variable holding the tenant cache salt (isolates tenants' keys)."""
    source: str | None = None
    """File the config was read from (for messages)."""
    server: ServerConfig = ServerConfig()
    """The shared-L1 server (server mode)."""

    def tier(self, name: str) -> TierConfig:
        """The tier called ``name``."""
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise ConfigError(f"no tier named {name!r}; tiers: {[t.name for t in self.tiers]}")


def check_events_endpoint(endpoint: str, where: str = "server.events_endpoint") -> None:
    """``ValueError`` (one line naming ``where``) unless ``endpoint`` is a tcp:// or ipc:// address and pyzmq
    is installed."""
    if not endpoint.startswith(_EVENTS_SCHEMES) or len(endpoint) <= 6:
        raise ValueError(f"{where} must be a tcp:// or ipc:// address, not {endpoint!r}")
    try:
        import zmq  # noqa: F401
    except ImportError:
        raise ValueError(f"{where} needs pyzmq: pip install 'tiercache[events]'") from None


def resolve_secrets(
    options: Mapping[str, Any], where: str, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Replace each ``<name>_env = "VAR"`` option by ``<name> = $VAR``; an unset variable is a ConfigError."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key.endswith("_env"):
            if not isinstance(value, str):
                raise ConfigError(f"{where}: option {key!r} must name an environment variable")
            if value not in env:
                raise ConfigError(
                    f"{where}: option {key!r} names environment variable {value!r}, which is not set"
                )
            out[key.removesuffix("_env")] = env[value]
        else:
            out[key] = value
    return out


def _expand(text: str, where: str) -> str:
    """Expand ``${VAR}`` and ``${VAR:-default}`` in a URL."""

    def repl(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise ConfigError(f"{where}: environment variable {name!r} is not set (use ${{{name}:-default}})")

    return _ENV_REF.sub(repl, text)


class _Reader:
    """Walks a parsed document, taking known keys and naming unknown ones with the file."""

    def __init__(self, data: Mapping[str, Any], where: str, source: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: {where or 'top level'} must be a table, got {type(data).__name__}")
        self.data = dict(data)
        self.where = where
        self.source = source

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def take(self, key: str, kinds: tuple[type, ...], default: Any) -> Any:
        if key not in self.data:
            return default
        value = self.data.pop(key)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise ConfigError(f"{self.source}: {self._name(key)} must be {names}, got {value!r}")
        return value

    def finish(self) -> None:
        if self.data:
            unknown = ", ".join(repr(self._name(k)) for k in sorted(self.data))
            raise ConfigError(f"{self.source}: unknown config key {unknown}")


def _quotas(r: _Reader, where: str, source: str) -> tuple[Mapping[str, int], int]:
    """``quotas`` (tenant id -> size) and ``default_quota`` of a table, sizes checked."""
    quotas = {
        str(t): _size_in_range(b, 0, _MAX_SIZE, f"{source}: {where}.quotas.{t}")
        for t, b in r.take("quotas", (dict,), {}).items()
    }
    default = _size_in_range(
        r.take("default_quota", (str, int), 0), 0, _MAX_SIZE, f"{source}: {where}.default_quota"
    )
    return MappingProxyType(quotas), default


def _tier(data: Any, index: int, source: str, names: set[str]) -> TierConfig:
    r = _Reader(data, f"tiers[{index}]", source)
    name = r.take("name", (str,), None)
    url = r.take("url", (str,), None)
    if not name:
        raise ConfigError(f"{source}: tiers[{index}].name is required")
    if name in names:
        raise ConfigError(f"{source}: duplicate tier name {name!r}")
    names.add(name)
    if not url:
        raise ConfigError(f"{source}: tiers[{index}] ({name!r}).url is required")
    where = f"{source}: tier {name!r}"
    check_url_secrets(url, where)  # before expanding: a ${VAR} in a secret place is refused too
    url = _expand(url, where)
    check_url_secrets(url, where)
    capacity_raw = r.take("capacity", (str, int), None)
    capacity = (
        None if capacity_raw is None else _size_in_range(capacity_raw, 0, _MAX_SIZE, f"{where}: capacity")
    )
    codecs_raw = r.take("codecs", (list,), ["raw"])
    codecs: list[str | Mapping[str, Any]] = []
    for item in codecs_raw:
        if isinstance(item, str):
            codecs.append(item)
        elif isinstance(item, Mapping) and isinstance(item.get("id"), str):
            for key in item:
                if key in _SECRET_NAMES:
                    raise ConfigError(f"{where}: codec option {key!r} is a secret; use {key}_env")
            codecs.append(MappingProxyType(dict(item)))
        else:
            raise ConfigError(f"{where}: each codec is an id or a table with an 'id', got {item!r}")
    options = dict(r.take("options", (dict,), {}))
    for key in options:
        if key.lower() in _SECRET_NAMES:
            raise ConfigError(
                f"{where}: option {key!r} is a secret; put it in the environment and use {key}_env"
            )
    adapter = r.take("adapter", (str,), None)
    admit_after = _number(r, "admit_after", (int,), 1, 1, 15)
    quotas, default_quota = _quotas(r, f"tiers[{index}]", source)
    r.finish()
    _validate_chain(codecs, where)
    return TierConfig(
        name,
        url,
        capacity,
        tuple(codecs),
        MappingProxyType(options),
        adapter,
        admit_after,
        quotas,
        default_quota,
    )


def _validate_chain(codecs: list[str | Mapping[str, Any]], where: str) -> None:
    from tiercache.serde import build_pipeline

    try:
        build_pipeline(codecs, validate_only=True)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except Exception as exc:
        raise ConfigError(f"{where}: invalid codec chain: {exc}") from None


def _fp8_first(chain: tuple[str | Mapping[str, Any], ...]) -> bool:
    """Whether ``chain`` starts with the fp8 codec at channel granularity (the fp8 L1's own bytes)."""
    first = chain[0] if chain else None
    if isinstance(first, str):
        return first == "fp8"
    return (
        isinstance(first, Mapping)
        and first.get("id") == "fp8"
        and first.get("granularity", "channel") == "channel"
    )


def check_l1_codec(codec: str, tiers: tuple[TierConfig, ...], source: str = "<config>") -> None:
    """ConfigError unless ``codec`` is a known L1 codec and, for ``"fp8"``, every tier's chain starts with
    ``fp8`` at channel granularity (such a tier stores the fp8 L1's bytes as they are; any other chain would
    store dequantized, already lossy KV under a lossless-looking chain, so it is refused)."""
    if codec not in L1_CODECS:
        raise ConfigError(
            f"{source}: l1.codec must be one of {', '.join(map(repr, L1_CODECS))}, not {codec!r}"
        )
    if codec != "fp8":
        return
    for tier in tiers:
        if not _fp8_first(tier.codecs):
            chain = [c if isinstance(c, str) else dict(c) for c in tier.codecs]
            raise ConfigError(
                f'{source}: l1.codec = "fp8" keeps quantized KV, but tier {tier.name!r} has codecs {chain}: '
                'with an fp8 L1 every tier\'s chain must start with "fp8" (channel granularity), e.g. '
                '["fp8"] or ["fp8", "shuffle", "zstd"], so it stores the L1 bytes as they are; '
                'or keep l1.codec = "raw"'
            )


def config_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> Config:
    """Build a Config from parsed TOML/YAML data (the same checks as ``load_config``)."""
    r = _Reader(data, "", source)
    chunk_size = _number(r, "chunk_size", (int,), 256, 1, MAX_CHUNK_SIZE)
    save_unfull = r.take("save_unfull_chunk", (bool,), True)
    cache_salt_env = r.take("cache_salt_env", (str,), None)

    l1r = _Reader(r.take("l1", (dict,), {}), "l1", source)
    l1_capacity = l1r.take("capacity", (str, int), None)
    l1_quotas, l1_default_quota = _quotas(l1r, "l1", source)
    l1 = L1Config(
        capacity=L1Config().capacity
        if l1_capacity is None
        else _size_in_range(l1_capacity, 1, _MAX_SIZE, f"{source}: l1.capacity"),
        pinned=l1r.take("pinned", (bool,), None),
        codec=l1r.take("codec", (str,), "raw"),
        eviction=l1r.take("eviction", (str,), "lru"),
        quotas=l1_quotas,
        default_quota=l1_default_quota,
        max_pinned_share=float(_number(l1r, "max_pinned_share", (int, float), 0.5, 0.0, 1.0)),
        max_tenant_labels=_number(l1r, "max_tenant_labels", (int,), 32, 0, 10_000),
        tenant_by=l1r.take("tenant_by", (str,), "salt"),
    )
    l1r.finish()
    if l1.tenant_by not in TENANT_BY:
        raise ConfigError(
            f"{source}: l1.tenant_by must be one of {', '.join(map(repr, TENANT_BY))}, not {l1.tenant_by!r}"
        )
    if l1.eviction not in EVICTION_POLICIES:
        choices = ", ".join(map(repr, EVICTION_POLICIES))
        raise ConfigError(f"{source}: l1.eviction must be one of {choices}, not {l1.eviction!r}")

    mr = _Reader(r.take("manager", (dict,), {}), "manager", source)
    policy: dict[str, Any] = {}
    for key, default in asdict(ManagerConfig()).items():
        low, high = MANAGER_RANGES[key]
        kinds = (int, float) if isinstance(default, float) else (int,)
        value = _number(mr, key, kinds, default, low, high)
        policy[key] = float(value) if isinstance(default, float) else value
    manager = ManagerConfig(**policy)
    mr.finish()

    names: set[str] = set()
    tiers = tuple(_tier(t, i, source, names) for i, t in enumerate(r.take("tiers", (list,), [])))
    server = _server_config(r.take("server", (dict,), {}), source)
    r.finish()
    check_l1_codec(l1.codec, tiers, source)
    return Config(chunk_size, save_unfull, l1, tiers, manager, cache_salt_env, source, server=server)


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read a TOML (``.toml``) or YAML (``.yaml``/``.yml``, needs PyYAML) config file."""
    file = Path(path)
    source = str(file)
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {source}: {exc.strerror or exc}") from None
    if file.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{source}: YAML configs need PyYAML: pip install 'tiercache[yaml]'") from None
        try:
            data = yaml.safe_load(raw) or {}
        except (yaml.YAMLError, ValueError) as exc:  # ValueError: an int of more than 4300 digits
            raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    else:
        try:
            data = tomllib.loads(raw.decode())
        except (tomllib.TOMLDecodeError, ValueError) as exc:  # ValueError: bad UTF-8, an int of 4300+ digits
            raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    return config_from_dict(data, source)
