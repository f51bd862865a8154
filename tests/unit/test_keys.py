"""Keys: keyspace digests, canonical key strings, chained prefix hashing, masks and contiguous_prefix."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.keys import ChunkKey, KeySpace, TokenDatabase, contiguous_prefix
from tiercache.spec import KVFormat, KVSpec

SAFE = re.compile(r"^[a-z0-9.]+$")


def make_keyspace(**overrides: object) -> KeySpace:
    fields: dict[str, object] = dict(
        model="meta-llama/Llama-3.1-8B@main", kv_dtype="bfloat16", num_layers=32, num_kv_heads=8, head_dim=128
    )
    fields.update(overrides)
    return KeySpace(**fields)  # type: ignore[arg-type]


def naive_hashes(keyspace: KeySpace, tokens: list[int], chunk: int, save_unfull: bool) -> list[bytes]:
    """Reference: the chain written out literally from the design."""
    prev = bytes(32)
    out = []
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        if len(part) < chunk and not save_unfull:
            break
        data = b"".join(t.to_bytes(4, "little") for t in part)
        prev = hashlib.sha256(prev + keyspace.digest + data).digest()
        out.append(prev)
    return out


token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=700)


@settings(max_examples=60, deadline=None)
@given(tokens=token_lists, chunk=st.integers(1, 300), save_unfull=st.booleans())
def test_fast_hashing_matches_the_literal_chain(tokens: list[int], chunk: int, save_unfull: bool) -> None:
    keyspace = make_keyspace()
    db = TokenDatabase(keyspace, chunk_size=chunk, save_unfull_chunk=save_unfull)
    assert db.prefix_hashes(tokens) == naive_hashes(keyspace, tokens, chunk, save_unfull)


def test_golden_key_is_frozen() -> None:
    """The key of a fixed prompt must never change: stored objects would become unreachable."""
    keyspace = make_keyspace()
    assert keyspace.digest_hex == "e5ec56667d81e286c3cde91cbcb31ab8"
    keys = TokenDatabase(keyspace, chunk_size=4).keys([1, 2, 3, 4, 5, 6])
    assert [str(k) for k in keys] == [
        "tc1.e5ec56667d81e286c3cde91cbcb31ab8.d04e0df74dde1eee480b3e5bcbcd7a2ee7b8077ce05555265f859476c8104870",
        "tc1.e5ec56667d81e286c3cde91cbcb31ab8.67fee1438e39b329dc43522289008a14c2a74d9a722f95819c36b28958397d6e",
    ]


@settings(max_examples=80, deadline=None)
@given(
    model=st.text(min_size=1, max_size=40),
    salt=st.text(max_size=20),
    rank=st.one_of(st.just("shared"), st.integers(0, 3)),
    layer=st.one_of(st.none(), st.integers(0, 999)),
)
def test_canonical_key_string_is_safe_and_parses_back(
    model: str, salt: str, rank: object, layer: int | None
) -> None:
    keyspace = make_keyspace(model=model, cache_salt=salt, world_size=4, rank=rank)
    key = TokenDatabase(keyspace, chunk_size=3).keys([7, 8, 9, 10])[0].with_layer(layer)
    text = str(key)
    assert SAFE.match(text), text  # safe as a file name, a Redis key and an S3 key
    assert len(text) <= 110
    assert ChunkKey.parse(text) == key
    assert ChunkKey.parse(text).layer == layer


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "tc1",
        "tc1.zz.00",
        "tc1." + "0" * 32 + "." + "0" * 63,
        "tc1." + "0" * 32 + "." + "0" * 64 + ".lx",
        "tc1." + "0" * 32 + "/" + "0" * 64,
        "TC1." + "0" * 32 + "." + "0" * 64,
    ],
)
def test_parse_rejects_non_keys(bad: str) -> None:
    with pytest.raises(ValueError, match="not a tiercache chunk key"):
        ChunkKey.parse(bad)


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"revision": "r2"},
        {"kv_dtype": "float16"},
        {"num_layers": 31},
        {"num_kv_heads": 4},
        {"head_dim": 64},
        {"world_size": 2, "rank": 1},
        {"world_size": 2, "rank": 0},
        {"rank": "shared"},
        {"cache_salt": "tenant-b"},
        {"key_format_version": 2},
    ],
)
def test_every_keyspace_field_changes_the_digest_and_the_keys(change: dict[str, object]) -> None:
    base = make_keyspace()
    other = make_keyspace(**change)
    assert base.digest != other.digest
    tokens = list(range(512))
    assert TokenDatabase(base).keys(tokens)[0] != TokenDatabase(other).keys(tokens)[0]


def test_keyspace_equal_fields_equal_digest_and_mla_needs_no_heads() -> None:
    assert make_keyspace().digest == make_keyspace().digest
    spec = KVSpec(num_layers=61, num_kv_heads=1, head_dim=576, dtype="bf16", format=KVFormat.KV_MLA)
    mla = KeySpace.for_spec("deepseek-ai/DeepSeek-V3", spec, world_size=8, rank="shared")
    assert mla.layout_fingerprint == "KV_MLA:L61:H1:D576:bfloat16"
    assert replace(mla).digest == mla.digest


@pytest.mark.parametrize(
    "bad",
    [
        {"model": ""},
        {"world_size": 0},
        {"rank": 4, "world_size": 4},
        {"rank": "x"},
        {"kv_dtype": "int4"},
        {"head_dim": 0},
    ],
)
def test_keyspace_rejects_bad_fields(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"model|world_size|rank|dtype|positive"):
        make_keyspace(**bad)


def test_chunking_spans_and_unfull_tail() -> None:
    db = TokenDatabase(make_keyspace(), chunk_size=256)
    spans = db.process_tokens(list(range(600)))
    assert [(s.start, s.end) for s in spans] == [(0, 256), (256, 512), (512, 600)]
    no_tail = TokenDatabase(make_keyspace(), chunk_size=256, save_unfull_chunk=False)
    assert [(s.start, s.end) for s in no_tail.process_tokens(list(range(600)))] == [(0, 256), (256, 512)]
    assert db.process_tokens([]) == []


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(0, 50_000), min_size=1, max_size=900), cut=st.integers(0, 900))
def test_keys_are_prefix_closed(tokens: list[int], cut: int) -> None:
    """A prompt's first n full chunks have the same keys as any longer prompt with that prefix."""
    db = TokenDatabase(make_keyspace(), chunk_size=64, save_unfull_chunk=False)
    cut = min(cut, len(tokens))
    short = db.keys(tokens[:cut])
    assert db.keys(tokens)[: len(short)] == short
    assert len(short) == cut // 64


