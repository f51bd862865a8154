"""The Redis adapter and its RESP client against a hostile server (``_hostile_resp.py``, a fake for fault
injection): garbage, wrong lengths, truncated, trickled, late, extra and missing replies, wrong handshake
answers, values over the limit.

Each scenario opens the adapter on a fresh fake server (``socket_timeout`` = ``DEADLINE``, the injected
deadline of every call; one connection per pool, so a connection left out of step would serve the next call),
warms its connections up, then turns the server hostile for the commands the scenario names and runs one
operation. It asserts:

- only the project's errors or misses come out: the outcome is one of ``ok`` (the right value), ``miss``,
  ``false`` (a refused put), ``unavailable`` (AdapterUnavailable) or ``timeout`` (AdapterTimeout), the one the
  scenario expects; any other exception fails the test, and so does a wrong value;
- bounded time: ``timeout`` means the client's own deadline fired; the operation runs under an outer guard of
  ``GUARD_S`` (only a generous bound: a client whose deadline is per read would outlive it on the trickles);
- bounded memory: tracemalloc's peak during the operation stays under ``MEMORY_LIMIT`` (a declared 8 GiB or
  600 MiB is refused from its length, before any allocation);
- no cross-talk: the server turns normal, finishes whatever late bytes it still sends, and the next calls
  (single GET, MGET, contains) get their own replies; a connection that failed or timed out, or received
  anything unexpected, never serves another call.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio

from tests.unit._hostile_resp import HostileServer, Session, bulk, normal
from tiercache.adapters._parts import NONCE_BYTES, Manifest
from tiercache.adapters.redis import MAX_VALUE_BYTES, RedisAdapter
from tiercache.errors import AdapterTimeout, AdapterUnavailable

DEADLINE = 0.3
"""The adapter's ``socket_timeout``: the deadline of each whole call."""
GUARD_S = 5.0
"""Outer bound on one operation; reaching it fails the scenario (the client's deadline did not hold)."""
MEMORY_LIMIT = 32 << 20
"""Most bytes the operation may allocate at its peak (the values involved are 300 KB at most)."""
GiB = 1 << 30
PREFIX = b"tiercache:"
BIG = bytes(range(256)) * 1172  # 300 032 bytes: read by one GET on the RESP client
OTHER = b"o" * 300_001
SMALL = {b"s1": b"1" * 1000, b"s2": b"2" * 1000, b"s3": b"3" * 1000}
PART = 1024
PARTED = bytes(reversed(range(256))) * 12  # 3072 bytes: a manifest and 3 parts of 1024
PARTED_PUT = b"w" * (3 << 20)  # written in 3 parts of 1 MiB (the adapter's part_size here)
SLOW = 0.05  # trickle interval, well under DEADLINE: a per-read timeout never fires


def _store() -> dict[bytes, bytes]:
    store = {PREFIX + b"big": BIG, PREFIX + b"other": OTHER}
    store.update({PREFIX + k: v for k, v in SMALL.items()})
    manifest = Manifest.new(len(PARTED), PART)
    store[PREFIX + b"obj"] = manifest.encode()
    for key, (a, b) in zip(manifest.part_keys("tiercache:obj"), manifest.bounds(), strict=True):
        store[key.encode()] = PARTED[a:b] + manifest.nonce
    return store


# -- what the hostile server does ------------------------------------------------------------------------

Step = bytes | float | str | tuple[bytes, int, float]
"""bytes: send them; float: sleep that long; "close" / "reset": end the connection (FIN / RST);
"silent": answer nothing more (until the client closes); (data, chunk, interval): trickle ``data``."""


def script(*steps: Step) -> Callable[[Session, list[bytes]], Awaitable[None]]:
    async def run(session: Session, args: list[bytes]) -> None:
        for step in steps:
            if isinstance(step, bytes):
                await session.send(step)
            elif isinstance(step, float):
                await asyncio.sleep(step)
            elif step == "close":
                session.close()
            elif step == "reset":
                session.reset()
            elif step == "silent":
                await session.silent()
            else:
                assert isinstance(step, tuple)
                await session.trickle(*step)

    return run


def _is(name: bytes) -> Callable[[list[bytes]], bool]:
    return lambda args: args[0].upper() == name


def _is_part(args: list[bytes]) -> bool:
    return args[0].upper() == b"GET" and b"#" in args[1]


