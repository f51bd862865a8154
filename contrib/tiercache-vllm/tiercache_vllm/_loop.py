"""One background asyncio loop thread per process: the only bridge from vLLM's sync calls to tiercache.

The connector's sync methods submit coroutines with :func:`submit` (fire and forget, a
``concurrent.futures.Future``) or :func:`call` (wait with a deadline). A deadline that passes is reported as
``TimeoutError`` to the caller, which treats it as a cache miss; the coroutine keeps running on the loop
(cancelled on request). A forked child gets a fresh loop (the parent's thread does not survive a fork).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["call", "get_loop", "submit"]

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