def test_a_change_in_an_early_chunk_changes_every_later_key() -> None:
    db = TokenDatabase(make_keyspace(), chunk_size=4)
    a = db.keys([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = db.keys([1, 2, 3, 99, 5, 6, 7, 8, 9])
    assert all(x != y for x, y in zip(a, b, strict=True))


@settings(max_examples=60, deadline=None)
@given(num_tokens=st.integers(1, 1200), num_false_chunks=st.integers(0, 6))
def test_mask_selects_chunks_from_its_first_true(num_tokens: int, num_false_chunks: int) -> None:
    chunk = 128
    num_false = min(num_false_chunks * chunk, (num_tokens // chunk) * chunk)
    mask = [False] * num_false + [True] * (num_tokens - num_false)
    tokens = list(range(num_tokens))
    db = TokenDatabase(make_keyspace(), chunk_size=chunk)
    masked = db.process_tokens(tokens, mask)
    full = db.process_tokens(tokens)
    assert masked == [s for s in full if s.start >= num_false]


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        ([True] * 4 + [False] * 4, "False...False True...True"),
        ([False] * 2 + [True] * 6, "multiple of the chunk size"),
        ([False] * 4 + [True, False, True, True], "False...False True...True"),
        ([True] * 7, "shape"),
    ],
)
def test_bad_masks_are_value_errors(mask: list[bool], message: str) -> None:
    db = TokenDatabase(make_keyspace(), chunk_size=4)
    with pytest.raises(ValueError, match=re.escape(message)):
        db.process_tokens(list(range(8)), mask)


def test_token_inputs_of_every_kind_give_the_same_keys() -> None:
    import torch

    tokens = [5, 6, 7, 100_000, 2**31 + 5]
    db = TokenDatabase(make_keyspace(), chunk_size=2)
    expected = db.keys(tokens)
    assert db.keys(np.array(tokens, dtype=np.int64)) == expected
    assert db.keys(np.array(tokens, dtype=np.uint32)) == expected
    assert db.keys(torch.tensor(tokens, dtype=torch.int64)) == expected
    assert db.keys(tuple(tokens)) == expected


@pytest.mark.parametrize("bad", [[-1], [2**32], [[1, 2]], [1.5]])
def test_bad_tokens_are_value_errors(bad: list[object]) -> None:
    with pytest.raises(ValueError, match=r"token ids|one-dimensional"):
        TokenDatabase(make_keyspace(), chunk_size=2).keys(bad)


def test_contiguous_prefix_stops_at_the_first_miss() -> None:
    assert contiguous_prefix([True, True, False, True, True]) == 2
    hits = {0, 1, 3, 4}
    assert contiguous_prefix([i in hits for i in range(5)]) == 2
    assert contiguous_prefix([object(), None, object()]) == 1
    assert contiguous_prefix([]) == 0
    assert contiguous_prefix(iter([1, 1, 0])) == 2


_CHILD = """
import json, sys
from tiercache.keys import KeySpace, TokenDatabase
ks = KeySpace(model="m/odel@x", kv_dtype="float16", num_layers=4, num_kv_heads=2, head_dim=64, cache_salt="s")
print(json.dumps([str(k) for k in TokenDatabase(ks, chunk_size=16).keys(list(range(1000, 1100)))]))
"""


def test_keys_are_identical_across_processes_with_different_hash_seeds() -> None:
    outputs = []
    for seed in ("1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-P", "-c", _CHILD], env=env, capture_output=True, text=True, check=True
        )
        outputs.append(json.loads(proc.stdout))
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(outputs[0]) == 7


def test_key_prefix_plus_hash_is_the_canonical_string() -> None:
    db = TokenDatabase(make_keyspace(cache_salt="t"), chunk_size=8)
    for key in db.keys(list(range(40))):
        assert db.key_prefix + key.chunk_hash.hex() == str(key)
