"""Codec behaviour: fp8 error on real KV, shuffle widths, stored fallback, AES-GCM keys and tampering."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lz4.block
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tiercache.serde.lz4 as lz4_codec_module
from tiercache import fp8_math
from tiercache.adapters.memory import MemoryAdapter
from tiercache.errors import ConfigError, FrameError
from tiercache.serde import CodecContext, build_pipeline, read_header
from tiercache.serde.aesgcm import OVERHEAD, AesGcmCodec, key_id
from tiercache.serde.fp8 import Fp8Codec
from tiercache.serde.frame import pack_static_header, payload_checksum, seal_header_into
from tiercache.serde.lz4 import Lz4Codec, decompress_into
from tiercache.serde.shuffle import ShuffleCodec
from tiercache.serde.zstd import ZstdCodec
from tiercache.spec import KVSpec
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager
from tiercache.testing.codecs import golden_array, load_kv_sample, random_array

SAMPLE = Path(__file__).resolve().parent.parent / "fixtures" / "kv_sample"
KEY1 = bytes(range(32))
KEY2 = bytes(range(1, 33))
ENV1 = "TIERCACHE_TEST_KEY_ONE"
ENV2 = "TIERCACHE_TEST_KEY_TWO"
SPEC = KVSpec(2, 2, 8, "bfloat16", tokens=4)


def load_sample() -> tuple[torch.Tensor, KVSpec]:
    x, spec = load_kv_sample(SAMPLE)
    assert spec.dtype == "bfloat16"
    assert spec.nbytes <= 2 * 1024 * 1024
    return x, spec


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def reseal(frame: bytes | bytearray, payload: bytes | bytearray) -> bytes:
    """``frame`` with its payload replaced and the header resealed (valid length, checksum and crc)."""
    header = read_header(frame)
    buf = bytearray(frame[: header.static_len]) + bytearray(20) + payload
    seal_header_into(buf, header.static_len, len(payload), payload_checksum(payload))
    return bytes(buf)


# ----- fp8 --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("granularity", "max_err"), [("channel", 0.03), ("token", 0.03)])
def test_fp8_error_on_real_kv_sample(granularity: str, max_err: float) -> None:
    x, spec = load_sample()
    pipe = build_pipeline([{"id": "fp8", "granularity": granularity}, "shuffle", "zstd"])
    frame = pipe.encode(x, spec, "sample")
    y, _ = pipe.decode(frame, "sample")
    assert rel_l2(y, x) <= max_err
    if granularity == "channel":
        assert spec.nbytes / len(frame) >= 2.6  # the fp8 -> shuffle -> zstd goal on real KV


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("granularity", ["channel", "token"])
def test_fp8_per_element_bound(dtype: str, granularity: str) -> None:
    spec = KVSpec(3, 2, 16, dtype, tokens=40)
    x = random_array(spec, 7, floats=True)
    codec = Fp8Codec(granularity)
    ctx = CodecContext("k", b"")
    out = bytearray(codec.max_encoded_size(spec.nbytes, spec))
    n = codec.encode_into(
        memoryview(bytes(x.contiguous().view(torch.uint8).reshape(-1).numpy())), memoryview(out), spec, ctx
    )
    assert n == len(out) == 4 * codec.num_scales(spec) + spec.nbytes // spec.itemsize
    y = torch.empty_like(x)
    codec.decode_into(memoryview(out), memoryview(y.view(torch.uint8).reshape(-1).numpy()), spec, ctx)
    shape, dim = fp8_math.groups(spec, granularity)
    xf, yf = x.float().reshape(shape), y.float().reshape(shape)
    s = xf.abs().amax(dim=dim, keepdim=True) / 448
    ulp = {"bfloat16": 2**-8, "float16": 2**-11, "float32": 2**-24}[dtype]
    bound = 2**-4 * xf.abs() + 2**-10 * s + ulp * yf.abs()
    assert bool(((yf - xf).abs() <= bound * 1.0001).all())


def test_fp8_zeros_and_nonfinite() -> None:
    pipe = build_pipeline(["fp8"])
    zeros = torch.zeros(SPEC.shape, dtype=torch.bfloat16)
    y, _ = pipe.decode(pipe.encode(zeros, SPEC, "k"), "k")
    assert bool((y == 0).all())
    bad = zeros.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        pipe.encode(bad, SPEC, "k")
    with pytest.raises(ValueError, match="fp8 codec encodes"):
        pipe.encode(bytes(8 * 32), KVSpec(2, 2, 8, "uint8", tokens=4), "k")


def test_fp8_granularity_is_in_frame_and_config_checked() -> None:
    assert Fp8Codec().header_params() == b"\x01\x02"
    assert Fp8Codec("token").header_params() == b"\x01\x01"
    frame = build_pipeline(["fp8"]).encode(golden_array(SPEC), SPEC, "k")
    with pytest.raises(FrameError, match="chain"):
        build_pipeline([{"id": "fp8", "granularity": "token"}]).decode(frame, "k")
    with pytest.raises(ConfigError, match="granularity"):
        build_pipeline([{"id": "fp8", "granularity": "tensor"}], validate_only=True)


# ----- shuffle ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("chain", "width"),
    [(["raw", "shuffle"], 2), (["fp8", "shuffle"], 1), (["raw", {"id": "shuffle", "itemsize": 4}], 4)],
)
def test_shuffle_width_follows_previous_stage(chain: list[object], width: int) -> None:
    pipe = build_pipeline(chain)  # type: ignore[arg-type]
    assert pipe.itemsizes(SPEC)[-1] == (1 if chain[0] == "fp8" else 2)
    frame = pipe.encode(golden_array(SPEC), SPEC, "k")
    assert frame[read_header(frame).header_len] == width


def test_shuffle_splits_byte_planes() -> None:
    codec = ShuffleCodec()
    out = bytearray(8)
    n = codec.encode_into(memoryview(b"abcdefg"), memoryview(out), SPEC, CodecContext("k", b"", 2))
    assert bytes(out[:n]) == b"\x02acebdfg"  # width, plane 0, plane 1, tail
    back = bytearray(7)
    assert codec.decode_into(memoryview(out[:n]), memoryview(back), SPEC, CodecContext("k", b"")) == 7
    assert back == b"abcdefg"


# ----- lz4 / zstd stored fallback ---------------------------------------------------------------------------
@pytest.mark.parametrize("codec", [Lz4Codec(), ZstdCodec()])
def test_compressors_store_incompressible_data(codec: Lz4Codec | ZstdCodec) -> None:
    spec = KVSpec(2, 4, 64, "uint8", tokens=64)
    noise = bytes(random_array(spec, 3).view(torch.uint8).reshape(-1).numpy())
    ctx = CodecContext("k", b"")
    for data, flag in ((noise, 0), (bytes(len(noise)), 1)):
        out = bytearray(codec.max_encoded_size(len(data), spec))
        n = codec.encode_into(memoryview(data), memoryview(out), spec, ctx)
        assert out[0] == flag
        assert n == len(data) + 1 if flag == 0 else n < len(data) * 63 // 64
        back = bytearray(len(data))
        assert codec.decode_into(memoryview(out)[:n], memoryview(back), spec, ctx) == len(data)
        assert back == data


@given(st.binary(min_size=1, max_size=4096), st.integers(1, 64), st.integers(0, 7))
def test_lz4_decodes_in_place_like_the_library(data: bytes, repeat: int, tail: int) -> None:
    """The bound C decoder writes the library's bytes into the caller's buffer (a slice of a larger one:
    nothing past the decoded length is touched) and rejects truncated or corrupted blocks."""
    plain = data * repeat
    block = lz4.block.compress(plain, store_size=False)
    target = bytearray(b"\xaa" * (len(plain) + tail))
    decompress_into(memoryview(block), memoryview(target), len(plain))
    assert bytes(target[: len(plain)]) == lz4.block.decompress(block, uncompressed_size=len(plain))
    assert target[len(plain) :] == b"\xaa" * tail
    with pytest.raises(ValueError, match="lz4"):
        decompress_into(memoryview(block)[:-1], memoryview(target), len(plain))
    with pytest.raises(ValueError, match="lz4"):  # claims more bytes than the block holds
        decompress_into(memoryview(block), memoryview(bytearray(len(plain) + 1)), len(plain) + 1)


def test_lz4_decoder_is_bound() -> None:
    """python-lz4 exports ``LZ4_decompress_safe``: decoding goes straight into the caller's buffer."""
    assert lz4_codec_module._DECOMPRESS_SAFE is not None