def _is_part_set(args: list[bytes]) -> bool:
    return args[0].upper() == b"SET" and b"#" in args[1]


GET, MGET, SET, GETRANGE, EXISTS = (_is(n) for n in (b"GET", b"MGET", b"SET", b"GETRANGE", b"EXISTS"))
AUTH, SELECT, HELLO, PING, DEL = (_is(n) for n in (b"AUTH", b"SELECT", b"HELLO", b"PING", b"DEL"))


@dataclass(frozen=True)
class Case:
    name: str
    op: str
    """What the adapter does: get (one key: a GET), mget (3 small keys), contains, put (a large value:
    GETRANGE + SET), puts (2 small values: a pipeline), parts (read a parted value), putparts (write one),
    delete, open."""
    respond: Callable[[Session, list[bytes]], Awaitable[None]]
    expect: str
    on: Callable[[list[bytes]], bool] = GET
    """The commands answered by ``respond`` (the others as a Redis server would)."""
    handshake: bool = False
    """Open with a password and database 2, and do not warm the pools up: the call opens a connection."""
    discard: bool | None = None
    """Whether the connection that met ``respond`` must never serve another call (default: for the
    outcomes unavailable and timeout)."""
    meets: bool = True
    """Whether the client sends the command ``on`` names (HELLO: never, RESP2 is pinned)."""


