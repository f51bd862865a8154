"""A small RESP2 client for ``GET`` / ``SET`` of large values over plain TCP, with no copies of the value, and
pipelines of small commands (``EXISTS``, ``GETRANGE``, ``MGET``, ``SET``).

redis-py's asyncio path joins a command into one ``bytes`` before writing (a copy of the value), asyncio's
transport copies what the socket did not take at once (another), and a reply is read through a stream
buffer and joined again. Here a ``SET`` hands the caller's buffer to ``sendmsg`` beside the command's header
and trailer, and a ``GET`` reads the bulk reply straight into one buffer allocated for it (not zero-filled;
returned as a view without its CRLF). Connections are pooled (``size`` at most). A call on a pooled
connection that finds it reset is retried once on a new one (``GET`` and ``SET`` are idempotent), as redis-py
does.

The server is not trusted. ``timeout`` bounds a whole call (connect and handshake when a new connection is
needed, the send, every byte of the reply), not each wait for the socket: a reply trickled slowly ends in
``AdapterTimeout`` at the call's deadline. A bulk length over ``max_bulk`` is refused before any byte of it is
read or any buffer allocated (``RespTooLarge``); lengths and integers are strict decimal; a reply of a type
the command cannot have, a missing CRLF, a line over 64 KiB or a type byte RESP2 does not have is a
``RespProtocolError``. A connection goes back to the pool only after a call that read every reply it expected
and nothing more: one that timed out, was cancelled, failed or saw anything unexpected (bytes left over, a
reply of the wrong type or size) is closed, never reused, and an idle connection that has received anything
(a late reply) or was closed by the server is dropped when it is next taken (bytes arriving after that
check cannot be told from the next call's reply: RESP2 has no request ids). A connection opens with
``AUTH`` and ``SELECT`` when configured, each answered by exactly ``+OK`` or the open fails
(``AdapterUnavailable`` naming the command and the answer). Errors: transport and protocol failures raise
``AdapterUnavailable`` (``RespProtocolError``, ``RespTooLarge``), a deadline ``AdapterTimeout``, an error
reply ``RespError`` (the connection stays in step).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple, TypeVar

from tiercache.errors import AdapterTimeout, AdapterUnavailable

__all__ = ["DEFAULT_MAX_BULK", "RespError", "RespPool", "RespProtocolError", "RespTooLarge", "new_buffer"]

_T = TypeVar("_T")
_LINE_MAX = 64 << 10
_RECV_HEAD = 64 << 10
DEFAULT_MAX_BULK = 512 << 20
"""Redis's default ``proto-max-bulk-len``: the largest bulk reply accepted (unless ``max_bulk`` says)."""
_NUMBER = re.compile(rb"-?[0-9]{1,19}")
"""A RESP length or integer: strict decimal (``int()`` would take spaces, ``+``, ``_``)."""


def new_buffer(size: int) -> memoryview:
    """A writable byte buffer of ``size`` bytes, not zero-filled (the receive overwrites all of it)."""
    import numpy as np

    view: memoryview = np.empty(size, dtype=np.uint8).data
    return view


class RespError(Exception):
    """An error reply of the server (``-ERR ...``, ``-OOM ...``); the connection stays usable."""


class RespProtocolError(AdapterUnavailable):
    """The server broke RESP2 (or answered what the command cannot get); the connection is closed."""


class RespTooLarge(RespProtocolError):
    """A bulk reply declared longer than ``max_bulk``: refused before reading or allocating any of it."""


class _Landed(NamedTuple):
    """A bulk reply received into the caller's buffer; ``tail`` holds its last bytes."""

    tail: bytes


class _Other(NamedTuple):
    """A bulk reply of another size than the caller's buffer expected, left unread (its connection is
    closed): a value the caller did not ask for."""

    size: int


class _Reset(ConnectionError):
    """The peer closed or reset the connection."""


def _number(rest: bytes, line: bytes) -> int:
    if rest.isdigit() and len(rest) < 20:  # the common case, without the regex (bytes: ASCII digits only)
        return int(rest)
    if _NUMBER.fullmatch(rest) is None:
        raise RespProtocolError(f"redis: not a RESP number in reply line {line[:64]!r}")
    return int(rest)


