"""A prompt's keys from a keyspace description: the description round-trips through JSON, token-keyed
keyspaces give the keys a ``TokenDatabase`` of each keyspace gives, block-keyed ones use vLLM's own block
hashes of the same request (salt and LoRA included), and what cannot be reproduced is refused in one line."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.cli.main import main as cli
from tiercache.keys import KeySpace, RequestIdentity, TokenDatabase
from tiercache.prompt_keys import KeyspaceDescription, load_description, prompt_keys, vllm_block_hashes

BASE = KeySpace(model="m", kv_dtype="float32", num_layers=2, num_kv_heads=2, head_dim=32, layout_tag="cpu")
TWO_RANKS = (
    dataclasses.replace(BASE, world_size=2, rank=0),
    dataclasses.replace(BASE, world_size=2, rank=1, kv_group="sliding_window:64:ab"),
)


def _block_source(block_size: int) -> str:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

    seed = resolve_none_hash_seed(get_hash_fn_by_name("sha256"))
    return f"vllm-block:sha256:bs{block_size}:seed={hashlib.sha256(seed.encode()).hexdigest()[:16]}"


def test_description_round_trips_and_checks_digests(tmp_path: Path) -> None:
    desc = KeyspaceDescription(TWO_RANKS, chunk_size=64, save_unfull_chunk=False)
    path = tmp_path / "ks.json"
    path.write_text(json.dumps(desc.to_json()))
    back = load_description(path)
    assert back == desc
    assert [k.digest_hex for k in back.keyspaces] == [k.digest_hex for k in TWO_RANKS]
    assert back.prefixes == [f"tc1.{k.digest_hex}." for k in TWO_RANKS]
    data = desc.to_json()
    data["keyspaces"][1]["fields"]["num_layers"] = 3  # fields edited: the digest no longer matches
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"ks\.json: not a tiercache keyspace description .*digest"):
        load_description(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a tiercache keyspace description"):
        load_description(path)
    with pytest.raises(ValueError, match=r"missing\.json: cannot read"):
        load_description(tmp_path / "missing.json")


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), max_size=300),
    salt=st.sampled_from(["", "customer-42"]),
    unfull=st.booleans(),
)
def test_token_keys_are_each_keyspaces_keys_chunk_major(tokens: list[int], salt: str, unfull: bool) -> None:
    desc = KeyspaceDescription(TWO_RANKS, chunk_size=32, save_unfull_chunk=unfull)
    keys = prompt_keys(desc, tokens, cache_salt=salt)
    identity = RequestIdentity(cache_salt=salt)
    per_rank = [
        [str(span.key) for span in TokenDatabase(k, 32, unfull).process_tokens(tokens, identity=identity)]
        for k in TWO_RANKS
    ]
    assert keys == [key for chunk in zip(*per_rank, strict=True) for key in chunk]
    assert len(keys) == 2 * (len(tokens) // 32 + (1 if unfull and len(tokens) % 32 else 0))
    if keys and salt:  # the salt is part of every key
        assert keys[0] != prompt_keys(desc, tokens)[0]


def test_block_hashes_are_vllms_for_the_same_request() -> None:
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    tokens = [(i * 7919) % 30_000 for i in range(100)]
    for salt, lora in (("", None), ("tenant-a", LoRARequest("ad", 1, "/adapters/ad"))):
        request = Request(
            "r",
            tokens,
            SamplingParams(max_tokens=1),
            None,
            cache_salt=salt or None,
            lora_request=lora,
            block_hasher=get_request_block_hasher(16, hash_fn),
        )
        ours = vllm_block_hashes(
            _block_source(16),
            tokens,
            cache_salt=salt,
            lora_name=lora.lora_name if lora else "",
            lora_path=lora.lora_path if lora else "",
        )
        assert ours.block_size == 16
        assert list(ours.hashes) == [bytes(h) for h in request.block_hashes]
        assert len(ours.hashes) == 6


def test_block_keys_follow_the_block_hashes() -> None:
    pytest.importorskip("vllm")
    spaces = tuple(dataclasses.replace(k, key_source=_block_source(16)) for k in TWO_RANKS)
    desc = KeyspaceDescription(spaces, chunk_size=32)
    tokens = list(range(1, 101))
    blocks = vllm_block_hashes(_block_source(16), tokens)
    keys = prompt_keys(desc, tokens)
    per_rank = [
        [str(s.key) for s in TokenDatabase(k, 32).process_tokens(tokens, block_hashes=blocks)] for k in spaces
    ]
    assert keys == [key for chunk in zip(*per_rank, strict=True) for key in chunk]
    assert len(keys) == 2 * 4
    # a different first token changes vLLM's first block hash and so every key
    assert not set(prompt_keys(desc, [0, *tokens[1:]])) & set(keys)


def test_unreproducible_block_hashes_are_refused() -> None:
    pytest.importorskip("vllm")
    with pytest.raises(ValueError, match=r"NONE_HASH seed is not this process.s.*PYTHONHASHSEED"):
        vllm_block_hashes("vllm-block:sha256:bs16:seed=0000000000000000", [1, 2, 3])
    with pytest.raises(ValueError, match="unknown key source"):
        vllm_block_hashes("vllm-block:sha256", [1])


def test_cli_prompt_needs_a_keyspace_and_token_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = tmp_path / "p.json"
    prompt.write_text("[1, 2, 3]")
    sock = str(tmp_path / "none.sock")
    assert cli(["cache", "pin", "--socket", sock, "--prompt", str(prompt)]) == 2
    assert "--prompt needs --keyspace" in capsys.readouterr().err
    ks = tmp_path / "ks.json"
    ks.write_text(json.dumps(KeyspaceDescription((BASE,), 32).to_json()))
    prompt.write_text('["a"]')
    assert cli(["cache", "pin", "--socket", sock, "--prompt", str(prompt), "--keyspace", str(ks)]) == 2
    assert "not a JSON list of non-negative integer token ids" in capsys.readouterr().err
