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

from tiercache.keys import (
    BlockHashes,
    ChunkKey,
    InputSpan,
    KeySpace,
    RequestIdentity,
    TokenDatabase,
    contiguous_prefix,
)
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
    ident = RequestIdentity(cache_salt="t", inputs=(InputSpan("mm", "x", 1, 3),))
    with_identity = db.keys(tokens, identity=ident)
    assert db.keys(np.array(tokens, dtype=np.int64), identity=ident) == with_identity
    assert db.keys(torch.tensor(tokens, dtype=torch.int64), identity=ident) == with_identity
    assert with_identity != expected


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
from tiercache.keys import InputSpan, KeySpace, RequestIdentity, TokenDatabase
ks = KeySpace(model="m/odel@x", kv_dtype="float16", num_layers=4, num_kv_heads=2, head_dim=64, cache_salt="s")
db = TokenDatabase(ks, chunk_size=16)
spans = (InputSpan("mm", "img", 20, 40), InputSpan("embeds", "ab", 0, 16))
ident = RequestIdentity("tenant", "lora", "/p", spans)
keys = db.keys(list(range(1000, 1100))) + db.keys(list(range(1000, 1100)), identity=ident)
print(json.dumps([str(k) for k in keys]))
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
    assert len(outputs[0]) == 14
    assert set(outputs[0][:7]).isdisjoint(outputs[0][7:])  # the identity changed every key


def test_key_prefix_plus_hash_is_the_canonical_string() -> None:
    db = TokenDatabase(make_keyspace(cache_salt="t"), chunk_size=8)
    for key in db.keys(list(range(40))):
        assert db.key_prefix + key.chunk_hash.hex() == str(key)


# ----- request identity ------------------------------------------------------------------------------------
def naive_identity_hashes(
    keyspace: KeySpace, tokens: list[int], chunk: int, identity: RequestIdentity
) -> list[bytes]:
    """Reference: the identity-aware chain written out literally (extras mixed into h_{i-1})."""
    prev = bytes(32)
    out = []
    for start in range(0, len(tokens), chunk):
        end = min(start + chunk, len(tokens))
        items: list[list[object]] = []
        if identity.lora_name:
            items.append(["lora", identity.lora_name, identity.lora_path])
        for span in sorted(identity.inputs, key=lambda s: (s.start, s.end, s.kind, s.digest)):
            if span.start < end and span.end > start:
                items.append([span.kind, span.digest, span.start - start, span.end - start])
        if start == 0 and identity.cache_salt:
            items.append(["salt", identity.cache_salt])
        if items:
            extras = json.dumps(items, separators=(",", ":")).encode()
            prev = hashlib.sha256(b"tiercache.extras.v1\x00" + prev + extras).digest()
        data = b"".join(t.to_bytes(4, "little") for t in tokens[start:end])
        prev = hashlib.sha256(prev + keyspace.digest + data).digest()
        out.append(prev)
    return out


spans_strategy = st.lists(
    st.tuples(
        st.sampled_from(["mm", "embeds"]),
        st.text("0123456789abcdef", min_size=1, max_size=8),
        st.integers(0, 300),
        st.integers(1, 200),
    ).map(lambda t: InputSpan(t[0], t[1], t[2], t[2] + t[3])),
    max_size=4,
)
identities = st.builds(
    RequestIdentity,
    cache_salt=st.text(max_size=10),
    lora_name=st.text(max_size=8),
    lora_path=st.just(""),
    inputs=spans_strategy.map(tuple),
)


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=400), chunk=st.integers(1, 100), identity=identities
)
def test_identity_chain_matches_the_literal_chain(
    tokens: list[int], chunk: int, identity: RequestIdentity
) -> None:
    keyspace = make_keyspace()
    db = TokenDatabase(keyspace, chunk_size=chunk)
    assert db.prefix_hashes(tokens, identity=identity) == naive_identity_hashes(
        keyspace, tokens, chunk, identity
    )


def test_empty_identity_gives_the_token_only_keys() -> None:
    db = TokenDatabase(make_keyspace(), chunk_size=4)
    tokens = [1, 2, 3, 4, 5, 6]
    assert db.keys(tokens, identity=RequestIdentity()) == db.keys(tokens) == db.keys(tokens, identity=None)
    # the golden keys hold for an empty identity too
    assert str(db.keys(tokens, identity=RequestIdentity())[0]).endswith(
        "d04e0df74dde1eee480b3e5bcbcd7a2ee7b8077ce05555265f859476c8104870"
    )


