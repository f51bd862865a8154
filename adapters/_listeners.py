"""Listeners of an adapter that evicts on its own: told which keys it pushed out for room or deleted."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

__all__ = ["TierListener", "TierListeners"]

log = logging.getLogger(__name__)

TierListener = Callable[[str, Sequence[str]], None]
"""``fn(kind, keys)``: ``kind`` is ``"evicted"`` (pushed out for room) or ``"deleted"`` (removed by
``batched_delete``). Called on the event loop's thread as it happens: it must be quick and must not call back
into the adapter. What it raises is logged, dropped."""


class TierListeners:
    """The listeners of one adapter (``add_listener``) and the call that tells them (``notify``)."""

    __slots__ = ("_fns",)

    def __init__(self) -> None:
        self._fns: list[TierListener] = []

    def add_listener(self, fn: TierListener) -> Callable[[], None]:
        """Call ``fn(kind, keys)`` on every eviction and deletion from now on; returns its remover."""
        self._fns.append(fn)

        def remove() -> None:
            if fn in self._fns:
                self._fns.remove(fn)

        return remove

    def notify(self, kind: str, keys: Sequence[str]) -> None:
        """Tell every listener that ``keys`` were ``kind`` (nothing when ``keys`` is empty)."""
        if not keys:
            return
        for fn in list(self._fns):
            try:
                fn(kind, keys)
            except Exception:
                log.exception("a tier listener failed on %d %s keys", len(keys), kind)
