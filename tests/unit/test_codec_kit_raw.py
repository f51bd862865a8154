"""The codec conformance kit run on the raw chain, plus raw-specific checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercache.errors import ConfigError
from tiercache.serde import CodecContext, build_pipeline, read_header
from tiercache.serde.raw import RawCodec
from tiercache.spec import KVSpec
from tiercache.testing.codecs import CodecConformance

GOLDEN_RAW = Path(__file__).resolve().parent.parent / "golden" / "raw"


class TestRawConformance(CodecConformance):
    chain = ["raw"]  # noqa: RUF012
    golden_dir = str(GOLDEN_RAW)


def test_raw_codec_contract_by_behaviour() -> None:
    """What raw's class constants promise, checked through a pipeline: it starts a chain (array to bytes),
    other codecs may follow it, it cannot follow another array codec, its frames hold exactly the array's
    bytes, they decode bit-exactly, and its config rebuilds the same chain."""
    spec = KVSpec(2, 2, 4, "bfloat16", tokens=3)
    array = bytes((i * 37 + 11) % 256 for i in range(spec.nbytes))
    pipeline = build_pipeline(["raw"])
    frame = pipeline.encode(array, spec, "k")
    header = read_header(frame)
    assert header.payload_len == spec.nbytes == RawCodec().max_encoded_size(spec.nbytes, spec)
    assert bytes(frame[header.header_len :]) == array  # no metadata, no transformation
    out = bytearray(spec.nbytes)
    pipeline.decode_into(frame, "k", out)
    assert bytes(out) == array  # lossless
    assert build_pipeline(["raw", "lz4"]).chain == ("raw", "lz4")  # not must_be_last
    with pytest.raises(ConfigError):
        build_pipeline(["lz4", "raw"])  # an array-to-bytes codec comes first
    with pytest.raises(ConfigError):
        build_pipeline(["raw", "raw"])
    assert build_pipeline(pipeline.get_config()).chain == pipeline.chain


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
