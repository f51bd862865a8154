"""A hostile RESP server for fault injection: it answers each command as a test's scenario says.

    server = await HostileServer(store).start()      # 127.0.0.1, a free port (the kernel picks it)
    server.respond = my_handler                      # async (session, args) -> None; None: act as Redis
    ...
    await server.stop()                              # closes the listener and every connection

The server reads well-formed RESP commands (arrays of bulk strings: what the clients under test send) and
hands each one to ``respond``, which writes whatever it likes with ``session.send`` / ``session.trickle`` /
``session.close``: garbage, wrong lengths, late or extra replies. Commands of one connection are handled one
after another, so a handler that sleeps delays every later reply of that connection, as a slow server does.
``normal`` answers as a Redis server holding ``store`` would (the handful of commands the clients send), so
a handler can misbehave on one command and delegate the rest. For tests only: it is a fake for fault
injection, never a stand-in for a real server's behaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable

__all__ = ["HostileServer", "Respond", "Session", "bulk", "normal"]

Respond = Callable[["Session", list[bytes]], Awaitable[None]]


def bulk(value: bytes | None) -> bytes:
    """The RESP bulk string of ``value`` (``$-1`` for None)."""
    if value is None:
        return b"$-1\r\n"
    return b"$%d\r\n%s\r\n" % (len(value), value)


class Session:
    """One accepted connection: what a handler writes goes to the client."""

    def __init__(
        self, server: HostileServer, number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.server = server
        self.number = number
        """1 for the first connection the server accepted, 2 for the next..."""
        self.reader = reader
        self.writer = writer
        self.commands = 0
        """Commands received on this connection so far (the current one included)."""

    async def send(self, data: bytes) -> None:
        """Write ``data`` now (nothing if the client has gone)."""
        if self.writer.is_closing():
            return
        self.writer.write(data)
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()

    async def trickle(self, data: bytes, chunk: int, delay_s: float) -> None:
        """Write ``data`` ``chunk`` bytes at a time, ``delay_s`` apart, until it ends or the client goes."""
        for start in range(0, len(data), chunk):
            if self.writer.is_closing():
                return
            await self.send(data[start : start + chunk])
            await asyncio.sleep(delay_s)

    async def silent(self) -> None:
        """Answer nothing more: read and drop what the client sends until it closes the connection."""
        with contextlib.suppress(ConnectionError):
            while await self.reader.read(1 << 16):
                pass

    def close(self) -> None:
        """Close the connection (FIN) after what was written."""
        self.writer.close()

    def reset(self) -> None:
        """Close the connection at once with a TCP RST (what was not sent is dropped)."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        self.writer.transport.abort()


async def normal(session: Session, args: list[bytes]) -> None:
    """Answer ``args`` as a Redis server holding ``session.server.store`` (strings only) would."""
    store = session.server.store
    name = args[0].upper()
    if name in (b"AUTH", b"SELECT") or (name == b"CLIENT" and len(args) > 1):
        await session.send(b"+OK\r\n")
    elif name == b"PING":
        await session.send(b"+PONG\r\n")
    elif name == b"GET":
        await session.send(bulk(store.get(args[1])))
    elif name == b"MGET":
        await session.send(b"*%d\r\n" % (len(args) - 1) + b"".join(bulk(store.get(k)) for k in args[1:]))
    elif name == b"SET":
        store[args[1]] = args[2]
        await session.send(b"+OK\r\n")
    elif name == b"GETRANGE":
        value, start, end = store.get(args[1], b""), int(args[2]), int(args[3])
        await session.send(bulk(value[start : end + 1 if end >= 0 else len(value) + end + 1]))
    elif name == b"EXISTS":
        await session.send(b":%d\r\n" % sum(k in store for k in args[1:]))
    elif name == b"DEL":
        await session.send(b":%d\r\n" % sum(store.pop(k, None) is not None for k in args[1:]))
    else:
        await session.send(b"-ERR unknown command '%s'\r\n" % name)


class HostileServer:
    """A TCP server on 127.0.0.1 answering through ``respond`` (``normal`` while it is None)."""

    def __init__(self, store: dict[bytes, bytes] | None = None) -> None:
        self.store: dict[bytes, bytes] = {} if store is None else store
        """Values by full key, for ``normal``."""
        self.respond: Respond | None = None
        self.accepted = 0
        """Connections accepted so far."""
        self.busy = 0
        """Commands being answered now (a handler still sleeping, trickling or sending late)."""
        self.log: list[tuple[int, bytes, bytes]] = []
        """(connection number, command name, first argument) of every command received."""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> HostileServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def stop(self) -> None:
        """Stop listening, close every connection and end every handler; idempotent."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        self.accepted += 1
        session = Session(self, self.accepted, reader, writer)
        try:
            while True:
                args = await _read_command(reader)
                if args is None:
                    break
                session.commands += 1
                self.log.append((session.number, args[0].upper(), args[1] if len(args) > 1 else b""))
                self.busy += 1
                try:
                    await (self.respond or normal)(session, args)
                finally:
                    self.busy -= 1
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        except asyncio.CancelledError:  # stop(): the handler ends here (asyncio logs a cancelled one)
            pass
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            writer.transport.abort()

    def commands(self, name: bytes) -> list[tuple[int, bytes]]:
        """(connection number, first argument) of each ``name`` command received."""
        return [(conn, first) for conn, cmd, first in self.log if cmd == name]

    async def received(self, name: bytes, count: int = 1, timeout_s: float = 30.0) -> None:
        """Wait until ``count`` ``name`` commands arrived (a loaded machine sends them later); AssertionError
        after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while len(self.commands(name)) < count:
            assert time.monotonic() < deadline, f"{count} {name!r} never reached the server"
            await asyncio.sleep(0.01)


async def _read_command(reader: asyncio.StreamReader) -> list[bytes] | None:
    """The next command (an array of bulk strings); None at the end of the stream."""
    line = await reader.readline()
    if not line:
        return None
    if not line.startswith(b"*") or not line.endswith(b"\r\n"):
        raise ValueError(f"not a RESP command: {line[:40]!r}")
    args: list[bytes] = []
    for _ in range(int(line[1:-2])):
        head = await reader.readline()
        if not head.startswith(b"$"):
            raise ValueError(f"not a bulk string: {head[:40]!r}")
        args.append((await reader.readexactly(int(head[1:-2]) + 2))[:-2])
    return args
