"""``RespPool.pipelines``: several pipelines at once, each on its own connection, sent and answered in the
pool's threads with one wake-up of the event loop for the call (adapters/_resp.py). The replies as
``pipeline`` gives them; one deadline for the whole call over a silent or stalling server; a cancelled call
ends every thread; a stale pooled connection is retried; failed connections are never reused."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st

from tests.unit._hostile_resp import HostileServer, Session, normal
from tiercache.adapters._resp import THREAD_BYTES, RespError, RespPool, RespProtocolError, _Conn, _Plan
from tiercache.errors import AdapterTimeout, AdapterUnavailable

DEADLINE = 0.5
BIG = bytes(range(256)) * (2 * THREAD_BYTES // 256)


@pytest_asyncio.fixture
async def server() -> AsyncIterator[HostileServer]:
    srv = await HostileServer().start()
    yield srv
    await srv.stop()


def _lane(keys: list[bytes], value: bytes) -> list[list[bytes | memoryview]]:
    commands: list[list[bytes | memoryview]] = []
    for key in keys:
        commands += [[b"GETRANGE", key, b"0", b"51"], [b"SET", key, memoryview(value)]]
    return commands


_PLAIN = {
    b"SET": st.sampled_from([b"+OK\r\n", b"-OOM no memory\r\n", b"+NO\r\n", b"$2\r\nOK\r\n", b":1\r\n"]),
    b"GETRANGE": st.one_of(
        st.builds(lambda v: b"$%d\r\n%b\r\n" % (len(v), v), st.binary(max_size=60)),  # some over max_bulk
        st.sampled_from([b"$-1\r\n", b"-WRONGTYPE x\r\n", b"+OK\r\n", b"$-2\r\n", b"$3\r\nab\r\n\r\n"]),
    ),
}


def _slow_read(plan: _Plan, data: bytes, max_bulk: int) -> object:
    """What the event loop's parser makes of ``data`` (an exception as a value; the stream ends after it)."""

    async def read() -> object:
        mine, theirs = socket.socketpair()
        theirs.close()
        mine.setblocking(False)
        conn = _Conn(mine, max_bulk)
        conn.pending += data
        try:
            got = await plan.read(conn, max_bulk)
            return got if not conn.pending else "bytes left over"
        except Exception as exc:
            return type(exc)
        finally:
            conn.close()

    return asyncio.run(read())


@given(
    st.lists(st.sampled_from([b"SET", b"GETRANGE"]), min_size=1, max_size=6).flatmap(
        lambda names: st.tuples(st.just(names), st.tuples(*(_PLAIN[n] for n in names)))
    ),
    st.binary(max_size=3),
)
def test_replies_parsed_whole_in_a_thread_agree_with_the_loops_parser(
    case: tuple[list[bytes], tuple[bytes, ...]], extra: bytes
) -> None:
    """``_Plan.read_whole`` gives what ``_Plan.read`` gives, or None (then ``read`` judges): never another
    answer, whatever the replies (wrong types, values over the limit, a bad CRLF, bytes after them)."""
    names, replies = case
    plan = _Plan([[n, b"k", b"v"] if n == b"SET" else [n, b"k", b"0", b"51"] for n in names], 0)
    data = b"".join(replies) + extra
    fast = plan.read_whole(bytearray(data), 52)
    slow = _slow_read(plan, data, 52)
    if fast is None:
        return
    assert isinstance(slow, list), f"parsed {fast!r} where the loop's parser found {slow!r}"
    assert [str(r) if isinstance(r, RespError) else r for r in fast] == [
        str(r) if isinstance(r, RespError) else r for r in slow
    ]
    assert not extra


def test_plain_replies_are_parsed_whole() -> None:
    plan = _Plan([[b"GETRANGE", b"k", b"0", b"51"], [b"SET", b"k", b"v"]] * 2, 0)
    data = bytearray(b"$3\r\nold\r\n+OK\r\n$-1\r\n-OOM full\r\n")
    got = plan.read_whole(data, 52)
    assert got is not None
    assert got[:3] == [b"old", b"OK", None]
    assert isinstance(got[3], RespError)
    assert str(got[3]) == "OOM full"
    assert plan.read_whole(data[:-1], 52) is None


@pytest.mark.asyncio
async def test_lanes_store_every_value_and_answer_as_pipeline_does(server: HostileServer) -> None:
    server.store[b"a0"] = b"old-head"
    pool = RespPool("127.0.0.1", server.port, timeout=30, size=4)
    try:
        lanes = [_lane([b"a0", b"a1"], BIG), _lane([b"b0"], BIG[::-1]), _lane([b"c0", b"c1", b"c2"], BIG)]
        got = await pool.pipelines(lanes, max_bulk=52, pace=2)
        assert got == [[b"old-head", b"OK", b"", b"OK"], [b"", b"OK"], [b"", b"OK", b"", b"OK", b"", b"OK"]]
        assert server.store[b"b0"] == BIG[::-1]
        assert all(server.store[k] == BIG for k in (b"a0", b"a1", b"c0", b"c1", b"c2"))
        conns = {conn for conn, _ in server.commands(b"SET")}
        assert len(conns) == 3, "the lanes did not each have a connection"
        again = await pool.pipelines(lanes, max_bulk=52, pace=2)  # the same connections, back in the pool
        assert again[0][0] == BIG[:52]
        assert server.accepted == 3
    finally:
        pool.close()