_ANY, _OK, _BULK, _INTEGER, _ARRAY = range(5)
"""What a command's success reply must be: anything (not checked), ``+OK``, a bulk string or null, an
integer, an MGET's array."""
_EXPECT = {
    b"SET": _OK,
    b"AUTH": _OK,
    b"SELECT": _OK,
    b"GET": _BULK,
    b"GETRANGE": _BULK,
    b"EXISTS": _INTEGER,
    b"DEL": _INTEGER,
    b"MGET": _ARRAY,
}

Reply = bytes | memoryview | int | list[memoryview | None] | None
"""A reply as ``reply`` returns it (simple string, bulk string, integer, MGET's array, null)."""


def _expect(name: bytes | memoryview) -> int:
    """What command ``name``'s success reply must be (``_EXPECT``; ``_ANY`` for another command)."""
    found = _EXPECT.get(name) if type(name) is bytes else None  # the adapter's literals: no upper()
    return found if found is not None else _EXPECT.get(bytes(name).upper(), _ANY)


def check_reply(name: bytes | memoryview, reply: object, expect: int | None = None) -> None:
    """RespProtocolError unless ``reply`` is a success reply command ``name`` can get (an error reply is
    raised or returned apart; a command this client does not know is not checked; an array's length is
    checked as it is read). ``expect``: ``_expect(name)``, if known already."""
    kind = _expect(name) if expect is None else expect
    if kind == _OK:
        ok = reply == b"OK" and type(reply) is bytes  # a bulk "OK" is a memoryview
    elif kind == _BULK:
        ok = reply is None or isinstance(reply, memoryview | _Landed | _Other)
    elif kind == _INTEGER:
        ok = type(reply) is int
    elif kind == _ARRAY:
        ok = isinstance(reply, list)
    else:
        return
    if not ok:
        shown = bytes(reply[:64]) if isinstance(reply, memoryview) else reply
        raise RespProtocolError(
            f"redis: unexpected reply to {bytes(name).decode(errors='replace')}: {shown!r}"
        )


