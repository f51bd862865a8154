"""The control plane: an asyncio loop serving SOCK_SEQPACKET connections on a Unix socket.

HELLO hands out the segment fds (SCM_RIGHTS) and the epoch. A connection's leases drop when it closes; its
reservations are freed only once its process has exited (pidfd readable): no late copy lands in a reused
slot. With L2 tiers (:class:`~tiercache.server.storage.ServerStorage`) a COMMIT queues the chunks for the
write-behind to L2, a LOOKUP with ``l2`` answers across L1 + L2 and starts the L2 -> L1 prefetch, and a stop
drains the write-behind for at most ``drain_s``.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import itertools
import logging
import os
import socket
import stat
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiercache.server.protocol import MAX_MESSAGE, Message, Op, ProtocolError, decode, encode
from tiercache.server.segment import Segment, SlotClass
from tiercache.server.slots import SlotTable

if TYPE_CHECKING:
    from tiercache.adapters import Adapter
    from tiercache.config import ManagerConfig
    from tiercache.serde import CodecPipeline
    from tiercache.server.storage import ServerStorage

__all__ = ["L1Server", "ServerAlreadyRunning", "ServerOptions", "claim_socket_path"]

log = logging.getLogger(__name__)
_UCRED = struct.Struct("3i")


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class ServerAlreadyRunning(RuntimeError):
    """Another live server answers on the socket path."""


@dataclass(frozen=True)
class ServerOptions:
    """Where and for whom the server listens; ``allowed_uids`` empty means only the server's own uid."""

    socket_path: str
    slot_classes: Sequence[SlotClass]
    mode: int = 0o600
    group: int | None = None  # gid that owns the socket (mode then usually 0o660); its members are allowed
    allowed_uids: frozenset[int] = field(default_factory=frozenset)
    drain_s: float = 10.0  # on stop, how long the write-behind to L2 may take to drain


