"""Client side of server mode: :class:`ServerConnection` (one SEQPACKET connection, blocking round trips) and
:class:`SharedL1`, the L1 surface the engine uses (reserve_write/finish_write/abort_write, contains,
acquire with leases) on the server's shared segment.

A dead or refusing server means cache-off: lookups miss, reservations fail (stores are skipped), nothing
raises; the next call after a backoff (doubling, injected clock) reconnects. Objects and leases of a lost
connection are never valid again, and slot generations are checked in the header table.
"""

from __future__ import annotations

import array
import collections
import contextlib
import itertools
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from tiercache.server.protocol import (
    MAX_KEYS,
    MAX_MESSAGE,
    MAX_WAIT_S,
    Op,
    ProtocolError,
    decode,
    encode,
    meta_spec,
    spec_meta,
)
from tiercache.server.segment import PUBLISHED, Segment, SlotClass, SlotObject
from tiercache.store.hits import L1_TIER, TierHit
from tiercache.store.l1 import L1Stats, ObjectState

if TYPE_CHECKING:
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
ALLOC_BATCH = 128  # keys per ALLOC (keys + 256-byte metadata each fit MAX_MESSAGE)


class ServerUnavailable(ConnectionError):
    """The server cannot be reached, closed the connection, or sent something malformed."""


class ServerRefused(ServerUnavailable):
    """The server answered with an error (forbidden peer, stale epoch, ...); ``code`` says which."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def _pin_for_cuda(segment: Segment) -> None:
    """Register ``segment``'s mapping with CUDA (a no-op without it); unregistered before it is unmapped."""
    from tiercache.server import cuda

    segment.cuda_register_s = cuda.register(segment.data)
    if segment.cuda_register_s is not None:
        weakref.finalize(segment, cuda.unregister, segment.data)


class ServerConnection:
    """One connection: HELLO maps the segment; :meth:`request` is one blocking round trip (thread-safe)."""

    def __init__(self, socket_path: str, *, role: str = "worker", timeout_s: float = 5.0) -> None:
        """Connect and HELLO; ServerUnavailable / ServerRefused on failure."""
        self._lock = threading.Lock()
        self._req_ids = itertools.count(1)
        self.closed = False
        self.epoch = 0
        self._timeout_s = timeout_s
        self.requests: collections.Counter[str] = collections.Counter()
        """Round trips made, by op name (after HELLO)."""
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
            if role == "worker":  # GPU <-> shared L1 at pinned speed where this process uses CUDA
                _pin_for_cuda(self.segment)
            self.epoch = int(body["epoch"])
            self.server_pid = int(body["pid"])
            self.tiers = [str(t) for t in body.get("tiers", [])]
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

    def request(self, op: Op, body: dict[str, Any], *, wait_s: float = 0.0) -> dict[str, Any]:
        """Send one request and return the reply body; the connection is closed on any failure.
        ``wait_s``: how long the server may work on it (LOOKUP's ``wait_s``, DRAIN) beyond the timeout."""
        with self._lock:
            if self.closed:
                raise ServerUnavailable("connection closed")
            req_id = next(self._req_ids)
            self.requests[op.name] += 1
            try:
                self._sock.settimeout(self._timeout_s + wait_s)
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


