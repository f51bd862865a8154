"""The control plane: an asyncio loop serving SOCK_SEQPACKET connections on a Unix socket.

HELLO hands out the sealed segment fds (SCM_RIGHTS), the epoch and a session token. A connection's leases drop
when it closes; its reservations' keys leave the index at once, and their slots are freed as soon as nothing
of the writer can still land: the client fences the lost session (HELLO ``fence`` or FENCE with its token,
once its writes into it ended), or the client process exits (a pidfd the client passed at HELLO, which works
across PID namespaces, else one opened from ``SO_PEERCRED``), or, with no way to watch the writer at all,
after ``orphan_grace_s``. Accept errors (EMFILE included) are survived with a backoff. With L2 tiers
(:class:`~tiercache.server.storage.ServerStorage`) a COMMIT queues the chunks for the write-behind to L2, a
LOOKUP with ``l2`` answers across L1 + L2 and starts the L2 -> L1 prefetch, and a stop drains the
write-behind for at most ``drain_s``.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import fcntl
import itertools
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiercache.server.listen import is_socket, listen_at
from tiercache.server.logs import RateLimitedLog
from tiercache.server.metrics import OpLatency
from tiercache.server.protocol import MAX_MESSAGE, Message, Op, ProtocolError, decode, encode
from tiercache.server.segment import Geometry, Segment
from tiercache.server.slots import Caps, SlotTable

if TYPE_CHECKING:
    from tiercache.adapters import Adapter
    from tiercache.config import ManagerConfig, TierConfig
    from tiercache.events import ChunkInfo, EventSink
    from tiercache.serde import CodecPipeline
    from tiercache.server.events_pub import EventPublisher
    from tiercache.server.storage import ServerStorage

__all__ = ["L1Server", "ServerAlreadyRunning", "ServerOptions", "claim_socket_path"]

log = logging.getLogger(__name__)
_UCRED = struct.Struct("3i")
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_ACCEPT_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_ADMIN_OPS = (Op.CLEAR, Op.DRAIN, Op.CONTROL)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _until_ready(sock: socket.socket, *, write: bool = False) -> None:
    """Wait until the running loop sees ``sock`` readable (writable with ``write``)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(sock.fileno(), _wake, fut)
    try:
        await fut
    finally:
        remove(sock.fileno())


class ServerAlreadyRunning(RuntimeError):
    """Another live server answers on the socket path."""


@dataclass(frozen=True)
class ServerOptions:
    """Where, for whom and with how much memory the server listens.

    ``capacity``: bytes of the shared segment; ``slot_bytes``: object sizes to make size classes for ahead
    (clients' sizes make more); ``region_bytes``: the unit classes take (None: from the capacity);
    ``allowed_uids`` empty means only the server's own uid (plus ``group``); admin operations are for the
    server's own uid and ``admin_group``.
    """

    socket_path: str
    capacity: int
    slot_bytes: Sequence[int] = ()
    region_bytes: int | None = None
    mode: int = 0o600
    group: int | None = None  # gid that owns the socket (mode then usually 0o660); its members are allowed
    allowed_uids: frozenset[int] = field(default_factory=frozenset)
    admin_group: int | None = None
    drain_s: float = 10.0  # on stop, how long the write-behind to L2 may take to drain
    caps: Caps = field(default_factory=Caps)
    max_clients: int = 1024
    orphan_grace_s: float = 60.0  # a lost writer that cannot be watched (no pidfd): its slots come back then
    events_endpoint: str | None = None  # ZMQ PUB address of the node's KV event stream (None: off)
    events_topic: str = ""

    def geometry(self) -> Geometry:
        """The segment's regions for these options."""
        return Geometry.for_capacity(self.capacity, self.region_bytes, max(self.slot_bytes, default=0))


