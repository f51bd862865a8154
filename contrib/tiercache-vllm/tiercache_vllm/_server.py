"""Server mode of the connector: the ``"server"`` key of ``kv_connector_extra_config`` (decided once).

* ``"off"`` (default): in-process (each worker owns its L1).
* ``"unix:///path"``: the node's ``tiercache serve`` on that socket. A server that is down (now or later) is
  cache-off for that time (misses, skipped stores) with reconnects; never in-process, never a failed request.
  A process that cannot run server mode at all (an install without one of its dependencies) logs one error
  line and runs cache-off.
* ``"auto"``: the node's daemon if it answers on ``server.socket`` of the tiercache config (default
  ``/run/tiercache/tiercache.sock``); else a private server for this vLLM instance, started by the first of
  its processes (scheduler or worker, an ``flock`` decides) with the connector's config (its path made
  absolute at start) and gone once that process exited; else (any failure, a missing dependency included)
  in-process with one warning line.

In server mode the scheduler and every worker run a ``CacheEngine`` on ``SharedL1`` (keys computed here), so
the scheduler's lookups see the shared L1 in every engine mode. The server owns L1 (and the L2 tiers, once it
runs them): the connector opens no L2 tier of its own there.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tiercache.server.listen import MAX_SOCKET_PATH, socket_path_fits

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from tiercache.config import Config
    from tiercache.gpu.layouts import PagedLayout
    from tiercache.store.engine import CacheEngine
    from tiercache.store.manager import StorageManager

__all__ = [
    "ServerChoice",
    "ServerSettings",
    "check_server_setting",
    "open_server_manager",
    "request_timeout_s",
    "resolve_server",
    "server_engine_stats",
    "server_for",
]

logger = logging.getLogger(__name__.replace("tiercache_vllm", "tiercache.vllm", 1))


class ServerSettings(Protocol):
    """The connector settings server mode reads (``ConnectorSettings`` has them)."""

    @property
    def server(self) -> str: ...
    @property
    def config(self) -> str | None: ...
    @property
    def layerwise(self) -> bool: ...
    @property
    def open_timeout_s(self) -> float: ...
    @property
    def lookup_timeout_s(self) -> float: ...
    @property
    def load_timeout_s(self) -> float: ...


_SCHEME = "unix://"


def check_server_setting(value: str) -> str:
    """``value`` if it is ``"off"``, ``"auto"`` or ``"unix:///absolute/path"``; else ``ValueError`` naming
    the key."""
    if value in ("off", "auto"):
        return value
    path = value[len(_SCHEME) :] if value.startswith(_SCHEME) else ""
    if not path.startswith("/") or not socket_path_fits(path) or "\0" in path:
        raise ValueError(
            'kv_connector_extra_config[\'server\'] must be "off", "auto" or "unix:///absolute/path" '
            f"(a socket path of at most {MAX_SOCKET_PATH} bytes): {value!r}"
        )
    return value


@dataclass(frozen=True, slots=True)
class ServerChoice:
    """What this process runs on: ``socket`` None = in-process; ``how`` says why (logs, stats)."""

    socket: str | None
    how: str
    """``off``, ``configured`` (unix://), ``unavailable`` (unix://, but server mode cannot run in this
    process, e.g. an install without one of its dependencies: the cache is off), ``daemon`` (auto found one),
    ``autostarted`` (auto, private server), ``fallback`` (auto, no server: in-process)."""


_lock = threading.Lock()
_CHOICES: dict[tuple[str, str], ServerChoice] = {}


def resolve_server(
    setting: str,
    config: Config,
    *,
    config_path: str | None,
    slot_bytes: int,
    instance: str,
    timeout_s: float,
) -> ServerChoice:
    """The server this process uses for ``setting`` (decided once per process and instance).

    ``instance``: vLLM's ``engine_id`` (every process of one vLLM instance has the same); ``slot_bytes``:
    one chunk object, the private server's slot size.
    """
    key = (setting, instance)
    with _lock:
        found = _CHOICES.get(key)
        if found is None:
            found = _CHOICES[key] = _decide(setting, config, config_path, slot_bytes, instance, timeout_s)
    return found


def server_for(
    vllm_config: VllmConfig, settings: ServerSettings, config: Config, layout: PagedLayout
) -> ServerChoice:
    """``resolve_server`` for one connector side of this vLLM instance."""
    from tiercache.store.engine import CacheEngine

    transfer = vllm_config.kv_transfer_config
    return resolve_server(
        settings.server,
        config,
        config_path=settings.config,
        slot_bytes=CacheEngine.slot_bytes(layout, config.chunk_size, settings.layerwise),
        instance=str(getattr(transfer, "engine_id", None) or "default"),
        timeout_s=settings.open_timeout_s,
    )


def _decide(
    setting: str, config: Config, config_path: str | None, slot_bytes: int, instance: str, timeout_s: float
) -> ServerChoice:
    """The choice for ``setting``; never raises: a piece of server mode that is missing or fails (an install
    without it, a server that cannot start) is one log line, then in-process (``auto``) or cache-off
    (``unix://``)."""
    if setting == "off":
        return ServerChoice(None, "off")
    if setting != "auto":
        path = setting[len(_SCHEME) :]
        try:
            from tiercache.server.autostart import socket_answers

            answers = socket_answers(path)
        except Exception as exc:
            logger.error(
                'tiercache: "server": "%s" cannot be used in this process (%s); the cache is off',
                setting,
                _one_line(exc),
            )
            return ServerChoice(path, "unavailable")
        if not answers:
            logger.warning("tiercache: no server answers on %s yet; cache off until it does", path)
        return _announce(ServerChoice(path, "configured"), config)
    daemon = config.server.socket or "the default daemon socket"
    try:
        from tiercache.server.autostart import DEFAULT_SOCKET, ensure_private_server, socket_answers

        daemon = config.server.socket or DEFAULT_SOCKET
        if socket_answers(daemon):
            return _announce(ServerChoice(daemon, "daemon"), config)
        private = hashlib.sha256(instance.encode()).hexdigest()[:16]
        path = ensure_private_server(
            private, slot_bytes=slot_bytes, config_path=config_path, timeout_s=timeout_s
        )
    except Exception as exc:
        logger.warning(
            'tiercache: "server": "auto" found no server on %s and could not start one (%s); running '
            "in-process (in vLLM's multi-process engine the scheduler then sees only the L2 tiers)",
            daemon,
            _one_line(exc),
        )
        return ServerChoice(None, "fallback")
    return _announce(ServerChoice(path, "autostarted"), config)


def _one_line(exc: BaseException) -> str:
    """``exc`` as one line (an install without a dependency says how to get it)."""
    from tiercache.server.autostart import AutostartError

    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, ImportError):
        return f"{type(exc).__name__}: {text} (install tiercache with its dependencies)"
    return text if isinstance(exc, AutostartError) else f"{type(exc).__name__}: {text}"