async def _silent_on_c(session: Session, args: list[bytes]) -> None:
    if args[1].startswith(b"c"):
        await session.silent()
    else:
        await normal(session, args)


@pytest.mark.asyncio
async def test_a_silent_lane_ends_the_call_at_its_deadline_and_its_connection_is_closed(
    server: HostileServer,
) -> None:
    server.respond = _silent_on_c
    pool = RespPool("127.0.0.1", server.port, timeout=DEADLINE, size=2)
    try:
        started = time.monotonic()
        with pytest.raises(AdapterTimeout):
            await pool.pipelines([_lane([b"a"], BIG), _lane([b"c"], BIG)], max_bulk=52, pace=2)
        assert time.monotonic() - started < DEADLINE + 2.0  # at its deadline (a loaded machine wakes late)
        assert server.store[b"a"] == BIG
        assert len(pool._idle) == 1, "the silent lane's connection went back to the pool"
        server.respond = normal
        pool.timeout = 30.0
        assert await pool.pipelines([_lane([b"c"], BIG), _lane([b"d"], BIG)]) == [[b"", b"OK"], [b"", b"OK"]]
        assert server.accepted == 3
    finally:
        pool.close()


@pytest.mark.asyncio
async def test_a_cancelled_call_ends_every_lane_thread(server: HostileServer) -> None:
    server.respond = _silent_on_c
    pool = RespPool("127.0.0.1", server.port, timeout=30, size=2)
    try:
        task = asyncio.ensure_future(pool.pipelines([_lane([b"c1"], BIG), _lane([b"c2"], BIG)]))
        await server.received(b"GETRANGE", 2)
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - started < 2, "the cancel waited out the threads' own deadline"
        assert not pool._idle
        server.respond = normal
        got = await asyncio.wait_for(pool.pipelines([_lane([b"x"], BIG), _lane([b"y"], BIG)]), 10)
        assert got == [[b"", b"OK"], [b"", b"OK"]]
    finally:
        pool.close()


async def _extra_reply(session: Session, args: list[bytes]) -> None:
    await normal(session, args)
    if args[0].upper() == b"SET" and args[1] == b"b":
        await session.send(b"+OK\r\n")  # one reply more than asked for


async def _wrong_type(session: Session, args: list[bytes]) -> None:
    if args[0].upper() == b"SET" and args[1] == b"b":
        await session.send(b":1\r\n")
    else:
        await normal(session, args)


@pytest.mark.asyncio
@pytest.mark.parametrize("hostile", [_extra_reply, _wrong_type])
async def test_a_lane_out_of_step_is_never_reused(server: HostileServer, hostile: object) -> None:
    server.respond = hostile  # type: ignore[assignment]
    pool = RespPool("127.0.0.1", server.port, timeout=5, size=2)
    try:
        try:
            got = await pool.pipelines([_lane([b"a"], BIG), _lane([b"b"], BIG)], max_bulk=52, pace=2)
        except RespProtocolError:
            assert hostile is _wrong_type
        else:
            assert hostile is _extra_reply
            assert got == [[b"", b"OK"], [b"", b"OK"]]
            await asyncio.sleep(0.1)  # the extra reply arrives: the connection is dropped when next taken
        server.respond = normal
        assert await pool.pipelines([_lane([b"c"], BIG), _lane([b"d"], BIG)]) == [[b"", b"OK"], [b"", b"OK"]]
        assert server.accepted == 3  # the out-of-step connection replaced, the other reused
    finally:
        pool.close()


@pytest.mark.asyncio
async def test_a_stale_pooled_connection_is_retried_and_a_closed_pool_refuses(server: HostileServer) -> None:
    pool = RespPool("127.0.0.1", server.port, timeout=30, size=2)
    try:
        assert await pool.pipelines([_lane([b"a"], BIG), _lane([b"b"], BIG)])
        for writer in list(server._writers):  # the server drops its idle connections
            writer.transport.abort()
        await asyncio.sleep(0.1)
        assert await pool.pipelines([_lane([b"c"], BIG), _lane([b"d"], BIG)]) == [[b"", b"OK"], [b"", b"OK"]]
        assert server.store[b"d"] == BIG
        pool.close()
        with pytest.raises(AdapterUnavailable):
            await pool.pipelines([_lane([b"e"], BIG), _lane([b"f"], BIG)])
    finally:
        pool.close()


@pytest.mark.asyncio
async def test_more_lanes_than_connections_run_in_groups_on_the_pools_connections(
    server: HostileServer,
) -> None:
    pool = RespPool("127.0.0.1", server.port, timeout=30, size=2)
    try:
        keys = [b"k%d" % i for i in range(5)]
        got = await pool.pipelines([_lane([k], BIG) for k in keys], max_bulk=52, pace=2)
        assert got == [[b"", b"OK"]] * 5
        assert all(server.store[k] == BIG for k in keys)
        assert server.accepted == 2
    finally:
        pool.close()


@pytest.mark.asyncio
async def test_without_threads_the_lanes_are_concurrent_calls_on_the_loop(server: HostileServer) -> None:
    pool = RespPool("127.0.0.1", server.port, timeout=30, size=2)
    pool._threads = None  # every send on the event loop
    try:
        got = await pool.pipelines([_lane([b"a"], BIG), _lane([b"b"], BIG[::-1])], max_bulk=52, pace=2)
        assert got == [[b"", b"OK"], [b"", b"OK"]]
        assert server.store[b"b"] == BIG[::-1]
        assert len({conn for conn, _ in server.commands(b"SET")}) == 2
    finally:
        pool.close()
