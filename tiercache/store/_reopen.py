"""A tier that was down when the manager opened: misses now, re-opened in the background with backoff.

``StorageManager.open`` wraps a tier whose ``open`` failed with a transport error in ``ReopeningAdapter``.
Until a background re-open succeeds every call raises ``AdapterUnavailable`` (the manager counts it as a
tier error, a miss, and opens the tier's circuit); afterwards every call goes to the opened adapter, and the
listeners added meanwhile (``add_listener``, ``add_expiry_listener``) hear the opened adapter's evictions,
deletes and expiries where it reports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from tiercache.adapters import Adapter, Buffer
from tiercache.adapters._listeners import TierListener, TierListeners
from tiercache.errors import AdapterUnavailable, ConfigError, PluginError

if TYPE_CHECKING:
    from typing import Self

__all__ = ["NOT_DOWN", "ReopeningAdapter", "is_down"]

log = logging.getLogger(__name__)

NOT_DOWN: tuple[type[Exception], ...] = (ConfigError, PluginError, ValueError, TypeError, ImportError)
"""Errors of an adapter's ``open`` that are the configuration's fault: they still raise at open."""


def is_down(exc: Exception) -> bool:
    """Whether ``exc`` from an adapter's ``open`` means "the backend cannot be reached now" (any error but a
    configuration one: adapters should raise AdapterUnavailable, a client library's own error counts too)."""
    return not isinstance(exc, NOT_DOWN)


class ReopeningAdapter(Adapter):
    """Stands in for a tier that is down: ``AdapterUnavailable`` until ``opener`` succeeds, then delegates.

    Re-open attempts run on the current event loop, first after ``first_delay_s``, doubling up to
    ``max_delay_s``; ``reopened`` is set once the tier is back, and ``capabilities`` are the opened
    adapter's from then on. ``aclose`` stops the attempts.
    """

    scheme = "reopening"

    def __init__(
        self,
        name: str,
        opener: Callable[[], Awaitable[Adapter]],
        error: BaseException,
        *,
        first_delay_s: float = 0.5,
        max_delay_s: float = 30.0,
    ) -> None:
        self.name = name
        self.attempts = 0
        self.reopened = asyncio.Event()
        self._opener = opener
        self._inner: Adapter | None = None
        self._closed = False
        self._reason = f"{type(error).__name__}"
        self._listeners = {"add_listener": TierListeners(), "add_expiry_listener": TierListeners()}
        """Listeners added while down, by the adapter method that takes them (connected at re-open)."""
        self._wanted: set[str] = set()
        self._task = asyncio.get_running_loop().create_task(self._reopen(first_delay_s, max_delay_s))
        log.warning(
            "tier %s is down at start (%s); running without it, re-opening in the background",
            name,
            self._reason,
        )

    @classmethod
    async def open(cls, url: str, **options: object) -> Self:
        raise AdapterUnavailable("a ReopeningAdapter is made by StorageManager.open, not from a URL")

    @property
    def closed(self) -> bool:
        """Whether ``aclose`` was called."""
        return self._closed

    @property
    def up(self) -> bool:
        """Whether the tier has been re-opened."""
        return self._inner is not None

    async def _reopen(self, delay_s: float, max_delay_s: float) -> None:
        while not self._closed:
            await asyncio.sleep(delay_s)
            self.attempts += 1
            try:
                adapter = await self._opener()
            except Exception as exc:
                if not is_down(exc):
                    log.error("tier %s: re-opening failed with a configuration error (%s)", self.name, exc)
                    return
                self._reason = type(exc).__name__
                delay_s = min(delay_s * 2, max_delay_s)
                continue
            if self.closed:
                await adapter.aclose()
                return
            self._connect_listeners(adapter)
            vars(self)["capabilities"] = adapter.capabilities  # its limits (value size, delete) from now on
            self._inner = adapter
            self.reopened.set()
            log.warning("tier %s is back after %d attempt(s)", self.name, self.attempts)
            return

    def add_listener(self, fn: TierListener) -> Callable[[], None]:
        """Call ``fn(kind, keys)`` on every eviction and deletion the re-opened adapter reports (see
        :data:`~tiercache.adapters._listeners.TierListener`); returns its remover."""
        return self._listen("add_listener", fn)

    def add_expiry_listener(self, fn: TierListener) -> Callable[[], None]:
        """Call ``fn("expired", keys)`` on every expiry the re-opened adapter announces; its remover."""
        return self._listen("add_expiry_listener", fn)

    def _listen(self, method: str, fn: TierListener) -> Callable[[], None]:
        """Add ``fn`` through the opened adapter's ``method`` now, or once it is re-opened."""
        if self._inner is not None:
            add = getattr(self._inner, method, None)
            return add(fn) if callable(add) else _nothing
        self._wanted.add(method)
        return self._listeners[method].add_listener(fn)

    def _connect_listeners(self, adapter: Adapter) -> None:
        """Have the re-opened ``adapter`` tell the listeners added while it was down."""
        for method in self._wanted:
            add = getattr(adapter, method, None)
            if callable(add):
                add(self._listeners[method].notify)

    def _adapter(self) -> Adapter:
        if self._inner is None:
            raise AdapterUnavailable(f"tier {self.name} is down since start ({self._reason}); re-opening")
        return self._inner

    async def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        return await self._adapter().batched_contains(keys)

    async def batched_get(self, keys: Sequence[str]) -> list[Buffer | None]:
        return await self._adapter().batched_get(keys)

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        return await self._adapter().batched_put(keys, values)

    async def batched_delete(self, keys: Sequence[str]) -> list[bool]:
        return await self._adapter().batched_delete(keys)

    def iter_keys(self, prefix: str) -> AsyncIterator[list[str]]:
        return self._adapter().iter_keys(prefix)

    async def aclose(self) -> None:
        self._closed = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        if self._inner is not None:
            await self._inner.aclose()


def _nothing() -> None:
    """The remover of a listener the adapter never took."""