def test_zstd_dictionary_is_bound_to_the_frame(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    d1.write_bytes(bytes(range(256)) * 8)
    d2.write_bytes(bytes(range(255, -1, -1)) * 8)
    monkeypatch.setenv("TIERCACHE_TEST_ZDICT", str(d2))
    with_d1 = build_pipeline(["raw", {"id": "zstd", "dict_path": str(d1)}])
    frame = with_d1.encode(golden_array(SPEC), SPEC, "k")
    assert bytes(with_d1.decode(frame, "k")[0].view(torch.uint8).reshape(-1).numpy()) == bytes(
        golden_array(SPEC).view(torch.uint8).reshape(-1).numpy()
    )
    for other in ([{"id": "zstd", "dict_env": "TIERCACHE_TEST_ZDICT"}], ["zstd"]):
        with pytest.raises(FrameError):
            build_pipeline(["raw", *other]).decode(frame, "k")  # type: ignore[list-item]
    build_pipeline(["raw", {"id": "zstd", "dict_env": "NOT_SET_ANYWHERE"}], validate_only=True)
    with pytest.raises(ConfigError, match="NOT_SET_ANYWHERE"):
        build_pipeline(["raw", {"id": "zstd", "dict_env": "NOT_SET_ANYWHERE"}])
    with pytest.raises(ConfigError, match="level"):
        build_pipeline(["raw", {"id": "zstd", "level": 99}], validate_only=True)


# ----- aesgcm: keys and config ------------------------------------------------------------------------------
@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV1, KEY1.hex())
    monkeypatch.setenv(ENV2, KEY2.hex())


