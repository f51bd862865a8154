"""Fuzzing: the frame parser and codec pipelines, the config loader, the vLLM connector's settings decoding.

Each target takes one input and either accepts it or raises the project's own error; anything else is a
finding. Oracles:

- ``frames``: a valid frame of a lossless pipeline (raw; shuffle+lz4; zstd; raw+aesgcm), mutated (bits
  flipped, bytes set, truncated, extended, spliced with another frame, ranges zeroed or copied), is decoded
  under its key: it either raises ``FrameError`` or yields exactly the original array's bytes. Decoding under
  another key, or with another AES key, must raise ``FrameError``. ``read_header`` on random bytes returns a
  header or raises ``FrameError``.
- ``config``: random documents built from the schema's own keys (with wrong types, unknown keys, bad sizes,
  bad codec chains, ``${VAR}`` references) and byte-mutated valid TOML files go through ``config_from_dict``
  (after ``tomllib``, as ``load_config`` does): a ``Config`` or ``ConfigError`` (a TOML syntax error is
  ``load_config``'s ConfigError). An accepted document round-trips the values it was given.
- ``protocol``: the server's wire messages (``tiercache.server.protocol``): valid requests of every op,
  byte-mutated, plus random msgpack documents of the message's shape, go through ``decode`` (request and
  reply side): a ``Message`` or ``ProtocolError``, nothing else; an accepted request re-encodes to a message
  that decodes to the same ``Message`` (what the server acts on is exactly what was sent).
- ``connector``: random ``kv_connector_extra_config`` dicts go through ``ConnectorSettings.from_extra``
  (``ValueError`` naming the key, or settings holding exactly the given values), and ``slot_mapping`` with
  random block tables is checked against a direct formula.

Inputs come from a seeded ``random.Random`` (deterministic, about 10-100x faster than hypothesis's
generation, so the long run reaches 1 M inputs per target in minutes); ``tests/unit/test_fuzz_*.py`` run the
same targets under hypothesis for a few seconds each, plus a short run of this loop.

- ``live`` (:func:`run_live`): a real ``python -m tiercache.server`` (1 GiB segment, 16 regions) serves two
  legitimate client processes (``SharedL1``) that store batches of byte-patterned objects and read them back,
  comparing every byte, for ``--live-s`` seconds alone, then as long again beside one fuzzer process
  (:class:`ServerFuzzer`: garbage, mutated and oversized messages, valid HELLOs then ALLOCs never committed,
  connections dropped mid-request or held open, pins, wrong epochs, random FENCEs, junk fds; it writes into
  the slots it reserved, so a slot handed out too early shows up as wrong bytes). Per client: the fraction
  of its stores that succeeded beside the fuzzer over the fraction alone; the server's RSS and fds before,
  during and after, its log bytes, whether it stayed alive and got back everything the fuzzer held once it
  exited. One run per ``--live-share`` (the server's ``--max-share``: what one client process may hold).

Run: ``python benchmarks/fuzz.py --inputs 1000000 --out benchmarks/results/fuzz_cpu.json`` (``make fuzz``;
``--targets '' --live-s 10`` for the live run alone).
"""

from __future__ import annotations

import argparse
import array
import contextlib
import hashlib
import json
import mmap
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiercache.config import Config, config_from_dict
from tiercache.errors import ConfigError, FrameError
from tiercache.serde import CodecPipeline, build_pipeline, read_header
from tiercache.serde.aesgcm import AesGcmCodec
from tiercache.spec import KVFormat, KVSpec
from tiercache.testing.harness.processes import NodeServer, socket_dir

__all__ = ["TARGETS", "ConfigFuzz", "ConnectorFuzz", "FrameFuzz", "run_target"]

KEY = "tc1.fuzz.0123456789abcdef"
OTHER_KEY = "tc1.fuzz.fedcba9876543210"
AES_KEY = bytes(range(32))
OTHER_AES_KEY = bytes(range(1, 33))


# ----- frames ------------------------------------------------------------------------------------------
def _pipelines() -> dict[str, CodecPipeline]:
    return {
        "raw": build_pipeline(["raw"]),
        "shuffle+lz4": build_pipeline(["raw", "shuffle", "lz4"]),
        "zstd": build_pipeline(["raw", "zstd"]),
        "raw+aesgcm": build_pipeline(["raw", AesGcmCodec(AES_KEY)]),
    }


def _array(spec: KVSpec, seed: int) -> bytes:
    """``spec.nbytes`` bytes with some structure (repeats compress, noise does not)."""
    rng = random.Random(seed)
    half = spec.nbytes // 2
    return bytes(rng.randrange(4) for _ in range(half)) + rng.randbytes(spec.nbytes - half)