class _Conn:
    """One non-blocking socket and the bytes received past the last reply's end."""

    def __init__(
        self, sock: socket.socket, max_bulk: int, alloc: Callable[[int], memoryview] = new_buffer
    ) -> None:
        self.sock = sock
        self.max_bulk = max_bulk
        self.alloc = alloc  # the buffer a large bulk reply is received into
        self.pending = bytearray()  # received bytes not consumed yet
        self.fresh = True  # no call has completed on it yet (a reset is then not a stale connection)
        self.broken = False  # out of step with the server (a reply left unread): never reused
        self._readable: asyncio.Future[None] | None = None  # a receive waiting for data

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def idle_and_open(self) -> bool:
        """Whether an idle connection may serve a call: nothing received since its last reply (a late or
        extra reply) and not closed by the server. One non-blocking peek, no wait."""
        if self.pending or self.broken:
            return False
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        return False  # bytes nobody asked for, or the end of the stream

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
            return n

    def _on_readable(self) -> None:
        waiter = self._readable
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _line(self) -> bytes:
        """The next reply line, without its CRLF."""
        while (end := self.pending.find(b"\r\n")) < 0:
            if len(self.pending) > _LINE_MAX:
                raise RespProtocolError("redis: reply line over 64 KiB: not a RESP server")
            chunk = bytearray(_RECV_HEAD)
            n = await self._recv_into(memoryview(chunk))
            self.pending += memoryview(chunk)[:n]
        if end > _LINE_MAX:
            raise RespProtocolError("redis: reply line over 64 KiB: not a RESP server")
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
        self, into: memoryview | None = None, tail: int = 0, max_bulk: int | None = None, items: int = -1
    ) -> Reply | _Landed | _Other:
        """Read one reply: simple string (bytes), integer, bulk string (a view of a buffer of its own),
        null (None); an error reply raises RespError. A bulk string of exactly ``into``'s size plus ``tail``
        bytes lands in ``into`` and its last ``tail`` bytes come back as ``_Landed``; of another size, it is
        left unread (``_Other``; the connection is then broken). A bulk string over ``max_bulk`` (default:
        the connection's) raises RespTooLarge before any of it is read. An array is accepted only where
        ``items`` says how long it must be (an MGET's): exactly that many bulk strings or nulls, no nesting.
        """
        line = await self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind != b"$":
            return await self._not_bulk(kind, rest, line, max_bulk, items)
        size = int(rest) if rest.isdigit() and len(rest) < 20 else _number(rest, line)
        if size == -1:
            return None
        if size < 0:
            raise RespProtocolError(f"redis: negative bulk length in reply line {line[:64]!r}")
        if into is not None:
            if into.nbytes + tail != size:
                self.broken = True  # its bytes stay unread: this connection serves nothing more
                return _Other(size)
            end = memoryview(bytearray(tail + 2))  # the value in place, then its tail and CRLF
            await self._take(into)
            await self._take(end)
            if bytes(end[tail:]) != b"\r\n":
                raise RespProtocolError("redis: bulk reply without its CRLF: not a RESP server")
            return _Landed(bytes(end[:tail]))
        limit = self.max_bulk if max_bulk is None else max_bulk
        if size > limit:
            self.broken = True
            raise RespTooLarge(f"redis: a bulk reply of {size} bytes, over the limit of {limit}: refused")
        if len(self.pending) >= size + 2:  # a small reply received whole already: sliced off, no buffer
            if self.pending[size : size + 2] != b"\r\n":
                raise RespProtocolError("redis: bulk reply without its CRLF: not a RESP server")
            value = memoryview(bytes(self.pending[:size]))
            del self.pending[: size + 2]
            return value
        whole = self.alloc(size + 2)  # the value and its CRLF, received in place
        await self._take(whole)
        if bytes(whole[size:]) != b"\r\n":
            raise RespProtocolError("redis: bulk reply without its CRLF: not a RESP server")
        return whole[:size]

    async def _not_bulk(
        self, kind: bytes, rest: bytes, line: bytes, max_bulk: int | None, items: int
    ) -> int | list[memoryview | None]:
        """A reply line that is neither a bulk string nor a simple string (see ``reply``)."""
        if kind == b"-":
            raise RespError(rest.decode("utf-8", "replace"))
        if kind == b":":
            return _number(rest, line)
        if kind == b"*" and items >= 0:
            return await self._array(_number(rest, line), items, max_bulk)
        self.broken = True
        raise RespProtocolError(f"redis: unexpected reply type {kind!r}: not a RESP2 server")

    async def _array(self, count: int, items: int, max_bulk: int | None) -> list[memoryview | None]:
        """The ``count`` elements of an array reply that must hold ``items`` bulk strings or nulls (checked
        before any element is read: a declared length is never trusted)."""
        if count != items:
            self.broken = True
            raise RespProtocolError(f"redis: an array reply of {count} elements where {items} were asked for")
        out: list[memoryview | None] = []
        for _ in range(count):
            try:
                element = await self.reply(max_bulk=max_bulk)
            except RespError as exc:  # an error inside an array: the rest of it is at an unknown point
                self.broken = True
                raise RespProtocolError(f"redis: an error reply inside an array: {exc}") from None
            if element is not None and not isinstance(element, memoryview):
                self.broken = True
                raise RespProtocolError(f"redis: an array element that is no bulk string: {element!r:.80}")
            out.append(element)
        return out

    async def call(
        self, parts: list[memoryview], deadline: float, into: memoryview | None = None, tail: int = 0
    ) -> Reply | _Landed | _Other:
        """Send one command and read its reply (see ``reply`` for ``into`` and ``tail``), checked against
        what the command can get; AdapterTimeout at ``deadline`` (the event loop's clock)."""
        name = _name(parts)

        async def read() -> Reply | _Landed | _Other:
            reply = await self.reply(into, tail)
            check_reply(name, reply)
            return reply

        return await self.exchange(parts, read, deadline)

    async def exchange(
        self, parts: list[memoryview], read: Callable[[], Awaitable[_T]], deadline: float
    ) -> _T:
        """Send ``parts`` (one or more commands), then ``read`` their replies; AdapterTimeout at
        ``deadline`` (the event loop's clock), however the bytes trickle in."""
        loop = asyncio.get_running_loop()
        fd = self.sock.fileno()
        loop.add_reader(fd, self._on_readable)  # one registration per call, not one per receive
        try:
            async with asyncio.timeout_at(deadline):
                await self.send(parts)
                return await read()
        except TimeoutError:
            self.broken = True
            raise AdapterTimeout("redis: no answer within the socket timeout (the call's deadline)") from None
        except RespError:  # an error reply read whole: the stream is in step
            raise
        except BaseException:
            self.broken = True  # a failed or cancelled call leaves the stream at an unknown point
            raise
        finally:
            loop.remove_reader(fd)


