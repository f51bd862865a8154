"""A small RESP2 client for ``GET`` / ``SET`` of large values over plain TCP, with no copies of the value.

redis-py's asyncio path joins a command into one ``bytes`` before writing (a copy of the value), asyncio's
transport copies what the socket did not take at once (another), and a reply is read through a stream
buffer and joined again. Here a ``SET`` hands the caller's buffer to ``sendmsg`` beside the command's header
and trailer, and a ``GET`` reads the bulk reply straight into one buffer allocated for it (not zero-filled;
returned as a view without its CRLF). Connections are pooled (``size`` at most); a connection whose call
failed, timed out or was cancelled part way is closed, never reused, so the server never sees half a command
followed by another. A call on a pooled connection that finds it reset before any reply byte arrived is
retried once on a new one (``GET`` and ``SET`` are idempotent), as redis-py does. ``timeout`` bounds every
wait for the socket (connect, each step of a send or a receive), not the whole transfer. Errors: transport
failures raise ``AdapterUnavailable``, a silent server ``AdapterTimeout``, an error reply ``RespError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple, TypeVar

from tiercache.errors import AdapterTimeout, AdapterUnavailable

__all__ = ["RespError", "RespPool", "new_buffer"]

_T = TypeVar("_T")
_LINE_MAX = 64 << 10
_RECV_HEAD = 64 << 10


def new_buffer(size: int) -> memoryview:
    """A writable byte buffer of ``size`` bytes, not zero-filled (the receive overwrites all of it)."""
    import numpy as np

    view: memoryview = np.empty(size, dtype=np.uint8).data
    return view


class RespError(Exception):
    """An error reply of the server (``-ERR ...``, ``-OOM ...``); the connection stays usable."""


class _Landed(NamedTuple):
    """A bulk reply received into the caller's buffer; ``tail`` holds its last bytes."""

    tail: bytes


class _Reset(ConnectionError):
    """The peer closed or reset the connection."""


