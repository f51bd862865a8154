"""The fault proxy's ``slow`` mode: a delay per forwarded chunk in the configured direction. The delay is
observed through an injected ``sleep`` (a gate the test opens), never by timing the wall clock."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest

from tiercache.testing.harness.processes import wait_until


@pytest.mark.parametrize(("direction", "delays"), [("down", 1), ("up", 1), ("both", 2), (None, 0)])
def test_slow_mode_delays_each_chunk_in_its_direction(
    redis_server: Any, fault_proxy: Any, direction: str | None, delays: int
) -> None:
    """A PING's answer is held by the injected sleep until the gate opens; one delay per chunk and
    direction (``None``: pass mode, no delay)."""
    proxy = fault_proxy(redis_server.port)
    calls: list[float] = []
    gate = threading.Event()

    async def gated_sleep(delay: float) -> None:
        calls.append(delay)
        await asyncio.to_thread(gate.wait, 30)

    proxy.sleep = gated_sleep
    proxy.delay_s = 7.5
    if direction is not None:
        proxy.mode, proxy.delay_direction = "slow", direction
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
        client.sendall(b"PING\r\n")
        if delays:
            wait_until(lambda: len(calls) == 1, timeout_s=10.0, every_s=0.005)
            client.setblocking(False)
            with pytest.raises(BlockingIOError):
                client.recv(16)  # the answer is held while the proxy sleeps
            client.setblocking(True)
            client.settimeout(10)
            gate.set()
        assert client.recv(16) == b"+PONG\r\n"
    assert calls == [7.5] * delays