def _name(parts: list[memoryview]) -> bytes:
    """The command name of the first command framed in ``parts`` (its first bulk string), upper case."""
    head = bytes(parts[0][:64])
    try:
        first = head.split(b"\r\n")[2]
    except IndexError:
        return b""
    return first.upper()


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
    """Up to ``size`` connections to one server, opened on demand (AUTH and SELECT done on each).

    ``timeout``: seconds a whole call may take (see the module docstring); ``max_bulk``: the largest bulk
    reply accepted (bytes); ``alloc(n)``: a writable buffer of ``n`` bytes to receive a bulk reply into
    (default: a new one each time; a pool of reused buffers spares the fresh pages)."""

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
        max_bulk: int = DEFAULT_MAX_BULK,
        alloc: Callable[[int], memoryview] = new_buffer,
    ) -> None:
        self.host, self.port, self.db = host, port, db
        self.alloc = alloc
        self.username, self.password = username, password
        self.timeout = timeout
        self.max_bulk = max_bulk
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(size)
        self._closed = False

    def _where(self) -> str:
        return f"redis {self.host}:{self.port}"

    async def _connect(self, deadline: float) -> _Conn:
        """A new connection, authenticated and on the database, by ``deadline``."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            family, kind, proto, _, addr = infos[0]
            sock = socket.socket(family, kind, proto)
        except TimeoutError:
            raise AdapterTimeout(f"{self._where()}: connect timed out") from None
        except OSError as exc:
            raise AdapterUnavailable(f"{self._where()}: {exc}") from exc
        conn = _Conn(sock, self.max_bulk, self.alloc)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                async with asyncio.timeout_at(deadline):
                    await loop.sock_connect(sock, addr)
            except TimeoutError:
                raise AdapterTimeout(f"{self._where()}: connect timed out") from None
            if self.password is not None:
                auth = [self.username.encode(), self.password.encode()] if self.username else []
                await self._handshake(conn, _command(b"AUTH", *(auth or [self.password.encode()])), deadline)
            if self.db:
                await self._handshake(conn, _command(b"SELECT", str(self.db).encode()), deadline)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, OSError):
                raise AdapterUnavailable(f"{self._where()}: {exc}") from exc
            raise
        return conn

    async def _handshake(self, conn: _Conn, parts: list[memoryview], deadline: float) -> None:
        """One command of the open, answered by exactly ``+OK`` and nothing after it, or the open fails."""
        name = _name(parts).decode()
        try:
            await conn.call(parts, deadline)
        except RespError as exc:
            raise AdapterUnavailable(f"{self._where()}: {name} refused: {exc}") from exc
        except RespProtocolError as exc:
            raise RespProtocolError(f"{self._where()}: {name} not answered +OK: {exc}") from exc
        if conn.pending:
            raise RespProtocolError(f"{self._where()}: more than one reply to {name}: not a RESP server")

    @contextlib.asynccontextmanager
    async def _lease(self, fresh: bool, deadline: float) -> AsyncIterator[_Conn]:
        """A connection for one call: an idle one that received nothing since (else a new one); back to
        the pool only if the call ended cleanly with every reply read and nothing more."""
        if self._closed:
            raise AdapterUnavailable("redis connection pool is closed")
        conn: _Conn | None = None
        while self._idle and not fresh:
            candidate = self._idle.pop()
            if candidate.idle_and_open():
                conn = candidate
                break
            candidate.close()  # a late reply, or closed by the server: never handed to this call
        if conn is None:
            conn = await self._connect(deadline)
        try:
            yield conn
        except RespError:  # an error reply, read whole: in step unless something else was left
            self._release(conn)
            raise
        except BaseException:
            conn.close()
            raise
        self._release(conn)

    def _release(self, conn: _Conn) -> None:
        conn.fresh = False
        if self._closed or conn.pending or conn.broken:
            conn.close()
        else:
            self._idle.append(conn)

    async def _run(self, op: Callable[[_Conn, float], Awaitable[_T]]) -> _T:
        async with self._slots:
            deadline = asyncio.get_running_loop().time() + self.timeout  # the whole call, a retry included
            for attempt in (0, 1):
                try:
                    async with self._lease(attempt > 0, deadline) as conn:
                        stale = not conn.fresh
                        return await op(conn, deadline)
                except _Reset as exc:
                    if attempt or not stale:
                        raise AdapterUnavailable(f"{self._where()}: {exc}") from exc
        raise AssertionError("unreachable")

    async def get(self, key: bytes) -> memoryview | None:
        """The value of ``key`` (a view of a buffer of its own), or None if absent; RespTooLarge for a value
        over ``max_bulk`` (none of it read), RespError for an error reply (WRONGTYPE: not a string)."""
        reply = await self._run(lambda c, d: c.call(_command(b"GET", key), d))
        assert reply is None or isinstance(reply, memoryview)  # check_reply: a bulk string or null
        return reply

    async def get_into(self, key: bytes, into: memoryview, tail: int = 0) -> bytes | None:
        """If the value of ``key`` is ``into``'s size plus ``tail`` bytes: receive its start into ``into``
        and return its last ``tail`` bytes; ``b""`` for a value of another size (left unread: the connection
        is closed, nothing allocated); None if absent; RespError for an error reply."""
        reply = await self._run(lambda c, d: c.call(_command(b"GET", key), d, into, tail))
        if isinstance(reply, _Landed):
            return reply.tail
        assert reply is None or isinstance(reply, _Other)  # check_reply, and reply() given ``into``
        return None if reply is None else b""

    async def set(self, key: bytes, value: memoryview, px: int | None = None, tail: bytes = b"") -> bool:
        """SET ``key`` to ``value`` followed by ``tail`` (sent from the caller's buffer); True, or RespError
        for a refusal such as OOM."""
        parts = _set_command(key, value, px, tail)
        await self._run(lambda c, d: c.call(parts, d))  # check_reply: +OK
        return True

    async def replace(
        self, key: bytes, value: memoryview, px: int | None = None, tail: bytes = b"", peek: int = 0
    ) -> bytes:
        """``GETRANGE key 0 peek-1`` then ``SET`` as ``set`` does, sent together on one connection (the
        server runs them in that order, one round trip): the first ``peek`` bytes the key held before the
        SET (``b""`` if none, or not a string); RespError if the SET was refused."""
        parts = _command(b"GETRANGE", key, b"0", str(peek - 1).encode()) + _set_command(key, value, px, tail)

        async def read(conn: _Conn) -> bytes:
            old: object
            try:
                old = await conn.reply(max_bulk=peek if peek > 0 else None)
                check_reply(b"GETRANGE", old)
            except RespError:  # not a string: nothing to peek at; the SET's reply still follows
                old = b""
            check_reply(b"SET", await conn.reply(max_bulk=0))
            return bytes(old) if isinstance(old, bytes | memoryview) else b""

        return await self._run(lambda c, d: c.exchange(parts, lambda: read(c), d))

    async def pipeline(
        self, commands: list[list[bytes | memoryview]], max_bulk: int | None = None
    ) -> list[object]:
        """Send ``commands`` (each a list of arguments) together on one connection and read their replies
        in order: simple strings and bulk strings as bytes, integers, None, an MGET's list of values (views)
        and nulls, or the ``RespError`` of an error reply in its place (every reply is read, so the
        connection stays in step). Each reply is checked against its command (``GET``, ``GETRANGE``,
        ``SET``, ``EXISTS``, ``MGET`` of as many values as keys...: RespProtocolError); ``max_bulk`` bounds
        each bulk reply (default: the pool's)."""
        parts = [p for args in commands for p in _command(*args)]
        expects: list[tuple[bytes | memoryview, int, int]] = []  # (name, what its reply is, MGET's keys)
        for args in commands:
            expect = _expect(args[0])
            expects.append((args[0], expect, len(args) - 1 if expect == _ARRAY else -1))

        async def read(conn: _Conn) -> list[object]:
            out: list[object] = []
            for name, expect, items in expects:
                reply: object
                try:
                    reply = await conn.reply(None, 0, max_bulk, items)
                    if expect == _OK:  # the common cases inline (a call per reply costs)
                        good = reply == b"OK" and type(reply) is bytes
                    else:
                        good = expect == _BULK and (reply is None or type(reply) is memoryview)
                    if not good:
                        check_reply(name, reply, expect)
                except RespError as exc:
                    reply = exc
                out.append(bytes(reply) if isinstance(reply, memoryview) else reply)
            return out

        return await self._run(lambda c, d: c.exchange(parts, lambda: read(c), d))

    def close(self) -> None:
        """Close the idle connections; connections in use close when their call ends. Idempotent."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()
