"""A small RESP2 client for ``GET`` / ``SET`` of large values over plain TCP, with no copies of the value, and
pipelines of small commands (``EXISTS``, ``GETRANGE``, ``MGET``, ``SET``).

redis-py's asyncio path joins a command into one ``bytes`` before writing (a copy of the value), asyncio's
transport copies what the socket did not take at once (another), and a reply is read through a stream
buffer and joined again. Here a ``SET`` hands the caller's buffer to ``sendmsg`` beside the command's header
and trailer, and a ``GET`` reads the bulk reply straight into one buffer allocated for it (not zero-filled;
returned as a view without its CRLF). A send of ``THREAD_BYTES`` or more runs in a worker thread of the pool
as blocking ``sendmsg`` calls, then waits there for the command's replies: the GIL is released in the kernel,
so large sends overlap each other and the event loop, with no loop wakeup between a send and its answer
(replies are received on the loop, a large one in pieces of up to ``RECV_LOWAT`` bytes per wakeup: a
thread's hand-off cost more than it saved on a 1-4 MiB reply). ``pipelines`` hands several pipelines to the
threads at once, one connection each, and wakes the loop once when all are done; each thread parses its
replies itself where they are plain ones (``+OK``, a short bulk string, an error), else the loop does.
Connections are pooled (``size`` at most). A call on a pooled
connection that finds it reset is retried once on a new one (``GET`` and ``SET`` are idempotent), as redis-py
does.

The server is not trusted. ``timeout`` bounds a whole call (connect and handshake when a new connection is
needed, the send, every byte of the reply), not each wait for the socket: a reply trickled slowly ends in
``AdapterTimeout`` at the call's deadline; a worker thread's socket times out with what is left of it, and a
call cancelled or past its deadline shuts its socket down (ending the thread's wait) and waits for the thread
before the connection is closed. A bulk length over ``max_bulk`` is refused before any byte of it is
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
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import NamedTuple, TypeVar

from tiercache.errors import AdapterTimeout, AdapterUnavailable

__all__ = ["DEFAULT_MAX_BULK", "RespError", "RespPool", "RespProtocolError", "RespTooLarge", "new_buffer"]

_T = TypeVar("_T")
_LINE_MAX = 64 << 10
_RECV_HEAD = 64 << 10
DEFAULT_MAX_BULK = 512 << 20
"""Redis's default ``proto-max-bulk-len``: the largest bulk reply accepted (unless ``max_bulk`` says)."""
THREAD_BYTES = 256 << 10
"""Sends of at least this many bytes run as blocking socket calls in a worker thread (the event loop goes on
meanwhile; the GIL is released in the kernel)."""
RECV_LOWAT = 512 << 10
"""A large bulk reply is received a piece of up to this many bytes per loop wakeup (``SO_RCVLOWAT``), not
whatever has arrived each time the socket turns readable (Linux caps it at half of ``tcp_rmem``'s maximum).
``benchmarks/vs_lmcache_resp.py`` times 2 MiB pieces beside it (``tc_get_2m_pieces``)."""
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
        self,
        sock: socket.socket,
        max_bulk: int,
        alloc: Callable[[int], memoryview] = new_buffer,
        threads: ThreadPoolExecutor | None = None,
        lowat: int = RECV_LOWAT,
    ) -> None:
        self.sock = sock
        self.threads = threads  # where large transfers block (None: every transfer on the event loop)
        self.max_bulk = max_bulk
        self.alloc = alloc  # the buffer a large bulk reply is received into
        self.pending = bytearray()  # received bytes not consumed yet
        self.fresh = True  # no call has completed on it yet (a reset is then not a stale connection)
        self.broken = False  # out of step with the server (a reply left unread): never reused
        self._readable: asyncio.Future[None] | None = None  # a receive waiting for data
        self._watched = False  # the loop watches the socket for this call (from its first wait on it)
        self.deadline = 0.0  # the current call's (the event loop's clock)
        self.lowat = lowat
        """The most bytes the loop waits to have arrived before it receives the next piece of a value (never
        more than what is left of it)."""
        self._chunk = memoryview(bytearray(_RECV_HEAD))  # what a reply line is received into, then copied

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

    async def send(self, parts: list[memoryview], replies: int = 0, paced: list[int] | None = None) -> None:
        """Send every part in order (``sendmsg`` of the parts left; no joining). A large send runs in a worker
        thread, which then waits for the first ``replies`` replies' bytes too (into ``pending``, parsed and
        checked by the caller as any received bytes): no loop wakeup between the send and its answer. There
        ``paced``, (parts, replies) counts, sends that many parts, then waits for that many more replies,
        before the next (one command's answer before the next large value: the server reads each value
        straight into its own string, and nothing queues unanswered)."""
        if self.threads is not None and sum(p.nbytes for p in parts) >= THREAD_BYTES:
            steps = _steps(parts, replies, paced)
            self.pending += await self._blocking(lambda s, d: _send_all(s, steps, d))
            return
        parts = [p for p in parts if p.nbytes]
        while parts:
            try:
                sent = self.sock.sendmsg(parts[:512])
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                raise _Reset(str(exc)) from exc
            sent = _advance(parts, sent)
            if parts:
                await self._writable()

    async def _recv_into(self, view: memoryview) -> int:
        """Receive what has arrived into ``view`` (at least one byte), waiting on the call's reader."""
        while True:
            try:
                n = self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                loop = asyncio.get_running_loop()
                if not self._watched:  # once per call, at its first wait (a reply received whole needs none)
                    loop.add_reader(self.sock.fileno(), self._on_readable)
                    self._watched = True
                waiter = self._readable = loop.create_future()
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

    async def _blocking(self, transfer: Callable[[socket.socket, float], _T]) -> _T:
        """``transfer(sock, deadline)`` in a worker thread, the socket blocking meanwhile and unwatched by the
        loop (``deadline``: the call's, on the monotonic clock). Cancelled (the call's deadline, the caller):
        the socket is shut down, which ends the thread's wait, and the thread is waited for before the
        connection can be closed."""
        assert self.threads is not None
        loop = asyncio.get_running_loop()
        fd = self.sock.fileno()
        watched, self._watched = self._watched, False
        if watched:
            loop.remove_reader(fd)
        self.sock.setblocking(True)
        deadline = time.monotonic() + (self.deadline - loop.time())
        try:
            fut = loop.run_in_executor(self.threads, transfer, self.sock, deadline)
        except RuntimeError:  # the pool was closed during this call
            self.broken = True
            self.sock.setblocking(False)
            raise AdapterUnavailable("redis connection pool is closed") from None
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.broken = True
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            while not fut.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([fut])
            if not fut.cancelled():
                fut.exception()  # retrieved: the cancellation is what the caller sees
            raise
        finally:
            self.sock.setblocking(False)
            if watched:
                loop.add_reader(fd, self._on_readable)
                self._watched = True

    def _on_readable(self) -> None:
        waiter = self._readable
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _line(self) -> bytes:
        """The next reply line, without its CRLF."""
        while (end := self.pending.find(b"\r\n")) < 0:
            if len(self.pending) > _LINE_MAX:
                raise RespProtocolError("redis: reply line over 64 KiB: not a RESP server")
            n = await self._recv_into(self._chunk)
            self.pending += self._chunk[:n]
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
        lowat = 1
        try:
            while have < view.nbytes:
                want = min(view.nbytes - have, self.lowat)
                if want != lowat and (want >= _RECV_HEAD or lowat > 1):
                    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                    lowat = want
                have += await self._recv_into(view[have:])
        finally:
            if lowat > 1:
                with contextlib.suppress(OSError):
                    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)

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
        self,
        parts: list[memoryview],
        read: Callable[[], Awaitable[_T]],
        deadline: float,
        replies: int = 1,
        paced: list[int] | None = None,
        received: bytearray | None = None,
    ) -> _T:
        """Send ``parts`` (one or more commands), then ``read`` their replies; AdapterTimeout at
        ``deadline`` (the event loop's clock), however the bytes trickle in. ``received``: the parts were
        sent already (a lane thread's ``_send_all``), these bytes of their replies received."""
        self.deadline = deadline
        fd = self.sock.fileno()
        try:
            async with asyncio.timeout_at(deadline):
                if received is None:
                    await self.send(parts, replies, paced)
                else:
                    self.pending += received
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
            if self._watched:  # one registration per call at most, not one per receive
                asyncio.get_running_loop().remove_reader(fd)
                self._watched = False


