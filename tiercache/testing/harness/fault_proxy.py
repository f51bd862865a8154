"""A fault-injecting TCP proxy: put it between a client and a real server.

    proxy = FaultProxy("127.0.0.1", server_port).start()   # listens on 127.0.0.1:proxy.port
    proxy.mode = "stall"        # or "pass", "slow", "reset", "truncate"; at once, open connections too
    ...
    proxy.stop()

Modes:

- ``pass``: forward both ways.
- ``slow``: forward both ways, but wait ``delay_s`` seconds before forwarding each chunk (up to 64 KiB) going
  in ``delay_direction``: ``"down"`` (server to client, the default), ``"up"`` or ``"both"``. The wait is
  ``await proxy.sleep(delay_s)`` (``asyncio.sleep`` unless a test injects another).
- ``stall``: accept, read and drop what the client sends, answer nothing (a hung server or network); open
  connections stop forwarding. When the stall ends, the stalled connections are closed.
- ``reset``: close every connection with a TCP RST (``SO_LINGER`` 0), new ones as soon as they arrive.
- ``truncate``: forward the client's request, then only ``truncate_after`` bytes of the server's answer on
  that connection, then close it (FIN). With ``strip_content_length`` (HTTP/1.1 servers) the answer's
  ``Content-Length`` header is removed first and ``truncate_after`` counts body bytes: a valid response whose
  body ends early, which a client can only catch by knowing the object's length.
- ``http_503``: answer each HTTP/1.1 request (read up to the end of its head, and its body unless the client
  waits for ``100 Continue``) with ``503 Slow Down`` and an S3 ``SlowDown`` error body, then close; open
  connections too, at their next request. An S3 service out of capacity, as clients see it.

The proxy runs its own event loop on a daemon thread, so it serves sync and async clients, and clients whose
blocking calls run in threads. Standard library only. ``ProcessFaultProxy`` runs one in a child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable

__all__ = ["SLOW_DOWN", "FaultProxy", "ProcessFaultProxy"]

_CHUNK = 64 << 10
_SLOW_DOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>fault-proxy</RequestId></Error>"
)
SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
    + f"Content-Length: {len(_SLOW_DOWN_BODY)}\r\n".encode()
    + b"Connection: close\r\n\r\n"
    + _SLOW_DOWN_BODY
)
"""What ``http_503`` answers: S3's reply when a bucket's request rate or capacity is exceeded."""


class FaultProxy:
    """A TCP proxy from ``127.0.0.1:port`` to ``target_host:target_port`` with switchable faults."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.mode = "pass"
        self.truncate_after = 0
        self.strip_content_length = False
        self.delay_s = 0.0
        self.delay_direction = "down"
        self.sleep: Callable[[float], Awaitable[object]] = asyncio.sleep
        """What ``slow`` awaits before each chunk (runs on the proxy's loop; tests inject a gate)."""
        self.connections = 0
        """Connections accepted so far."""
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        """Listen on a free 127.0.0.1 port (``self.port``) and serve on a daemon thread."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop

            async def serve() -> None:
                self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
                self.port = self._server.sockets[0].getsockname()[1]
                ready.set()

            loop.run_until_complete(serve())
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        return self

    def stop(self) -> None:
        """Close the listener and every connection, stop the thread."""
        loop = self._loop
        if loop is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- forwarding ------------------------------------------------------------------------------------

    @staticmethod
    def _reset(writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def _hold(self, reader: asyncio.StreamReader) -> None:
        """Stall: swallow whatever arrives while the mode is ``stall``; the connection is closed once the peer
        goes away or the stall ends (what was swallowed is lost, so it cannot carry on)."""
        while self.mode == "stall":
            try:
                if not await asyncio.wait_for(reader.read(_CHUNK), 0.05):
                    return
            except TimeoutError:
                continue

    @staticmethod
    async def _slow_down(reader: asyncio.StreamReader, data: bytes, writer: asyncio.StreamWriter) -> None:
        """Read one HTTP request (``data`` is its start) and answer ``SLOW_DOWN``; the caller closes."""
        while b"\r\n\r\n" not in data:
            more = await reader.read(_CHUNK)
            if not more:
                return
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        fields = {
            name.strip().lower(): value.strip().lower()
            for name, _, value in (line.partition(b":") for line in head.split(b"\r\n")[1:])
        }
        if fields.get(b"expect") != b"100-continue":
            missing = int(fields.get(b"content-length", b"0") or b"0") - len(body)
            while missing > 0:
                more = await reader.read(min(missing, _CHUNK))
                if not more:
                    return
                missing -= len(more)
        writer.write(SLOW_DOWN)
        await writer.drain()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(client_w)
        upstream_w: asyncio.StreamWriter | None = None
        try:
            if self.mode == "reset":
                self._reset(client_w)
                return
            if self.mode == "stall":
                await self._hold(client_r)
                return
            if self.mode == "http_503":
                await self._slow_down(client_r, b"", client_w)
                return
            upstream_r, upstream_w = await asyncio.open_connection(*self.target)
            self._writers.add(upstream_w)
            up = asyncio.ensure_future(self._pump(client_r, upstream_w, client_w, upstream=True))
            down = asyncio.ensure_future(self._pump(upstream_r, client_w, client_w, upstream=False))
            _, pending = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for writer in (client_w, upstream_w):
                if writer is None:
                    continue
                self._writers.discard(writer)
                if self.mode == "reset":
                    writer.transport.abort()
                else:
                    writer.close()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client_w: asyncio.StreamWriter,
        *,
        upstream: bool,
    ) -> None:
        """Copy ``reader`` to ``writer`` while the mode allows it."""
        head: bytes | None = b"" if self.strip_content_length else None  # HTTP head not yet rewritten
        sent = 0
        while True:
            data = await reader.read(_CHUNK)
            if not data:
                return
            mode = self.mode
            if mode == "stall":
                await self._hold(reader)
                return
            if mode == "reset":
                self._reset(client_w)
                return
            if mode == "http_503" and upstream:
                await self._slow_down(reader, data, client_w)
                return
            if mode == "truncate" and not upstream:
                if head is not None:
                    head += data
                    end = head.find(b"\r\n\r\n")
                    if end < 0:
                        continue
                    lines = head[:end].split(b"\r\n")
                    drop = (b"content-length:", b"connection:")
                    kept = [ln for ln in lines if not ln.lower().startswith(drop)]
                    writer.write(b"\r\n".join([*kept, b"Connection: close"]) + b"\r\n\r\n")
                    data, head = head[end + 4 :], None
                room = self.truncate_after - sent
                writer.write(data[: max(room, 0)])
                sent += min(len(data), max(room, 0))
                if sent >= self.truncate_after:
                    await writer.drain()
                    writer.close()
                    return
                await writer.drain()
                continue
            if mode == "slow" and self.delay_direction in ("both", "up" if upstream else "down"):
                await self.sleep(self.delay_s)
            writer.write(data)
            await writer.drain()


class ProcessFaultProxy:
    """A FaultProxy in its own process, for clients that hold the GIL while they block on the network
    (Mooncake's store binding does: an in-process proxy thread could not forward until the call gave up).

    Same knobs as ``FaultProxy`` (``mode``, ``truncate_after``): each assignment is sent to the child and
    acknowledged before it returns, so it is in effect when the next line of the test runs."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> ProcessFaultProxy:
        """Start the child proxy and read the port it listens on."""
        argv = [sys.executable, "-P", "-m", __name__, self.target[0], str(self.target[1])]
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        self.port = int(self._proc.stdout.readline())
        return self

    def _set(self, name: str, value: object) -> None:
        proc = self._proc
        assert proc is not None
        assert proc.stdin is not None
        assert proc.stdout is not None
        proc.stdin.write(f"{name} {value}\n")
        proc.stdin.flush()
        if proc.stdout.readline().strip() != "ok":
            raise RuntimeError(f"fault proxy child refused {name}={value!r}")

    def __setattr__(self, name: str, value: object) -> None:
        if name in _KNOBS:
            self._set(name, value)
        else:
            object.__setattr__(self, name, value)

    def stop(self) -> None:
        """Stop the child (closing its stdin ends it) and wait for it."""
        proc = self._proc
        if proc is None:
            return
        assert proc.stdin is not None
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        self._proc = None


_KNOBS: dict[str, type] = {"mode": str, "truncate_after": int, "delay_s": float, "delay_direction": str}


def _serve_child(host: str, port: int) -> None:
    """The child's main: a FaultProxy driven by ``name value`` lines on stdin, acknowledged on stdout."""
    proxy = FaultProxy(host, port).start()
    print(proxy.port, flush=True)
    for line in sys.stdin:
        words = line.split()
        if len(words) == 2 and words[0] in _KNOBS:
            setattr(proxy, words[0], _KNOBS[words[0]](words[1]))
            print("ok", flush=True)
        else:
            print("error", flush=True)
    proxy.stop()


if __name__ == "__main__":
    _serve_child(sys.argv[1], int(sys.argv[2]))