class FrameFuzz:
    """Valid frames of each lossless pipeline and the mutations applied to them."""

    def __init__(self) -> None:
        self.pipelines = _pipelines()
        self.other_aes = build_pipeline(["raw", AesGcmCodec(OTHER_AES_KEY)])
        specs = [
            KVSpec(2, 2, 8, "bfloat16", KVFormat.KV_2LTD, tokens=4),
            KVSpec(4, 1, 16, "float16", KVFormat.KV_2LTD, tokens=3, layer_start=2, layer_end=3),
        ]
        self.cases: list[tuple[str, KVSpec, bytes, bytes]] = []  # pipeline, spec, array, frame
        for name, pipe in self.pipelines.items():
            for i, spec in enumerate(specs):
                array = _array(spec, i)
                frame = bytes(pipe.encode(bytearray(array), spec, KEY))
                self.cases.append((name, spec, array, frame))

    def mutate(self, rng: random.Random, frame: bytes) -> bytes:
        """1-4 mutations; header bytes (the first 96) are picked more often than payload bytes."""
        data = bytearray(frame)
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(9)
            n = len(data)
            pos = rng.randrange(min(n, 96)) if n and rng.random() < 0.6 else (rng.randrange(n) if n else 0)
            if op == 0 and n:
                data[pos] ^= 1 << rng.randrange(8)
            elif op == 1 and n:
                data[pos] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
            elif op == 2:
                del data[rng.randrange(n + 1) :]
            elif op == 3:
                data += rng.randbytes(rng.randint(1, 16))
            elif op == 4:
                other = rng.choice(self.cases)[3]
                cut = rng.randrange(min(len(other), n) + 1)
                data = data[:cut] + bytearray(other[cut:])
            elif op == 5 and n:
                end = min(n, pos + rng.randint(1, 8))
                data[pos:end] = bytes(end - pos)
            elif op == 6 and n > 2:
                src, length = rng.randrange(n), rng.randint(1, 8)
                chunk = data[src : src + length]
                data[pos : pos + len(chunk)] = chunk
            elif op == 7 and n:
                del data[pos : pos + rng.randint(1, 4)]
            elif op == 8:
                data[pos:pos] = rng.randbytes(rng.randint(1, 4))
        return bytes(data)

    def check_frame(self, case: int, data: bytes) -> str:
        """Decode ``data`` (a mutation of case ``case``'s frame); 'rejected' or 'same'; AssertionError if
        it decodes to anything but the original array."""
        name, spec, array, _ = self.cases[case]
        out = bytearray(spec.nbytes)
        try:
            self.pipelines[name].decode_into(data, KEY, out)
        except FrameError:
            return "rejected"
        assert bytes(out) == array, f"{name}: a mutated frame decoded to other bytes"
        return "same"

    def check_isolation(self, case: int) -> None:
        """The original frame never decodes under another object key, nor under another AES key."""
        name, spec, _, frame = self.cases[case]
        out = bytearray(spec.nbytes)
        for pipe, key in ((self.pipelines[name], OTHER_KEY), (self.other_aes, KEY)):
            if pipe is self.other_aes and name != "raw+aesgcm":
                continue
            try:
                pipe.decode_into(frame, key, out)
            except FrameError:
                continue
            raise AssertionError(f"{name}: a frame decoded under another key/AES key")

    def check_header(self, data: bytes) -> str:
        try:
            read_header(data)
        except FrameError:
            return "rejected"
        return "header"

    def one(self, rng: random.Random) -> str:
        roll = rng.random()
        if roll < 0.1:
            return self.check_header(rng.randbytes(rng.randrange(128)))
        case = rng.randrange(len(self.cases))
        if roll < 0.11:
            self.check_isolation(case)
            return "isolated"
        frame = self.cases[case][3]
        data = self.mutate(rng, frame)
        outcome = self.check_frame(case, data)
        return "unchanged" if data == frame else outcome  # "same": a changed frame decoded to the original


# ----- config ------------------------------------------------------------------------------------------
_VALID_TOML = """\
chunk_size = 256
save_unfull_chunk = true
cache_salt_env = "TENANT_SALT"

[l1]
capacity = "2GiB"
pinned = false

[manager]
l2_deadline_s = 2.0
lookup_deadline_s = 0.5
store_queue_size = 64
circuit_failures = 5
circuit_cooldown_s = 10.0

[[tiers]]
name = "disk"
url = "file:///tmp/tiercache-fuzz"
capacity = "4GiB"
codecs = ["raw", "zstd"]

[[tiers]]
name = "redis"
url = "redis://127.0.0.1:6379/0"
codecs = ["raw", {id = "aesgcm", key_env = "TC_KEY"}]
options = { password_env = "REDIS_PASSWORD" }
"""

_SCHEMA: dict[str, Any] = {
    "chunk_size": [256, 16, 0, -1, 1.5, "256", True, None],
    "save_unfull_chunk": [True, False, 1, "yes"],
    "cache_salt_env": ["SALT", "", 3, "${HOME}"],
    "l1": {"capacity": ["1GiB", "12MB", 1 << 20, -5, "lots", "1.5GiB", "0", 0], "pinned": [True, None, "x"]},
    "manager": {
        "l2_deadline_s": [2.0, 0, -1, "2", float("nan"), float("inf")],
        "lookup_deadline_s": [0.5, 1, -0.5],
        "store_queue_size": [1, 0, -3, 2.5, 256],
        "circuit_failures": [5, 0, "five"],
        "circuit_cooldown_s": [10.0, -1.0],
    },
}
_TIER_VALUES: dict[str, list[Any]] = {
    "name": ["disk", "redis", "", "a b", "L1", 7, "x" * 300],
    "url": [
        "file:///tmp/x",
        "redis://h:1/0",
        "s3://bucket/p",
        "nope://x",
        "",
        "file://rel",
        5,
        "redis://user:pw@h/0",
        "file:///${HOME}/x",
        "${UNSET_TIERCACHE_FUZZ}",
    ],
    "capacity": ["1GiB", -1, "x", 10, None],
    "codecs": [
        ["raw"],
        ["raw", "zstd"],
        ["zstd"],
        ["raw", "aesgcm", "zstd"],
        "raw",
        [],
        [{"id": "zstd", "level": 3}],
        [{"level": 3}],
        ["raw", {"id": "aesgcm", "key": "00"}],
        ["fp8", "lz4"],
        [7],
    ],
    "options": [{}, {"threads": 4}, {"password_env": "P"}, {"password": "hunter2"}, [], "x"],
    "adapter": [None, "mod:Cls", 3, "nocolon"],
}


