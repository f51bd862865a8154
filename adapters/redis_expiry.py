"""Expiry of a Redis/Valkey tier's objects (its ``ttl``), as the server announces it: keyspace notifications.

The server publishes ``__keyevent@<db>__:expired`` with the expired key's name when
``notify-keyspace-events`` holds ``E`` and ``x`` (or ``A``). :func:`watch_expiry` turns that on with ``CONFIG
SET`` (added to what the server already announces) where the server allows it, else logs one warning line
that expiry is not announced; it subscribes on a connection of its own in a daemon thread and reports the
expired keys under the adapter's prefix (the heads of parted objects; their ``#n`` parts are skipped) as
``fn("expired", keys)``, batched as they arrive. A lost connection is re-made and the flags set again (a
restarted server forgot them); expiries meanwhile are not announced. A cluster's nodes announce only their
own keys: expiry on a cluster is not announced (one warning line).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tiercache.adapters._listeners import TierListener

if TYPE_CHECKING:
    from tiercache.adapters.redis import RedisAdapter

__all__ = ["ExpiryWatcher", "notify_flags", "watch_expiry"]

log = logging.getLogger(__name__)

_CONNECTION_KEYS = ("host", "port", "db", "username", "password", "socket_connect_timeout")
_SSL_KEYS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_BATCH = 512
"""Most keys told in one call."""


def notify_flags(current: str) -> str | None:
    """``notify-keyspace-events`` flags that keep ``current`` and add expired-key events (``E`` + ``x``);
    None when ``current`` already announces them."""
    has_x = "x" in current or "A" in current
    if "E" in current and has_x:
        return None
    return current + ("" if "E" in current else "E") + ("" if has_x else "x")


def watch_expiry(adapter: RedisAdapter, fn: TierListener) -> Callable[[], None]:
    """Tell ``fn("expired", keys)`` the chunk keys of ``adapter`` that its server expires; returns a function
    that stops watching. Without a TTL nothing expires: nothing is started."""
    if adapter.ttl_ms is None:
        return _nothing
    if adapter.scheme.endswith("+cluster"):
        log.warning(
            "redis tier %s: expiry (ttl) is not announced as KV events on a cluster; expired chunks stay "
            "announced until deleted or reset",
            adapter.name,
        )
        return _nothing
    pool = adapter._client.connection_pool
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if k in _CONNECTION_KEYS}
    if "SSL" in getattr(pool.connection_class, "__name__", ""):
        kwargs["ssl"] = True
        kwargs.update({k: v for k, v in pool.connection_kwargs.items() if k in _SSL_KEYS})
    ref = weakref.ref(adapter)

    def closed() -> bool:
        found = ref()
        return found is None or found._closed

    watcher = ExpiryWatcher(adapter.name, adapter.prefix, int(kwargs.get("db", 0)), kwargs, fn, closed)
    return watcher.stop


class ExpiryWatcher:
    """One subscription to a server's expired-key events in a daemon thread (see the module docstring)."""

    def __init__(
        self,
        name: str,
        prefix: str,
        db: int,
        connection: dict[str, Any],
        fn: TierListener,
        closed: Callable[[], bool] = lambda: False,
    ) -> None:
        """Start watching ``db`` of the server ``connection`` (redis-py's keywords) until :meth:`stop` or
        ``closed()`` (the adapter was closed)."""
        self.name = name
        self.prefix = prefix
        self.channel = f"__keyevent@{db}__:expired"
        self.fn = fn
        self.told = 0
        """Expired keys told so far."""
        self.subscribed = threading.Event()
        """Set once subscribed (again after each reconnection)."""
        self._refusal_told = False
        self._again = threading.Event()
        self._connection = connection
        self._closed = closed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tiercache-expiry-{name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (the thread ends within a poll interval); idempotent."""
        self._stop.set()

    def _run(self) -> None:
        import redis

        delay, warned = 0.1, False
        while not self._stop.is_set() and not self._closed():
            client = redis.Redis(**self._connection, socket_timeout=None, protocol=2)
            try:
                self._enable(client)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.channel)
                # redis-py re-connects and re-subscribes by itself; the server may have restarted without
                # the flags then: turn them on again (_listen)
                connection: Any = pubsub.connection  # made by subscribe (redis-py types it None)
                if connection is not None:
                    connection.register_connect_callback(self._reconnected)
                self.subscribed.set()
                delay, warned = 0.1, False
                self._listen(pubsub, client)
                pubsub.close()
            except Exception as exc:
                if not warned:
                    log.warning("redis tier %s: watching expiry failed (%s); retrying", self.name, exc)
                    warned = True
                self._stop.wait(delay)
                delay = min(delay * 2, 30.0)
            finally:
                client.close()

    def _enable(self, client: Any) -> None:
        """Have the server announce expired keys (one warning line where it refuses or cannot be asked)."""
        import redis

        try:
            current = str(client.config_get("notify-keyspace-events").get("notify-keyspace-events", ""))
            wanted = notify_flags(current)
            if wanted is not None:
                client.config_set("notify-keyspace-events", wanted)
        except redis.ResponseError as exc:  # CONFIG renamed or refused (managed services, ACLs)
            if self._refusal_told:  # once, not at every reconnection
                return
            self._refusal_told = True
            log.warning(
                "redis tier %s: expiry (ttl) is not announced as KV events unless the server's "
                "notify-keyspace-events includes Ex (CONFIG refused: %s)",
                self.name,
                exc,
            )

    def _reconnected(self, connection: Any) -> None:
        """redis-py's callback when the subscription's connection was made again."""
        self._again.set()

    def _listen(self, pubsub: Any, client: Any) -> None:
        """Tell the expired keys of our prefix in batches until stopped."""
        prefix, cut = self.prefix, len(self.prefix)
        while not self._stop.is_set():
            if self._closed():
                self._stop.set()
                return
            if self._again.is_set():
                self._again.clear()
                self._enable(client)
            message = pubsub.get_message(timeout=0.2)
            keys: list[str] = []
            while message is not None and len(keys) < _BATCH:
                if message.get("type") == "message":
                    raw = message.get("data")
                    key = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
                    if key.startswith(prefix) and "#" not in key[cut:]:
                        keys.append(key[cut:])
                message = pubsub.get_message(timeout=0.0)
            if keys:
                self.told += len(keys)
                try:
                    self.fn("expired", keys)
                except Exception:
                    log.exception("redis tier %s: an expiry listener failed on %d keys", self.name, len(keys))


def _nothing() -> None:
    """The remover when nothing was started."""