def _timeouts(sock: socket.socket, deadline: float) -> None:
    """Bound the socket's blocking sends and receives by what is left until ``deadline`` (monotonic)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    whole = int(left)
    value = struct.pack("ll", whole, max(1, int((left - whole) * 1e6)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)


def _advance(parts: list[memoryview], sent: int) -> int:
    """Drop the ``sent`` bytes sent from the front of ``parts`` (whole parts, then the start of one)."""
    while sent:
        if sent >= parts[0].nbytes:
            sent -= parts.pop(0).nbytes
        else:
            parts[0] = parts[0][sent:]
            sent = 0
    return sent


def _send_all(sock: socket.socket, steps: list[tuple[list[memoryview], int]], deadline: float) -> bytearray:
    """For each (parts, replies) step in turn: send the parts on the blocking ``sock``, then receive until
    ``replies`` replies in all look whole (``_framed``); by ``deadline``. The bytes received (a worker
    thread's ``send``)."""
    got = bytearray()
    at = done = 0  # how far the replies received are framed
    chunk = bytearray(4096)
    _timeouts(sock, deadline)  # once: a blocking call that outlives it ends in EAGAIN, checked below
    for parts, replies in steps:
        while parts:
            try:
                sent = sock.sendmsg(parts[:512])
            except (BlockingIOError, InterruptedError):
                _timeouts(sock, deadline)  # TimeoutError past the deadline, else the time left
                sent = 0
            except OSError as exc:
                raise _Reset(str(exc)) from exc
            _advance(parts, sent)
        at, done = _frame(got, at, done, replies)
        while done < replies:
            try:
                n = sock.recv_into(chunk)
            except (BlockingIOError, InterruptedError):
                _timeouts(sock, deadline)
                continue
            except OSError as exc:
                raise _Reset(str(exc)) from exc
            if n == 0:
                return got  # the parser finds the stream's end where it reads next
            got += memoryview(chunk)[:n]
            at, done = _frame(got, at, done, replies)
    return got


def _framed(data: bytearray, count: int) -> bool:
    """Whether ``data`` holds ``count`` whole replies, by their framing only (simple lines and bulk strings);
    True as well for anything else or anything long, which the parser reads (and judges) on its own."""
    return _frame(data, 0, 0, count)[1] == count


def _frame(data: bytearray, at: int, done: int, count: int) -> tuple[int, int]:
    """``_framed`` step by step: from offset ``at``, where ``done`` replies end, on past whole replies until
    ``count`` of them: the offset and number reached (``count`` also where framing leaves the rest to the
    parser)."""
    while done < count:
        if len(data) > _LINE_MAX:
            return at, count
        end = data.find(b"\r\n", at)
        if end < 0:
            return at, done
        kind = data[at]
        if kind == 36:  # "$": a bulk string (a null, "$-1", is one line)
            size = bytes(data[at + 1 : end])
            if size != b"-1":
                if not size.isdigit():
                    return at, count  # not a length: the parser's to judge
                end += int(size) + 2
                if end + 2 > len(data):
                    return at, done
        elif kind not in b"+-:":
            return at, count
        at, done = end + 2, done + 1
    return at, done


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
        if type(arg) is bytes and len(arg) <= 512:  # a name, key or number: framed in place
            head += b"$%d\r\n%b\r\n" % (len(arg), arg)
            continue
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


class _Plan:
    """A pipeline's commands as parts to send (``paced``: see ``_Conn.send``) and how to read the replies."""

    def __init__(self, commands: list[list[bytes | memoryview]], pace: int) -> None:
        framed = [_command(*args) for args in commands]
        self.parts = [p for command in framed for p in command]
        self.replies = len(commands)
        self.paced: list[int] | None = None
        if pace:  # (parts, replies) of each run of ``pace`` commands
            runs = [framed[i : i + pace] for i in range(0, len(framed), pace)]
            self.paced = [n for run in runs for n in (sum(len(c) for c in run), len(run))]
        self.expects: list[tuple[bytes | memoryview, int, int]] = []  # (name, its reply, MGET's keys)
        for args in commands:
            expect = _expect(args[0])
            self.expects.append((args[0], expect, len(args) - 1 if expect == _ARRAY else -1))

    @property
    def steps(self) -> list[tuple[list[memoryview], int]]:
        """The parts as ``_send_all``'s (parts, replies) steps: all of them, or each paced run."""
        return _steps(self.parts, self.replies, self.paced)

    async def read(self, conn: _Conn, max_bulk: int | None) -> list[object]:
        """The commands' replies from ``conn``, as ``RespPool.pipeline`` returns them."""
        out: list[object] = []
        for name, expect, items in self.expects:
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

    def read_whole(self, data: bytearray, max_bulk: int) -> list[object] | None:
        """The replies as ``read`` gives them, parsed at once from ``data``, which holds all of them and
        nothing more, each a plain one: ``+OK`` to a ``SET``, a bulk string within ``max_bulk`` or a null to
        a ``GET`` or ``GETRANGE``, an error reply to any. None for anything else (``read`` then judges it)."""
        out: list[object] = []
        at = 0
        for _, expect, _ in self.expects:
            end = data.find(b"\r\n", at)
            if end < 0 or end - at > _LINE_MAX:
                return None
            kind = data[at]
            if kind == 45:  # "-": an error reply, in place
                out.append(RespError(data[at + 1 : end].decode("utf-8", "replace")))
            elif kind == 43 and expect == _OK and data[at + 1 : end] == b"OK":
                out.append(b"OK")
            elif kind == 36 and expect == _BULK:  # "$"
                size = bytes(data[at + 1 : end])
                if size == b"-1":
                    out.append(None)
                elif size.isdigit() and len(size) < 20 and int(size) <= max_bulk:
                    start, end = end + 2, end + 2 + int(size)
                    if data[end : end + 2] != b"\r\n":
                        return None
                    out.append(bytes(data[start:end]))
                else:
                    return None
            else:
                return None
            at = end + 2
        return out if at == len(data) else None


def _steps(
    parts: list[memoryview], replies: int, paced: list[int] | None
) -> list[tuple[list[memoryview], int]]:
    """``parts`` as (parts, replies so far) steps of ``_send_all``: one, or one per paced run (empty parts
    left out)."""
    steps: list[tuple[list[memoryview], int]] = [(parts, replies)]
    if paced:
        steps, at, total = [], 0, 0
        for count, more in zip(paced[0::2], paced[1::2], strict=True):
            total += more
            steps.append((parts[at : at + count], total))
            at += count
    return [([p for p in run if p.nbytes], after) for run, after in steps]


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
        self.recv_lowat = RECV_LOWAT
        """The receive piece of the connections opened from now on (``RECV_LOWAT``)."""
        self.username, self.password = username, password
        self.timeout = timeout
        self.max_bulk = max_bulk
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(size)
        self._size = size
        self._batch = asyncio.Lock()  # held while a ``pipelines`` call takes its slots
        self._closed = False
        self._threads: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=size, thread_name_prefix="tiercache-resp"
        )
        """Where large sends block (None: every send on the event loop)."""

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
        conn = _Conn(sock, self.max_bulk, self.alloc, self._threads, self.recv_lowat)
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
        conn = await self._take(fresh, deadline)
        try:
            yield conn
        except RespError:  # an error reply, read whole: in step unless something else was left
            self._release(conn)
            raise
        except BaseException:
            conn.close()
            raise
        self._release(conn)

    async def _take(self, fresh: bool, deadline: float) -> _Conn:
        """An idle connection that received nothing since its last call (unless ``fresh``), else a new one."""
        if self._closed:
            raise AdapterUnavailable("redis connection pool is closed")
        while self._idle and not fresh:
            candidate = self._idle.pop()
            if candidate.idle_and_open():
                return candidate
            candidate.close()  # a late reply, or closed by the server: never handed to this call
        return await self._connect(deadline)

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

        return await self._run(lambda c, d: c.exchange(parts, lambda: read(c), d, 2))

    async def pipeline(
        self, commands: list[list[bytes | memoryview]], max_bulk: int | None = None, pace: int = 0
    ) -> list[object]:
        """Send ``commands`` (each a list of arguments) together on one connection and read their replies
        in order: simple strings and bulk strings as bytes, integers, None, an MGET's list of values (views)
        and nulls, or the ``RespError`` of an error reply in its place (every reply is read, so the
        connection stays in step). Each reply is checked against its command (``GET``, ``GETRANGE``,
        ``SET``, ``EXISTS``, ``MGET`` of as many values as keys...: RespProtocolError); ``max_bulk`` bounds
        each bulk reply (default: the pool's). ``pace``: a large pipeline waits for the replies of each run
        of that many commands before it sends the next run (see ``_Conn.send``)."""
        plan = _Plan(commands, pace)
        return await self._run(
            lambda c, d: c.exchange(plan.parts, lambda: plan.read(c, max_bulk), d, plan.replies, plan.paced)
        )

    async def pipelines(
        self, lanes: list[list[list[bytes | memoryview]]], max_bulk: int | None = None, pace: int = 0
    ) -> list[list[object]]:
        """``pipeline`` of each of ``lanes`` at once, each on a connection of its own, the replies of each in
        order. The pool's threads send every lane and receive its replies, with one wake-up of the event
        loop for up to ``size`` lanes (not one per lane); ``timeout`` bounds each such group of lanes as a
        whole (more lanes run as further groups in turn). A lane's failure is raised once every lane of its
        group has ended (a lane that ended cleanly keeps its connection); a lane whose pooled connection was
        found reset is retried once as ``pipeline``."""
        if len(lanes) < 2:
            return [await self.pipeline(commands, max_bulk, pace) for commands in lanes]
        if self._threads is None:  # every send on the loop: the lanes as concurrent calls
            calls = await asyncio.gather(
                *(self.pipeline(c, max_bulk, pace) for c in lanes), return_exceptions=True
            )
            for result in calls:
                if isinstance(result, BaseException):
                    raise result
            return [r for r in calls if not isinstance(r, BaseException)]
        out: list[list[object]] = []
        for at in range(0, len(lanes), self._size):
            out += await self._lanes_at_once(lanes[at : at + self._size], max_bulk, pace)
        return out

    async def _lanes_at_once(
        self, lanes: list[list[list[bytes | memoryview]]], max_bulk: int | None, pace: int
    ) -> list[list[object]]:
        """``pipelines`` of at most ``size`` lanes: one deadline, one hand-off to the threads and back."""
        plans = [_Plan(commands, pace) for commands in lanes]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        async with self._batch:  # a call takes its slots whole: no two calls holding part of theirs
            for _ in lanes:
                await self._slots.acquire()
        conns: list[_Conn] = []
        retry: list[int] = []
        try:
            for _ in lanes:
                conns.append(await self._take(False, deadline))
            got = await self._in_threads(conns, plans, deadline, max_bulk)
            out: list[list[object]] = []
            failed: BaseException | None = None
            for i, (plan, received) in enumerate(zip(plans, got, strict=True)):
                conn = conns.pop(0)  # this lane's: closed or released below, whatever happens
                replies: list[object] = []
                if isinstance(received, _Reset) and not conn.fresh:
                    conn.close()  # a stale pooled connection: the lane is retried below
                    retry.append(i)
                elif isinstance(received, BaseException):
                    conn.close()
                    failed = failed or received
                elif received[1] is not None:  # parsed whole in its thread
                    replies = received[1]
                    self._release(conn)
                else:
                    try:
                        replies = await conn.exchange(
                            [], partial(plan.read, conn, max_bulk), deadline, 0, None, received[0]
                        )
                    except BaseException as exc:
                        conn.close()
                        if not isinstance(exc, Exception):
                            raise
                        failed = failed or exc
                    else:
                        self._release(conn)
                out.append(replies)
        finally:
            for conn in conns:  # cancelled or failed before its lanes were handled: none goes back
                conn.close()
            for _ in lanes:
                self._slots.release()
        if isinstance(failed, _Reset):
            raise AdapterUnavailable(f"{self._where()}: {failed}") from failed
        if isinstance(failed, TimeoutError):
            raise AdapterTimeout("redis: no answer within the socket timeout (the call's deadline)") from None
        if failed is not None:
            raise failed
        for i in retry:
            out[i] = await self.pipeline(lanes[i], max_bulk, pace)
        return out

    async def _in_threads(
        self, conns: list[_Conn], plans: list[_Plan], deadline: float, max_bulk: int | None
    ) -> list[tuple[bytearray, list[object] | None] | BaseException]:
        """Each plan's commands sent on its connection, and the bytes of their replies received, in the pool's
        threads (``_send_all``, bounded by ``deadline``, the event loop's clock): what each received and its
        replies if plain (``_Plan.read_whole``), or the exception that ended it. Once the last is done, one
        wake-up of the loop. Cancelled: every socket is shut down, which ends the threads' waits, and every
        thread is waited for."""
        assert self._threads is not None
        loop = asyncio.get_running_loop()
        mono = time.monotonic() + (deadline - loop.time())
        done: asyncio.Future[None] = loop.create_future()
        out: list[tuple[bytearray, list[object] | None] | BaseException] = [_Reset("not sent")] * len(conns)
        limit = self.max_bulk if max_bulk is None else max_bulk
        left = [len(conns)]
        lock = threading.Lock()

        def finished(count: int) -> None:
            with lock:
                left[0] -= count
                last = left[0] == 0
            if last:
                loop.call_soon_threadsafe(lambda: None if done.done() else done.set_result(None))

        def lane(i: int) -> None:
            try:
                got = _send_all(conns[i].sock, plans[i].steps, mono)
                out[i] = (got, plans[i].read_whole(got, limit))
            except BaseException as exc:  # handed to the caller
                out[i] = exc
            finished(1)

        for conn in conns:
            conn.broken = True  # until the call has read its replies in step
            conn.sock.setblocking(True)
        try:
            started = 0
            try:
                for i in range(len(conns)):
                    self._threads.submit(lane, i)
                    started += 1
            except RuntimeError:  # the pool was closed during this call
                finished(len(conns) - started)
                await asyncio.shield(done)
                raise AdapterUnavailable("redis connection pool is closed") from None
            try:
                await asyncio.shield(done)
            except asyncio.CancelledError:
                for conn in conns:
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_RDWR)
                while not done.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait([done])
                raise
        finally:
            for conn in conns:
                conn.sock.setblocking(False)
        for conn in conns:
            conn.broken = False
        return out

    def close(self) -> None:
        """Close the idle connections; connections in use close when their call ends. Idempotent."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()
        if self._threads is not None:
            self._threads.shutdown(wait=False)
