"""Large sends of the RESP client run as blocking socket calls in worker threads, which wait there for the
replies too (adapters/_resp.py): the replies' framing check that ends that wait, a paced pipeline's one value
at a time, the call's deadline over a thread that waits on a silent server, and the thread given back for the
next call; and a large reply received in large pieces, the socket left as it was."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st

from tests.unit._hostile_resp import HostileServer, Session, bulk, normal
from tiercache.adapters._resp import THREAD_BYTES, RespPool, _command, _frame, _framed
from tiercache.errors import AdapterTimeout

DEADLINE = 0.5
BIG = bytes(range(256)) * (2 * THREAD_BYTES // 256)  # over THREAD_BYTES: sent in a thread

_reply = st.one_of(
    st.just(b"+OK\r\n"),
    st.builds(lambda n: b":%d\r\n" % n, st.integers(-(2**40), 2**40)),
    st.builds(lambda t: b"-ERR " + t + b"\r\n", st.text("abc xyz", max_size=20).map(str.encode)),
    st.builds(bulk, st.none() | st.binary(max_size=300)),  # a bulk string may hold CRLFs
)


@given(st.lists(_reply, min_size=1, max_size=5))
def test_replies_are_framed_only_when_every_byte_of_them_is_there(replies: list[bytes]) -> None:
    whole = b"".join(replies)
    assert _framed(bytearray(whole), len(replies))
    assert _framed(bytearray(whole + b"+OK\r\n"), len(replies))  # bytes after them: the parser's to judge
    for cut in range(len(whole)):
        assert not _framed(bytearray(whole[:cut]), len(replies)), f"framed at {cut} of {len(whole)}"


@given(st.lists(_reply, min_size=1, max_size=5), st.lists(st.integers(1, 40), max_size=30))
def test_framing_as_bytes_arrive_agrees_with_framing_all(replies: list[bytes], pieces: list[int]) -> None:
    """A thread's wait frames what has arrived from where it left off: at every piece received, as many
    replies framed as a check of all the bytes from the start finds, and the last one at the end."""
    whole = b"".join(replies)
    data, at, done, cut = bytearray(), 0, 0, 0
    for size in [*pieces, len(whole)]:
        data += whole[cut : cut + size]
        cut += size
        at, done = _frame(data, at, done, len(replies))
        assert (done == len(replies)) == _framed(data, len(replies))
        assert done == max(n for n in range(len(replies) + 1) if _framed(data, n))
    assert (at, done) == (len(whole), len(replies))


def test_what_is_no_reply_framing_is_left_to_the_parser() -> None:
    """Another type byte, a length that is no number, or more than a line's limit ends the wait at once."""
    assert _framed(bytearray(b"*2\r\n"), 1)
    assert _framed(bytearray(b"$x\r\n"), 1)
    assert _framed(bytearray(b"?\r\n"), 2)
    assert _framed(bytearray(b"$99999999\r\n" + b"x" * (65 << 10)), 1)


@pytest_asyncio.fixture
async def server() -> AsyncIterator[HostileServer]:
    srv = await HostileServer({b"big": BIG}).start()
    yield srv
    await srv.stop()


async def _silent(session: Session, args: list[bytes]) -> None:
    await session.silent()


