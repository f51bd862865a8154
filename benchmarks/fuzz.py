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

Run: ``python benchmarks/fuzz.py --inputs 1000000 --out benchmarks/results/fuzz_cpu.json`` (``make fuzz``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import tomllib
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiercache.config import Config, config_from_dict
from tiercache.errors import ConfigError, FrameError
from tiercache.serde import CodecPipeline, build_pipeline, read_header
from tiercache.serde.aesgcm import AesGcmCodec
from tiercache.spec import KVFormat, KVSpec

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
            return rng.randbytes(rng.randrange(300))
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
        keys += ["role", "timeout_s", "x"]
        return {rng.choice(keys): self.random_value(rng, depth + 1) for _ in range(rng.randrange(5))}

    def random_message(self, rng: random.Random) -> bytes:
        """``[version, epoch, op, req_id, body]`` with a map body of schema keys, some fields replaced."""
        import msgpack

        body = self.random_value(rng, 1) if rng.random() < 0.8 else None
        if not isinstance(body, dict):
            body = {"keys": self.random_value(rng, 1)}
        fields = [1, rng.randrange(1 << 8), rng.choice(list(self.p.Op)).value, rng.randrange(1 << 16), body]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--inputs", type=int, default=1_000_000, help="inputs per target")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    results = []
    for name in args.targets.split(","):
        result = run_target(name, args.inputs, args.seed)
        print(json.dumps({k: v for k, v in result.items() if k != "findings"}), flush=True)
        results.append(result)
    report = {
        "benchmark": "fuzz",
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "targets": results,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    found = sum(len(r["findings"]) for r in results)
    print(f"findings: {found}")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
