"""Client side of server mode: :class:`ServerConnection` (one SEQPACKET connection, blocking round trips) and
:class:`SharedL1`, the L1 surface the engine uses (reserve_write/finish_write/abort_write, contains,
acquire with leases) on the server's shared segment.

A dead or refusing server means cache-off: lookups miss, reservations fail (stores are skipped), nothing
raises; the next call after a backoff (doubling, injected clock) reconnects. Objects and leases of a lost
connection are never valid again, and slot generations are checked in the header table.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import msgpack

from tiercache.l1 import L1Stats, ObjectState
from tiercache.server.protocol import MAX_MESSAGE, Op, ProtocolError, decode, encode
from tiercache.server.segment import PUBLISHED, Segment, SlotClass

if TYPE_CHECKING:
    import torch

    from tiercache.spec import KVSpec

__all__ = [
    "ServerConnection",
    "ServerRefused",
    "ServerUnavailable",
    "SharedL1",
    "SharedLease",
    "SharedObject",
]

log = logging.getLogger(__name__)

LOOKUP_BATCH = 128  # keys per LOOKUP: 128 keys of MAX_KEY_LEN fit MAX_MESSAGE, and so do their hits


class ServerUnavailable(ConnectionError):
    """The server cannot be reached, closed the connection, or sent something malformed."""


class ServerRefused(ServerUnavailable):
    """The server answered with an error (forbidden peer, stale epoch, ...); ``code`` says which."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class ServerConnection:
    """One connection: HELLO maps the segment; :meth:`request` is one blocking round trip (thread-safe)."""

    def __init__(self, socket_path: str, *, role: str = "worker", timeout_s: float = 5.0) -> None:
        """Connect and HELLO; ServerUnavailable / ServerRefused on failure."""
        self._lock = threading.Lock()
        self._req_ids = itertools.count(1)
        self.closed = False
        self.epoch = 0
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(timeout_s)
        try:
            sock.connect(socket_path)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.send(encode(Op.HELLO, 0, 0, {"role": role}))  # a refusing server may have closed already
            data, anc, _, _ = sock.recvmsg(MAX_MESSAGE + 1, socket.CMSG_SPACE(2 * 4))
        except OSError as exc:
            sock.close()
            raise ServerUnavailable(f"cannot reach the tiercache server at {socket_path}: {exc}") from exc
        self._sock = sock
        fds = [
            fd
            for lvl, typ, raw in anc
            if lvl == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS
            for fd in array.array("i", raw[: len(raw) - len(raw) % 4])
        ]
        try:
            body = self._reply(data, 0)
            if len(fds) != 2:
                raise ServerUnavailable(f"HELLO passed {len(fds)} fds, expected 2")
            classes = [SlotClass(int(b), int(c)) for b, c in body["classes"]]
            self.segment = Segment(classes, fds[0], fds[1], writable_header=False)
            self.epoch = int(body["epoch"])
            self.server_pid = int(body["pid"])
        except (ServerUnavailable, KeyError, TypeError, ValueError) as exc:
            self.close()
            raise (
                exc if isinstance(exc, ServerUnavailable) else ServerUnavailable(f"bad HELLO reply: {exc}")
            ) from exc
        finally:
            import os

            for fd in fds:
                os.close(fd)  # the mappings keep the memory

    def _reply(self, data: bytes, req_id: int) -> dict[str, Any]:
        if not data:
            raise ServerUnavailable("the server closed the connection")
        try:
            msg = decode(data, request=False)
        except ProtocolError as exc:
            raise ServerUnavailable(f"malformed reply: {exc}") from exc
        if msg.op is Op.ERR:
            raise ServerRefused(str(msg.body.get("code")), str(msg.body.get("message")))
        if msg.req_id != req_id:
            raise ServerUnavailable(f"reply to request {msg.req_id}, expected {req_id}")
        return msg.body

    def request(self, op: Op, body: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return the reply body; the connection is closed on any failure."""
        with self._lock:
            if self.closed:
                raise ServerUnavailable("connection closed")
            req_id = next(self._req_ids)
            try:
                self._sock.send(encode(op, self.epoch, req_id, body))
                return self._reply(self._sock.recv(MAX_MESSAGE + 1), req_id)
            except ServerUnavailable:
                self._close_locked()
                raise
            except OSError as exc:
                self._close_locked()
                raise ServerUnavailable(f"server connection lost: {exc}") from exc

    def _close_locked(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()

    def close(self) -> None:
        """Close the socket (the segment stays mapped while objects use it); idempotent."""
        with self._lock:
            self._close_locked()


def _spec_meta(spec: KVSpec) -> bytes:
    meta: bytes = msgpack.packb(
        [
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            spec.dtype,
            int(spec.format),
            spec.tokens,
            spec.layer_start,
            spec.layer_end,
        ]
    )
    return meta


def _meta_spec(meta: bytes) -> KVSpec | None:
    from tiercache.spec import KVFormat, KVSpec

    try:
        f = msgpack.unpackb(meta)
        return KVSpec(f[0], f[1], f[2], f[3], KVFormat(f[4]), f[5], f[6], f[7])
    except Exception:  # another client's garbage metadata is a miss, never a crash
        return None


class SharedObject:
    """A slot of the shared segment holding ``spec`` (WRITING after reserve_write, READY when leased)."""

    __slots__ = ("_conn", "gen", "key", "slot", "spec", "state")

    def __init__(
        self, conn: ServerConnection, key: str, spec: KVSpec, slot: int, gen: int, state: ObjectState
    ):
        self._conn = conn
        self.key = key
        self.spec = spec
        self.slot = slot
        self.gen = gen
        self.state = state

    def buffer(self) -> memoryview:
        """A writable uint8 view of exactly ``spec.nbytes`` bytes of the slot (no copy)."""
        return self._conn.segment.buffer(self.slot, self.spec.nbytes)

    def tensor(self) -> torch.Tensor:
        """A no-copy view shaped ``spec.shape`` with the spec's dtype on the slot's memory."""
        import torch

        raw = torch.frombuffer(self.buffer(), dtype=torch.uint8)
        return raw.view(getattr(torch, self.spec.dtype)).view(self.spec.shape)

    def __repr__(self) -> str:
        """Debug representation."""
        return f"SharedObject(key={self.key!r}, state={self.state.name}, slot={self.slot}, gen={self.gen})"


class SharedLease:
    """A connection-owned read lease (no TTL): valid while the connection lives and the slot keeps its gen."""

    __slots__ = ("_id", "_owner", "_released", "obj")

    def __init__(self, owner: SharedL1, obj: SharedObject, lease_id: int) -> None:
        self._owner = owner
        self.obj = obj
        self._id = lease_id
        self._released = False

    def valid(self) -> bool:
        """Unreleased, on the live connection, and the header shows our slot PUBLISHED at our gen."""
        conn = self.obj._conn
        if self._released or conn.closed or conn is not self._owner._conn:
            return False
        return conn.segment.slot_state(self.obj.slot) == (self.obj.gen, PUBLISHED)

    def release(self) -> None:
        """Drop the lease; idempotent and never raises (a lost connection already dropped it)."""
        if self._released:
            return
        self._released = True
        self._owner._release(self.obj._conn, self._id)

    def __enter__(self) -> SharedLease:
        """Return the lease itself."""
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Release the lease."""
        self.release()


class SharedL1:
    """The L1 surface of :class:`tiercache.l1.L1Cache` on a server's shared segment; cache-off when down."""

    pinned = False

    def __init__(
        self,
        socket_path: str,
        *,
        role: str = "worker",
        timeout_s: float = 5.0,
        backoff_s: float = 0.05,
        max_backoff_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Connect now if the server answers; otherwise start cache-off (no exception)."""
        self.socket_path = socket_path
        self.role = role
        self.timeout_s = timeout_s
        self._backoff_initial = backoff_s
        self._max_backoff = max_backoff_s
        self._backoff = backoff_s
        self._clock = clock
        self._next_attempt = 0.0
        self._lock = threading.Lock()
        self._conn: ServerConnection | None = None
        self.reconnects = 0
        self.offline_misses = 0
        self.skipped_stores = 0
        self.capacity = 0
        self.slot_bytes = 0
        self._connection()

    # ------------------------------------------------------------------ connection
    def _connection(self) -> ServerConnection | None:
        """The live connection, reconnecting once the backoff elapsed; None = cache-off."""
        with self._lock:
            conn = self._conn
            if conn is not None and not conn.closed:
                return conn
            now = self._clock()
            if now < self._next_attempt:
                return None
            try:
                conn = ServerConnection(self.socket_path, role=self.role, timeout_s=self.timeout_s)
            except ServerUnavailable as exc:
                log.warning("tiercache server unavailable (%s); cache off for %.2f s", exc, self._backoff)
                self._next_attempt = now + self._backoff
                self._backoff = min(self._backoff * 2, self._max_backoff)
                self._conn = None
                return None
            if self._conn is not None:
                self.reconnects += 1
            self._conn = conn
            self._backoff = self._backoff_initial
            seg = conn.segment
            self.capacity = seg.data_bytes
            self.slot_bytes = max(c.slot_bytes for c in seg.classes)
            return conn

    def _call(self, op: Op, body: dict[str, Any]) -> tuple[ServerConnection, dict[str, Any]] | None:
        conn = self._connection()
        if conn is None:
            return None
        try:
            return conn, conn.request(op, body)
        except ServerUnavailable as exc:
            log.warning("tiercache server request %s failed: %s; cache off", op.name, exc)
            with self._lock:
                self._next_attempt = self._clock() + self._backoff
            return None

    def connected(self) -> bool:
        """Whether a live connection exists now (no reconnect attempt)."""
        conn = self._conn
        return conn is not None and not conn.closed

    def close(self) -> None:
        """Close the connection (the server drops its leases)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
            self._next_attempt = float("inf")

    # ------------------------------------------------------------------ writes
    def reserve_write(self, key: str, spec: KVSpec) -> SharedObject | None:
        """Reserve a slot for ``key`` (WRITING); None if present, no room, or cache-off."""
        got = self._call(Op.ALLOC, {"keys": [key], "nbytes": [spec.nbytes], "meta": [_spec_meta(spec)]})
        if got is None:
            self.skipped_stores += 1
            return None
        conn, body = got
        ref = body["slots"][0]
        if not isinstance(ref, list):
            return None
        return SharedObject(conn, key, spec, int(ref[0]), int(ref[1]), ObjectState.WRITING)

    def _settle(self, obj: SharedObject, op: Op) -> bool:
        if obj.state is not ObjectState.WRITING:
            raise ValueError(f"{obj!r} is not a WRITING object")
        if obj._conn is not self._conn or obj._conn.closed:
            return False  # its connection is gone: the server frees the slot once we exit, never publishes it
        try:
            ok = bool(obj._conn.request(op, {"slots": [[obj.slot, obj.gen]]})["ok"][0])
        except ServerUnavailable:
            return False
        if ok and op is Op.COMMIT:
            obj.state = ObjectState.READY
        return ok

    def finish_write(self, obj: SharedObject) -> None:
        """Publish ``obj`` (COMMIT); a lost connection or stale generation drops it silently."""
        self._settle(obj, Op.COMMIT)

    def abort_write(self, obj: SharedObject) -> None:
        """Free the reservation (ABORT); nothing to do when the connection is gone."""
        self._settle(obj, Op.ABORT)

    # ------------------------------------------------------------------ reads
    def _lookup(self, keys: Sequence[str], pin: bool) -> tuple[ServerConnection, list[Any]] | None:
        """LOOKUP in batches of LOOKUP_BATCH keys (each request and reply fits one message)."""
        hits: list[Any] = []
        conn = None
        for start in range(0, len(keys), LOOKUP_BATCH):
            batch = list(keys[start : start + LOOKUP_BATCH])
            got = self._call(Op.LOOKUP, {"keys": batch, "pin": pin, "prefix": False})
            if got is None or (conn is not None and got[0] is not conn):
                self.offline_misses += len(keys)
                return None  # leases of earlier batches went with their connection
            conn = got[0]
            hits.extend(got[1]["hits"])
        return None if conn is None else (conn, hits)  # None for no keys: callers answer [] either way

    def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """Per key whether it is published (False for all when cache-off)."""
        got = self._lookup(keys, False)
        return [False] * len(keys) if got is None else [h is not None for h in got[1]]

    def contains(self, key: str) -> bool:
        """Whether ``key`` is published."""
        return self.batched_contains([key])[0]

    def batched_acquire(self, keys: Sequence[str], lease_s: float | None = None) -> list[SharedLease | None]:
        """Lease each published key (``lease_s`` is ignored: leases live with the connection)."""
        got = self._lookup(keys, True)
        if got is None:
            return [None] * len(keys)
        conn, hits = got
        out: list[SharedLease | None] = []
        for key, hit in zip(keys, hits, strict=True):
            spec = None if hit is None else _meta_spec(hit[3])
            if hit is None or spec is None or spec.nbytes != hit[2]:
                if hit is not None:
                    self._release(conn, int(hit[4]))
                out.append(None)
                continue
            obj = SharedObject(conn, key, spec, int(hit[0]), int(hit[1]), ObjectState.READY)
            out.append(SharedLease(self, obj, int(hit[4])))
        return out

    def acquire(self, key: str, lease_s: float | None = None) -> SharedLease | None:
        """Lease the published ``key``; None on a miss or cache-off."""
        return self.batched_acquire([key], lease_s)[0]

    def delete(self, key: str) -> bool:
        """Not supported on the shared L1 (eviction is the server's): always False."""
        return False

    def _release(self, conn: ServerConnection, lease_id: int) -> None:
        if conn.closed:
            return
        with contextlib.suppress(ServerUnavailable):
            conn.request(Op.RELEASE, {"leases": [lease_id]})

    def server_stats(self) -> dict[str, Any] | None:
        """The server's STATS reply, None when cache-off."""
        got = self._call(Op.STATS, {})
        return None if got is None else got[1]

    def stats(self) -> L1Stats:
        """Occupancy in :class:`L1Stats` terms (zeros when cache-off)."""
        s = self.server_stats() or {}
        used = int(s.get("reserved", 0)) + int(s.get("published", 0))
        return L1Stats(
            used_slots=used,
            num_slots=int(s.get("num_slots", 0)),
            used_bytes=0,
            capacity=self.capacity,
            ready=int(s.get("published", 0)),
            writing=int(s.get("reserved", 0)),
            leased=int(s.get("leased_slots", 0)),
            evictions=int(s.get("evictions", 0)),
            expired_leases=0,
            alloc_failures=int(s.get("alloc_failures", 0)),
        )
