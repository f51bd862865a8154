"""The codec conformance kit run on the raw chain, plus raw-specific checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercache.errors import ConfigError
from tiercache.serde import CodecContext, Stage
from tiercache.serde.raw import RawCodec
from tiercache.spec import KVSpec
from tiercache.testing.codecs import CodecConformance

GOLDEN_RAW = Path(__file__).resolve().parent.parent / "golden" / "raw"


class TestRawConformance(CodecConformance):
    chain = ["raw"]  # noqa: RUF012
    golden_dir = str(GOLDEN_RAW)


def test_raw_codec_contract() -> None:
    codec = RawCodec()
    spec = KVSpec(2, 2, 4, "bf16", tokens=3)
    assert codec.stage is Stage.ARRAY_TO_BYTES
    assert codec.lossless
    assert not codec.must_be_last
    assert codec.max_encoded_size(spec.nbytes, spec) == spec.nbytes
    assert codec.header_params() == b""
    assert codec.get_config() == {"id": "raw"}


def test_raw_codec_copies_bytes() -> None:
    codec = RawCodec()
    spec = KVSpec(1, 1, 4, "uint8", tokens=2)
    ctx = CodecContext(key="k", aad=b"")
    src = memoryview(bytes(range(1, 9)))
    dst = bytearray(b"\xff" * 10)
    assert codec.encode_into(src, memoryview(dst), spec, ctx) == 8
    assert dst == bytes(range(1, 9)) + b"\xff\xff"
    out = bytearray(8)
    assert codec.decode_into(src, memoryview(out), spec, ctx) == 8
    assert out == bytes(range(1, 9))


def test_raw_decode_rejects_wrong_length() -> None:
    codec = RawCodec()
    spec = KVSpec(1, 1, 4, "uint8", tokens=2)
    with pytest.raises(ValueError, match="raw payload"):
        codec.decode_into(memoryview(bytes(7)), memoryview(bytearray(8)), spec, CodecContext("k", b""))


def test_raw_from_config_checks() -> None:
    assert isinstance(RawCodec.from_config({"id": "raw"}), RawCodec)
    assert isinstance(RawCodec.from_config({}), RawCodec)
    with pytest.raises(ConfigError, match="lz4"):
        RawCodec.from_config({"id": "lz4"})
    with pytest.raises(ConfigError, match=r"level.*speed|speed.*level"):
        RawCodec.from_config({"id": "raw", "speed": 1, "level": 2})