def claim_socket_path(path: str) -> None:
    """Make ``path`` bindable: refuse if a server answers there or it is no socket; unlink a stale socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ServerAlreadyRunning(f"{path} exists and is not a socket; refusing to replace it")
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
    role: str = ""


class L1Server:
    """Owns one epoch's segment and slot table and serves clients until :meth:`stop`."""

    def __init__(
        self,
        options: ServerOptions,
        *,
        epoch: int | None = None,
        tiers: Sequence[tuple[str, Adapter, CodecPipeline]] = (),
        policy: ManagerConfig | None = None,
    ) -> None:
        """Create the segment (memfd) for a new epoch and, with ``tiers`` (opened L2 tiers, closed by
        :meth:`stop`), the storage that runs them; nothing listens until :meth:`start`. Construct inside the
        event loop that will serve."""
        self.options = options
        self.epoch = epoch if epoch is not None else time.time_ns() & (2**62 - 1)
        self.segment, self._data_fd, self._header_fd = Segment.create(options.slot_classes, self.epoch)
        self.table = SlotTable(self.segment)
        self.storage: ServerStorage | None = None
        if tiers:
            from tiercache.server.storage import ServerStorage

            self.storage = ServerStorage(self.table, tiers, policy)
        self._listener: socket.socket | None = None
        self._socket_id = (0, 0)
        self._conns: dict[int, _Conn] = {}
        self._cids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self._pidfds: dict[int, int] = {}  # cid -> pidfd waited on for freeing reservations
        self._stopped = asyncio.Event()  # stop() began
        self._finished = asyncio.Event()  # stop() completed (drained, closed)
        self.counters = {"protocol_errors": 0, "refused_peers": 0, "connections": 0, "drain_timeouts": 0}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bind the socket (0600 unless configured) and start accepting."""
        path = self.options.socket_path
        claim_socket_path(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)  # no window in which the socket is reachable by others
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        if self.options.group is not None:
            os.chown(path, -1, self.options.group)
        os.chmod(path, self.options.mode)
        st = os.lstat(path)
        self._socket_id = (st.st_dev, st.st_ino)
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self._spawn(self._accept_loop())
        log.info("tiercache server epoch %d on %s (%d slots)", self.epoch, path, self.segment.num_slots)

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
        loop = asyncio.get_running_loop()
        if self._listener is not None:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(self.options.socket_path)
                if (st.st_dev, st.st_ino) == self._socket_id:  # ours, not a successor's
                    os.unlink(self.options.socket_path)
        # Cancel the accept loop and the connections' tasks and let them end before their sockets close: a
        # socket closed while the loop still watches it leaves a stale registration behind, and the next
        # socket given the same number (a store worker's new connection to L2, still running now) fails.
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for conn in list(self._conns.values()):
            conn.sock.close()
        for fd in self._pidfds.values():
            loop.remove_reader(fd)
            os.close(fd)
        self._pidfds.clear()
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
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            sock.setblocking(False)
            pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            conn = _Conn(next(self._cids), sock, pid, uid)
            if not self._allowed(uid, gid):
                self.counters["refused_peers"] += 1
                log.warning("refused peer pid %d uid %d gid %d", pid, uid, gid)
                self._spawn(self._refuse(sock, uid))
                continue
            self.counters["connections"] += 1
            self._conns[conn.cid] = conn
            self._spawn(self._serve(conn))

    async def _refuse(self, sock: socket.socket, uid: int) -> None:
        """Answer the peer's first message (within 5 s) with a 'forbidden' error, then close.

        Closing with its HELLO unread would reset the connection and lose the error for the peer.
        """
        loop = asyncio.get_running_loop()
        try:
            with contextlib.suppress(TimeoutError, OSError):
                await asyncio.wait_for(loop.sock_recv(sock, MAX_MESSAGE + 1), 5.0)
                err = {"code": "forbidden", "message": f"uid {uid} is not allowed on this server"}
                sock.send(encode(Op.ERR, self.epoch, 0, err))
        finally:
            sock.close()

    def _allowed(self, uid: int, gid: int) -> bool:
        allowed = self.options.allowed_uids or frozenset({os.getuid()})
        return uid in allowed or (self.options.group is not None and gid == self.options.group)

    async def _serve(self, conn: _Conn) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await loop.sock_recv(conn.sock, MAX_MESSAGE + 1)
                if not data:
                    return  # EOF: the peer closed or died
                try:
                    msg = decode(data)
                    reply, fds = await self._handle(conn, msg)
                except ProtocolError as exc:
                    self.counters["protocol_errors"] += 1
                    log.warning("protocol error from pid %d: %s; dropping the connection", conn.pid, exc)
                    with contextlib.suppress(OSError):
                        conn.sock.send(
                            encode(Op.ERR, self.epoch, 0, {"code": "protocol", "message": str(exc)})
                        )
                    return
                await self._send(conn.sock, reply, fds)
        except (ConnectionError, OSError) as exc:
            log.info("connection of pid %d lost: %s", conn.pid, exc)
        finally:
            self._closed(conn)

    async def _send(self, sock: socket.socket, data: bytes, fds: Iterable[int]) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        while True:
            try:
                sock.sendmsg([data], anc)
                return
            except BlockingIOError:
                loop = asyncio.get_running_loop()
                fut: asyncio.Future[None] = loop.create_future()
                loop.add_writer(sock.fileno(), _wake, fut)
                try:
                    await fut
                finally:
                    loop.remove_writer(sock.fileno())

    def _closed(self, conn: _Conn) -> None:
        """Drop leases now; free reservations once the peer process has exited."""
        self._conns.pop(conn.cid, None)
        conn.sock.close()
        self.table.drop_leases(conn.cid)
        if not self.table.reserved_by(conn.cid) or self._stopped.is_set():
            return
        try:
            pidfd = os.pidfd_open(conn.pid)
        except ProcessLookupError:
            self.table.free_reservations(conn.cid)  # already gone
            return
        self._pidfds[conn.cid] = pidfd
        asyncio.get_running_loop().add_reader(pidfd, self._peer_exited, conn.cid)

    def _peer_exited(self, cid: int) -> None:
        fd = self._pidfds.pop(cid)
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)
        freed = self.table.free_reservations(cid)
        log.info("peer of connection %d exited; freed %d reservations", cid, freed)

    # ------------------------------------------------------------------ requests
    async def _handle(self, conn: _Conn, msg: Message) -> tuple[bytes, list[int]]:
        """The reply (and fds to pass) for one validated request."""
        body = msg.body
        if msg.op is Op.HELLO:
            conn.role = body["role"]
            classes = [[c.slot_bytes, c.count] for c in self.segment.classes]
            tiers = [] if self.storage is None else self.storage.tier_names
            reply = {"epoch": self.epoch, "classes": classes, "pid": os.getpid(), "tiers": tiers}
            return encode(Op.OK, self.epoch, msg.req_id, reply), [self._data_fd, self._header_fd]
        if msg.epoch != self.epoch:
            return self._error(msg, "stale_epoch", f"epoch {msg.epoch} is not {self.epoch}")
        if msg.op in (Op.CLEAR, Op.DRAIN) and conn.role != "admin":
            return self._error(msg, "forbidden", f"{msg.op.name} needs a connection with role admin")
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
            hits = t.lookup(cid, keys, pin=body["pin"], prefix=body["prefix"])
            out = {"hits": hits}  # a Hit is a tuple: [slot, generation, nbytes, meta, lease] on the wire
            if levels is not None:
                out["levels"] = levels  # per key: 0 = L1, n = L2 tier n (prefetching), -1 = nowhere
        elif msg.op is Op.ALLOC:
            out = {"slots": t.alloc(cid, body["keys"], body["nbytes"], body["meta"])}
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
        elif msg.op is Op.CLEAR:
            out = {"cleared": t.clear()}
        elif msg.op is Op.DRAIN:
            drained = True if storage is None else await storage.drain(body["timeout_s"])
            out = {"drained": drained, "pending": 0 if storage is None else storage.pending_stores()}
        else:  # STATS
            out = {**t.stats(), **self.counters, "clients": len(self._conns), "epoch": self.epoch}
            out["pending_stores"] = 0 if storage is None else storage.pending_stores()
        try:
            return encode(Op.OK, self.epoch, msg.req_id, out), []
        except ProtocolError as exc:  # the answer is too large: the request's fault is not a protocol error
            return self._error(msg, "too_large", str(exc))

    def _error(self, msg: Message, code: str, message: str) -> tuple[bytes, list[int]]:
        return encode(Op.ERR, self.epoch, msg.req_id, {"code": code, "message": message}), []