def _lock_path(lock_path: str) -> int:
    """An open fd holding an exclusive ``flock`` on ``lock_path`` (created 0600); ServerAlreadyRunning when
    another process holds it, or when the file was replaced while we locked it (a stopping server)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st, now = os.fstat(fd), os.stat(lock_path)
        if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
            raise FileNotFoundError(lock_path)
    except (BlockingIOError, FileNotFoundError):
        os.close(fd)
        socket_path = lock_path.removesuffix(".lock")
        raise ServerAlreadyRunning(f"a tiercache server is already listening on {socket_path}") from None
    return fd


def claim_socket_path(path: str) -> None:
    """Make ``path`` bindable: refuse if a server answers there or it is no socket; unlink a stale socket."""
    try:
        if not is_socket(path):
            return
    except FileExistsError as exc:
        raise ServerAlreadyRunning(str(exc)) from None
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise ServerAlreadyRunning(f"cannot probe existing socket {path}: {exc}") from exc
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # stale: its server is gone
        return
    finally:
        probe.close()
    raise ServerAlreadyRunning(f"a tiercache server is already listening on {path}")


@dataclass(eq=False)
class _Conn:
    cid: int
    sock: socket.socket
    pid: int
    uid: int
    gid: int
    role: str = ""
    admin: bool = False
    session: bytes = b""
    pidfd: int = -1  # watches the peer process (client-passed or from SO_PEERCRED); -1: none
    fenced: bool = False  # the client declared this session over: nothing more is served on it
    last_alloc: list[tuple[int, int]] = field(default_factory=list)  # refs of the ALLOC being answered


@dataclass(eq=False)
class _Lost:
    """A closed connection whose reservations wait until nothing of its writer can land."""

    conn: _Conn
    timer: asyncio.TimerHandle | None = None


def _peer_groups(sock: socket.socket) -> set[int]:
    """The peer's supplementary groups (``SO_PEERGROUPS``); empty where the kernel does not tell."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 1024)
    except OSError:
        return set()
    return set(array.array("I", raw[: len(raw) - len(raw) % 4]))


def _pidfd_pid(fd: int) -> int | None:
    """The pid (in our namespace; 0 or -1 when not visible there) a pidfd refers to; None for another fd."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as info:
            for line in info:
                if line.startswith("Pid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _chunk_info(chunk: tuple[Any, ...]) -> ChunkInfo:
    """A validated DESCRIBE entry as the sink's block description."""
    from tiercache.events import ChunkInfo

    _, hashes, parent, tokens, size, lora = chunk
    return ChunkInfo(tuple(hashes), parent, tuple(tokens), size, lora)


