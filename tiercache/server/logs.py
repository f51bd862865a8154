"""Rate-limited logging for the server: at most one line per key per interval, then a count of the rest.

A misbehaving or fuzzing client can make the server log once per dropped connection or malformed message;
:class:`RateLimitedLog` keeps that to one line per key (``"protocol_error"``, ``"refused_peer"``, ...) per
``interval_s`` and, on the next line it lets through for that key, says how many similar lines it suppressed.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Hashable

__all__ = ["RateLimitedLog"]


class _KeyState:
    __slots__ = ("last", "level", "suppressed")

    def __init__(self, last: float, level: int) -> None:
        self.last = last  # clock value of the last line emitted for the key
        self.suppressed = 0  # lines held back since then
        self.level = level  # level of the last line (for flush)


class RateLimitedLog:
    """Logs through ``logger`` at most one line per key every ``interval_s`` seconds of ``clock``.

    The first line for a key is emitted at once; later ones within ``interval_s`` of the last emitted one are
    counted, not logged; the next emitted line for the key ends with ``(N similar lines suppressed in the
    last S s)``. At most ``max_keys`` keys are tracked (the least recently emitted one is forgotten, its
    pending count with it). Thread-safe; every method is O(1).
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 1024,
    ) -> None:
        """``interval_s``: seconds between two lines of one key (> 0); ``clock``: seconds, monotonic."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys!r}")
        self.logger = logger
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._clock = clock
        self._keys: collections.OrderedDict[Hashable, _KeyState] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.suppressed_total = 0
        """Lines held back since construction, all keys together."""

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at WARNING unless ``key`` logged within the interval; True if it was logged."""
        return self._log(logging.WARNING, key, msg, args)

    def info(self, key: Hashable, msg: str, *args: object) -> bool:
        """As :meth:`warning`, at INFO."""
        return self._log(logging.INFO, key, msg, args)

    def error(self, key: Hashable, msg: str, *args: object) -> bool:
        """As :meth:`warning`, at ERROR."""
        return self._log(logging.ERROR, key, msg, args)

    def log(self, level: int, key: Hashable, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at ``level`` for ``key`` (rate-limited per key); True if a line was emitted.

        A level the logger does not emit counts nothing and returns False.
        """
        return self._log(level, key, msg, args)

    def _log(self, level: int, key: Hashable, msg: str, args: tuple[object, ...]) -> bool:
        # stacklevel=3: the record names the caller of warning()/info()/log(), not this module
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            state = self._keys.get(key)
            if state is not None and now - state.last < self.interval_s:
                state.suppressed += 1
                state.level = level
                self.suppressed_total += 1
                return False
            suppressed, since = (0, 0.0) if state is None else (state.suppressed, now - state.last)
            if state is None:
                self._keys[key] = _KeyState(now, level)
                if len(self._keys) > self.max_keys:
                    self._keys.popitem(last=False)
            else:
                state.last, state.suppressed, state.level = now, 0, level
                self._keys.move_to_end(key)
        if suppressed:
            if not args:
                msg = msg.replace("%", "%%")  # logging formats only when there are args: keep msg literal
            self.logger.log(
                level,
                msg + " (%d similar lines suppressed in the last %.1f s)",
                *args,
                suppressed,
                since,
                stacklevel=3,
            )
        else:
            self.logger.log(level, msg, *args, stacklevel=3)
        return True

    def flush(self) -> int:
        """Log one summary line per key with suppressed lines still pending (on stop); returns the lines."""
        now = self._clock()
        with self._lock:
            pending = [
                (key, s.level, s.suppressed, now - s.last) for key, s in self._keys.items() if s.suppressed
            ]
            for key, *_ in pending:
                state = self._keys[key]
                state.suppressed = 0
        for key, level, count, since in pending:
            self.logger.log(level, "%s: %d similar lines suppressed in the last %.1f s", key, count, since)
        return len(pending)