class SharedObject(SlotObject):
    """A slot of the shared segment, reached through connection ``_conn`` (its objects die with it)."""

    __slots__ = ("_conn",)

    def __init__(
        self, conn: ServerConnection, key: str, spec: KVSpec, slot: int, gen: int, state: ObjectState
    ):
        super().__init__(conn.segment, key, spec, slot, gen, state)
        self._conn = conn


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
        self._owner._release(self.obj._conn, [self._id])

    def __enter__(self) -> SharedLease:
        """Return the lease itself."""
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Release the lease."""
        self.release()


class SharedL1:
    """The L1 surface of :class:`~tiercache.store.l1.L1Cache` on a shared segment (cache-off when down)."""

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
        self.requests: collections.Counter[str] = collections.Counter()
        """Round trips to the server by op name, over every connection this L1 made."""
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
            conn.requests = self.requests  # one tally across reconnects
            self._conn = conn
            self._backoff = self._backoff_initial
            seg = conn.segment
            self.capacity = seg.data_bytes
            self.slot_bytes = max(c.slot_bytes for c in seg.classes)
            return conn

    def _call(
        self, op: Op, body: dict[str, Any], *, wait_s: float = 0.0
    ) -> tuple[ServerConnection, dict[str, Any]] | None:
        conn = self._connection()
        if conn is None:
            return None
        try:
            return conn, conn.request(op, body, wait_s=wait_s)
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
        return self.batched_reserve_write([key], [spec])[0]

    def batched_reserve_write(
        self, keys: Sequence[str], specs: Sequence[KVSpec]
    ) -> list[SharedObject | None]:
        """One ALLOC per ALLOC_BATCH keys: a WRITING object per key, None where present, no room or
        cache-off."""
        out: list[SharedObject | None] = []
        conn = None
        for start in range(0, len(keys), ALLOC_BATCH):
            batch = list(keys[start : start + ALLOC_BATCH])
            batch_specs = specs[start : start + ALLOC_BATCH]
            body = {
                "keys": batch,
                "nbytes": [s.nbytes for s in batch_specs],
                "meta": [spec_meta(s) for s in batch_specs],
            }
            got = self._call(Op.ALLOC, body)
            if got is None or (conn is not None and got[0] is not conn):
                self.skipped_stores += len(keys) - len(out)
                return out + [None] * (len(keys) - len(out))  # reservations of a lost connection are void
            conn = got[0]
            for key, spec, ref in zip(batch, batch_specs, got[1]["slots"], strict=True):
                ok = isinstance(ref, list)
                out.append(
                    SharedObject(conn, key, spec, int(ref[0]), int(ref[1]), ObjectState.WRITING)
                    if ok
                    else None
                )
        return out

    def _settle(self, objs: Sequence[SharedObject], op: Op) -> list[bool]:
        """COMMIT or ABORT ``objs`` in one request; False for those whose connection is gone or stale."""
        for obj in objs:
            if obj.state is not ObjectState.WRITING:
                raise ValueError(f"{obj!r} is not a WRITING object")
        live = [i for i, obj in enumerate(objs) if obj._conn is self._conn and not obj._conn.closed]
        # objects of a lost connection: the server frees their slots once we exit, never publishes them
        done = [False] * len(objs)
        for start in range(0, len(live), ALLOC_BATCH):
            idx = live[start : start + ALLOC_BATCH]
            conn = objs[idx[0]]._conn
            try:
                oks = conn.request(op, {"slots": [[objs[i].slot, objs[i].gen] for i in idx]})["ok"]
            except ServerUnavailable:
                break
            for i, ok in zip(idx, oks, strict=True):
                done[i] = bool(ok)
                if ok and op is Op.COMMIT:
                    objs[i].state = ObjectState.READY
        return done

    def finish_write(self, obj: SharedObject) -> None:
        """Publish ``obj`` (COMMIT); a lost connection or stale generation drops it silently."""
        self._settle([obj], Op.COMMIT)

    def batched_finish_write(self, objs: Sequence[SharedObject]) -> None:
        """Publish every object in one COMMIT (the server then writes them behind to its L2 tiers)."""
        self._settle(objs, Op.COMMIT)

    def abort_write(self, obj: SharedObject) -> None:
        """Free the reservation (ABORT); nothing to do when the connection is gone."""
        self._settle([obj], Op.ABORT)

    def batched_abort_write(self, objs: Sequence[SharedObject]) -> None:
        """Free every reservation in one ABORT."""
        self._settle(objs, Op.ABORT)

    # ------------------------------------------------------------------ reads
    def _lookup(
        self, keys: Sequence[str], pin: bool, **extra: Any
    ) -> tuple[ServerConnection, list[dict[str, Any]]] | None:
        """LOOKUP in batches of LOOKUP_BATCH keys (each request and reply fits one message); the replies."""
        replies: list[dict[str, Any]] = []
        conn = None
        for start in range(0, len(keys), LOOKUP_BATCH):
            batch = list(keys[start : start + LOOKUP_BATCH])
            got = self._call(
                Op.LOOKUP,
                {"keys": batch, "pin": pin, "prefix": False, **extra},
                wait_s=extra.get("wait_s", 0.0),
            )
            if got is None or (conn is not None and got[0] is not conn):
                self.offline_misses += len(keys)
                return None  # leases of earlier batches went with their connection
            conn = got[0]
            replies.append(got[1])
        return None if conn is None else (conn, replies)  # None for no keys: callers answer [] either way

    def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """Per key whether it is published in the shared L1 (False for all when cache-off)."""
        got = self._lookup(keys, False)
        return [False] * len(keys) if got is None else [h is not None for r in got[1] for h in r["hits"]]

    def contains(self, key: str) -> bool:
        """Whether ``key`` is published."""
        return self.batched_contains([key])[0]

    def batched_locate(self, keys: Sequence[str], *, prefetch: bool) -> list[TierHit | None]:
        """Per key where the server has it: L1 (level 0), one of its L2 tiers (level >= 1; with
        ``prefetch`` the server is loading the contiguous prefix's L2 part into the shared L1), or None.
        One LOOKUP per LOOKUP_BATCH keys; all None when cache-off."""
        got = self._lookup(keys, False, l2=True, prefetch=prefetch)
        if got is None:
            return [None] * len(keys)
        conn, replies = got
        l1_hit = TierHit(L1_TIER, 0)
        out: list[TierHit | None] = []
        for reply in replies:
            levels = reply.get("levels") or [0] * len(reply["hits"])
            for hit, level in zip(reply["hits"], levels, strict=True):
                if hit is not None:
                    out.append(l1_hit)
                elif 1 <= level <= len(conn.tiers):
                    out.append(TierHit(conn.tiers[level - 1], level))
                else:
                    out.append(None)
        return out

    def _leases(
        self, conn: ServerConnection, keys: Sequence[str], hits: list[Any]
    ) -> list[SharedLease | None]:
        out: list[SharedLease | None] = []
        for key, hit in zip(keys, hits, strict=True):
            spec = None if hit is None else meta_spec(hit[3])
            if hit is None or spec is None or spec.nbytes != hit[2]:
                if hit is not None:
                    self._release(conn, [int(hit[4])])
                out.append(None)
                continue
            obj = SharedObject(conn, key, spec, int(hit[0]), int(hit[1]), ObjectState.READY)
            out.append(SharedLease(self, obj, int(hit[4])))
        return out

    def batched_acquire(self, keys: Sequence[str], lease_s: float | None = None) -> list[SharedLease | None]:
        """Lease each published key (``lease_s`` is ignored: leases live with the connection)."""
        got = self._lookup(keys, True)
        if got is None:
            return [None] * len(keys)
        return self._leases(got[0], keys, [h for r in got[1] for h in r["hits"]])

    def batched_acquire_loaded(self, keys: Sequence[str], wait_s: float) -> list[SharedLease | None]:
        """Lease each key after the server loaded the L2 part of its contiguous prefix into the shared L1
        (waiting for prefetches in flight, at most about ``wait_s``); one LOOKUP per LOOKUP_BATCH keys."""
        got = self._lookup(keys, True, l2=True, wait_s=min(max(wait_s, 0.0), MAX_WAIT_S))
        if got is None:
            return [None] * len(keys)
        return self._leases(got[0], keys, [h for r in got[1] for h in r["hits"]])

    def acquire(self, key: str, lease_s: float | None = None) -> SharedLease | None:
        """Lease the published ``key``; None on a miss or cache-off."""
        return self.batched_acquire([key], lease_s)[0]

    def batched_release(self, leases: Sequence[SharedLease]) -> None:
        """Release every lease in one RELEASE per connection (never raises)."""
        by_conn: dict[int, tuple[ServerConnection, list[int]]] = {}
        for lease in leases:
            if lease._released:
                continue
            lease._released = True
            conn = lease.obj._conn
            by_conn.setdefault(id(conn), (conn, []))[1].append(lease._id)
        for conn, ids in by_conn.values():
            self._release(conn, ids)

    def delete(self, key: str) -> bool:
        """Not supported on the shared L1 (eviction is the server's): always False."""
        return False

    def _release(self, conn: ServerConnection, lease_ids: list[int]) -> None:
        if conn.closed:
            return
        for start in range(0, len(lease_ids), MAX_KEYS):
            with contextlib.suppress(ServerUnavailable):
                conn.request(Op.RELEASE, {"leases": lease_ids[start : start + MAX_KEYS]})

    # ------------------------------------------------------------------ admin
    def clear(self) -> int | None:
        """CLEAR (admin role): drop every unleased published object; how many, None when cache-off."""
        got = self._call(Op.CLEAR, {})
        return None if got is None else int(got[1]["cleared"])

    def drain(self, timeout_s: float) -> bool:
        """DRAIN (admin role): wait until the server's write-behind queue to L2 is empty (at most
        ``timeout_s``); False on timeout or cache-off."""
        got = self._call(Op.DRAIN, {"timeout_s": timeout_s}, wait_s=timeout_s)
        return got is not None and bool(got[1]["drained"])

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