def test_aesgcm_config_never_holds_secrets() -> None:
    for bad in ({"key": KEY1.hex()}, {"key_env": ENV1, "decrypt_keys": [KEY2.hex()]}):
        with pytest.raises(ConfigError, match="secret"):
            build_pipeline(["raw", {"id": "aesgcm", **bad}], validate_only=True)
    with pytest.raises(ConfigError, match="exactly one"):
        build_pipeline(["raw", {"id": "aesgcm"}], validate_only=True)
    # validation reads no secret: the variable need not exist yet
    build_pipeline(["raw", {"id": "aesgcm", "key_env": "TIERCACHE_NOT_SET_XYZ"}], validate_only=True)
    with pytest.raises(ConfigError, match="TIERCACHE_NOT_SET_XYZ"):
        build_pipeline(["raw", {"id": "aesgcm", "key_env": "TIERCACHE_NOT_SET_XYZ"}])


def test_aesgcm_bad_key_material(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV1, "abc")
    with pytest.raises(ConfigError, match="64 hex"):
        build_pipeline(["raw", {"id": "aesgcm", "key_env": ENV1}])


def test_chain_order_checked_at_config_time(keys: None) -> None:
    with pytest.raises(ConfigError, match="must be last"):
        build_pipeline(["raw", {"id": "aesgcm", "key_env": ENV1}, "zstd"], validate_only=True)
    with pytest.raises(ConfigError, match="start with an array-to-bytes"):
        build_pipeline(["shuffle", "raw"], validate_only=True)
    with pytest.raises(ConfigError, match="more than one array-to-bytes"):
        build_pipeline(["raw", "fp8"], validate_only=True)
    with pytest.raises(ConfigError, match=r"'brotli'.*'snappy'"):
        build_pipeline(["raw", "brotli", "snappy"], validate_only=True)


def test_aesgcm_key_file_and_rotation(tmp_path: Path, keys: None, monkeypatch: pytest.MonkeyPatch) -> None:
    hex_file, raw_file = tmp_path / "k.hex", tmp_path / "k.bin"
    hex_file.write_text(KEY1.hex() + "\n")
    raw_file.write_bytes(KEY1)
    old = build_pipeline(["raw", {"id": "aesgcm", "key_file": str(hex_file)}])
    assert build_pipeline(["raw", {"id": "aesgcm", "key_file": str(raw_file)}]).codecs[1].key_id == key_id(
        KEY1
    )  # type: ignore[attr-defined]
    frame = old.encode(golden_array(SPEC), SPEC, "k")
    new_only = build_pipeline(["raw", {"id": "aesgcm", "key_env": ENV2}])
    with pytest.raises(FrameError, match="key id"):
        new_only.decode(frame, "k")
    monkeypatch.setenv("TIERCACHE_TEST_OLD_KEYS", f"{bytes(32).hex()}, {KEY1.hex()}")
    rotated = build_pipeline(
        ["raw", {"id": "aesgcm", "key_env": ENV2, "decrypt_keys_env": "TIERCACHE_TEST_OLD_KEYS"}]
    )
    assert rotated.decode(frame, "k")[0].equal(golden_array(SPEC))
    rotated2 = build_pipeline(
        ["raw", {"id": "aesgcm", "key_env": ENV2, "decrypt_key_files": [str(hex_file)]}]
    )
    assert rotated2.decode(frame, "k")[0].equal(golden_array(SPEC))
    fresh = rotated.encode(golden_array(SPEC), SPEC, "k")
    assert read_header(fresh).header_len  # new frames use the new key
    assert int.from_bytes(fresh[read_header(fresh).header_len + 1 :][:4], "little") == key_id(KEY2)


def test_aesgcm_same_key_id_other_key_fails_tag() -> None:
    frame = build_pipeline(["raw", AesGcmCodec(KEY1)]).encode(golden_array(SPEC), SPEC, "k")
    impostor = AesGcmCodec(KEY2)
    impostor._ciphers[key_id(KEY1)] = impostor._ciphers[key_id(KEY2)]  # a key id collision
    with pytest.raises(FrameError, match="aesgcm"):
        build_pipeline(["raw", impostor]).decode(frame, "k")