class ConfigFuzz:
    """Random config documents from the schema, and byte-mutated TOML, through the loader."""

    def random_value(self, rng: random.Random) -> Any:
        return rng.choice([0, -1, 1.5, "", "x", True, None, [], {}, [1, "a"], {"k": 1}, 10**30])

    def random_doc(self, rng: random.Random) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        for key, values in _SCHEMA.items():
            if rng.random() < 0.5:
                continue
            if isinstance(values, dict):
                doc[key] = {k: rng.choice(v) for k, v in values.items() if rng.random() < 0.6}
                if rng.random() < 0.05:
                    doc[key] = self.random_value(rng)
            else:
                doc[key] = rng.choice(values)
        if rng.random() < 0.8:
            doc["tiers"] = [
                {
                    k: rng.choice(v)
                    for k, v in _TIER_VALUES.items()
                    if rng.random() < (0.9 if k in ("name", "url") else 0.3)
                }
                for _ in range(rng.randint(0, 3))
            ]
            if rng.random() < 0.05:
                doc["tiers"] = self.random_value(rng)
        if rng.random() < 0.1:
            doc[rng.choice(["extra", "tier", "L1", "chunk"])] = self.random_value(rng)
        return doc

    def check_doc(self, doc: Any) -> str:
        try:
            config = config_from_dict(doc, "<fuzz>")
        except ConfigError:
            return "rejected"
        assert isinstance(config, Config)
        if isinstance(doc.get("chunk_size"), int):
            assert config.chunk_size == doc["chunk_size"]
        given = doc.get("tiers") or []
        assert [t.name for t in config.tiers] == [t["name"] for t in given]
        return "accepted"

    def check_text(self, text: bytes) -> str:
        try:
            doc = tomllib.loads(text.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            return "toml_error"
        return self.check_doc(doc)

    def one(self, rng: random.Random) -> str:
        if rng.random() < 0.7:
            return self.check_doc(self.random_doc(rng))
        data = bytearray(_VALID_TOML.encode())
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(len(data))
            op = rng.randrange(3)
            if op == 0:
                data[pos] = rng.choice(b'"=[]{},.0123456789-abcxyz \n#$')
            elif op == 1:
                del data[pos : pos + rng.randint(1, 6)]
            else:
                data[pos:pos] = rng.choice([b"1", b'"', b"x", b"GiB", b"-", b"\n[l1]\n", b"\xff"])
        return self.check_text(bytes(data))


# ----- server protocol ----------------------------------------------------------------------------------
class ProtocolFuzz:
    """Valid requests of every op, mutated, and random documents of the message's shape, through decode."""

    def __init__(self) -> None:
        from tiercache.server import protocol

        self.p = protocol
        op = protocol.Op
        meta = protocol.spec_meta(KVSpec(2, 2, 8, "bfloat16", KVFormat.KV_2LTD, tokens=4))
        bodies: list[tuple[Any, dict[str, Any]]] = [
            (op.HELLO, {"role": "worker"}),
            (op.HELLO, {"role": "scheduler", "slot_bytes": [4096, 1 << 20], "fence": [bytes(16), b"s" * 16]}),
            (op.FENCE, {"sessions": [b"t" * 16]}),
            (op.LOOKUP, {"keys": ["a", "b" * 40], "pin": True, "prefix": True, "l2": True, "wait_s": 1.5}),
            (op.ALLOC, {"keys": ["k1", "k2"], "nbytes": [4096, 17], "meta": [meta, meta]}),
            (op.COMMIT, {"slots": [[3, 7], [0, 1]]}),
            (op.ABORT, {"slots": [[9, 2]]}),
            (op.RELEASE, {"leases": [1, 2, 3]}),
            (op.END, {}),
            (op.STATS, {}),
            (op.CLEAR, {}),
            (op.DRAIN, {"timeout_s": 5.0}),
        ]
        self.valid = [protocol.encode(o, 3, i + 1, b) for i, (o, b) in enumerate(bodies)]
        self.frames = FrameFuzz.__new__(FrameFuzz)  # its byte mutations, over these messages
        self.frames.cases = [
            ("", KVSpec(1, 1, 1, "float16", KVFormat.KV_2LTD, tokens=1), b"", m) for m in self.valid
        ]

    def random_value(self, rng: random.Random, depth: int = 0) -> Any:
        pick = rng.randrange(10 if depth < 2 else 7)
        if pick == 0:
            return rng.choice((0, 1, -1, 2**63, 2**64 - 1, rng.randrange(1 << 20)))
        if pick == 1:
            return rng.choice(("", "worker", "admin", "k" * rng.randrange(600)))
        if pick == 2:
            return rng.randbytes(rng.choice((16, rng.randrange(300))))  # 16: a session token's length
        if pick == 3:
            return rng.choice((True, False, None))
        if pick == 4:
            return rng.choice((0.0, -1.0, 1e9, float("inf"), float("nan"), 2.5))
        if pick == 5:
            return [rng.randrange(1 << 16), rng.randrange(1 << 16)]
        if pick == 6:
            return rng.choice(list(self.p.Op)).value
        if pick == 7:
            return [self.random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
        keys = ["keys", "pin", "prefix", "l2", "prefetch", "wait_s", "nbytes", "meta", "slots", "leases"]
        keys += ["role", "timeout_s", "slot_bytes", "fence", "sessions", "x"]
        return {rng.choice(keys): self.random_value(rng, depth + 1) for _ in range(rng.randrange(5))}

    def random_message(self, rng: random.Random) -> bytes:
        """``[version, epoch, op, req_id, body]`` with a map body of schema keys, some fields replaced."""
        import msgpack

        body = self.random_value(rng, 1) if rng.random() < 0.8 else None
        if not isinstance(body, dict):
            body = {"keys": self.random_value(rng, 1)}
        version = self.p.PROTOCOL_VERSION
        fields = [
            version,
            rng.randrange(1 << 8),
            rng.choice(list(self.p.Op)).value,
            rng.randrange(1 << 16),
            body,
        ]
        for i in rng.sample(range(5), rng.choice((0, 0, 1, 2))):
            fields[i] = self.random_value(rng)
        if rng.random() < 0.05:
            fields = fields[: rng.randrange(5)]
        return bytes(msgpack.packb(fields))

    def check(self, data: bytes, request: bool) -> str:
        try:
            msg = self.p.decode(data, request=request)
        except self.p.ProtocolError:
            return "rejected"
        wire = self.p.encode(msg.op, msg.epoch, msg.req_id, msg.body)
        again = self.p.decode(wire, request=request)  # bytes compared: a reply body may hold NaN
        assert self.p.encode(again.op, again.epoch, again.req_id, again.body) == wire, f"{msg!r} changed"
        return "accepted"

    def one(self, rng: random.Random) -> str:
        request = rng.random() < 0.9
        if rng.random() < 0.5:
            return self.check(self.frames.mutate(rng, rng.choice(self.valid)), request)
        return self.check(self.random_message(rng), request)


# ----- vLLM connector -----------------------------------------------------------------------------------
class ConnectorFuzz:
    """``kv_connector_extra_config`` decoding and the worker's slot mapping."""

    def __init__(self) -> None:
        from tiercache_vllm._common import _EXTRA_KEYS, ConnectorSettings, slot_mapping

        self.keys = sorted(_EXTRA_KEYS)
        self.settings = ConnectorSettings
        self.slot_mapping = slot_mapping

    def random_extra(self, rng: random.Random) -> dict[Any, Any]:
        values = [True, False, 0, 1, -1, 2.5, float("nan"), "x", "/tmp/c.toml", None, [], {}, b"b", 10**20]
        extra: dict[Any, Any] = {k: rng.choice(values) for k in self.keys if rng.random() < 0.4}
        if rng.random() < 0.1:
            extra[rng.choice(["configs", "Config", "", 3, "load-async"])] = rng.choice(values)
        return extra

    def check_extra(self, extra: dict[Any, Any]) -> str:
        try:
            settings = self.settings.from_extra(extra)
        except ValueError:
            return "rejected"
        for key, value in extra.items():
            got = getattr(settings, key)
            if key in ("config", "keyspace_file") and value:  # relative paths: against the working directory
                value = os.path.abspath(value)
            if isinstance(got, float) and type(value) is int:  # numbers of float options are kept as floats
                value = float(value)
            assert got == value or (got != got and value != value), f"{key}: {value!r} became {got!r}"
            assert type(got) is type(value) or isinstance(got, float), f"{key}: type {type(got)}"
        return "accepted"

    def check_slots(self, block_ids: list[int], num_tokens: int, block_size: int) -> str:
        slots = self.slot_mapping(block_ids, num_tokens, block_size).tolist()
        expected = [
            block_ids[t // block_size] * block_size + t % block_size
            if t // block_size < len(block_ids)
            else -1
            for t in range(num_tokens)
        ]
        assert slots == expected, "slot_mapping differs from the formula"
        return "slots"

    def one(self, rng: random.Random) -> str:
        if rng.random() < 0.9:
            return self.check_extra(self.random_extra(rng))
        size = rng.choice((1, 16, 32))
        blocks = [rng.randrange(1 << 20) for _ in range(rng.randrange(8))]
        return self.check_slots(blocks, rng.randrange(8 * size + 3), size)


# ----- live server: one fuzzer process beside two legitimate clients -------------------------------------
LIVE_SPEC = KVSpec(4, 2, 64, "float16", KVFormat.KV_2LTD, tokens=64)
"""The legitimate clients' objects: 128 KiB at 64 tokens (:func:`run_live` picks the tokens)."""


def _pattern(key: str, n: int) -> Any:
    """``n`` bytes that only ``key`` has at these offsets (a slot read at another key or offset differs)."""
    import numpy as np

    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    i = np.arange(n, dtype=np.uint64)
    return ((i * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)) >> np.uint64(40)).astype(np.uint8)


def _legit_client(cfg: dict[str, Any]) -> dict[str, Any]:
    """A legitimate client (``SharedL1``): batches of new keys stored, each read back at once, plus earlier
    keys; every byte read is compared with the key's pattern. Counts per store outcome."""
    import numpy as np

    from tiercache.server.client import SharedL1
    from tiercache.store.l1 import ObjectState

    spec = LIVE_SPEC.with_tokens(cfg["tokens"])
    n, batch = spec.nbytes, cfg["batch"]
    rng = random.Random(cfg["seed"])
    l1 = SharedL1(cfg["socket"], slot_bytes=[n], timeout_s=cfg["timeout_s"])
    connected = l1.wait_connected(10.0)
    out: Counter[str] = Counter()
    recent: list[str] = []
    steps: list[float] = []
    deadline = time.monotonic() + cfg["seconds"]
    i = 0
    while time.monotonic() < deadline:
        keys = [f"{cfg['name']}/{i + j}" for j in range(batch)]
        i += batch
        started = time.perf_counter()
        skipped = l1.skipped_stores
        objs = l1.batched_reserve_write(keys, [spec] * batch)
        offline = l1.skipped_stores - skipped
        writing = []
        for key, obj in zip(keys, objs, strict=True):
            if obj is not None:
                np.frombuffer(obj.buffer(), np.uint8)[:] = _pattern(key, n)
                writing.append(obj)
        if writing:
            l1.batched_finish_write(writing)
        stored = [obj.key for obj in writing if obj.state is ObjectState.READY]
        out["stores"] += batch
        out["stored"] += len(stored)
        out["offline"] += offline
        out["no_room"] += batch - len(writing) - offline
        out["commit_failed"] += len(writing) - len(stored)
        reads = stored + rng.sample(recent, min(len(recent), batch))
        leases = l1.batched_acquire(reads)
        for key, lease in zip(reads, leases, strict=True):
            out["reads"] += 1
            if lease is None:
                continue
            got = np.frombuffer(lease.obj.buffer(), np.uint8)
            wrong = int(np.count_nonzero(got != _pattern(key, n)))
            del got
            out["hits"] += 1
            out["read_bytes"] += n
            if wrong:
                out["wrong_bytes"] += wrong
                out["wrong_objects"] += 1
        l1.batched_release([lease for lease in leases if lease is not None])
        recent.extend(stored)
        del recent[:-512]
        steps.append(time.perf_counter() - started)
    out["lost_connections"] = l1.lost_connections
    out["refused_leases"] = l1.refused_leases
    l1.close()
    steps.sort()
    return {
        "name": cfg["name"],
        "connected": connected,
        **dict(out),
        "steps": len(steps),
        "step_ms_p50": round(1e3 * steps[len(steps) // 2], 2) if steps else None,
        "step_ms_p99": round(1e3 * steps[int(len(steps) * 0.99)], 2) if steps else None,
    }


class _FuzzPeer:
    """One raw SEQPACKET connection of the fuzzer (requests are built and sent by hand)."""

    serial = 0

    def __init__(self, path: str, timeout_s: float) -> None:
        _FuzzPeer.serial += 1
        self.id = _FuzzPeer.serial
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)
        self.epoch = 0
        self.session = b""
        self.req = 0
        self.alive = True
        self.leases: list[int] = []

    def send(self, data: bytes, fds: list[int] | None = None) -> bool:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        try:
            self.sock.sendmsg([data], anc)
            return True
        except OSError:
            self.alive = False
            return False

    def recv(self) -> tuple[bytes, list[int]]:
        """One reply and the fds passed with it (b"" on EOF, timeout or error: the peer is then dead)."""
        try:
            data, anc, _, _ = self.sock.recvmsg(1 << 18, socket.CMSG_SPACE(2 * 4))
        except OSError:
            self.alive = False
            return b"", []
        fds = [
            fd
            for lvl, typ, raw in anc
            if lvl == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS
            for fd in array.array("i", raw[: len(raw) - len(raw) % 4])
        ]
        if not data:
            self.alive = False
        return data, fds

    def ask(self, op: Any, body: dict[str, Any], epoch: int | None = None) -> tuple[str, Any]:
        """("ok", body), ("err", code) or ("dead", None)."""
        from tiercache.server.protocol import Op, ProtocolError, decode, encode

        self.req += 1
        if not self.send(encode(op, self.epoch if epoch is None else epoch, self.req, body)):
            return "dead", None
        data, fds = self.recv()
        for fd in fds:
            os.close(fd)
        if not data:
            return "dead", None
        try:
            msg = decode(data, request=False)
        except ProtocolError:
            return "dead", None
        if msg.op is Op.ERR:
            if msg.body.get("code") == "protocol":
                self.alive = False
            return "err", msg.body.get("code")
        return "ok", msg.body

    def close(self) -> None:
        self.alive = False
        self.sock.close()


class ServerFuzzer:
    """A hostile client process: garbage, mutated and oversized messages, valid HELLOs then ALLOCs never
    committed, pins held, wrong epochs, FENCEs of random tokens, requests dropped before their answer,
    connections held open with and without a HELLO. It writes into the slots it reserved and never settled
    (allowed: its writes may land until it exits), so a slot handed to another client too early shows up as
    wrong bytes there."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.path = cfg["socket"]
        self.rng = random.Random(cfg["seed"])
        self.protocol = ProtocolFuzz()
        self.p = self.protocol.p
        self.held: list[_FuzzPeer] = []
        self.idle: list[Any] = []  # connections that never sent anything
        # peer id -> {(slot, generation): (offset, nbytes)} reserved on that connection and never settled
        self.writable: dict[int, dict[tuple[int, int], tuple[int, int]]] = {}
        self.data: mmap.mmap | None = None
        self.ink = memoryview(bytes([0xE5]) * (1 << 20))
        self.max_object = 1 << 20
        self.legit = int(cfg["legit_nbytes"])
        self.keys: list[str] = []
        self.out: Counter[str] = Counter()
        self.errors: list[str] = []
        self.stop = False

    # -- connections
    def peer(self) -> _FuzzPeer | None:
        try:
            return _FuzzPeer(self.path, self.cfg["timeout_s"])
        except OSError:
            self.out["connect_failed"] += 1
            return None

    def hello(self, peer: _FuzzPeer, role: str = "worker") -> bool:
        """A valid HELLO (some sizes declared, random fences, random fds passed along); maps the segment."""
        rng = self.rng
        body: dict[str, Any] = {"role": role}
        if rng.random() < 0.3:
            sizes = [self.size() for _ in range(rng.randrange(1, 17))]
            body["slot_bytes"] = sorted(sizes) if rng.random() < 0.5 else sizes  # ascending: new classes
        if rng.random() < 0.2:
            body["fence"] = [rng.randbytes(16) for _ in range(rng.randrange(1, 65))]
        fds: list[int] = []
        if rng.random() < 0.2:  # junk fds beside (or instead of) a pidfd: the server closes them
            r, w = os.pipe()
            fds = [r, w] + ([os.pidfd_open(os.getpid())] if rng.random() < 0.5 else [])
        ok = peer.send(self.p.encode(self.p.Op.HELLO, 0, 0, body), fds)
        for fd in fds:
            os.close(fd)
        if not ok:
            return False
        data, got = peer.recv()
        try:
            msg = self.p.decode(data, request=False) if data else None
        except self.p.ProtocolError:
            msg = None
        if msg is None or msg.op is not self.p.Op.OK:
            for fd in got:
                os.close(fd)
            return False
        peer.epoch, peer.session = msg.body["epoch"], msg.body["session"]
        self.max_object = msg.body["max_object"]
        if self.data is None and got:
            region, regions = msg.body["geometry"]
            self.data = mmap.mmap(got[0], region * regions)
        for fd in got:
            os.close(fd)
        self.out["hellos"] += 1
        return True

    def drop(self, peer: _FuzzPeer) -> None:
        """Close ``peer``: its unsettled reservations stay this process's to write until it exits."""
        peer.close()
        if peer in self.held:
            self.held.remove(peer)

    # -- requests
    def size(self) -> int:
        rng, roll = self.rng, self.rng.random()
        if roll < 0.3:
            return self.legit
        if roll < 0.5:
            return rng.randrange(1, 8193)
        if roll < 0.8:
            return rng.randrange(1, self.max_object + 1)
        return rng.choice((0, self.max_object, self.max_object + 1, 2**63 - 1))

    def key(self) -> str:
        if self.keys and self.rng.random() < 0.1:
            return self.rng.choice(self.keys)
        key = f"fz{self.rng.randrange(1 << 40):x}"
        self.keys.append(key)
        del self.keys[:-256]
        return key

    def alloc(self, peer: _FuzzPeer, epoch: int | None = None) -> list[list[int]]:
        """ALLOC 1-32 keys of random sizes; the reserved refs (scribbled on at once, sometimes)."""
        rng = self.rng
        k = rng.randrange(1, 33)
        if rng.random() < 0.2:  # one object of each of k ascending sizes: one class (and region) each
            sizes = sorted(rng.randrange(self.legit, self.max_object + 1) for _ in range(k))
        else:
            sizes = [self.size() for _ in range(k)]
        meta = [self.p.spec_meta(LIVE_SPEC) if rng.random() < 0.5 else rng.randbytes(40) for _ in range(k)]
        body = {
            "keys": [self.key() for _ in range(k)],
            "nbytes": sizes,
            "meta": meta,
        }
        status, reply = peer.ask(self.p.Op.ALLOC, body, epoch)
        self.out[f"alloc_{status}"] += 1
        if status != "ok":
            return []
        refs = []
        for ref, n in zip(reply["slots"], sizes, strict=True):
            if isinstance(ref, list):
                refs.append(ref)
                self.writable.setdefault(peer.id, {})[ref[0], ref[1]] = (ref[2], n)
                self.out["reserved"] += 1
            else:
                self.out[f"alloc_{ref}"] += 1
        self.scribble(4)
        return refs

    def settle(self, peer: _FuzzPeer, refs: list[list[int]], op: Any, label: str = "") -> None:
        """COMMIT or ABORT ``refs``; those the server settled are no longer this process's to write."""
        status, reply = peer.ask(op, {"slots": [[r[0], r[1]] for r in refs]})
        self.out[f"{label}{op.name.lower()}_{status}"] += 1
        if status == "ok":
            mine = self.writable.get(peer.id, {})
            for ref, ok in zip(refs, reply["ok"], strict=True):
                if ok:
                    mine.pop((ref[0], ref[1]), None)

    def scribble(self, count: int) -> None:
        """Write into slots this process reserved and never settled (allowed until it exits)."""
        if self.data is None or not self.writable:
            return
        for _ in range(count):
            slots = self.writable[self.rng.choice(list(self.writable))]
            if not slots:
                continue
            offset, n = self.rng.choice(list(slots.values()))
            n = min(n, self.max_object, len(self.data) - offset)
            if n <= 0:
                continue
            if n > len(self.ink):  # a window of a large slot; over many writes every part gets one
                offset += self.rng.randrange(n - len(self.ink) + 1)
                n = len(self.ink)
            self.data[offset : offset + n] = self.ink[:n]
            self.out["scribbles"] += 1

    # -- actions
    def garbage(self) -> None:
        """A fresh connection (sometimes after a valid HELLO and reservations) gets garbage, a mutated or a
        random message; the answer is read or not."""
        peer = self.peer()
        if peer is None:
            return
        rng = self.rng
        if rng.random() < 0.5 and self.hello(peer) and rng.random() < 0.5:
            self.alloc(peer)
        roll = rng.random()
        if roll < 0.3:
            data = rng.randbytes(rng.randrange(1, 300))
        elif roll < 0.65:
            data = self.protocol.frames.mutate(rng, rng.choice(self.protocol.valid))
        else:
            data = self.protocol.random_message(rng)
        peer.send(data)
        if rng.random() < 0.7:
            peer.recv()
        self.out["garbage"] += 1
        self.drop(peer)

    def oversized(self) -> None:
        """More than one message may hold: a long datagram, too many keys, too long keys."""
        peer = self.peer()
        if peer is None:
            return
        rng = self.rng
        if rng.random() < 0.5:
            self.hello(peer)
        roll = rng.random()
        if roll < 0.4:
            data = rng.randbytes(self.p.MAX_MESSAGE + rng.randrange(1, 60_000))
        else:
            import msgpack

            n = self.p.MAX_KEYS + 1 if roll < 0.7 else 8
            key = "k" * (self.p.MAX_KEY_LEN + 1 if roll >= 0.7 else 8)
            body = {"keys": [key] * n, "nbytes": [self.legit] * n, "meta": [b""] * n}
            data = msgpack.packb([self.p.PROTOCOL_VERSION, peer.epoch, 3, 1, body], use_bin_type=True)
        peer.send(data)
        peer.recv()
        self.out["oversized"] += 1
        self.drop(peer)

    def reserve_and_drop(self) -> None:
        """HELLO, reservations never committed, then the connection goes: closed, with a request in flight,
        after a protocol error, or after a half close."""
        peer = self.peer()
        if peer is None:
            return
        rng = self.rng
        if not self.hello(peer):
            self.drop(peer)
            return
        for _ in range(rng.randrange(1, 4)):
            self.alloc(peer)
        roll = rng.random()
        if roll < 0.3:  # a request whose answer is never read
            body = {"keys": [self.key() for _ in range(8)], "nbytes": [self.legit] * 8, "meta": [b"m"] * 8}
            peer.send(self.p.encode(self.p.Op.ALLOC, peer.epoch, 99, body))
            self.out["dropped_mid_request"] += 1
        elif roll < 0.5:
            peer.send(b"\xc1")
            peer.recv()
        elif roll < 0.6:
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_WR)
            peer.recv()
        self.out["reserve_and_drop"] += 1
        self.drop(peer)

    def on_held(self) -> None:
        """One request on a connection kept open (opened when fewer than ``held`` are)."""
        rng = self.rng
        if len(self.held) < self.cfg["held"] and (not self.held or rng.random() < 0.2):
            peer = self.peer()
            if peer is None:
                return
            if self.hello(peer, rng.choice(("worker", "worker", "scheduler", "probe"))):
                self.held.append(peer)
            else:
                self.drop(peer)
            return
        if not self.held:
            return
        peer = rng.choice(self.held)
        op = self.p.Op
        roll = rng.random()
        if roll < 0.3:
            refs = self.alloc(peer)
            if refs and rng.random() < 0.5:
                self.settle(peer, refs, op.COMMIT if rng.random() < 0.8 else op.ABORT)
        elif roll < 0.45 and self.keys:  # pins held
            status, reply = peer.ask(op.LOOKUP, {"keys": self.keys[-64:], "pin": True, "prefix": False})
            self.out[f"pin_{status}"] += 1
            if status == "ok":
                peer.leases += [h[4] for h in reply["hits"] if h is not None and h[4]]
        elif roll < 0.55:  # a stale or a future epoch
            epoch = rng.choice((0, peer.epoch + 1, peer.epoch - 1 if peer.epoch else 5, 2**63 - 1))
            self.alloc(peer, epoch=epoch)
        elif roll < 0.62:
            status, _ = peer.ask(
                op.FENCE, {"sessions": [rng.randbytes(16) for _ in range(rng.randrange(65))]}
            )
            self.out[f"fence_{status}"] += 1
        elif roll < 0.67:  # another held connection of this process, with nothing left to write, ended
            victims = [p for p in self.held if p is not peer and not self.writable.get(p.id)]
            if victims:
                victim = rng.choice(victims)
                status, _ = peer.ask(op.FENCE, {"sessions": [victim.session]})
                self.out[f"fence_own_{status}"] += 1
                self.drop(victim)
        elif roll < 0.75:  # refs and leases that are not (or no longer) this connection's
            refs = [[rng.randrange(1 << 12), rng.randrange(4)] for _ in range(rng.randrange(1, 16))]
            self.settle(peer, refs, rng.choice((op.COMMIT, op.ABORT)), "foreign_")
            status, _ = peer.ask(op.RELEASE, {"leases": [rng.randrange(1 << 16) for _ in range(8)]})
            self.out[f"foreign_release_{status}"] += 1
        elif roll < 0.8:
            which = rng.choice((op.CLEAR, op.DRAIN, op.STATS, op.END))
            body: dict[str, Any] = {"timeout_s": 0.0} if which is op.DRAIN else {}
            status, _ = peer.ask(which, body)
            self.out[f"{which.name.lower()}_{status}"] += 1
            if which is op.END:
                peer.leases = []
        elif roll < 0.85:  # a second HELLO is a protocol error: the connection goes, reservations orphaned
            self.hello(peer)
            self.out["second_hello"] += 1
        elif roll < 0.9:
            self.out["closed_held"] += 1
            self.drop(peer)
        else:
            lookup = {"keys": [self.key() for _ in range(16)], "pin": rng.random() < 0.5, "prefix": True}
            lookup.update(l2=True, prefetch=True, wait_s=rng.choice((0.0, 1.5)))
            status, _ = peer.ask(op.LOOKUP, lookup)
            self.out[f"lookup_{status}"] += 1
        if not peer.alive:
            self.drop(peer)

    def idle_connection(self) -> None:
        """A connection that never says anything, kept open (at most ``idle`` of them)."""
        if len(self.idle) >= self.cfg["idle"]:
            self.idle.pop(self.rng.randrange(len(self.idle))).close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            return
        self.idle.append(sock)
        self.out["idle"] += 1

    def run(self) -> dict[str, Any]:
        actions = [
            (0.25, self.garbage),
            (0.25, self.reserve_and_drop),
            (0.40, self.on_held),
            (0.05, self.oversized),
            (0.05, self.idle_connection),
        ]
        weights = [w for w, _ in actions]
        deadline = time.monotonic() + self.cfg["seconds"]
        started = time.perf_counter()
        while not self.stop and time.monotonic() < deadline:
            action = self.rng.choices(actions, weights)[0][1]
            try:
                action()
            except Exception as exc:  # a fuzzer bug, not the server's: counted and shown
                self.out["fuzzer_errors"] += 1
                if len(self.errors) < 5:
                    self.errors.append(traceback.format_exc(limit=4))
                del exc
            self.out["actions"] += 1
            self.scribble(1)
        seconds = time.perf_counter() - started
        for peer in list(self.held):
            self.drop(peer)
        for sock in self.idle:
            sock.close()
        return {
            "seconds": round(seconds, 1),
            "actions_per_s": round(self.out["actions"] / seconds),
            "counts": dict(sorted(self.out.items())),
            "errors": self.errors,
        }


def _child(role: str, cfg: dict[str, Any]) -> subprocess.Popen[str]:
    """This file run as a legitimate client or the fuzzer (one JSON line on stdout when done)."""
    argv = [sys.executable, "-P", "-m", __name__, "--child", role, json.dumps(cfg)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def _report(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=timeout_s)
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"failed": True, "returncode": proc.returncode}
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def _process(pid: int) -> dict[str, int]:
    """RSS (KiB) and open descriptors of ``pid``."""
    rss = 0
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        fds = -1
    return {"rss_kib": rss, "fds": fds}


_STATS_KEYS = (
    "max_object",
    "connections",
    "clients",
    "protocol_errors",
    "reserved",
    "orphaned",
    "published",
    "leases",
    "lost_sessions",
    "cap_refusals",
    "alloc_failures",
    "too_large",
    "evictions",
    "classes",
    "free_regions",
    "freed_on_exit",
    "freed_unsent",
    "fenced_sessions",
    "busy_refusals",
)


def _server_stats(path: str) -> dict[str, Any] | None:
    """The server's STATS through a probe connection (None when it does not answer)."""
    from tiercache.server.client import ServerConnection, ServerUnavailable
    from tiercache.server.protocol import Op

    try:
        conn = ServerConnection(path, role="probe", timeout_s=10.0)
    except ServerUnavailable:
        return None
    try:
        stats = conn.request(Op.STATS, {})
    except ServerUnavailable:
        return None
    finally:
        conn.close()
    return {k: stats[k] for k in _STATS_KEYS if k in stats}


def _clients(cfg: dict[str, Any], phase: str, clients: int, seconds: float) -> list[dict[str, Any]]:
    procs = [
        _child("client", {**cfg, "name": f"client{i}/{phase}", "seed": cfg["seed"] + i, "seconds": seconds})
        for i in range(clients)
    ]
    return [_report(p, seconds + 120) for p in procs]


def run_live(
    seconds: float,
    max_share: float,
    *,
    capacity: int = 1 << 30,
    region_bytes: int | None = None,
    tokens: int = 64,
    batch: int = 4,
    clients: int = 2,
    held: int = 32,
    idle: int = 16,
    warmup_s: float = 2.0,
    orphan_grace_s: float = 60.0,
    seed: int = 0,
) -> dict[str, Any]:
    """A real ``python -m tiercache.server``; ``clients`` legitimate client processes store and read back for
    ``seconds`` alone, then for ``seconds`` beside one fuzzer process (started ``warmup_s`` earlier). Per
    client the fraction of stores that succeeded in each phase and their ratio; the server's RSS and fds
    before, during and after the fuzz, its log bytes, whether it stayed alive, and whether everything the
    fuzzer held came back once it exited."""
    nbytes = LIVE_SPEC.with_tokens(tokens).nbytes
    tmp = socket_dir("tc-fz-")
    path = str(tmp / "s.sock")
    flags = [
        "--capacity",
        str(capacity),
        "--max-share",
        str(max_share),
        "--orphan-grace-s",
        str(orphan_grace_s),
    ]
    if region_bytes is not None:
        flags += ["--region-bytes", str(region_bytes)]
    cfg: dict[str, Any] = {"socket": path, "tokens": tokens, "batch": batch, "timeout_s": 5.0, "seed": seed}
    server = NodeServer(path, *flags, slot_bytes=nbytes, slots=None)
    fuzzer: subprocess.Popen[str] | None = None
    result: dict[str, Any] = {"max_share": max_share, "seconds": seconds}
    try:
        if not server.ready:
            raise RuntimeError(f"the server did not start: {server.log()[-2000:]}")
        started = _server_stats(path)
        result["server"] = {
            "argv": ["-m", "tiercache.server", "--socket", path, "--slot-bytes", str(nbytes), *flags],
            "max_object": None if started is None else started["max_object"],
        }
        base = _clients(cfg, "alone", clients, seconds)
        before = {**_process(server.proc.pid), "stats": _server_stats(path)}
        fz_cfg = {**cfg, "seconds": 1e6, "legit_nbytes": nbytes, "held": held, "idle": idle}
        fuzzer = _child("fuzzer", fz_cfg)
        time.sleep(warmup_s)
        fuzzed = _clients(cfg, "fuzzed", clients, seconds)
        during = {**_process(server.proc.pid), "stats": _server_stats(path)}
        fuzzer.send_signal(signal.SIGTERM)
        fuzz_report = _report(fuzzer, 60)
        fuzzer = None
        settle = time.monotonic() + 10
        after_stats = _server_stats(path)
        while (
            after_stats is not None
            and time.monotonic() < settle
            and (after_stats["lost_sessions"] or after_stats["reserved"])
        ):
            time.sleep(0.1)
            after_stats = _server_stats(path)
        after = {**_process(server.proc.pid), "stats": after_stats}
        alive = server.proc.poll() is None and after_stats is not None
    finally:
        if fuzzer is not None:
            fuzzer.kill()
            fuzzer.wait()
        try:
            returncode = server.stop(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            returncode = server.proc.returncode
    log_text = server.log()
    shutil.rmtree(tmp, ignore_errors=True)
    per_client = []
    for alone, fz in zip(base, fuzzed, strict=True):
        f_alone = alone.get("stored", 0) / max(alone.get("stores", 0), 1)
        f_fuzzed = fz.get("stored", 0) / max(fz.get("stores", 0), 1)
        per_client.append(
            {
                "client": alone.get("name", "?").split("/")[0],
                "stored_fraction_alone": round(f_alone, 4),
                "stored_fraction_fuzzed": round(f_fuzzed, 4),
                "ratio": round(f_fuzzed / f_alone, 4) if f_alone else 0.0,
                "read_hit_fraction_alone": round(alone.get("hits", 0) / max(alone.get("reads", 0), 1), 4),
                "read_hit_fraction_fuzzed": round(fz.get("hits", 0) / max(fz.get("reads", 0), 1), 4),
                "alone": alone,
                "fuzzed": fz,
            }
        )
    result.update(
        clients=per_client,
        min_ratio=min(c["ratio"] for c in per_client),
        wrong_bytes=sum(c[p].get("wrong_bytes", 0) for c in per_client for p in ("alone", "fuzzed")),
        server_alive=alive,
        server_exit=returncode,
        server_before_fuzz=before,
        server_during_fuzz=during,
        server_after_fuzzer_exit=after,
        log_bytes=len(log_text.encode()),
        log_lines=len(log_text.splitlines()),
        log_tail=log_text.splitlines()[-8:],
        fuzzer=fuzz_report,
    )
    return result


TARGETS: dict[str, Callable[[], Any]] = {
    "frames": FrameFuzz,
    "config": ConfigFuzz,
    "protocol": ProtocolFuzz,
    "connector": ConnectorFuzz,
}


def run_target(name: str, inputs: int, seed: int = 0, max_findings: int = 20) -> dict[str, Any]:
    """Run ``inputs`` inputs of one target; outcomes counted, findings (unexpected errors) recorded."""
    target = TARGETS[name]()
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    findings: list[dict[str, str]] = []
    started = time.perf_counter()
    for i in range(inputs):
        state = rng.getstate()
        try:
            outcomes[target.one(rng)] += 1
        except Exception as exc:
            outcomes["finding"] += 1
            if len(findings) < max_findings:
                findings.append({"input": str(i), "error": repr(exc), "trace": traceback.format_exc(limit=3)})
            rng.setstate(state)
            rng.random()  # move on to another input
    seconds = time.perf_counter() - started
    return {
        "target": name,
        "inputs": inputs,
        "seed": seed,
        "seconds": round(seconds, 1),
        "inputs_per_s": round(inputs / seconds),
        "outcomes": dict(outcomes),
        "findings": findings,
    }


def _child_main(role: str, cfg: dict[str, Any]) -> int:
    """``--child client|fuzzer JSON``: one process of the live-server run; its report on stdout."""
    if role == "client":
        print(json.dumps(_legit_client(cfg)), flush=True)
        return 0
    fuzzer = ServerFuzzer(cfg)
    signal.signal(signal.SIGTERM, lambda *_: setattr(fuzzer, "stop", True))
    print(json.dumps(fuzzer.run()), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--inputs", type=int, default=1_000_000, help="inputs per target")
    parser.add_argument("--targets", default=",".join(TARGETS), help="in-process targets ('' for none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--live-s", type=float, default=60.0, help="seconds per phase of the live run (0: none)"
    )
    parser.add_argument(
        "--live-share", default="0.25,0.9", help="the server's --max-share in each live run (comma-separated)"
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", nargs=2, metavar=("ROLE", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child_main(args.child[0], json.loads(args.child[1]))
    results = []
    for name in filter(None, args.targets.split(",")):
        result = run_target(name, args.inputs, args.seed)
        print(json.dumps({k: v for k, v in result.items() if k != "findings"}), flush=True)
        results.append(result)
    live = []
    for share in filter(None, args.live_share.split(",")) if args.live_s > 0 else []:
        run = run_live(args.live_s, float(share), seed=args.seed)
        keys = ("max_share", "min_ratio", "wrong_bytes", "server_alive", "log_bytes")
        print(json.dumps({k: run[k] for k in keys}), flush=True)
        live.append(run)
    report = {
        "benchmark": "fuzz",
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "targets": results,
        "live": live,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    found = sum(len(r["findings"]) for r in results)
    found += sum(1 for run in live if run["wrong_bytes"] or not run["server_alive"])
    print(f"findings: {found}")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
