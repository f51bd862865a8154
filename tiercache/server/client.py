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
import os
import select
import socket
import struct
import sys
import threading
import weakref
from collections.abc import Sequence
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
from tiercache.server.segment import Geometry, Segment, SlotObject
from tiercache.store.hits import L1_TIER, TierHit
from tiercache.store.l1 import L1Stats, ObjectState

if TYPE_CHECKING:
    from tiercache.events import ChunkInfo
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
_UCRED = struct.Struct("3i")


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


def _uses_cuda() -> bool:
    """Whether this process already uses torch with a CUDA device (then a worker registers the segment)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_available())


def _own_pidfd() -> list[int]:
    """A pidfd of this process, passed with HELLO so the server sees it exit even across PID namespaces."""
    try:
        return [os.pidfd_open(os.getpid())]
    except (AttributeError, OSError):
        return []


def _trusted_server_uids(server_uid: int | None) -> frozenset[int]:
    return frozenset({server_uid}) if server_uid is not None else frozenset({os.getuid(), 0})


class ServerConnection:
    """One connection: HELLO maps the segment (not for role ``probe``); :meth:`request` is one blocking round
    trip (thread-safe). The server must run as ``server_uid`` (default: this process's uid or root)."""

    def __init__(
        self,
        socket_path: str,
        *,
        role: str = "worker",
        timeout_s: float = 5.0,
        slot_bytes: Sequence[int] = (),
        fence: Sequence[bytes] = (),
        server_uid: int | None = None,
    ) -> None:
        """Connect and HELLO (declaring ``slot_bytes``, ending the lost sessions ``fence``);
        ServerUnavailable / ServerRefused on failure."""
        self._lock = threading.Lock()
        self._req_ids = itertools.count(1)
        self.closed = False
        self.epoch = 0
        self.role = role
        self._timeout_s = timeout_s
        self.open_writes = 0
        """Objects reserved on this connection whose writer has not settled them (COMMIT/ABORT) yet."""
        self.requests: collections.Counter[str] = collections.Counter()
        """Round trips made, by op name (after HELLO)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(timeout_s)
        pidfds = [] if role == "probe" else _own_pidfd()
        try:
            sock.connect(socket_path)
            _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            if uid not in _trusted_server_uids(server_uid):
                sock.close()
                raise ServerRefused(
                    "untrusted_server",
                    f"the server on {socket_path} runs as uid {uid}, not "
                    f"{server_uid if server_uid is not None else f'{os.getuid()} or 0'} (server.server_uid)",
                )
            hello = {"role": role, "slot_bytes": list(slot_bytes), "fence": list(fence)}
            anc = (
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", pidfds).tobytes())] if pidfds else []
            )
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendmsg([encode(Op.HELLO, 0, 0, hello)], anc)  # a refusing server may have closed
            data, anc_in, _, _ = sock.recvmsg(MAX_MESSAGE + 1, socket.CMSG_SPACE(2 * 4))
        except ServerUnavailable:
            raise
        except OSError as exc:
            sock.close()
            raise ServerUnavailable(f"cannot reach the tiercache server at {socket_path}: {exc}") from exc
        finally:
            for fd in pidfds:
                os.close(fd)
        self._sock = sock
        fds = [
            fd
            for lvl, typ, raw in anc_in
            if lvl == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS
            for fd in array.array("i", raw[: len(raw) - len(raw) % 4])
        ]
        self.segment: Segment | None = None
        try:
            body = self._reply(data, 0)
            self.epoch = int(body["epoch"])
            self.server_pid = int(body["pid"])
            self.session = bytes(body["session"])
            self.max_object = int(body["max_object"])
            self.tiers = [str(t) for t in body.get("tiers", [])]
            self.events = bool(body.get("events", False))
            """The server publishes KV events: it wants ``DESCRIBE`` before stores."""
            if role != "probe":
                if len(fds) != 2:
                    raise ServerUnavailable(f"HELLO passed {len(fds)} fds, expected 2")
                region_bytes, num_regions = body["geometry"]
                self.segment = Segment(
                    Geometry(int(region_bytes), int(num_regions)), fds[0], fds[1], writable_header=False
                )
        except (ServerUnavailable, KeyError, TypeError, ValueError) as exc:
            self.close()
            raise (
                exc if isinstance(exc, ServerUnavailable) else ServerUnavailable(f"bad HELLO reply: {exc}")
            ) from exc
        finally:
            for fd in fds:
                os.close(fd)  # the mappings keep the memory

    @property
    def seg(self) -> Segment:
        """The mapped segment (every role but ``probe`` has one)."""
        if self.segment is None:
            raise ServerUnavailable("a probe connection maps no segment")
        return self.segment

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
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes a watcher polling a duplicate of the socket
            self._sock.close()

    def fileno(self) -> int:
        """The socket's descriptor (-1 once closed)."""
        return self._sock.fileno()

    def close(self) -> None:
        """Close the socket (the segment stays mapped while objects use it); idempotent."""
        with self._lock:
            self._close_locked()


class SharedObject(SlotObject):
    """A slot of the shared segment, reached through connection ``_conn`` (its objects die with it)."""

    __slots__ = ("_conn", "_done")

    def __init__(
        self,
        conn: ServerConnection,
        key: str,
        spec: KVSpec,
        slot: int,
        gen: int,
        offset: int,
        state: ObjectState,
    ):
        super().__init__(conn.seg, key, spec, slot, gen, offset, state)
        self._conn = conn
        self._done = state is not ObjectState.WRITING  # a write settled (COMMIT or ABORT sent or void)


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
        return self.obj.published()

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
    """The L1 surface of :class:`~tiercache.store.l1.L1Cache` on a shared segment (cache-off when down).

    Fail-fast: a request that fails or times out once ends the connection and the client is cache-off at
    once (misses, skipped stores, no waiting); a background thread reconnects with a doubling backoff,
    notices a server that went away while the client was idle, registers a new segment with CUDA off the
    request path, and ends the lost session on the server (a fence) once every write into it has settled.
    """

    pinned = False

    def __init__(
        self,
        socket_path: str,
        *,
        role: str = "worker",
        timeout_s: float = 5.0,
        backoff_s: float = 0.05,
        max_backoff_s: float = 5.0,
        slot_bytes: Sequence[int] = (),
        server_uid: int | None = None,
    ) -> None:
        """Connect now if the server answers within ``timeout_s`` (the segment's CUDA registration, where a
        worker uses CUDA, goes on in the background: misses meanwhile); otherwise start cache-off. Never
        raises for an absent server. ``slot_bytes``: the object sizes this client stores (declared at HELLO
        so the server has a size class ready)."""
        self.socket_path = socket_path
        self.role = role
        self.timeout_s = timeout_s
        self._backoff_initial = backoff_s
        self._max_backoff = max_backoff_s
        self._slot_bytes = tuple(slot_bytes)
        self._server_uid = server_uid
        self._lock = threading.Lock()
        self._conn: ServerConnection | None = None
        self._installed = threading.Condition(self._lock)
        self._live = False
        self._stopping = False
        self._fence_ready: list[bytes] = []  # lost sessions with every write settled, not yet fenced
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.requests: collections.Counter[str] = collections.Counter()
        """Round trips to the server by op name, over every connection this L1 made."""
        self.reconnects = 0
        self.offline_misses = 0
        self.skipped_stores = 0
        self.lost_connections = 0
        self.refused_leases = 0
        self.capacity = 0
        self.slot_bytes = 0
        self.last_error = ""
        """Why the last connection attempt or request failed (empty while none did)."""
        first = self._open()
        if first is not None and not (role == "worker" and _uses_cuda()):
            self._install(first)
            first = None
        self._thread = threading.Thread(
            target=self._watch, args=(first,), name="tiercache-server-watch", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ connection
    def _open(self) -> ServerConnection | None:
        """One HELLO (fencing the lost sessions that are ready); None when the server cannot be reached."""
        with self._lock:
            fence = list(self._fence_ready)
        try:
            conn = ServerConnection(
                self.socket_path,
                role=self.role,
                timeout_s=self.timeout_s,
                slot_bytes=self._slot_bytes,
                fence=fence,
                server_uid=self._server_uid,
            )
        except ServerUnavailable as exc:
            if str(exc) != self.last_error:
                log.warning("tiercache server unavailable (%s); cache off, retrying in the background", exc)
            self.last_error = str(exc)
            return None
        with self._lock:
            self._fence_ready = [t for t in self._fence_ready if t not in fence]
        return conn

    def _install(self, conn: ServerConnection) -> None:
        """Make ``conn`` the live connection (after its CUDA registration, where one is due)."""
        with self._lock:
            if self._stopping:
                conn.close()
                return
            if self.capacity:
                self.reconnects += 1
            conn.requests = self.requests  # one tally across reconnects
            self._conn = conn
            self.capacity = conn.seg.data_bytes
            self.slot_bytes = conn.max_object
            self.last_error = ""
            self._live = True
            self._installed.notify_all()
        if 0 < conn.max_object < max(self._slot_bytes, default=0):
            log.warning(
                "tiercache: the server on %s takes objects of at most %d bytes, this client's need %d: those "
                "are not stored (raise the server's region_bytes or l1.capacity)",
                self.socket_path,
                conn.max_object,
                max(self._slot_bytes),
            )

    def _lose(self, conn: ServerConnection, why: str) -> None:
        """``conn`` failed: cache-off now; the watcher reconnects. Its session is fenced once its writes
        settled (at once when none is open)."""
        with self._lock:
            if self._conn is conn:
                self._conn = None
                self._live = False
                self.lost_connections += 1
                log.warning(
                    "tiercache server connection lost (%s); cache off, reconnecting in the background", why
                )
            conn.close()
            if conn.open_writes == 0 and conn.session not in self._fence_ready:
                self._fence_ready.append(conn.session)
            if conn.segment is not None:
                conn.segment.release_views()
        self._poke()

    def _poke(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _watch(self, pending: ServerConnection | None) -> None:
        """Background: register and install ``pending``; while connected wait for the socket to hang up;
        while not, reconnect with a doubling backoff."""
        delay = self._backoff_initial
        while not self._stopping:
            conn = self._conn
            if conn is not None and not conn.closed:
                self._wait_hangup(conn)
                continue
            if pending is None:
                pending = self._open()
            if pending is None:
                self._sleep(delay)
                delay = min(delay * 2, self._max_backoff)
                continue
            if self.role == "worker":
                _pin_for_cuda(pending.seg)  # off the request path: requests miss meanwhile
            self._install(pending)
            pending = None
            delay = self._backoff_initial
        if pending is not None:
            pending.close()

    def _wait_hangup(self, conn: ServerConnection) -> None:
        """Block until ``conn``'s server hangs up (then lose it) or the watcher is poked."""
        try:
            fd = os.dup(conn.fileno())
        except OSError:
            return
        try:
            poller = select.poll()
            poller.register(fd, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
            poller.register(self._wake_r, select.POLLIN)
            events = dict(poller.poll())
        finally:
            os.close(fd)
        if events.get(self._wake_r):
            with contextlib.suppress(BlockingIOError, OSError):
                os.read(self._wake_r, 4096)
        if events.get(fd) and not conn.closed:
            self._lose(conn, "the server closed the connection")

    def _sleep(self, seconds: float) -> None:
        """Wait ``seconds`` or until poked (close)."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        if poller.poll(int(seconds * 1000)):
            with contextlib.suppress(BlockingIOError, OSError):
                os.read(self._wake_r, 4096)

    def wait_connected(self, timeout_s: float, reconnects: int = 0) -> bool:
        """Wait (at most ``timeout_s``) until a connection is live and at least ``reconnects`` reconnects
        happened; whether that holds."""
        with self._lock:
            return self._installed.wait_for(lambda: self._live and self.reconnects >= reconnects, timeout_s)

    def _connection(self) -> ServerConnection | None:
        """The live connection, or None (cache-off: never waits for a reconnect)."""
        conn = self._conn
        return conn if conn is not None and not conn.closed else None

    def _call(
        self, op: Op, body: dict[str, Any], *, wait_s: float = 0.0
    ) -> tuple[ServerConnection, dict[str, Any]] | None:
        conn = self._connection()
        if conn is None:
            return None
        if self._fence_ready:
            self._send_fences(conn)
        try:
            return conn, conn.request(op, body, wait_s=wait_s)
        except ServerUnavailable as exc:
            self._lose(conn, f"{op.name}: {exc}")
            return None

    def _send_fences(self, conn: ServerConnection) -> None:
        with self._lock:
            ready, self._fence_ready = self._fence_ready, []
        try:
            conn.request(Op.FENCE, {"sessions": ready})
        except ServerUnavailable as exc:
            with self._lock:
                self._fence_ready.extend(ready)
            self._lose(conn, f"FENCE: {exc}")

    def connected(self) -> bool:
        """Whether a live connection exists now (no reconnect attempt)."""
        return self._connection() is not None

    def close(self) -> None:
        """Close the connection (the server drops its leases) and stop reconnecting."""
        with self._lock:
            self._stopping = True
            conn, self._conn = self._conn, None
            self._live = False
        if conn is not None:
            conn.close()
        self._poke()
        if self._thread is not threading.current_thread():
            self._thread.join(self.timeout_s + 1.0)

    # ------------------------------------------------------------------ writes
    def reserve_write(self, key: str, spec: KVSpec, tenant: str = "") -> SharedObject | None:
        """Reserve a slot for ``key`` (WRITING) on behalf of ``tenant``; None if present, no room, or
        cache-off."""
        return self.batched_reserve_write([key], [spec], tenant)[0]

    def batched_reserve_write(
        self, keys: Sequence[str], specs: Sequence[KVSpec], tenant: str = ""
    ) -> list[SharedObject | None]:
        """One ALLOC per ALLOC_BATCH keys: a WRITING object per key, None where present, no room or
        cache-off (``tenant`` travels with the ALLOC: the server's quotas count it)."""
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
            if tenant:
                body["tenant"] = tenant
            got = self._call(Op.ALLOC, body)
            if got is None or (conn is not None and got[0] is not conn):
                self.skipped_stores += len(keys) - len(out)
                return out + [None] * (len(keys) - len(out))  # reservations of a lost connection are void
            conn = got[0]
            made = 0
            for key, spec, ref in zip(batch, batch_specs, got[1]["slots"], strict=True):
                if isinstance(ref, list):
                    made += 1
                    out.append(
                        SharedObject(
                            conn, key, spec, int(ref[0]), int(ref[1]), int(ref[2]), ObjectState.WRITING
                        )
                    )
                else:
                    out.append(None)
            with self._lock:
                conn.open_writes += made
        return out

    def _settled(self, objs: Sequence[SharedObject]) -> None:
        """Count ``objs`` as settled on their connections; a lost session whose last write settled is
        queued for a fence."""
        with self._lock:
            for obj in objs:
                if obj._done:
                    continue
                obj._done = True
                conn = obj._conn
                conn.open_writes -= 1
                if conn.closed and conn.open_writes == 0 and conn.session not in self._fence_ready:
                    self._fence_ready.append(conn.session)

    def _settle(self, objs: Sequence[SharedObject], op: Op) -> list[bool]:
        """COMMIT or ABORT ``objs`` in one request; False for those whose connection is gone or stale."""
        for obj in objs:
            if obj.state is not ObjectState.WRITING:
                raise ValueError(f"{obj!r} is not a WRITING object")
        live = [i for i, obj in enumerate(objs) if obj._conn is self._conn and not obj._conn.closed]
        done = [False] * len(objs)
        for start in range(0, len(live), ALLOC_BATCH):
            idx = live[start : start + ALLOC_BATCH]
            conn = objs[idx[0]]._conn
            try:
                oks = conn.request(op, {"slots": [[objs[i].slot, objs[i].gen] for i in idx]})["ok"]
            except ServerUnavailable as exc:
                self._lose(conn, f"{op.name}: {exc}")
                break
            for i, ok in zip(idx, oks, strict=True):
                done[i] = bool(ok)
                if ok and op is Op.COMMIT:
                    objs[i].state = ObjectState.READY
        self._settled(objs)
        return done

    def finish_write(self, obj: SharedObject) -> None:
        """Publish ``obj`` (COMMIT); a lost connection or stale generation drops it silently."""
        self._settle([obj], Op.COMMIT)

    def describe(self, keys: Sequence[str], infos: Sequence[ChunkInfo | None]) -> None:
        """Tell a server that publishes KV events which vLLM blocks ``keys`` cover (before they are stored);
        nothing when it publishes none or no connection is up. Sent in batches that fit a message."""
        conn = self._connection()
        if conn is None or not conn.events:
            return
        batch: list[list[Any]] = []
        size = 0
        for key, info in zip(keys, infos, strict=True):
            if info is None:
                continue
            entry = [
                key,
                list(info.block_hashes),
                info.parent,
                list(info.token_ids),
                info.block_size,
                info.lora_name,
            ]
            n = 64 + len(key) + 34 * len(info.block_hashes) + 5 * len(info.token_ids)
            if batch and (size + n > MAX_MESSAGE // 2 or len(batch) >= ALLOC_BATCH):
                if self._call(Op.DESCRIBE, {"chunks": batch}) is None:
                    return
                batch, size = [], 0
            batch.append(entry)
            size += n
        if batch:
            self._call(Op.DESCRIBE, {"chunks": batch})

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
            refused = int(got[1].get("refused", 0))
            if refused:
                self.refused_leases += refused
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
            obj = SharedObject(conn, key, spec, int(hit[0]), int(hit[1]), int(hit[5]), ObjectState.READY)
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