# ----- aesgcm: tampering ------------------------------------------------------------------------------------
def test_every_bit_of_an_encrypted_payload_is_authenticated() -> None:
    """Flip each bit of the aesgcm output and reseal the frame checksum: only the AEAD tag can catch it."""
    pipe = build_pipeline(["raw", AesGcmCodec(KEY1)])
    spec = KVSpec(1, 1, 2, "bfloat16", tokens=2)
    frame = bytes(pipe.encode(golden_array(spec), spec, "k"))
    header = read_header(frame)
    payload = frame[header.header_len :]
    assert len(payload) == spec.nbytes + OVERHEAD
    assert pipe.decode(reseal(frame, payload), "k")[0].equal(golden_array(spec))
    for i in range(len(payload)):
        for bit in range(8):
            bad = bytearray(payload)
            bad[i] ^= 1 << bit
            with pytest.raises(FrameError):
                pipe.decode(reseal(frame, bad), "k")


def test_payload_moved_under_another_key_fails_the_tag() -> None:
    """A frame rebuilt for another object key (valid header, fingerprint, checksum) is still rejected."""
    pipe = build_pipeline(["raw", AesGcmCodec(KEY1)])
    frame = bytes(pipe.encode(golden_array(SPEC), SPEC, "victim"))
    payload = frame[read_header(frame).header_len :]
    static = pack_static_header(SPEC, list(zip(pipe.chain, (b"", b""), strict=True)), "attacker")
    forged = bytearray(static) + bytearray(20) + payload
    seal_header_into(forged, len(static), len(payload), payload_checksum(payload))
    assert read_header(forged).payload_len == len(payload)
    with pytest.raises(FrameError, match="aesgcm"):
        pipe.decode(forged, "attacker")


# ----- through the storage manager --------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_wrong_key_or_moved_frame_is_a_miss_in_the_manager() -> None:
    spec = KVSpec(2, 2, 16, "bfloat16", tokens=8)
    writer = build_pipeline(["fp8", "shuffle", "zstd", AesGcmCodec(KEY1)])
    reader = build_pipeline(["fp8", "shuffle", "zstd", AesGcmCodec(KEY2)])
    same_key = build_pipeline(["fp8", "shuffle", "zstd", AesGcmCodec(KEY1)])
    x = random_array(spec, 5, floats=True)
    frame = bytes(writer.encode(x, spec, "obj-a"))
    payload = frame[read_header(frame).header_len :]
    static = same_key.static_header(spec, "obj-b")
    moved = bytearray(static) + bytearray(20) + payload
    seal_header_into(moved, len(static), len(payload), payload_checksum(payload))
    stores = [MemoryAdapter(), MemoryAdapter()]  # closing a manager closes its adapters
    for store in stores:
        await store.batched_put(["obj-a", "obj-b"], [frame, bytes(moved)])
    async with StorageManager(L1Cache(spec.nbytes * 4, spec.nbytes), [("enc", stores[0], reader)]) as manager:
        assert await manager.batched_get(["obj-a"], [spec]) == [None]
        assert manager.metrics.value("tiercache_frames_rejected_total", tier="enc") == 1
    async with StorageManager(
        L1Cache(spec.nbytes * 4, spec.nbytes), [("enc", stores[1], same_key)]
    ) as manager:
        assert await manager.batched_get(["obj-b"], [spec]) == [None]
        assert manager.metrics.value("tiercache_frames_rejected_total", tier="enc") == 1
        assert not manager.l1.contains("obj-b")
        lease = (await manager.batched_get(["obj-a"], [spec]))[0]
        assert lease is not None
        lease.release()


# ----- inspect ----------------------------------------------------------------------------------------------
def test_inspect_shows_chain_sizes_and_key_id(tmp_path: Path) -> None:
    pipe = build_pipeline(["fp8", "shuffle", "zstd", AesGcmCodec(KEY1)])
    path = tmp_path / "frame.bin"
    path.write_bytes(pipe.encode(golden_array(SPEC), SPEC, "k"))
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "tiercache", "inspect", str(path), "--json"],
        capture_output=True, text=True, check=False, env={**os.environ},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["chain"] == ["fp8", "shuffle", "zstd", "aesgcm"]
    assert info["aesgcm_key_id"] == f"{key_id(KEY1):08x}"
    assert info["fp8_params"] == "0102"
    assert info["payload_bytes"] < info["raw_bytes"]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("granularity", ["channel", "token"])
def test_fp8_encode_never_modifies_the_source_array(dtype: str, granularity: str) -> None:
    import torch

    from tiercache.serde import build_pipeline
    from tiercache.spec import KVSpec

    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, dtype=dtype, tokens=40)
    source = (torch.randn(spec.shape) * 3).to(getattr(torch, dtype))
    before = source.clone()
    build_pipeline([{"id": "fp8", "granularity": granularity}]).encode(source, spec, "some.key")
    assert torch.equal(source, before)