def _announce(choice: ServerChoice, config: Config) -> ServerChoice:
    logger.info("tiercache: server mode (%s) on %s", choice.how, choice.socket)
    if config.tiers and choice.how != "autostarted":  # a private server runs the connector's own config
        logger.warning(
            "tiercache: server mode: the connector opens no L2 tier of its own; the %d tier(s) of its config "
            "are ignored here (the server runs the tiers of its own config)",
            len(config.tiers),
        )
    return choice


MAX_REQUEST_TIMEOUT_S = 5.0
"""The longest one request of a connector side to the server may take (the client's own default)."""
REQUEST_SHARE = 0.75
"""The share of its caller's deadline one request to the server may take (the rest: the caller's own work)."""


def request_timeout_s(settings: ServerSettings, role: str) -> float:
    """How long one request of this side to the server may take before the client ends the connection
    (cache-off at once, reconnected in the background): ``REQUEST_SHARE`` of the shortest deadline its
    callers wait, at most ``MAX_REQUEST_TIMEOUT_S``. The scheduler's callers wait ``lookup_timeout_s``; a
    worker's wait ``load_timeout_s``, and ``lookup_timeout_s`` too (a scheduler in the same process looks up
    on the worker's engine). Default: 1.5 s for both.

    The client's requests block the connector's loop: one that outlived its caller's deadline would keep
    the loop busy after the caller gave up, and each later call would wait out its own deadline behind it
    (a hung server cost several lookup timeouts). Within the deadline, the request that found the server
    hung ends the connection, and every later call is answered cache-off at once. The server's own bound on
    a LOOKUP that asks its L2 tiers (``manager.lookup_deadline_s`` per tier, 0.5 s) must stay below it."""
    deadline = settings.lookup_timeout_s
    if role != "scheduler":
        deadline = min(deadline, settings.load_timeout_s)
    return min(MAX_REQUEST_TIMEOUT_S, REQUEST_SHARE * deadline)


def open_server_manager(
    socket_path: str,
    config: Config,
    *,
    role: str,
    slot_bytes: int,
    timeout_s: float = MAX_REQUEST_TIMEOUT_S,
) -> StorageManager:
    """A ``StorageManager`` on the server's shared L1 (no L2 tier); call on the engine's event loop.
    ``slot_bytes`` (one chunk object) is declared to the server, which makes a size class for it;
    ``timeout_s``: one request's limit (see ``request_timeout_s``)."""
    from tiercache.server.client import SharedL1
    from tiercache.server.main import server_uid_of
    from tiercache.store.manager import StorageManager

    l1 = SharedL1(
        socket_path,
        role=role,
        timeout_s=timeout_s,
        slot_bytes=[slot_bytes],
        server_uid=server_uid_of(config.server.server_uid),
    )
    return StorageManager(l1, [], config.manager)


def server_engine_stats(engine: CacheEngine | None) -> dict[str, int]:
    """The client counters of an engine on the shared L1 (empty for an in-process engine)."""
    l1 = getattr(getattr(engine, "manager", None), "l1", None)
    if l1 is None or not hasattr(l1, "reconnects"):
        return {}
    return {
        "server_connected": int(l1.connected()),
        "server_reconnects": int(l1.reconnects),
        "server_lost_connections": int(l1.lost_connections),
        "server_offline_misses": int(l1.offline_misses),
        "server_skipped_stores": int(l1.skipped_stores),
        "server_refused_leases": int(l1.refused_leases),
        "server_requests": sum(l1.requests.values()),
    }