def _cases() -> list[Case]:
    v = BIG
    head = b"$%d\r\n" % len(v)
    wrongtype = b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
    s = list(SMALL.values())
    mget_ok = b"*3\r\n" + b"".join(bulk(x) for x in s)
    return [
        # -- a single GET (the zero-copy path): types, lengths, framing
        Case("garbage type byte", "get", script(b"?what\r\n"), "unavailable"),
        Case("RESP3 map for a GET", "get", script(b"%1\r\n+a\r\n+b\r\n"), "unavailable"),
        Case("array for a GET", "get", script(b"*1\r\n$3\r\nabc\r\n"), "unavailable"),
        Case("integer then the value", "get", script(b":1\r\n", SLOW, bulk(v)), "unavailable"),
        Case("simple string for a GET", "get", script(b"+OK\r\n"), "unavailable"),
        Case("negative length", "get", script(b"$-5\r\n"), "unavailable"),
        Case("null bulk is a miss", "get", script(b"$-1\r\n"), "miss", discard=False),
        Case(
            "declared 8 GiB",
            "get",
            script(b"$%d\r\n" % (8 * GiB), b"x" * 1024, "silent"),
            "miss",
            discard=True,
        ),
        Case("declared 2**63-1", "get", script(b"$9223372036854775807\r\n", "silent"), "miss", discard=True),
        Case(
            "600 MiB value",
            "get",
            script(b"$%d\r\n" % (600 << 20), b"x" * 65536, "silent"),
            "miss",
            discard=True,
        ),
        Case(
            "max_value_bytes + 1",
            "get",
            script(b"$%d\r\n" % (MAX_VALUE_BYTES + 1), "silent"),
            "miss",
            discard=True,
        ),
        Case("20-digit length", "get", script(b"$99999999999999999999\r\n"), "unavailable"),
        Case("non-numeric length", "get", script(b"$abc\r\n"), "unavailable"),
        Case("length with a space", "get", script(b"$ 5\r\nhello\r\n"), "unavailable"),
        Case("length with an underscore", "get", script(b"$1_0\r\n0123456789\r\n"), "unavailable"),
        Case("empty length", "get", script(b"$\r\n"), "unavailable"),
        Case("truncated, then closed", "get", script(head + v[:1000], "close"), "unavailable"),
        Case("truncated, then silent", "get", script(head + v[:1000], "silent"), "timeout"),
        Case("small value without CRLF", "get", script(b"$5\r\nhelloXX"), "unavailable"),
        Case("large value without CRLF", "get", script(head + v + b"XX"), "unavailable"),
        Case("header without CRLF", "get", script(head[:-2], "silent"), "timeout"),
        Case("line over 64 KiB", "get", script(b"+" + b"a" * 70_000), "unavailable"),
        Case("LF line ends", "get", script(b"$5\nhello\n", "silent"), "timeout"),
        Case("error reply", "get", script(b"-ERR something broke\r\n"), "unavailable", discard=False),
        Case("WRONGTYPE is a miss", "get", script(wrongtype), "miss", discard=False),
        Case("error, then a late value", "get", script(b"-ERR busy\r\n", SLOW, bulk(v)), "unavailable"),
        Case("extra reply, same segment", "get", script(bulk(v) + bulk(b"extra")), "ok", discard=True),
        Case("extra reply, later", "get", script(bulk(v), SLOW, bulk(b"extra")), "ok", discard=True),
        Case("reply past the deadline", "get", script(DEADLINE * 2, bulk(v)), "timeout"),
        Case("value trickled", "get", script(b"$1048576\r\n", (b"t" * (1 << 20), 1024, SLOW)), "timeout"),
        Case("header trickled", "get", script((head + v, 1, SLOW)), "timeout"),
        Case("closed before the reply", "get", script("close"), "unavailable"),
        Case("reset before the reply", "get", script("reset"), "unavailable"),
        Case("closed mid-header", "get", script(b"$300", "close"), "unavailable"),
        Case("closed mid-value", "get", script(head + v[:150_000], "close"), "unavailable"),
        # -- MGET (small values: a pipeline of MGETs on the RESP client)
        Case(
            "MGET: array too short", "mget", script(b"*2\r\n" + bulk(s[0]) + bulk(s[1])), "unavailable", MGET
        ),
        Case(
            "MGET: 2**31-1 elements",
            "mget",
            script(b"*2147483647\r\n" + b"$-1\r\n" * 1000, "silent"),
            "unavailable",
            MGET,
        ),
        Case(
            "MGET: nested 100000 deep", "mget", script(b"*3\r\n" + b"*1\r\n" * 100_000), "unavailable", MGET
        ),
        Case(
            "MGET: nested array",
            "mget",
            script(b"*3\r\n*1\r\n$1\r\na\r\n$-1\r\n$-1\r\n"),
            "unavailable",
            MGET,
        ),
        Case("MGET: error element", "mget", script(b"*3\r\n-ERR x\r\n$-1\r\n$-1\r\n"), "unavailable", MGET),
        Case("MGET: error reply", "mget", script(b"-ERR whole\r\n"), "unavailable", MGET, discard=False),
        Case("MGET: integer elements", "mget", script(b"*3\r\n:1\r\n:2\r\n:3\r\n"), "unavailable", MGET),
        Case(
            "MGET: an 8 GiB element",
            "mget",
            script(b"*3\r\n$%d\r\n" % (8 * GiB), "silent"),
            "ok",
            MGET,
            discard=True,
        ),
        Case("MGET: trickled", "mget", script((mget_ok, 100, SLOW)), "timeout", MGET),
        Case("MGET: past the deadline", "mget", script(DEADLINE * 2, mget_ok), "timeout", MGET),
        # -- contains (a pipeline of EXISTS + GETRANGE)
        Case("EXISTS: a bulk string", "contains", script(b"$1\r\n1\r\n"), "unavailable", EXISTS),
        Case("EXISTS: error reply", "contains", script(b"-ERR x\r\n"), "unavailable", EXISTS, discard=False),
        Case("GETRANGE: WRONGTYPE", "contains", script(wrongtype), "miss", GETRANGE, discard=False),
        Case(
            "GETRANGE: over its 52 bytes",
            "contains",
            script(b"$100000000\r\n", "silent"),
            "unavailable",
            GETRANGE,
        ),
        Case("EXISTS: silent", "contains", script("silent"), "timeout", EXISTS),
        # -- small puts (a pipeline of GETRANGE + SET per key)
        Case("pipeline: a SET unanswered", "puts", script("silent"), "timeout", SET),
        Case("pipeline: two replies to a SET", "puts", script(b"+OK\r\n+OK\r\n"), "unavailable", SET),
        Case("pipeline: GETRANGE error", "puts", script(b"-ERR x\r\n"), "ok", GETRANGE, discard=False),
        Case("pipeline: SET error", "puts", script(b"-ERR x\r\n"), "unavailable", SET, discard=False),
        Case(
            "pipeline: SET refused (OOM)",
            "puts",
            script(b"-OOM command not allowed\r\n"),
            "false",
            SET,
            discard=False,
        ),
        Case("pipeline: SET answered as bulk", "puts", script(b"$2\r\nOK\r\n"), "unavailable", SET),
        Case(
            "pipeline: GETRANGE 100 MB", "puts", script(b"$100000000\r\n", "silent"), "unavailable", GETRANGE
        ),
        # -- a large put (GETRANGE + SET on one connection)
        Case("SET answered +QUEUED", "put", script(b"+QUEUED\r\n"), "unavailable", SET),
        Case("SET past the deadline", "put", script(DEADLINE * 2, b"+OK\r\n"), "timeout", SET),
        Case(
            "SET refused (OOM)", "put", script(b"-OOM command not allowed\r\n"), "false", SET, discard=False
        ),
        # -- a parted value (each part received in place)
        Case("part of another size", "parts", script(bulk(b"p" * 100)), "miss", _is_part, discard=True),
        Case(
            "part declared 8 GiB",
            "parts",
            script(b"$%d\r\n" % (8 * GiB), "silent"),
            "miss",
            _is_part,
            discard=True,
        ),
        Case("part WRONGTYPE", "parts", script(wrongtype), "miss", _is_part, discard=False),
        Case(
            "part SET past the deadline",
            "putparts",
            script(DEADLINE * 2, b"+OK\r\n"),
            "timeout",
            _is_part_set,
        ),
        Case(
            "part trickled",
            "parts",
            script((bulk(PARTED[:PART] + b"n" * NONCE_BYTES), 16, SLOW)),
            "timeout",
            _is_part,
        ),
        # -- delete (redis-py: every exception translated, the whole call bounded)
        Case("DEL: nested 100000 deep", "delete", script(b"*1\r\n" * 100_000), "unavailable", DEL),
        Case("GETRANGE: negative length", "delete", script(b"$-5\r\n"), "unavailable", GETRANGE),
        Case("DEL: trickled", "delete", script((b":" + b"1" * 1000 + b"\r\n", 1, SLOW)), "timeout", DEL),
        # -- the handshake of a new RESP connection (AUTH, SELECT); HELLO, PING at open
        Case("AUTH answered +WRONG", "get", script(b"+WRONG\r\n"), "unavailable", AUTH, True),
        Case("AUTH answered :1", "get", script(b":1\r\n"), "unavailable", AUTH, True),
        Case("AUTH answered as bulk", "get", script(b"$2\r\nOK\r\n"), "unavailable", AUTH, True),
        Case("AUTH refused", "get", script(b"-WRONGPASS invalid password\r\n"), "unavailable", AUTH, True),
        Case(
            "AUTH answered by a HELLO map",
            "get",
            script(b"%1\r\n+server\r\n+redis\r\n"),
            "unavailable",
            AUTH,
            True,
        ),
        Case("AUTH answered twice", "get", script(b"+OK\r\n+OK\r\n"), "unavailable", AUTH, True),
        Case("AUTH never answered", "get", script("silent"), "timeout", AUTH, True),
        Case("AUTH trickled", "get", script((b"+OK\r\n", 1, DEADLINE / 2)), "timeout", AUTH, True),
        Case("SELECT answered +NOPE", "get", script(b"+NOPE\r\n"), "unavailable", SELECT, True),
        Case(
            "SELECT refused", "get", script(b"-ERR DB index is out of range\r\n"), "unavailable", SELECT, True
        ),
        Case("HELLO answered +OK", "open", script(b"+OK\r\n"), "ok", HELLO, meets=False),
        Case("HELLO answered :1", "open", script(b":1\r\n"), "ok", HELLO, meets=False),
        Case(
            "HELLO answered by an array",
            "open",
            script(b"*2\r\n$1\r\na\r\n$1\r\nb\r\n"),
            "ok",
            HELLO,
            meets=False,
        ),
        Case("PING answered +PANG", "open", script(b"+PANG\r\n"), "unavailable", PING),
        Case("PING answered garbage", "open", script(b"?\r\n"), "unavailable", PING),
        Case("PING trickled", "open", script((b"+PONG\r\n", 1, DEADLINE / 2)), "timeout", PING),
    ]