async def _stall_mid_value(session: Session, args: list[bytes]) -> None:
    if args[0].upper() == b"GET":
        await session.send(b"$%d\r\n" % len(BIG) + BIG[: len(BIG) // 2])
    await session.silent()


@pytest.mark.asyncio
@pytest.mark.parametrize("stall", ["set unanswered", "get stalls mid-value"])
async def test_a_stalled_large_transfer_ends_at_the_deadline_and_frees_its_thread(
    server: HostileServer, stall: str
) -> None:
    """One connection and one worker thread: after a call times out in its thread, the next one runs (the
    thread was released, the stalled connection closed) and reads and writes every byte."""
    pool = RespPool("127.0.0.1", server.port, timeout=DEADLINE, size=1)
    try:
        server.respond = _silent if stall == "set unanswered" else _stall_mid_value
        started = time.monotonic()
        call = pool.set(b"k", memoryview(BIG)) if stall == "set unanswered" else pool.get(b"big")
        with pytest.raises(AdapterTimeout):
            await call
        assert time.monotonic() - started < DEADLINE + 2.0  # at its deadline (a loaded machine wakes it late)
        server.respond = normal
        pool.timeout = 30.0  # the calls after the stall: a loaded machine may move 2 MiB slowly
        assert await pool.set(b"k2", memoryview(BIG[::-1]))
        assert server.store[b"k2"] == BIG[::-1]
        got = await pool.get(b"big")
        assert got is not None
        assert bytes(got) == BIG
        assert server.accepted == 2, "the stalled connection was used again"
    finally:
        pool.close()


@pytest.mark.asyncio
async def test_a_cancelled_large_get_frees_its_thread(server: HostileServer) -> None:
    """A caller that gives up (cancels) while a thread waits for the value: the thread ends, the next call
    gets every byte on a new connection."""
    server.respond = _stall_mid_value
    pool = RespPool("127.0.0.1", server.port, timeout=30, size=1)
    try:
        task = asyncio.ensure_future(pool.get(b"big"))
        await server.received(b"GET")  # sent: its thread waits for the value
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - started < 2, "the cancel waited out the thread's own deadline"
        server.respond = normal
        got = await asyncio.wait_for(pool.get(b"big"), 5)
        assert got is not None
        assert bytes(got) == BIG
        assert server.accepted == 2
    finally:
        pool.close()


@pytest.mark.asyncio
async def test_a_paced_pipeline_sends_the_next_value_only_once_the_last_was_answered() -> None:
    """``pace=2`` (a GETRANGE and a SET per value): the server sees nothing of the second value while it holds
    back its answers to the first, then gets the rest, and every reply comes back in order."""
    first = len(b"".join(b"".join(map(bytes, c)) for c in _pair(b"a", BIG)))
    seen: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got = await reader.readexactly(first)
        await asyncio.sleep(0.3)  # holding the answers back: a paced client sends nothing more meanwhile
        with contextlib.suppress(TimeoutError):
            got += await asyncio.wait_for(reader.read(1 << 20), 0.01)
        seen.append(len(got))
        writer.write(b"$0\r\n\r\n+OK\r\n")
        rest = await reader.readexactly(first)  # the second pair, same sizes
        seen.append(len(rest))
        writer.write(b"$3\r\nold\r\n+OK\r\n")
        await writer.drain()
        await reader.read()  # until the client closes

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    pool = RespPool("127.0.0.1", srv.sockets[0].getsockname()[1], timeout=5, size=1)
    try:
        commands: list[list[bytes | memoryview]] = []
        for key in (b"a", b"b"):
            commands += [[b"GETRANGE", key, b"0", b"51"], [b"SET", key, memoryview(BIG)]]
        assert await pool.pipeline(commands, max_bulk=52, pace=2) == [b"", b"OK", b"old", b"OK"]
        assert seen == [first, first]
    finally:
        pool.close()
        srv.close()


def _pair(key: bytes, value: bytes) -> list[list[memoryview]]:
    return [_command(b"GETRANGE", key, b"0", b"51"), _command(b"SET", key, memoryview(value))]


@pytest.mark.asyncio
async def test_a_large_reply_is_received_in_large_pieces_and_the_socket_is_left_as_it_was(
    server: HostileServer,
) -> None:
    """While a large bulk reply arrives the loop waits for pieces of up to ``RECV_LOWAT`` bytes; afterwards
    the connection waits for single bytes again, so a small reply on it is read at once."""
    server.store[b"small"] = b"x"
    pool = RespPool("127.0.0.1", server.port, timeout=5, size=1)
    try:
        got = await pool.get(b"big")
        assert got is not None
        assert bytes(got) == BIG
        (conn,) = pool._idle
        assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        started = time.monotonic()
        assert bytes(await pool.get(b"small") or b"") == b"x"
        assert time.monotonic() - started < 2.5  # at once, not after the call's 5 s deadline
        assert server.accepted == 1
    finally:
        pool.close()