def _first_affected(change: str, span: InputSpan, chunk: int) -> int:
    return span.start // chunk if change == "input" else 0


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 600),
    chunk=st.integers(1, 128),
    base=identities,
    change=st.sampled_from(["salt", "lora", "lora_path", "input"]),
    span=st.tuples(st.integers(0, 599), st.integers(1, 100)).map(
        lambda t: InputSpan("mm", "img-1", t[0], t[0] + t[1])
    ),
)
def test_a_differing_identity_part_changes_exactly_the_affected_chunks_onward(
    n: int, chunk: int, base: RequestIdentity, change: str, span: InputSpan
) -> None:
    tokens = list(range(7, 7 + n))
    if change == "salt":
        other = replace(base, cache_salt=base.cache_salt + "x")
    elif change == "lora":
        other = replace(base, lora_name=base.lora_name + "B")
    elif change == "lora_path":
        other = replace(base, lora_name=base.lora_name or "A", lora_path=base.lora_path + "/other")
        base = replace(base, lora_name=base.lora_name or "A")
    else:
        span = span._replace(start=span.start % n, end=span.start % n + span.end - span.start)
        other = replace(base, inputs=(*base.inputs, span))
    db = TokenDatabase(make_keyspace(), chunk_size=chunk)
    keys_a = db.keys(tokens, identity=base)
    keys_b = db.keys(tokens, identity=other)
    first = _first_affected(change, span, chunk)
    first = min(first, len(keys_a))
    assert keys_a[:first] == keys_b[:first]
    assert all(a != b for a, b in zip(keys_a[first:], keys_b[first:], strict=True))
    # the same identity, built again, gives the same keys
    assert db.keys(tokens, identity=replace(other)) == keys_b


def test_input_span_offsets_within_a_chunk_matter_and_order_does_not() -> None:
    db = TokenDatabase(make_keyspace(), chunk_size=8)
    tokens = [5] * 16

    def at(start: int) -> RequestIdentity:
        return RequestIdentity(inputs=(InputSpan("mm", "h", start, start + 2),))

    assert db.keys(tokens, identity=at(0)) != db.keys(tokens, identity=at(2))
    two = (InputSpan("mm", "a", 0, 2), InputSpan("mm", "b", 9, 12))
    assert db.keys(tokens, identity=RequestIdentity(inputs=two)) == db.keys(
        tokens, identity=RequestIdentity(inputs=two[::-1])
    )


@pytest.mark.parametrize(
    "bad",
    [
        dict(lora_path="/p"),
        dict(inputs=(InputSpan("mm", "", 0, 2),)),
        dict(inputs=(InputSpan("", "h", 0, 2),)),
        dict(inputs=(InputSpan("mm", "h", 3, 3),)),
        dict(inputs=(InputSpan("mm", "h", -1, 3),)),
    ],
)
def test_bad_identities_are_value_errors(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"LoRA|input span"):
        RequestIdentity(**bad)  # type: ignore[arg-type]


# ----- keys from vLLM block hashes -------------------------------------------------------------------------
def chained_blocks(tokens: list[int], block: int, seed: bytes = b"seed") -> list[bytes]:
    """A stand-in for vLLM's chained block hashes (full blocks only)."""
    prev = hashlib.sha256(seed).digest()
    out = []
    for start in range(0, len(tokens) - block + 1, block):
        prev = hashlib.sha256(prev + repr(tokens[start : start + block]).encode()).digest()
        out.append(prev)
    return out