CASES = _cases()


# -- running one scenario --------------------------------------------------------------------------------


@pytest_asyncio.fixture
async def server() -> AsyncIterator[HostileServer]:
    srv = await HostileServer(_store()).start()
    yield srv
    await srv.stop()


async def _open(srv: HostileServer, handshake: bool) -> RedisAdapter:
    url = f"redis://127.0.0.1:{srv.port}/{2 if handshake else 0}"
    password = {"password": "pw"} if handshake else {}
    # parts of 1 MiB: BIG goes whole (one SET), PARTED_PUT in 3 parts; PARTED (stored) names its own size
    return await RedisAdapter.open(url, socket_timeout=DEADLINE, pool_size=1, part_size=1 << 20, **password)


async def _operate(srv: HostileServer, adapter: RedisAdapter | None, case: Case) -> str:
    """Run the scenario's operation; its outcome (any exception but the project's propagates)."""
    op = case.op
    if op == "open":
        opened = await _open(srv, case.handshake)
        await opened.aclose()
        return "ok"
    assert adapter is not None
    if op == "get":
        return _value_outcome(await adapter.batched_get(["big"]), [BIG])
    if op == "parts":
        return _value_outcome(await adapter.batched_get(["obj"]), [PARTED])
    if op == "mget":
        return _value_outcome(await adapter.batched_get(["s1", "s2", "s3"]), list(SMALL.values()))
    if op == "contains":
        found = await adapter.batched_contains(["s1", "s2"])
        return "ok" if found == [True, True] else "miss"
    if op == "put":
        return "ok" if await adapter.batched_put(["big"], [BIG]) == [True] else "false"
    if op == "putparts":
        return "ok" if await adapter.batched_put(["obj"], [PARTED_PUT]) == [True] else "false"
    if op == "puts":
        return "ok" if await adapter.batched_put(["s1", "s2"], [b"a", b"b"]) == [True, True] else "false"
    if op == "delete":
        assert await adapter.batched_delete(["s3"]) == [True]
        return "ok"
    raise AssertionError(op)


