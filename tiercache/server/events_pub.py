"""The server's node-wide KV event stream: an :class:`~tiercache.events.EventSink` published on a ZMQ PUB
socket in vLLM's wire format (``[topic, 8-byte big-endian sequence number, KVEventBatch msgpack]``, as vLLM's
``ZmqEventPublisher`` sends), so a router subscribes to one endpoint per node.

pyzmq is optional (``pip install 'tiercache[events]'``); ``tiercache.config.check_events_endpoint`` refuses
the endpoint in one line when it is missing or the endpoint is not ``tcp://`` or ``ipc://``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any

from tiercache.config import check_events_endpoint
from tiercache.events import encode_batch

if TYPE_CHECKING:
    from tiercache.events import EventSink

__all__ = ["EventPublisher"]

log = logging.getLogger(__name__)


class EventPublisher:
    """Publishes what ``sink`` queues every ``interval_s`` on a PUB socket bound to ``endpoint`` (a thread;
    a failed send is logged once and the batch dropped: events are best effort, like vLLM's)."""

    def __init__(self, sink: EventSink, endpoint: str, *, topic: str = "", interval_s: float = 0.05) -> None:
        check_events_endpoint(endpoint)
        import zmq

        self.sink = sink
        self.topic = topic.encode()
        self.interval_s = interval_s
        self.seq = 0
        """Batches sent so far (the next batch's sequence number)."""
        self._pub: Any = zmq.Context.instance().socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound address (a ``tcp://host:0`` endpoint gets its port here)."""
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="tiercache-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()
        self.flush()

    def flush(self) -> None:
        """Send what the sink queued (one batch), now."""
        events = self.sink.take()
        if not events:
            return
        try:
            self._pub.send_multipart([self.topic, self.seq.to_bytes(8, "big"), encode_batch(events)])
            self.seq += 1
        except Exception as exc:
            if not self._failed:
                self._failed = True
                log.error(
                    "KV events: publishing on %s failed (%r); later failures are dropped", self.endpoint, exc
                )

    def close(self) -> None:
        """Send what is queued, then stop and close the socket; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5)
        with contextlib.suppress(Exception):
            self._pub.close(linger=0)