def naive_block_keys(keyspace: KeySpace, n: int, chunk: int, blocks: list[bytes], block: int) -> list[bytes]:
    out = []
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        bounds = start.to_bytes(8, "little") + end.to_bytes(8, "little")
        out.append(
            hashlib.sha256(
                b"tiercache.vllm-block.v1\x00" + keyspace.digest + bounds + blocks[end // block - 1]
            ).digest()
        )
    return out


@settings(max_examples=60, deadline=None)
@given(blocks_in_prompt=st.integers(1, 40), per_chunk=st.integers(1, 4), block=st.sampled_from([2, 4, 16]))
def test_block_hash_keys_match_the_literal_derivation(
    blocks_in_prompt: int, per_chunk: int, block: int
) -> None:
    keyspace = make_keyspace()
    tokens = [(i * 7919) % 1000 for i in range(blocks_in_prompt * block)]
    blocks = chained_blocks(tokens, block)
    db = TokenDatabase(keyspace, chunk_size=per_chunk * block)
    got = db.prefix_hashes(tokens, block_hashes=BlockHashes(blocks, block))
    assert got == naive_block_keys(keyspace, len(tokens), per_chunk * block, blocks, block)
    assert got != db.prefix_hashes(tokens)  # never equal to token-chain keys


def test_block_hash_keys_fall_back_to_the_chain_past_the_last_full_block() -> None:
    keyspace = make_keyspace()
    db = TokenDatabase(keyspace, chunk_size=8)
    tokens = list(
        range(21)
    )  # blocks of 4: five full blocks; chunks [0,8) [8,16) derived, tail [16,21) chained
    blocks = chained_blocks(tokens, 4)
    ident = RequestIdentity(cache_salt="s", lora_name="A")
    got = db.prefix_hashes(tokens, identity=ident, block_hashes=BlockHashes(blocks, 4))
    assert got[:2] == naive_block_keys(keyspace, 16, 8, blocks, 4)
    extras = json.dumps([["lora", "A", ""]], separators=(",", ":")).encode()
    mixed = hashlib.sha256(b"tiercache.extras.v1\x00" + got[1] + extras).digest()
    tail = b"".join(t.to_bytes(4, "little") for t in tokens[16:])
    assert got[2] == hashlib.sha256(mixed + keyspace.digest + tail).digest()
    # a chunk size that is not a multiple of the block size: the whole prompt uses the identity chain
    db6 = TokenDatabase(keyspace, chunk_size=6)
    assert db6.prefix_hashes(
        tokens, identity=ident, block_hashes=BlockHashes(blocks, 4)
    ) == db6.prefix_hashes(tokens, identity=ident)


def test_block_hash_keys_change_from_the_first_changed_block_onward() -> None:
    db = TokenDatabase(make_keyspace(), chunk_size=8)
    tokens = list(range(64))
    blocks = chained_blocks(tokens, 4)
    other = chained_blocks(tokens, 4, seed=b"other")  # e.g. another salt: every block differs
    changed = [*tokens[:20], 999, *tokens[21:]]  # block 5 (chunk 2) onward differ
    a = db.keys(tokens, block_hashes=BlockHashes(blocks, 4))
    assert a == db.keys(tokens, block_hashes=BlockHashes(list(blocks), 4))
    assert all(x != y for x, y in zip(a, db.keys(tokens, block_hashes=BlockHashes(other, 4)), strict=True))
    c = db.keys(changed, block_hashes=BlockHashes(chained_blocks(changed, 4), 4))
    assert c[:2] == a[:2]
    assert all(x != y for x, y in zip(a[2:], c[2:], strict=True))


def test_key_source_changes_the_digest_only_when_set() -> None:
    base = make_keyspace()
    assert replace(base, key_source="").digest == base.digest
    assert replace(base, key_source="vllm-block:sha256:bs32:seed=ab").digest != base.digest


def literal_mixed(
    keyspace: KeySpace, tokens: list[int], chunk: int, blocks: list[bytes], block: int, ident: RequestIdentity
) -> list[bytes]:
    """Reference: derive a chunk from the hash of its last block while every earlier chunk was derived and
    that block is covered; otherwise chain from the previous chunk with the identity's extras."""
    out: list[bytes] = []
    deriving = chunk % block == 0
    prev = bytes(32)
    for start in range(0, len(tokens), chunk):
        end = min(start + chunk, len(tokens))
        if deriving and end % block == 0 and end // block <= len(blocks):
            bounds = start.to_bytes(8, "little") + end.to_bytes(8, "little")
            prev = hashlib.sha256(
                b"tiercache.vllm-block.v1\x00" + keyspace.digest + bounds + blocks[end // block - 1]
            ).digest()
        else:
            deriving = False
            extras = ident.chunk_extras(start, end)
            if extras:
                prev = hashlib.sha256(b"tiercache.extras.v1\x00" + prev + extras).digest()
            data = b"".join(t.to_bytes(4, "little") for t in tokens[start:end])
            prev = hashlib.sha256(prev + keyspace.digest + data).digest()
        out.append(prev)
    return out


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 200),
    block=st.sampled_from([1, 2, 4, 8]),
    chunk=st.integers(1, 24),
    covered=st.integers(0, 60),
    ident=identities,
)
def test_block_and_token_keys_combine_as_specified(
    n: int, block: int, chunk: int, covered: int, ident: RequestIdentity
) -> None:
    keyspace = make_keyspace()
    tokens = [(i * 31) % 500 for i in range(n)]
    blocks = chained_blocks(tokens, block)[:covered]
    db = TokenDatabase(keyspace, chunk_size=chunk)
    got = db.prefix_hashes(tokens, identity=ident, block_hashes=BlockHashes(blocks, block))
    assert got == literal_mixed(keyspace, tokens, chunk, blocks, block, ident)
