"""Per-op latency (``OpLatency``) and the server's ``/metrics``: a real ``L1Server`` on this test's event
loop, its endpoint started by ``serve_metrics``, scraped over HTTP, parsed with ``prometheus_client.parser``.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tiercache.server.client import ServerConnection
from tiercache.server.metrics import OP_SECONDS_BUCKETS, OpLatency, ServerCollector, serve_metrics
from tiercache.server.protocol import Op
from tiercache.server.server import L1Server, ServerOptions

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (sample name, sorted labels) -> value
Families = dict[str, Samples]


def parse(text: str) -> tuple[Families, dict[str, str]]:
    """Samples by family: {(sample name, sorted labels): value}, and each family's type."""
    families: Families = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        samples = families.setdefault(family.name, {})
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return families, types


def buckets(samples: Samples, op: str) -> list[tuple[float, float]]:
    """(le, cumulative count) of one op's histogram, in bound order."""
    out = []
    for (name, labels), value in samples.items():
        lab = dict(labels)
        if name == "tiercache_server_op_seconds_bucket" and lab["op"] == op:
            out.append((float(lab["le"]), value))
    return sorted(out)


# ----------------------------------------------------------------------------------------- OpLatency alone
def test_observations_land_in_le_buckets() -> None:
    lat = OpLatency(ops=["LOOKUP"])
    assert OP_SECONDS_BUCKETS[0] == 1e-5
    assert OP_SECONDS_BUCKETS[-1] == 10.0
    assert list(OP_SECONDS_BUCKETS) == sorted(set(OP_SECONDS_BUCKETS))
    for seconds in (0.0, 1e-5, 1.1e-5, 3e-3, 10.0, 10.5, 7200.0):
        lat.observe("LOOKUP", seconds)
    cumulative, total = lat.snapshot()["LOOKUP"]
    assert len(cumulative) == len(OP_SECONDS_BUCKETS) + 1  # the last is +Inf
    per_bucket = [b - a for a, b in zip([0, *cumulative], cumulative, strict=False)]
    at = {b: i for i, b in enumerate(OP_SECONDS_BUCKETS)}
    expected = [0] * (len(OP_SECONDS_BUCKETS) + 1)
    expected[at[1e-5]] = 2  # 0 and exactly 10 µs: a bound is "less or equal"
    expected[at[2.5e-5]] = 1
    expected[at[5e-3]] = 1
    expected[at[10.0]] = 1  # exactly 10 s
    expected[-1] = 2  # above the last bound: +Inf only
    assert per_bucket == expected
    assert cumulative[-1] == 7
    assert total == pytest.approx(0.0 + 1e-5 + 1.1e-5 + 3e-3 + 10.0 + 10.5 + 7200.0)


def test_request_ops_exist_from_the_start_and_new_names_are_added() -> None:
    lat = OpLatency()
    snap = lat.snapshot()
    assert set(snap) == {op.name for op in Op if op < Op.OK}  # every request op, no reply op
    assert all(cumulative[-1] == 0 and total == 0.0 for cumulative, total in snap.values())
    lat.observe("LOOKUP_L2", 0.5)
    lat.observe("nan", float("nan"))  # never poisons the sum
    snap = lat.snapshot()
    assert snap["LOOKUP_L2"][0][-1] == 1
    assert snap["LOOKUP_L2"][1] == 0.5
    assert snap["nan"] == ([1] * (len(OP_SECONDS_BUCKETS) + 1), 0.0)


def test_op_names_are_bounded() -> None:
    lat = OpLatency(ops=[])
    for i in range(200):
        lat.observe(f"op{i}", 1e-3)
    snap = lat.snapshot()
    assert len(snap) <= 65
    assert sum(c[-1] for c, _ in snap.values()) == 200  # nothing lost: the rest counted under "other"
    assert snap["other"][0][-1] == 200 - (len(snap) - 1)


@pytest.fixture
def fast_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython allows: races show up
    yield
    sys.setswitchinterval(old)


@pytest.mark.usefixtures("fast_switching")
def test_scrapes_while_the_loop_observes_new_ops() -> None:
    """A reader snapshots while the writer keeps adding op names and observations: never an error, and every
    snapshot is a valid histogram (cumulative counts never decrease)."""
    errors: list[BaseException] = []
    for _ in range(200):
        lat = OpLatency(ops=[])
        stop = threading.Event()

        def read(lat: OpLatency = lat, stop: threading.Event = stop) -> None:
            try:
                while not stop.is_set():
                    for cumulative, _ in lat.snapshot().values():
                        assert all(a <= b for a, b in itertools.pairwise(cumulative))
            except BaseException as exc:
                errors.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        for i in range(60):
            for j in range(50):
                lat.observe(f"op{i}", j * 1e-4)
        stop.set()
        reader.join()
        assert sum(c[-1] for c, _ in lat.snapshot().values()) == 60 * 50
    assert errors == []


