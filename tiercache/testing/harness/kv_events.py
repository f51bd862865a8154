"""A subscriber to a KV event stream (vLLM's ZMQ publisher or the node server's), decoding with vLLM's own
``KVEventBatch`` decoder: needs pyzmq, msgspec and vLLM."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["receive", "subscribe"]


def subscribe(endpoint: str) -> Any:
    """A SUB socket on ``endpoint`` whose connection is up (the handshake done, so the subscription reaches
    the publisher before the test makes events, however loaded the machine). Events published meanwhile
    queue in the socket until :func:`receive` reads them."""
    import zmq

    sock: Any = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(endpoint)
    try:
        assert monitor.poll(30_000), f"no connection to {endpoint} within 30 s"
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
    time.sleep(0.1)  # the subscription frame follows the handshake on the same connection; no event says so
    return sock


def receive(sock: Any, done: Callable[[list[Any]], bool], settle_s: float = 1.0) -> list[Any]:
    """Events (vLLM's event objects) until ``done(events)`` (at most 60 s), then ``settle_s`` more (so
    duplicates would show); the batches' sequence numbers must rise."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    out: list[Any] = []
    seqs: list[int] = []
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if sock.poll(100):
            _topic, seq, payload = sock.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            out.extend(decoder.decode(payload).events)
        elif done(out):
            end = min(end, time.monotonic() + settle_s)
    assert seqs == sorted(seqs)
    return out