class _Conn:
    """One non-blocking socket and the bytes received past the last reply's end."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.timeout = timeout
        self.pending = bytearray()  # received bytes not consumed yet
        self.fresh = True  # no call has completed on it yet (a reset is then not a stale connection)
        self._deadline: asyncio.Timeout | None = None  # of the call in progress; pushed on at each step
        self._readable: asyncio.Future[None] | None = None  # a receive waiting for data

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def _progress(self) -> None:
        """Bytes moved: the call's timeout counts again from now."""
        if self._deadline is not None:
            self._deadline.reschedule(asyncio.get_running_loop().time() + self.timeout)

    async def _writable(self) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        fd = self.sock.fileno()
        loop.add_writer(fd, lambda: None if fut.done() else fut.set_result(None))
        try:
            await fut
        finally:
            loop.remove_writer(fd)

    async def send(self, parts: list[memoryview]) -> None:
        """Send every part in order (``sendmsg`` of the parts left; no joining)."""
        parts = [p for p in parts if p.nbytes]
        while parts:
            try:
                sent = self.sock.sendmsg(parts[:512])
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                raise _Reset(str(exc)) from exc
            if sent:
                self._progress()
            while sent:
                if sent >= parts[0].nbytes:
                    sent -= parts.pop(0).nbytes
                else:
                    parts[0] = parts[0][sent:]
                    sent = 0
            if parts:
                await self._writable()

    async def _recv_into(self, view: memoryview) -> int:
        """Receive what has arrived into ``view`` (at least one byte), waiting on the call's reader."""
        while True:
            try:
                n = self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                waiter = self._readable = asyncio.get_running_loop().create_future()
                try:
                    await waiter
                finally:
                    self._readable = None
                continue
            except OSError as exc:
                raise _Reset(str(exc)) from exc
            if n == 0:
                raise _Reset("connection closed by the server")
            self._progress()
            return n

    def _on_readable(self) -> None:
        waiter = self._readable
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _line(self) -> bytes:
        """The next reply line, without its CRLF."""
        while (end := self.pending.find(b"\r\n")) < 0:
            if len(self.pending) > _LINE_MAX:
                raise _Reset("reply line too long: not a RESP server")
            chunk = bytearray(_RECV_HEAD)
            n = await self._recv_into(memoryview(chunk))
            self.pending += memoryview(chunk)[:n]
        line = bytes(self.pending[:end])
        del self.pending[: end + 2]
        return line

    async def _take(self, view: memoryview) -> None:
        """Fill ``view`` with the next bytes of the stream (what is pending first, then the socket)."""
        have = min(len(self.pending), view.nbytes)
        view[:have] = self.pending[:have]
        del self.pending[:have]
        while have < view.nbytes:
            have += await self._recv_into(view[have:])

    async def reply(
        self, into: memoryview | None = None, tail: int = 0
    ) -> bytes | memoryview | int | _Landed | None:
        """Read one reply: simple string (bytes), integer, bulk string (a view of a buffer of its own),
        null (None); an error reply raises RespError. A bulk string of exactly ``into``'s size plus ``tail``
        bytes lands in ``into`` and its last ``tail`` bytes come back as ``_Landed``."""
        line = await self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            raise RespError(rest.decode("utf-8", "replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            if into is not None and into.nbytes + tail == size:
                end = memoryview(bytearray(tail + 2))  # the value in place, then its tail and CRLF
                await self._take(into)
                await self._take(end)
                if bytes(end[tail:]) != b"\r\n":
                    raise _Reset("bulk reply without its CRLF: not a RESP server")
                return _Landed(bytes(end[:tail]))
            if len(self.pending) >= size + 2:  # a small reply received whole already: sliced off, no buffer
                if self.pending[size : size + 2] != b"\r\n":
                    raise _Reset("bulk reply without its CRLF: not a RESP server")
                value = memoryview(bytes(self.pending[:size]))
                del self.pending[: size + 2]
                return value
            whole = new_buffer(size + 2)  # the value and its CRLF, received in place
            await self._take(whole)
            if bytes(whole[size:]) != b"\r\n":
                raise _Reset("bulk reply without its CRLF: not a RESP server")
            return whole[:size]
        raise _Reset(f"unexpected reply type {kind!r}: not a RESP2 server")

    async def call(
        self, parts: list[memoryview], into: memoryview | None = None, tail: int = 0
    ) -> bytes | memoryview | int | _Landed | None:
        """Send one command and read its reply (see ``reply`` for ``into`` and ``tail``); AdapterTimeout
        when ``timeout`` passes with no progress."""
        return await self.exchange(parts, lambda: self.reply(into, tail))

    async def exchange(self, parts: list[memoryview], read: Callable[[], Awaitable[_T]]) -> _T:
        """Send ``parts`` (one or more commands), then ``read`` their replies; AdapterTimeout when
        ``timeout`` passes with no progress."""
        loop = asyncio.get_running_loop()
        fd = self.sock.fileno()
        loop.add_reader(fd, self._on_readable)  # one registration per call, not one per receive
        try:
            async with asyncio.timeout(self.timeout) as self._deadline:
                await self.send(parts)
                return await read()
        except TimeoutError:
            raise AdapterTimeout(f"redis: no answer within the socket timeout ({self.timeout} s)") from None
        finally:
            self._deadline = None
            loop.remove_reader(fd)


def _command(*args: bytes | memoryview | tuple[bytes | memoryview, ...]) -> list[memoryview]:
    """A RESP array of bulk strings as parts to send: small framing pieces around the caller's buffers
    (an argument given as a tuple of buffers is one bulk string, their concatenation)."""
    out: list[memoryview] = []
    head = bytearray(b"*%d\r\n" % len(args))
    for arg in args:
        views = [memoryview(a) for a in (arg if isinstance(arg, tuple) else (arg,))]
        head += b"$%d\r\n" % sum(v.nbytes for v in views)
        for view in views:
            if view.nbytes <= 512:
                head += view
                continue
            out.append(memoryview(head))
            out.append(view)
            head = bytearray()
        head += b"\r\n"
    out.append(memoryview(head))
    return out


def _set_command(key: bytes, value: memoryview, px: int | None, tail: bytes) -> list[memoryview]:
    """``SET key <value + tail> [PX px]`` as parts to send (the value from the caller's buffer)."""
    args: list[bytes | memoryview | tuple[bytes | memoryview, ...]] = [b"SET", key, (value, tail)]
    if px is not None:
        args += [b"PX", str(px).encode()]
    return _command(*args)


class RespPool:
    """Up to ``size`` connections to one server, opened on demand (AUTH and SELECT done on each)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        timeout: float = 5.0,
        size: int = 16,
    ) -> None:
        self.host, self.port, self.db = host, port, db
        self.username, self.password = username, password
        self.timeout = timeout
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(size)
        self._closed = False

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM), self.timeout
            )
            family, kind, proto, _, addr = infos[0]
            sock = socket.socket(family, kind, proto)
        except TimeoutError:
            raise AdapterTimeout(f"redis {self.host}:{self.port}: connect timed out") from None
        except OSError as exc:
            raise AdapterUnavailable(f"redis {self.host}:{self.port}: {exc}") from exc
        conn = _Conn(sock, self.timeout)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                async with asyncio.timeout(self.timeout):
                    await loop.sock_connect(sock, addr)
            except TimeoutError:
                raise AdapterTimeout(f"redis {self.host}:{self.port}: connect timed out") from None
            if self.password is not None:
                auth = [self.username.encode(), self.password.encode()] if self.username else []
                await conn.call(_command(b"AUTH", *(auth or [self.password.encode()])))
            if self.db:
                await conn.call(_command(b"SELECT", str(self.db).encode()))
        except BaseException as exc:
            conn.close()
            if isinstance(exc, RespError | OSError):
                raise AdapterUnavailable(f"redis {self.host}:{self.port}: {exc}") from exc
            raise
        return conn

    @contextlib.asynccontextmanager
    async def _lease(self, fresh: bool) -> AsyncIterator[_Conn]:
        """A connection for one call; back to the pool only if the call ended cleanly (or by RespError)."""
        if self._closed:
            raise AdapterUnavailable("redis connection pool is closed")
        conn = self._idle.pop() if self._idle and not fresh else await self._connect()
        try:
            yield conn
        except RespError:
            self._release(conn)
            raise
        except BaseException:
            conn.close()
            raise
        self._release(conn)

    def _release(self, conn: _Conn) -> None:
        conn.fresh = False
        if self._closed or conn.pending:
            conn.close()
        else:
            self._idle.append(conn)

    async def _run(self, op: Callable[[_Conn], Awaitable[_T]]) -> _T:
        async with self._slots:
            for attempt in (0, 1):
                try:
                    async with self._lease(fresh=attempt > 0) as conn:
                        stale = not conn.fresh
                        return await op(conn)
                except _Reset as exc:
                    if attempt or not stale:
                        raise AdapterUnavailable(f"redis {self.host}:{self.port}: {exc}") from exc
        raise AssertionError("unreachable")

    async def get(self, key: bytes) -> memoryview | None:
        """The value of ``key`` (a view of a buffer of its own), or None if absent."""
        reply = await self._run(lambda c: c.call(_command(b"GET", key)))
        if reply is None or isinstance(reply, memoryview):
            return reply
        raise AdapterUnavailable(f"redis {self.host}:{self.port}: unexpected GET reply {reply!r}")

    async def get_into(self, key: bytes, into: memoryview, tail: int = 0) -> bytes | None:
        """If the value of ``key`` is ``into``'s size plus ``tail`` bytes: receive its start into ``into``
        and return its last ``tail`` bytes; ``b""`` for a value of another size (read and dropped); None if
        absent."""
        reply = await self._run(lambda c: c.call(_command(b"GET", key), into, tail))
        if isinstance(reply, _Landed):
            return reply.tail
        if reply is None:
            return None
        if isinstance(reply, memoryview):
            return b""
        raise AdapterUnavailable(f"redis {self.host}:{self.port}: unexpected GET reply {reply!r}")

    async def set(self, key: bytes, value: memoryview, px: int | None = None, tail: bytes = b"") -> bool:
        """SET ``key`` to ``value`` followed by ``tail`` (sent from the caller's buffer); RespError for a
        refusal such as OOM."""
        parts = _set_command(key, value, px, tail)
        reply = await self._run(lambda c: c.call(parts))
        return reply == b"OK"

    async def replace(
        self, key: bytes, value: memoryview, px: int | None = None, tail: bytes = b"", peek: int = 0
    ) -> bytes:
        """``GETRANGE key 0 peek-1`` then ``SET`` as ``set`` does, sent together on one connection (the
        server runs them in that order, one round trip): the first ``peek`` bytes the key held before the
        SET (``b""`` if none, or not a string); RespError if the SET was refused."""
        parts = _command(b"GETRANGE", key, b"0", str(peek - 1).encode()) + _set_command(key, value, px, tail)

        async def read(conn: _Conn) -> tuple[object, object]:
            try:
                old: object = await conn.reply()
            except RespError:  # not a string: nothing to peek at; the SET's reply still follows
                old = b""
            return old, await conn.reply()

        old, reply = await self._run(lambda c: c.exchange(parts, lambda: read(c)))
        if reply != b"OK":
            raise AdapterUnavailable(f"redis {self.host}:{self.port}: unexpected SET reply {reply!r}")
        return bytes(old) if isinstance(old, bytes | memoryview) else b""

    async def pipeline(self, commands: list[list[bytes | memoryview]]) -> list[object]:
        """Send ``commands`` (each a list of arguments) together on one connection and read their replies
        in order: simple strings and bulk strings as bytes, integers, None, or the ``RespError`` of an
        error reply in its place (every reply is read, so the connection stays in step)."""
        parts = [p for args in commands for p in _command(*args)]

        async def read(conn: _Conn) -> list[object]:
            out: list[object] = []
            for _ in commands:
                reply: object
                try:
                    reply = await conn.reply()
                except RespError as exc:
                    reply = exc
                out.append(bytes(reply) if isinstance(reply, memoryview) else reply)
            return out

        return await self._run(lambda c: c.exchange(parts, lambda: read(c)))

    def close(self) -> None:
        """Close the idle connections; connections in use close when their call ends. Idempotent."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()
