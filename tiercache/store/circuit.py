"""Per-tier circuit breaker: consecutive failures open it; after a cool-down one probe call may close it.

A probe is always resolved: the caller records success or failure, and a probe that ends any other way
(cancelled by its caller, an unexpected exception) is recorded as a failure by ``abandon``, so the circuit
probes again after the next cool-down instead of staying "probing" for good.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["CircuitBreaker"]


class CircuitBreaker:
    """closed -(N consecutive failures)-> open -(cooldown)-> half-open: one probe -> closed or open."""

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures = max(1, failures)
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._consecutive = 0
        self._opened_at: float | None = None
        self._probing = False

    @property
    def is_open(self) -> bool:
        """True while calls are being refused (open and not yet due for a probe)."""
        return self._opened_at is not None and (
            self._probing or self._clock() - self._opened_at < self.cooldown_s
        )

    def allow(self) -> bool:
        """Whether a call may go to the tier now (claims the single half-open probe slot)."""
        if self._opened_at is None:
            return True
        if self._probing or self._clock() - self._opened_at < self.cooldown_s:
            return False
        self._probing = True
        return True

    @property
    def probing(self) -> bool:
        """True while the single half-open probe call is out."""
        return self._probing

    def abandon(self, probe: bool) -> bool:
        """A call that ``allow`` admitted ended without a result (cancelled): a probe counts as a failure
        (the circuit re-opens and probes again after the cool-down); any other call changes nothing.
        Returns True if this re-opened the circuit."""
        if probe and self._probing:
            return self.record_failure()
        return False

    def record_success(self) -> None:
        """A call succeeded: close the circuit."""
        self._consecutive = 0
        self._opened_at = None
        self._probing = False

    def record_failure(self) -> bool:
        """A call failed; returns True if this failure opened (or re-opened) the circuit."""
        self._consecutive += 1
        if self._probing or (self._opened_at is None and self._consecutive >= self.failures):
            self._opened_at = self._clock()
            self._probing = False
            return True
        return False
