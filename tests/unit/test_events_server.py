"""The server's node-wide KV event stream: a real ``tiercache serve`` with ``server.events_endpoint`` and a
POSIX tier, two engines on two connections storing the same prompt, one subscriber decoding with vLLM's
msgspec decoder: every block is announced once per medium; DESCRIBE is validated; the config key is refused
in one line when invalid."""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_engine import CHUNK, POLICY, Engine, keyspace_of, layout_of
from tiercache.events import ForwardingSink
from tiercache.keys import BlockHashes
from tiercache.server.client import SharedL1
from tiercache.store.engine import CacheEngine
from tiercache.store.manager import StorageManager
from tiercache.testing.harness.kv_events import receive, subscribe
from tiercache.testing.harness.processes import ConfigServer, free_port

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
kv_events = pytest.importorskip("vllm.distributed.kv_events")

LAYOUT = layout_of()
SLOT_BYTES = CacheEngine.slot_bytes(LAYOUT, CHUNK)
BLOCK = LAYOUT.block_size


def event_server(tmp: Path, sock: Path, endpoint: str) -> ConfigServer:
    """``tiercache serve`` with an events endpoint and a file tier."""
    cfg = tmp / "server.toml"
    cfg.write_text(
        f'[l1]\ncapacity = {SLOT_BYTES * 16}\n\n[server]\nevents_endpoint = "{endpoint}"\n'
        f"slot_bytes = {SLOT_BYTES}\n\n[manager]\nl2_deadline_s = 5.0\n\n"
        f'[[tiers]]\nname = "disk"\nurl = "file://{tmp}/l2"\ncodecs = ["raw"]\n'
    )
    return ConfigServer(cfg, str(sock / "l1.sock"))


@pytest.fixture
def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture
def server(tmp_path: Path, sock_dir: Path, endpoint: str) -> Iterator[ConfigServer]:
    with event_server(tmp_path, sock_dir, endpoint) as srv:
        yield srv


def engine_on(path: str) -> CacheEngine:
    l1 = SharedL1(path)
    engine = CacheEngine(StorageManager(l1, [], POLICY), LAYOUT, keyspace_of(LAYOUT), chunk_size=CHUNK)  # type: ignore[arg-type]
    engine.events = ForwardingSink(l1.describe)
    return engine


def block_hashes(tokens: list[int]) -> BlockHashes:
    hashes, parent = [], b""
    for i in range(len(tokens) // BLOCK):
        parent = hashlib.sha256(parent + repr(tokens[i * BLOCK : (i + 1) * BLOCK]).encode()).digest()
        hashes.append(parent)
    return BlockHashes(hashes, BLOCK)


def test_two_engines_one_stream_each_block_once(server: ConfigServer, endpoint: str) -> None:
    sub = subscribe(endpoint)
    tokens = list(range(3000, 3000 + 3 * CHUNK))
    blocks = block_hashes(tokens)
    src = Engine.holding(LAYOUT, len(tokens), seed=1, num_blocks=128)

    async def store_twice() -> list[int]:
        stored = []
        for _ in range(2):  # two connections (two vLLM instances on the node)
            engine = engine_on(server.path)
            try:
                stored.append(await engine.store(tokens, src.kv, src.slots(len(tokens)), block_hashes=blocks))
            finally:
                await engine.aclose()
        return stored

    assert asyncio.run(store_twice()) == [len(tokens), 0]  # the second finds every chunk stored
    want = [int.from_bytes(h[-8:], "big") for h in blocks.hashes]

    def both_media(events: list[Any]) -> bool:
        stored = [e for e in events if isinstance(e, kv_events.BlockStored)]
        return all(
            sum(len(e.block_hashes) for e in stored if e.medium == m) >= len(want) for m in ("CPU", "DISK")
        )

    events = receive(sub, both_media)
    sub.close(linger=0)
    stored = [e for e in events if isinstance(e, kv_events.BlockStored)]
    for medium in ("CPU", "DISK"):
        announced = [h for e in stored if e.medium == medium for h in e.block_hashes]
        assert announced == want, medium  # every block once, in prefix order
    cpu = [e for e in stored if e.medium == "CPU"]
    assert [t for e in cpu for t in e.token_ids] == tokens
    assert cpu[0].parent_block_hash is None
    assert cpu[1].parent_block_hash == want[CHUNK // BLOCK - 1]
    assert not [e for e in events if isinstance(e, kv_events.BlockRemoved)]


def test_events_endpoint_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tiercache.config import load_config
    from tiercache.errors import ConfigError

    cfg = tmp_path / "bad.toml"
    cfg.write_text('[server]\nevents_endpoint = "http://x"\n')
    with pytest.raises(ConfigError, match=r"server\.events_endpoint must be a tcp:// or ipc:// address"):
        load_config(cfg)
    cfg.write_text('[server]\nevents_endpoint = "tcp://127.0.0.1:5557"\n')
    assert load_config(cfg).server.events_endpoint == "tcp://127.0.0.1:5557"
    monkeypatch.setitem(sys.modules, "zmq", None)  # pyzmq not installed
    with pytest.raises(
        ConfigError, match=r"server\.events_endpoint needs pyzmq: pip install 'tiercache\[events\]'"
    ):
        load_config(cfg)


def test_describe_validation() -> None:
    from tiercache.server.protocol import PROTOCOL_VERSION, Op, ProtocolError, decode, encode

    good = ["k.1", [2**64 - 1, b"\x01" * 32], None, [1, 2, 3, 4], 2, "adapter"]
    msg = decode(encode(Op.DESCRIBE, 1, 1, {"chunks": [good]}))
    assert msg.body["chunks"][0][1] == [2**64 - 1, b"\x01" * 32]
    bad = [
        ["k.1", [-1], None, [1, 2], 2, None],  # negative hash
        ["k.1", [1], None, [1, 2, 3], 2, None],  # tokens != blocks * block_size
        ["k.1", [], None, [], 2, None],  # no block
        ["", [1], None, [1, 2], 2, None],  # empty key
        ["k.1", [1], None, [1, 2], 2, 7],  # lora_name not a str
        ["k.1", [1], None, [1, 2], 2],  # short entry
    ]
    for entry in bad:
        with pytest.raises(ProtocolError):
            decode(encode(Op.DESCRIBE, 1, 1, {"chunks": [entry]}))
    assert PROTOCOL_VERSION == 2