class L1Server:
    """Owns one epoch's segment and slot table and serves clients until :meth:`stop`."""

    def __init__(
        self,
        options: ServerOptions,
        *,
        epoch: int | None = None,
        tiers: Sequence[tuple[str, Adapter, CodecPipeline]] = (),
        policy: ManagerConfig | None = None,
        tier_configs: Sequence[TierConfig] = (),
    ) -> None:
        """Create the sealed segment (memfds) for a new epoch and, with ``tiers`` (opened L2 tiers, closed by
        :meth:`stop`), the storage that runs them (``tier_configs``: their admission and tenant quotas);
        nothing listens until :meth:`start`. Construct inside the event loop that will serve."""
        self.options = options
        self.epoch = epoch if epoch is not None else time.time_ns() & (2**62 - 1)
        self.segment, self._data_fd, self._header_fd = Segment.create(options.geometry(), self.epoch)
        self.table = SlotTable(self.segment, options.caps)
        for n in options.slot_bytes:
            if not self.table.declare(n):
                raise ValueError(
                    f"slot_bytes {n} is larger than one region ({self.table.max_object} bytes); raise "
                    "server.region_bytes or l1.capacity"
                )
        self.storage: ServerStorage | None = None
        if tiers:
            from tiercache.server.storage import ServerStorage

            self.storage = ServerStorage(self.table, tiers, policy, tier_configs=tier_configs)
        self.events: EventSink = self._event_sink(tiers, emit=options.events_endpoint is not None)
        """What the shared L1 and the L2 tiers hold (cache control deletes by prefix from it) and, with
        ``events_endpoint``, the node's KV events."""
        self.publisher: EventPublisher | None = None
        from tiercache.server.control import PINS_SUFFIX, CacheControl

        self.control = CacheControl(self.table, self.storage, self.events, options.socket_path + PINS_SUFFIX)
        """Cache control (``CONTROL``): pins (kept across restarts), deletes, prefetches, tenant stats."""
        self._listener: socket.socket | None = None
        self._spare_fd = -1  # closed to accept-and-refuse one client when out of file descriptors
        self._lock_fd = -1  # flock of PATH.lock while serving
        self._socket_id = (0, 0)
        self._conns: dict[int, _Conn] = {}
        self._sessions: dict[bytes, _Conn] = {}  # session token -> live connection
        self._lost: dict[bytes, _Lost] = {}  # session token -> closed connection holding reservations
        self._cids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = asyncio.Event()  # stop() began
        self._finished = asyncio.Event()  # stop() completed (drained, closed)
        self._log = RateLimitedLog(log)
        self.op_latency = OpLatency()
        """Seconds each request took to handle and answer, by op (``/metrics``)."""
        self.counters = {
            "protocol_errors": 0,
            "refused_peers": 0,
            "connections": 0,
            "drain_timeouts": 0,
            "accept_errors": 0,
            "busy_refusals": 0,
            "shed_clients": 0,
            "fenced_sessions": 0,
            "freed_on_exit": 0,
            "freed_by_fence": 0,
            "freed_after_grace": 0,
            "freed_unsent": 0,
        }

    def _event_sink(self, tiers: Sequence[tuple[str, Adapter, CodecPipeline]], *, emit: bool) -> EventSink:
        """A sink following the slot table, the write-behind and the tiers that report their evictions (each
        tier's medium from its scheme)."""
        from tiercache.events import EventSink, medium_of

        sink = EventSink({name: medium_of(f"{adapter.scheme}://") for name, adapter, _ in tiers}, emit=emit)
        self.table.add_listener(sink.l1_listener)
        if self.storage is not None:
            sink.attach(self.storage.manager)  # the write-behind's stores, the tiers' own evictions
        return sink

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Take the socket path's lock file (``PATH.lock``, held while serving and removed at stop: two
        servers started at once on one path cannot both run), bind the socket (0600 unless configured) and
        start accepting."""
        path = self.options.socket_path
        if self.storage is not None:  # per-tenant usage of the quota'd tiers from before this server
            await self.storage.manager.store.restore_ledgers()
        self._lock_fd = _lock_path(path + ".lock")
        claim_socket_path(path)
        try:
            sock = listen_at(path, mode=self.options.mode, group=self.options.group)
        except FileExistsError as exc:
            raise ServerAlreadyRunning(str(exc)) from None
        st = os.lstat(path)
        self._socket_id = (st.st_dev, st.st_ino)
        sock.setblocking(False)
        self._listener = sock
        self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        if self.options.events_endpoint is not None:
            from tiercache.server.events_pub import EventPublisher

            self.events.cleared()  # a new epoch: whatever an earlier server announced on this stream is gone

            self.publisher = EventPublisher(
                self.events, self.options.events_endpoint, topic=self.options.events_topic
            )
            log.info("KV events on %s", self.publisher.endpoint)
        self._spawn(self._accept_loop())
        self._spawn(self._restore_pins())
        geo = self.segment.geometry
        log.info(
            "tiercache server epoch %d on %s (%d regions of %d bytes)",
            self.epoch,
            path,
            geo.num_regions,
            geo.region_bytes,
        )

    async def _restore_pins(self) -> None:
        """Pin again what the pin file names and a tier still holds (a restart); failures are logged."""
        try:
            await self.control.restore()
        except Exception:
            log.exception("restoring pins failed")

    async def serve_forever(self) -> None:
        """Wait until :meth:`stop` was called and has finished (its drain included)."""
        await self._finished.wait()

    async def stop(self) -> None:
        """Close the listener and every connection, unlink the socket, drain the write-behind to L2 (at most
        ``drain_s``), close the tiers and the memfds; idempotent."""
        if self._stopped.is_set():
            await self._finished.wait()
            return
        self._stopped.set()
        if self._listener is not None:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(self.options.socket_path)
                if (st.st_dev, st.st_ino) == self._socket_id:  # ours, not a successor's
                    os.unlink(self.options.socket_path)
        if self._lock_fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.options.socket_path + ".lock")  # still locked: no one else holds this file
        # Cancel the accept loop and the connections' tasks and let them end before their sockets close: a
        # socket closed while the loop still watches it leaves a stale registration behind, and the next
        # socket given the same number (a store worker's new connection to L2, still running now) fails.
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for fd in (self._spare_fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._spare_fd = self._lock_fd = -1
        for conn in list(self._conns.values()):
            conn.sock.close()
            self._close_pidfd(conn)
        for lost in list(self._lost.values()):
            self._end_lost(lost)
        self._lost.clear()
        if self.publisher is not None:
            self.publisher.close()
        if self.storage is not None:
            pending = self.storage.pending_stores()
            if not await self.storage.drain(self.options.drain_s):
                self.counters["drain_timeouts"] += 1
                log.warning(
                    "stop: %d L2 stores still pending after %.1f s; dropped",
                    self.storage.pending_stores(),
                    self.options.drain_s,
                )
            elif pending:
                log.info("stop: drained %d pending L2 stores", pending)
            await self.storage.aclose()
        os.close(self._data_fd)
        os.close(self._header_fd)
        self._finished.set()

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ connections
    async def _accept_loop(self) -> None:
        """Accept until stopped; never dies: out of descriptors or memory, it sheds the clients waiting now
        (they see EOF at once instead of hanging); any accept error is counted, logged (rate-limited) and
        followed by a short backoff."""
        loop = asyncio.get_running_loop()
        listener = self._listener
        assert listener is not None
        delay = 0.0
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:
                self.counters["accept_errors"] += 1
                self._log.warning("accept", "accept failed: %s; backing off", exc)
                if exc.errno in _ACCEPT_RESOURCE_ERRORS:
                    self._shed_waiting(listener)
                delay = min(max(2 * delay, 0.005), 0.25)
                await asyncio.sleep(delay)
                continue
            delay = 0.0
            self._spawn(self._admit(sock))

    def _shed_waiting(self, listener: socket.socket) -> None:
        """Out of descriptors: free the spare one, accept every waiting client and close it, take the spare
        back (the clients go cache-off at once instead of waiting for a HELLO answer)."""
        if self._spare_fd < 0:
            return
        os.close(self._spare_fd)
        self._spare_fd = -1
        with contextlib.suppress(OSError):
            while True:
                sock, _ = listener.accept()
                sock.close()
                self.counters["shed_clients"] += 1
        with contextlib.suppress(OSError):
            self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    async def _admit(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        try:
            pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        except OSError:
            sock.close()
            return
        if not self._allowed(uid, gid, sock):
            self.counters["refused_peers"] += 1
            self._log.warning("refused", "refused peer pid %d uid %d gid %d", pid, uid, gid)
            await self._refuse(sock, "forbidden", f"uid {uid} is not allowed on this server")
            return
        if len(self._conns) >= self.options.max_clients:
            self.counters["busy_refusals"] += 1
            self._log.warning("busy", "refused a client: %d connections open", len(self._conns))
            await self._refuse(sock, "busy", f"the server has {len(self._conns)} connections open")
            return
        conn = _Conn(next(self._cids), sock, pid, uid, gid)
        if pid > 0:  # every connection of one process shares its cap (a lost one's reservations too)
            self.table.set_holder(conn.cid, -pid)
        self.counters["connections"] += 1
        self._conns[conn.cid] = conn
        await self._serve(conn)

    async def _refuse(self, sock: socket.socket, code: str, message: str) -> None:
        """Answer the peer's first message (within 5 s) with an error, then close.

        Closing with its HELLO unread would reset the connection and lose the error for the peer.
        """
        try:
            with contextlib.suppress(TimeoutError, OSError):
                _, fds = await asyncio.wait_for(self._recv(sock), 5.0)
                for fd in fds:
                    os.close(fd)
                sock.send(encode(Op.ERR, self.epoch, 0, {"code": code, "message": message}))
        finally:
            sock.close()

    def _allowed(self, uid: int, gid: int, sock: socket.socket) -> bool:
        allowed = self.options.allowed_uids or frozenset({os.getuid()})
        group = self.options.group
        return (
            uid in allowed
            or uid == os.getuid()
            or (group is not None and (gid == group or group in _peer_groups(sock)))
        )

    def _is_admin(self, conn: _Conn) -> bool:
        group = self.options.admin_group
        return conn.uid == os.getuid() or (
            group is not None and (conn.gid == group or group in _peer_groups(conn.sock))
        )

    async def _recv(self, sock: socket.socket) -> tuple[bytes, list[int]]:
        """One message and the descriptors passed with it (the caller closes those it does not keep)."""
        while True:
            try:
                data, anc, _, _ = sock.recvmsg(MAX_MESSAGE + 1, socket.CMSG_SPACE(4 * 4))
            except BlockingIOError:
                await _until_ready(sock)
                continue
            fds = [
                fd
                for lvl, typ, raw in anc
                if lvl == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS
                for fd in array.array("i", raw[: len(raw) - len(raw) % 4])
            ]
            return data, fds

    async def _serve(self, conn: _Conn) -> None:
        try:
            while True:
                data, fds = await self._recv(conn.sock)
                if conn.fenced:
                    for fd in fds:
                        os.close(fd)
                    return  # the client ended this session: nothing it still sends is served
                if not data:
                    return  # EOF: the peer closed or died
                started = time.perf_counter()
                try:
                    msg = decode(data)
                    if msg.op is Op.HELLO and not conn.role:
                        self._watch(conn, fds)  # takes the peer's pidfd out of fds; the rest are closed below
                    reply, out_fds = await self._handle(conn, msg)
                except ProtocolError as exc:
                    self.counters["protocol_errors"] += 1
                    self._log.warning(
                        "protocol", "protocol error from pid %d: %s; dropping the connection", conn.pid, exc
                    )
                    with contextlib.suppress(OSError):
                        conn.sock.send(
                            encode(Op.ERR, self.epoch, 0, {"code": "protocol", "message": str(exc)})
                        )
                    return
                finally:
                    for fd in fds:
                        os.close(fd)
                try:
                    await self._send(conn.sock, reply, out_fds)
                except OSError:
                    self._unsent(conn)
                    raise
                conn.last_alloc = []
                self.op_latency.observe(msg.op.name, time.perf_counter() - started)
        except (ConnectionError, OSError) as exc:
            self._log.info("lost", "connection of pid %d lost: %s", conn.pid, exc)
        finally:
            self._closed(conn)

    async def _send(self, sock: socket.socket, data: bytes, fds: Iterable[int]) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        while True:
            try:
                sock.sendmsg([data], anc)
                return
            except BlockingIOError:
                await _until_ready(sock, write=True)

    def _unsent(self, conn: _Conn) -> None:
        """An ALLOC answer never reached the client: nobody can write those slots; free them now."""
        if conn.last_alloc:
            freed = sum(self.table.abort(conn.cid, conn.last_alloc))
            self.counters["freed_unsent"] += freed
            conn.last_alloc = []

    def _watch(self, conn: _Conn, fds: list[int]) -> None:
        """Keep a pidfd of the peer: the one it passed with HELLO if it is a pidfd of that peer, else one
        opened from its ``SO_PEERCRED`` pid (impossible across PID namespaces: pid 0); -1 when neither."""
        for fd in list(fds):
            pid = _pidfd_pid(fd)
            if pid is not None and (conn.pid <= 0 or pid == conn.pid):
                conn.pidfd = fd
                fds.remove(fd)
                return
        if conn.pid > 0:
            try:
                conn.pidfd = os.pidfd_open(conn.pid)
            except OSError as exc:  # gone already (then its exit is certain), or no pidfds here
                if exc.errno == errno.ESRCH:
                    conn.pid = -1
                else:
                    self._log.warning("pidfd", "cannot watch pid %d: %s", conn.pid, exc)

    def _close_pidfd(self, conn: _Conn) -> None:
        if conn.pidfd >= 0:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(conn.pidfd)
            os.close(conn.pidfd)
            conn.pidfd = -1

    def _closed(self, conn: _Conn) -> None:
        """Drop leases and orphan reservations now; free the reservations once nothing can land."""
        self._conns.pop(conn.cid, None)
        self._sessions.pop(conn.session, None)
        conn.sock.close()
        if not self.table.orphan(conn.cid) or self._stopped.is_set() or conn.fenced:
            if not conn.fenced:
                self.table.free_reservations(conn.cid)
            self._close_pidfd(conn)
            return
        lost = _Lost(conn)
        self._lost[conn.session] = lost
        loop = asyncio.get_running_loop()
        if conn.pidfd >= 0:
            loop.add_reader(conn.pidfd, self._peer_exited, conn.session)
        elif conn.pid == -1:  # its process was gone before HELLO finished
            loop.call_soon(self._peer_exited, conn.session)
        else:
            lost.timer = loop.call_later(self.options.orphan_grace_s, self._grace_over, conn.session)

    def _end_lost(self, lost: _Lost) -> int:
        if lost.timer is not None:
            lost.timer.cancel()
        self._close_pidfd(lost.conn)
        return self.table.free_reservations(lost.conn.cid)

    def _peer_exited(self, session: bytes) -> None:
        lost = self._lost.pop(session, None)
        if lost is not None:
            freed = self._end_lost(lost)
            self.counters["freed_on_exit"] += freed
            self._log.info("exit", "peer pid %d exited; freed %d reservations", lost.conn.pid, freed)

    def _grace_over(self, session: bytes) -> None:
        lost = self._lost.pop(session, None)
        if lost is not None:
            freed = self._end_lost(lost)
            self.counters["freed_after_grace"] += freed
            self._log.warning(
                "grace",
                "freed %d reservations of a lost connection whose process cannot be watched, after %.0f s",
                freed,
                self.options.orphan_grace_s,
            )

    def _fence(self, conn: _Conn, sessions: list[bytes]) -> int:
        """End the given sessions of the same uid: their reservations are freed now (the client says nothing
        of them can land) and a session still connected serves nothing more. Reservations freed."""
        freed = 0
        for token in sessions:
            lost = self._lost.get(token)
            if lost is not None and lost.conn.uid == conn.uid:
                del self._lost[token]
                freed += self._end_lost(lost)
                self.counters["fenced_sessions"] += 1
                continue
            live = self._sessions.get(token)
            if live is not None and live is not conn and live.uid == conn.uid:
                live.fenced = True
                self.table.drop_leases(live.cid)
                freed += self.table.free_reservations(live.cid)
                self.counters["fenced_sessions"] += 1
                with contextlib.suppress(OSError):
                    live.sock.shutdown(socket.SHUT_RDWR)
        self.counters["freed_by_fence"] += freed
        return freed

    # ------------------------------------------------------------------ requests
    def _hello(self, conn: _Conn, msg: Message) -> tuple[bytes, list[int]]:
        body = msg.body
        if conn.role:
            raise ProtocolError("HELLO twice on one connection")
        if body["role"] == "admin" and not self._is_admin(conn):
            return self._error(msg, "forbidden", f"uid {conn.uid} may not connect as admin")
        conn.role = body["role"]
        conn.admin = conn.role == "admin"
        conn.session = secrets.token_bytes(16)
        self._sessions[conn.session] = conn
        declared = [n for n in body["slot_bytes"] if self.table.declare(n)]
        freed = self._fence(conn, body["fence"])
        geo = self.segment.geometry
        reply = {
            "epoch": self.epoch,
            "pid": os.getpid(),
            "uid": os.getuid(),
            "session": conn.session,
            "geometry": [geo.region_bytes, geo.num_regions],
            "max_object": self.table.max_object,
            "declared": declared,
            "fenced": freed,
            "tiers": [] if self.storage is None else self.storage.tier_names,
            "events": self.events.emit,
            "ready": True,
        }
        fds = [] if conn.role == "probe" else [self._data_fd, self._header_fd]
        return encode(Op.OK, self.epoch, msg.req_id, reply), fds

    async def _handle(self, conn: _Conn, msg: Message) -> tuple[bytes, list[int]]:
        """The reply (and fds to pass) for one validated request."""
        body = msg.body
        if msg.op is Op.HELLO:
            return self._hello(conn, msg)
        if not conn.role:
            raise ProtocolError(f"{msg.op.name} before HELLO")
        if msg.epoch != self.epoch:
            return self._error(msg, "stale_epoch", f"epoch {msg.epoch} is not {self.epoch}")
        if conn.role == "probe" and msg.op is not Op.STATS:
            return self._error(msg, "forbidden", f"{msg.op.name} is not open to a probe connection")
        if msg.op in _ADMIN_OPS and not conn.admin:
            return self._error(msg, "forbidden", f"{msg.op.name} needs an admin connection")
        cid, t, storage = conn.cid, self.table, self.storage
        out: dict[str, Any]
        if msg.op is Op.LOOKUP:
            keys = body["keys"]
            levels = None
            if body["l2"] and storage is not None:
                if body["pin"] and body["wait_s"] > 0:  # a read: load the L2 prefix first (bounded)
                    await storage.load(keys, body["wait_s"])
                else:
                    levels = await storage.locate(keys, prefetch=body["prefetch"])
                if conn.fenced:
                    return self._error(msg, "fenced", "this session was ended")
            hits, refused = t.lookup(cid, keys, pin=body["pin"], prefix=body["prefix"])
            out = {"hits": hits}  # a Hit is a tuple: [slot, generation, nbytes, meta, lease, offset]
            if refused:
                out["refused"] = refused  # pinned hits over this connection's caps (answered as misses)
                self._log.warning("caps", "refused %d leases to pid %d (its caps)", refused, conn.pid)
            if levels is not None:
                out["levels"] = levels  # per key: 0 = L1, n = L2 tier n (prefetching), -1 = nowhere
            try:
                return encode(Op.OK, self.epoch, msg.req_id, out), []
            except ProtocolError as exc:  # too large: the leases taken for it are dropped again
                t.release(cid, [h.lease for h in hits if h is not None and h.lease])
                return self._error(msg, "too_large", str(exc))
        if msg.op is Op.ALLOC:
            slots = t.alloc(cid, body["keys"], body["nbytes"], body["meta"], body.get("tenant", ""))
            conn.last_alloc = [(ref[0], ref[1]) for ref in slots if isinstance(ref, list)]
            out = {"slots": slots}
        elif msg.op is Op.COMMIT:
            refs = body["slots"]
            ok = t.commit(cid, refs)
            if storage is not None:
                storage.published([t.key_of(slot) for (slot, _), good in zip(refs, ok, strict=True) if good])
            out = {"ok": ok}
        elif msg.op is Op.ABORT:
            out = {"ok": t.abort(cid, body["slots"])}
        elif msg.op is Op.RELEASE:
            t.release(cid, body["leases"])
            out = {}
        elif msg.op is Op.END:
            t.drop_leases(cid)
            out = {}
        elif msg.op is Op.FENCE:
            out = {"freed": self._fence(conn, body["sessions"])}
        elif msg.op is Op.CLEAR:
            out = {"cleared": t.clear()}
        elif msg.op is Op.CONTROL:
            out = await self.control.handle(body)
        elif msg.op is Op.DESCRIBE:
            chunks = body["chunks"]
            self.events.describe([c[0] for c in chunks], [_chunk_info(c) for c in chunks])
            out = {}
        elif msg.op is Op.DRAIN:
            drained = True if storage is None else await storage.drain(body["timeout_s"])
            out = {"drained": drained, "pending": 0 if storage is None else storage.pending_stores()}
        else:  # STATS
            out = self.stats()
        return encode(Op.OK, self.epoch, msg.req_id, out), []

    def stats(self) -> dict[str, Any]:
        """The STATS answer: slot table, counters, clients, lost sessions, write-behind."""
        storage = self.storage
        out: dict[str, Any] = {**self.table.stats(), **self.counters}
        out.update(
            clients=len(self._conns),
            lost_sessions=len(self._lost),
            epoch=self.epoch,
            max_object=self.table.max_object,
            pending_stores=0 if storage is None else storage.pending_stores(),
            stores_dropped=0 if storage is None else sum(storage.dropped_stores().values()),
            hit_rate_ceiling=round(self.table.ceiling.ceiling(), 4),
        )
        return out

    def _error(self, msg: Message, code: str, message: str) -> tuple[bytes, list[int]]:
        return encode(Op.ERR, self.epoch, msg.req_id, {"code": code, "message": message}), []
