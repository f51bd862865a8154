"""The server's node-wide KV event stream: a real ``tiercache serve`` with ``server.events_endpoint`` and a
POSIX tier, two engines on two connections storing the same prompt, one subscriber decoding with vLLM's
msgspec decoder: every block is announced once per medium; DESCRIBE is validated; the config key is refused
in one line when invalid."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_engine import CHUNK, POLICY, Engine, expected_kv, keyspace_of, layout_of
from tiercache.events import ForwardingSink
from tiercache.keys import BlockHashes
from tiercache.server.client import SharedL1
from tiercache.store.engine import CacheEngine
from tiercache.store.manager import StorageManager
from tiercache.testing.harness.processes import free_port

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
kv_events = pytest.importorskip("vllm.distributed.kv_events")

LAYOUT = layout_of()
SLOT_BYTES = CacheEngine.slot_bytes(LAYOUT, CHUNK)
BLOCK = LAYOUT.block_size


class EventServer:
    """``python -m tiercache serve`` with an events endpoint and a file tier (stopped by its PID)."""

    def __init__(self, tmp: Path, sock: Path, endpoint: str) -> None:
        cfg = tmp / "server.toml"
        cfg.write_text(
            f'[l1]\ncapacity = {SLOT_BYTES * 16}\n\n[server]\nevents_endpoint = "{endpoint}"\n'
            f"slot_bytes = {SLOT_BYTES}\n\n[manager]\nl2_deadline_s = 5.0\n\n"
            f'[[tiers]]\nname = "disk"\nurl = "file://{tmp}/l2"\ncodecs = ["raw"]\n'
        )
        self.path = str(sock / "l1.sock")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tiercache", "serve", "--config", str(cfg), "--socket", self.path],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp,  # not the repo root: its tiercache/ folder would shadow the installed package
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("tiercache server listening"), line + self.proc.stderr.read()  # type: ignore[union-attr]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


@pytest.fixture
def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture
def server(tmp_path: Path, sock_dir: Path, endpoint: str) -> Iterator[EventServer]:
    srv = EventServer(tmp_path, sock_dir, endpoint)
    yield srv
    srv.stop()


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


def subscribe(endpoint: str) -> Any:
    """A SUB socket on ``endpoint`` whose connection is up (the handshake done, so the subscription reaches
    the publisher before the test makes events, however loaded the machine)."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(endpoint)
    try:
        assert monitor.poll(30_000), f"no connection to {endpoint} within 30 s"
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
    time.sleep(0.1)  # the subscription frame follows the handshake on the same connection
    return sock


def receive(sock: Any, done: Callable[[list[Any]], bool], settle_s: float = 1.0) -> list[Any]:
    """Events until ``done(events)`` (at most 60 s), then ``settle_s`` more (so duplicates would show)."""
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    out: list[Any] = []
    seqs: list[int] = []
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if sock.poll(100):
            _topic, seq, payload = sock.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            out.extend(decoder.decode(payload).events)
        elif done(out):
            end = min(end, time.monotonic() + settle_s)
    assert seqs == sorted(seqs)
    return out


def test_two_engines_one_stream_each_block_once(server: EventServer, endpoint: str) -> None:
    sub = subscribe(endpoint)
    tokens = list(range(3000, 3000 + 3 * CHUNK))
    blocks = block_hashes(tokens)
    kv = expected_kv(LAYOUT, len(tokens))
    src = Engine(LAYOUT, num_blocks=128, seed=1)
    src.write(kv, 0, len(tokens))

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
