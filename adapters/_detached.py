"""Work an adapter must finish (or clean up) even when the call that started it is cancelled.

Cancellation is a normal path (the manager's deadlines, callers giving up). An operation whose effects cannot
be stopped half-way (a write handed to a thread, a multipart upload to abort) runs as a tracked task: the
caller awaits it through ``asyncio.shield``, so cancelling the caller leaves the task to finish its
bookkeeping (count what landed, release what it reserved). ``aclose`` waits for the tracked tasks a bounded
time and cancels what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["DetachedWork"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class DetachedWork:
    """A set of tasks that outlive a cancelled caller; each is tracked until it ends."""

    def __init__(self, name: str) -> None:
        """``name`` labels log lines (e.g. the adapter's redacted location)."""
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        """Tasks still running."""
        return len(self._tasks)

    def start(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        """Run ``coro`` as a tracked task (clean-up nobody waits for); its exception is logged, not lost."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    async def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Await ``coro`` as a tracked task: cancelling the caller does not cancel it (it completes its
        bookkeeping on its own); its result or exception goes to the caller when the caller is still there."""
        return await asyncio.shield(self.start(coro))

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.debug("%s: detached work ended with %r", self.name, exc)

    async def wait(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the tracked tasks, cancel the rest; return how many were cancelled."""
        pending = set(self._tasks)
        if not pending:
            return 0
        _, late = await asyncio.wait(pending, timeout=timeout_s)
        for task in late:
            task.cancel()
        for task in late:
            with contextlib.suppress(BaseException):
                await task
        if late:
            log.warning(
                "%s: %d detached task(s) still running after %.1f s: cancelled",
                self.name,
                len(late),
                timeout_s,
            )
        return len(late)
