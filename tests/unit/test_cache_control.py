"""Cache control on a real ``tiercache serve`` (a shared L1 of six slots and a POSIX tier) through the CLI:
a pinned prompt stays in L1 through a burst that evicts everything else, stats count it per tenant, a
prefetch brings an evicted prompt back so its next lookup hits L1, a delete removes it from L1 and L2, and
pins come back after a server restart from the L2 tier."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_engine import CHUNK, POLICY, Engine, keyspace_of, layout_of
from tiercache.cli.main import main as cli
from tiercache.server.client import SharedL1
from tiercache.server.segment import stride_of
from tiercache.store.engine import CacheEngine
from tiercache.store.manager import StorageManager
from tiercache.testing.harness.processes import ConfigServer

LAYOUT = layout_of()
SLOT_BYTES = CacheEngine.slot_bytes(LAYOUT, CHUNK)
REGION = max(stride_of(SLOT_BYTES), 4096)
SLOTS = 6


def serve(tmp: Path, sock: Path) -> ConfigServer:
    """``tiercache serve`` on ``sock``: an L1 of SLOTS slots and a file tier."""
    cfg = tmp / "server.toml"
    cfg.write_text(
        f"[l1]\ncapacity = {SLOTS * REGION}\n\n[server]\nslot_bytes = {SLOT_BYTES}\n"
        f"region_bytes = {REGION}\n\n[manager]\nl2_deadline_s = 5.0\n\n"
        f'[[tiers]]\nname = "disk"\nurl = "file://{tmp}/l2"\ncodecs = ["raw"]\n'
    )
    return ConfigServer(cfg, str(sock))


@pytest.fixture
def server(tmp_path: Path, sock_dir: Path) -> Iterator[ConfigServer]:
    with serve(tmp_path, sock_dir / "l1.sock") as srv:
        yield srv


def run_cli(*argv: str) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(["cache", *argv, "--json"]) == 0
    answer: dict[str, Any] = json.loads(out.getvalue())
    return answer


def prompt(seed: int) -> list[int]:
    return [seed * 10_000 + i for i in range(2 * CHUNK)]  # two chunks


class Node:
    """One engine on the server's shared L1 (a vLLM instance's worker, in short)."""

    def __init__(self, path: str) -> None:
        self.engine = CacheEngine(
            StorageManager(SharedL1(path), [], POLICY),  # type: ignore[arg-type]
            LAYOUT,
            keyspace_of(LAYOUT),
            chunk_size=CHUNK,
        )
        self.src = Engine.holding(LAYOUT, 2 * CHUNK, seed=1)

    def store(self, tokens: list[int]) -> int:
        return asyncio.run(self.engine.store(tokens, self.src.kv, self.src.slots(len(tokens))))

    def tiers(self, tokens: list[int]) -> tuple[str, ...]:
        """Where the lookup finds each chunk (no prefetch)."""
        return asyncio.run(self.engine.lookup_hit(tokens, prefetch=False)).tiers

    def keys(self, tokens: list[int]) -> list[str]:
        return [str(span.key) for span in self.engine.token_db.process_tokens(tokens)]

    def drain(self, path: str) -> None:
        from tiercache.server.client import ServerConnection
        from tiercache.server.protocol import Op

        conn = ServerConnection(path, role="admin")
        try:
            assert conn.request(Op.DRAIN, {"timeout_s": 10.0}, wait_s=10.0)["drained"]
        finally:
            conn.close()


def test_pin_prefetch_delete_and_stats(server: ConfigServer) -> None:
    node = Node(server.path)
    kept, other = prompt(1), prompt(2)
    assert node.store(kept) == len(kept)
    assert node.store(other) == len(other)
    node.drain(server.path)
    keys = node.keys(kept)
    answer = run_cli("pin", "--socket", server.path, "--key", keys[0], "--key", keys[1])
    assert (answer["pinned"], answer["refused"]) == (2, 0)
    stats = run_cli("stats", "--socket", server.path)
    assert stats["pins"] == 2
    assert stats["tenants"][""]["pinned"] == 2
    assert stats["tenants"][""]["objects"] == 4
    assert stats["keyspaces"] == {node.engine.token_db.key_prefix: 4}
    burst_chunks = 0
    for seed in range(3, 3 + SLOTS):  # a burst of 2 * SLOTS chunks: evicts everything unpinned
        # a store the full L1 refuses (its slots still being written behind on a loaded machine) is dropped
        burst_chunks += node.store(prompt(seed)) // CHUNK
        node.drain(server.path)
    assert burst_chunks >= 2 * (SLOTS - 2)
    assert node.tiers(kept) == ("L1", "L1")  # pinned: still in L1
    assert node.tiers(other) == ("disk", "disk")  # evicted, still on disk
    answer = run_cli(
        "prefetch", "--socket", server.path, "--key", node.keys(other)[0], "--key", node.keys(other)[1]
    )
    assert answer["in_l1"] == 2
    assert node.tiers(other) == ("L1", "L1")  # the next request's hit comes from L1
    answer = run_cli("unpin", "--socket", server.path, "--prefix", node.engine.token_db.key_prefix)
    assert answer["unpinned"] == 2
    answer = run_cli("delete", "--socket", server.path, "--key", keys[0], "--key", keys[1])
    assert answer["deleted"] == 4  # two from L1, two from the disk tier
    assert node.tiers(kept) == ()
    # the burst's prompts: some only on disk now; a keyspace delete (the connector's reset_cache in server
    # mode) removes them from L1 and disk alike: the server tracks what its tiers hold
    assert node.tiers(prompt(3 + SLOTS - 1)) == ("L1", "L1")
    assert node.tiers(prompt(3)) == ("disk", "disk")
    answer = run_cli("delete", "--socket", server.path, "--prefix", node.engine.token_db.key_prefix)
    assert answer["keys"] == 2 + burst_chunks  # other + what the burst stored
    for seed in [2, *range(3, 3 + SLOTS)]:
        assert node.tiers(prompt(seed)) == ()
    asyncio.run(node.engine.aclose())


def test_pins_survive_a_restart(tmp_path: Path, sock_dir: Path) -> None:
    sock = sock_dir / "l1.sock"
    server = serve(tmp_path, sock)
    try:
        node = Node(server.path)
        kept = prompt(1)
        node.store(kept)
        node.drain(server.path)
        assert run_cli("pin", "--socket", server.path, "--prefix", node.keys(kept)[0])["pinned"] == 1
        asyncio.run(node.engine.aclose())
    finally:
        server.stop()
    server = serve(tmp_path, sock)  # a fresh, empty shared L1: the pin file names the key, disk holds it
    try:
        deadline = time.monotonic() + 20
        while run_cli("stats", "--socket", server.path)["pins"] < 1:
            assert time.monotonic() < deadline, "the pin was not restored"
            time.sleep(0.2)
        node = Node(server.path)
        for seed in range(3, 3 + SLOTS):
            node.store(prompt(seed))
        node.drain(server.path)
        assert node.tiers(kept)[:1] == ("L1",)  # restored into L1, pinned through the burst
        asyncio.run(node.engine.aclose())
    finally:
        server.stop()


def test_cli_needs_objects_and_a_socket(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["cache", "pin"]) == 2
    assert "no server socket" in capsys.readouterr().err
    assert cli(["cache", "delete", "--socket", "/nonexistent/x.sock"]) == 2
    assert "name the objects with --key, --prefix or --salt" in capsys.readouterr().err