# ----------------------------------------------------------------------------------------- a real server
@pytest_asyncio.fixture
async def server(sock_dir: Path) -> AsyncIterator[L1Server]:
    server = L1Server(ServerOptions(str(sock_dir / "m.sock"), 4 * 4096, (4096,), region_bytes=4096))
    await server.start()
    yield server
    await server.stop()


async def scrape(port: int) -> tuple[Families, dict[str, str]]:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as resp:
            return str(resp.read().decode())

    return parse(await asyncio.to_thread(get))


@pytest.mark.asyncio
async def test_op_seconds_is_a_histogram_on_metrics(server: L1Server) -> None:
    lat = OpLatency()
    server.op_latency = lat  # type: ignore[attr-defined,unused-ignore]  # what L1Server keeps per request
    for seconds in (2e-5, 3e-5, 0.2):
        lat.observe("LOOKUP", seconds)
    lat.observe("ALLOC", 20.0)
    port = serve_metrics(server, "127.0.0.1", 0)
    families, types = await scrape(port)
    assert types["tiercache_server_op_seconds"] == "histogram"
    samples = families["tiercache_server_op_seconds"]
    bounds = [*OP_SECONDS_BUCKETS, float("inf")]
    lookup = buckets(samples, "LOOKUP")
    assert [le for le, _ in lookup] == bounds
    expect = [float((b >= 2e-5) + (b >= 3e-5) + (b >= 0.2)) for b in bounds]  # cumulative: le >= value
    assert [count for _, count in lookup] == expect
    assert samples[("tiercache_server_op_seconds_count", (("op", "LOOKUP"),))] == 3
    assert samples[("tiercache_server_op_seconds_sum", (("op", "LOOKUP"),))] == pytest.approx(0.20005)
    assert [count for _, count in buckets(samples, "ALLOC")] == [0.0] * len(OP_SECONDS_BUCKETS) + [1.0]
    assert samples[("tiercache_server_op_seconds_sum", (("op", "ALLOC"),))] == 20.0
    assert [count for _, count in buckets(samples, "COMMIT")] == [0.0] * len(bounds)  # there before use
    # the other families are still there, read from the same server; every server counter among them
    assert families["tiercache_server_slots"][("tiercache_server_slots", (("state", "free"),))] == 4
    assert server.counters
    for name, value in server.counters.items():
        assert types[f"tiercache_server_{name}"] == "counter"
        assert families[f"tiercache_server_{name}"][(f"tiercache_server_{name}_total", ())] == value

    lat.observe("LOOKUP", 1e-5)  # read at scrape time: the next scrape sees it
    families, _ = await scrape(port)
    samples = families["tiercache_server_op_seconds"]
    assert samples[("tiercache_server_op_seconds_count", (("op", "LOOKUP"),))] == 4
    assert buckets(samples, "LOOKUP")[0] == (1e-5, 1.0)


@pytest.mark.asyncio
async def test_metrics_without_op_latency(server: L1Server) -> None:
    """A server without ``op_latency`` (None or absent) still gives every other family."""
    server.op_latency = None  # type: ignore[attr-defined,unused-ignore]
    registry = CollectorRegistry()
    registry.register(ServerCollector(server))
    text = generate_latest(registry).decode()
    del server.op_latency  # type: ignore[attr-defined,unused-ignore]
    assert generate_latest(registry).decode() == text
    families, _ = parse(text)
    assert "tiercache_server_op_seconds" not in families
    assert families["tiercache_server_slots"][("tiercache_server_slots", (("state", "free"),))] == 4
    assert families["tiercache_server_clients"][("tiercache_server_clients", ())] == 0


@pytest.mark.asyncio
async def test_requests_are_timed_per_op(server: L1Server) -> None:
    """serve_metrics gives the server an OpLatency; the server times each request it answers: a client's
    three STATS show up on /metrics."""
    server.op_latency = None  # type: ignore[attr-defined,unused-ignore]
    port = serve_metrics(server, "127.0.0.1", 0)
    assert isinstance(server.op_latency, OpLatency)  # type: ignore[attr-defined,unused-ignore]
    families, _ = await scrape(port)
    before = families["tiercache_server_op_seconds"]

    def client() -> None:
        conn = ServerConnection(server.options.socket_path, role="probe")
        try:
            for _ in range(3):
                conn.request(Op.STATS, {})
        finally:
            conn.close()

    await asyncio.to_thread(client)
    families, _ = await scrape(port)
    after = families["tiercache_server_op_seconds"]

    def count(samples: Samples, op: str) -> float:
        return samples.get(("tiercache_server_op_seconds_count", (("op", op),)), 0.0)

    assert count(before, "STATS") == 0
    assert count(after, "STATS") == 3
    assert count(after, "LOOKUP") == 0
    stats_sum = after[("tiercache_server_op_seconds_sum", (("op", "STATS"),))]
    assert 0 < stats_sum < 60