def _value_outcome(got: list[Any], want: list[bytes]) -> str:
    if got == [None] * len(want):
        return "miss"
    values = [None if g is None else bytes(g) for g in got]
    assert values == want, "a value other than the one asked for (cross-talk or garbage served as data)"
    return "ok"


async def _outcome(srv: HostileServer, adapter: RedisAdapter | None, case: Case) -> str:
    try:
        return await asyncio.wait_for(_operate(srv, adapter, case), GUARD_S)
    except AdapterTimeout:
        return "timeout"
    except AdapterUnavailable:
        return "unavailable"


async def _settled(srv: HostileServer) -> None:
    """Wait until the server has sent whatever its handlers still had to send (late replies)."""
    for _ in range(int(GUARD_S / 0.01)):
        if not srv.busy:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the hostile server is still busy")


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_hostile_server(server: HostileServer, case: Case) -> None:
    met: set[int] = set()  # connections on which the hostile answers went out

    async def respond(session: Session, args: list[bytes]) -> None:
        if case.on(args):
            met.add(session.number)
            await case.respond(session, args)
        else:
            await normal(session, args)

    adapter = None
    if case.op != "open":
        adapter = await _open(server, case.handshake)
        if not case.handshake:  # a pooled connection on each client: the scenario meets a used one
            assert await adapter.batched_get(["other"]) == [OTHER]
            assert await adapter.batched_contains(["s1"]) == [True]
    try:
        server.respond = respond
        tracemalloc.start()
        try:
            outcome = await _outcome(server, adapter, case)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert outcome == case.expect
        assert peak < MEMORY_LIMIT, f"{peak} bytes allocated at the peak"
        assert bool(met) == case.meets, "the scenario never met its command" if case.meets else "HELLO sent"
        server.respond = normal
        await _settled(server)
        # No cross-talk: each call gets its own reply, on a connection that did not fail or time out.
        if adapter is None:
            adapter = await _open(server, case.handshake)
        start = len(server.log)
        assert await asyncio.wait_for(adapter.batched_get(["other"]), GUARD_S) == [OTHER]
        small = await asyncio.wait_for(adapter.batched_get(["s1", "s2"]), GUARD_S)
        want = [server.store.get(PREFIX + k) for k in (b"s1", b"s2")]  # a put may have changed them
        assert [None if x is None else bytes(x) for x in small] == want
        assert await asyncio.wait_for(adapter.batched_contains(["other", "nothing"]), GUARD_S) == [
            True,
            False,
        ]
        discard = case.discard if case.discard is not None else case.expect in ("unavailable", "timeout")
        if discard:
            reused = {conn for conn, _, _ in server.log[start:]} & met
            assert not reused, f"connection(s) {reused} served a call after what they got"
    finally:
        if adapter is not None:
            await adapter.aclose()


def test_the_scenarios_cover_the_ground() -> None:
    assert len(CASES) >= 45
    assert len({c.name for c in CASES}) == len(CASES)
    assert {c.expect for c in CASES} == {"ok", "miss", "false", "unavailable", "timeout"}
