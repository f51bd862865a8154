"""Listeners of an adapter that evicts on its own (told which keys it pushed out for room or deleted), and of
the server's slot table (told which keys were published or left)."""

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
    """The listeners of one adapter or slot table (``add_listener``) and the call that tells them
    (``notify``); ``what`` names them in the log line of a listener that fails."""

    __slots__ = ("_fns", "_what")

    def __init__(self, what: str = "tier") -> None:
        self._fns: list[TierListener] = []
        self._what = what

    def __bool__(self) -> bool:
        """Whether anyone listens (a caller can skip building the keys)."""
        return bool(self._fns)

    def add_listener(self, fn: TierListener) -> Callable[[], None]:
        """Call ``fn(kind, keys)`` on everything ``notify`` tells from now on; returns its remover."""
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
                log.exception("a %s listener failed on %d %s keys", self._what, len(keys), kind)
