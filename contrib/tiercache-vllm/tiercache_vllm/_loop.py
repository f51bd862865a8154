"""One background asyncio loop thread per process: the only bridge from vLLM's sync calls to tiercache.

The connector's sync methods submit coroutines with :func:`submit` (fire and forget, a
``concurrent.futures.Future``) or :func:`call` (wait with a deadline). A deadline that passes is reported as
``TimeoutError`` to the caller, which treats it as a cache miss; the coroutine keeps running on the loop
(cancelled on request). Work that touches vLLM's paged KV runs as a :class:`Job` (:func:`start`): cancelling
a Job's future does not stop its coroutine at once, so ``Job.stop`` cancels and then waits until the
coroutine really no longer runs. A forked child gets a fresh loop (the parent's thread does not survive a
fork).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

__all__ = ["Job", "call", "get_loop", "start", "submit"]

T = TypeVar("T")

_lock = threading.Lock()
_state: dict[str, Any] = {"pid": None, "loop": None, "thread": None}


def get_loop() -> asyncio.AbstractEventLoop:
    """The process's background loop, started on first use (again after a fork)."""
    with _lock:
        loop: asyncio.AbstractEventLoop | None = _state["loop"]
        if loop is not None and _state["pid"] == os.getpid() and not loop.is_closed():
            return loop
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        thread = threading.Thread(target=run, name="tiercache-vllm-loop", daemon=True)
        thread.start()
        ready.wait()
        _state.update(pid=os.getpid(), loop=loop, thread=thread)
        return loop


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Schedule ``coro`` on the background loop; returns at once."""
    return asyncio.run_coroutine_threadsafe(coro, get_loop())


def call(coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
    """Run ``coro`` on the background loop and wait up to ``timeout`` seconds (``TimeoutError`` after it;
    the coroutine is then cancelled). Never call this from the loop thread itself."""
    if threading.current_thread() is _state.get("thread"):
        raise RuntimeError("tiercache_vllm._loop.call() from the loop thread would deadlock")
    future = submit(coro)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"tiercache call did not finish within {timeout} s") from None


class Job(Generic[T]):
    """A coroutine on the background loop whose end can be awaited from another thread, also after a cancel.

    ``future`` is the usual ``concurrent.futures.Future``; ``finished()`` is True only once the coroutine has
    returned, raised or been cancelled before it ever ran (a cancelled ``future`` alone does not mean that).
    """

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        self.started = threading.Event()
        self.stopped = threading.Event()
        self._loop = get_loop()
        self._barrier: threading.Event | None = None

        async def run() -> T:
            self.started.set()
            try:
                return await coro
            finally:
                self.stopped.set()

        self.future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(run(), self._loop)

    def finished(self) -> bool:
        """True when the coroutine no longer runs and never will (non-blocking)."""
        if self.stopped.is_set():
            return True
        barrier = self._barrier
        # the cancel reached the loop before the coroutine's first step: it will never run
        return barrier is not None and barrier.is_set() and not self.started.is_set()

    def cancel(self) -> None:
        """Ask the coroutine to stop (non-blocking); ``finished()`` says when it has."""
        if self._barrier is None:
            self.future.cancel()
            self._barrier = threading.Event()
            self._loop.call_soon_threadsafe(self._barrier.set)  # runs after the loop applied the cancel

    def stop(self, timeout: float) -> bool:
        """Cancel and wait up to ``timeout`` seconds until the coroutine no longer runs; True when it has."""
        self.cancel()
        deadline = time.monotonic() + timeout
        while not self.finished():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.stopped.wait(min(left, 0.05))
        return True


def start(coro: Coroutine[Any, Any, T]) -> Job[T]:
    """Run ``coro`` on the background loop as a :class:`Job`; returns at once."""
    return Job(coro)
