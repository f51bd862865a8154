"""CodecPipeline: chain validation, encode/decode, failure wrapping, buffers, the kit on a 3-stage chain."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import pytest
import torch

from tiercache.buffers import as_readable_bytes, as_writable_bytes
from tiercache.errors import ConfigError, FrameError
from tiercache.hookspecs import CodecRegistrar, hookimpl
from tiercache.registry import Registry, reset_registry
from tiercache.serde import Codec, CodecContext, CodecPipeline, Stage, build_pipeline, read_header
from tiercache.serde.pipeline import _codec_class
from tiercache.serde.raw import RawCodec
from tiercache.spec import KVFormat, KVSpec
from tiercache.testing.codecs import CodecConformance

if TYPE_CHECKING:
    from typing import Self

    from tiercache.serde.pipeline import ChainEntry

KEY = "tc1.pipeline.test"
SPEC = KVSpec(2, 2, 4, "bfloat16", KVFormat.KV_2LTD, tokens=5)


# ----- test codecs ------------------------------------------------------------------------------------------
class XorCodec(Codec):
    """BYTES_TO_BYTES test codec: XOR every byte with ``mask`` (a decode-relevant header param)."""

    codec_id: ClassVar[str] = "test-xor"
    stage: ClassVar[Stage] = Stage.BYTES_TO_BYTES
    lossless: ClassVar[bool] = True
    config_options: ClassVar[tuple[str, ...]] = ("mask",)

    def __init__(self, mask: int = 0x5A) -> None:
        self.mask = mask

    def max_encoded_size(self, nbytes: int, spec: KVSpec) -> int:
        return nbytes

    def encode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        n = len(src)
        dst[:n] = (np.frombuffer(src, np.uint8) ^ np.uint8(self.mask)).tobytes()
        return n

    def decode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        return self.encode_into(src, dst, spec, ctx)

    def header_params(self) -> bytes:
        return bytes([self.mask])

    def get_config(self) -> dict[str, object]:
        return {"id": self.codec_id, "mask": self.mask}

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> Self:
        options = cls.check_options(config)
        mask = options.get("mask", 0x5A)
        assert isinstance(mask, int)
        return cls(mask)


class TagCodec(Codec):
    """BYTES_TO_BYTES, must be last: appends sha256(key, aad, payload)[:8] and checks it (AEAD stand-in)."""

    codec_id: ClassVar[str] = "test-tag"
    stage: ClassVar[Stage] = Stage.BYTES_TO_BYTES
    lossless: ClassVar[bool] = True
    must_be_last: ClassVar[bool] = True

    @staticmethod
    def _tag(payload: memoryview, ctx: CodecContext) -> bytes:
        return hashlib.sha256(ctx.key.encode() + b"|" + ctx.aad + b"|" + bytes(payload)).digest()[:8]

    def max_encoded_size(self, nbytes: int, spec: KVSpec) -> int:
        return nbytes + 16  # loose on purpose: exercises trimming

    def encode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        n = len(src)
        dst[:n] = src
        dst[n : n + 8] = self._tag(src, ctx)
        return n + 8

    def decode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        body, tag = src[:-8], bytes(src[-8:])
        if len(src) < 8 or self._tag(body, ctx) != tag:
            raise ValueError("authentication tag mismatch")
        dst[: len(body)] = body
        return len(body)


class Raw2Codec(RawCodec):
    codec_id: ClassVar[str] = "test-raw2"


class FailingCodec(XorCodec):
    """Encodes like XorCodec, raises on decode."""

    codec_id: ClassVar[str] = "test-fail"

    def decode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        raise RuntimeError("boom")


class OverflowCodec(XorCodec):
    """Claims to have decoded more bytes than its buffer holds."""

    codec_id: ClassVar[str] = "test-overflow"

    def decode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        return len(dst) + 1


class ShortArrayCodec(RawCodec):
    """An array codec that decodes one byte too few."""

    codec_id: ClassVar[str] = "test-short"

    def decode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        return max(0, super().decode_into(src, dst, spec, ctx) - 1)


class UnderstatedBoundCodec(XorCodec):
    """Broken: its bound is smaller than what it writes (the kit must notice)."""

    codec_id: ClassVar[str] = "test-understated"

    def max_encoded_size(self, nbytes: int, spec: KVSpec) -> int:
        return nbytes + 1

    def encode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        n = super().encode_into(src, dst, spec, ctx)
        return n + 2  # reports more than the bound


class CorruptingCodec(XorCodec):
    """Broken: decoding flips the first byte (the kit must notice)."""

    codec_id: ClassVar[str] = "test-corrupting"

    def decode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        n = super().decode_into(src, dst, spec, ctx)
        if n:
            dst[0] ^= 0x01
        return n


class SloppyConfigCodec(XorCodec):
    """Broken: accepts any option silently (the kit must notice)."""

    codec_id: ClassVar[str] = "test-sloppy"

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> Self:
        return cls()


_TEST_CODECS: list[type[Codec]] = [
    XorCodec, TagCodec, Raw2Codec, FailingCodec, OverflowCodec, ShortArrayCodec, UnderstatedBoundCodec,
    CorruptingCodec, SloppyConfigCodec,
]  # fmt: skip


class _TestCodecsPlugin:
    @hookimpl
    def tiercache_register_codecs(self, register: CodecRegistrar) -> None:
        for cls in _TEST_CODECS:
            register(cls.codec_id, f"{__name__}:{cls.__name__}")


@pytest.fixture(autouse=True)
def _registry_with_test_codecs() -> Iterator[None]:
    registry = Registry()
    registry.add_plugin(_TestCodecsPlugin(), "tests")
    reset_registry(registry)
    yield
    reset_registry(None)


def _array(spec: KVSpec = SPEC, seed: int = 7) -> torch.Tensor:
    raw = np.random.default_rng(seed).integers(1, 256, size=spec.nbytes, dtype=np.uint8)
    return torch.from_numpy(raw).view(getattr(torch, spec.dtype)).reshape(spec.shape)


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(as_readable_bytes(t))


# ----- the kit on a three-stage chain ----------------------------------------------------------------------
class TestThreeStageConformance(CodecConformance):
    chain = ["raw", {"id": "test-xor", "mask": 0x33}, "test-tag"]  # noqa: RUF012


@pytest.mark.parametrize(
    ("codec_id", "test_name"),
    [
        ("test-understated", "test_stage_output_within_bound"),
        ("test-corrupting", "test_round_trip"),
        ("test-sloppy", "test_config_round_trip"),
    ],
)
def test_kit_catches_broken_codecs(codec_id: str, test_name: str) -> None:
    class Kit(CodecConformance):
        chain = ["raw", codec_id]  # noqa: RUF012

    with pytest.raises((AssertionError, pytest.fail.Exception, RuntimeError)):
        getattr(Kit(), test_name)()


# ----- chain validation ------------------------------------------------------------------------------------
def test_build_pipeline_accepts_ids_dicts_and_instances() -> None:
    pipe = build_pipeline(["raw", {"id": "test-xor", "mask": 7}, TagCodec()])
    assert pipe.chain == ("raw", "test-xor", "test-tag")
    assert pipe.get_config() == [{"id": "raw"}, {"id": "test-xor", "mask": 7}, {"id": "test-tag"}]
    assert pipe.lossless
    assert "XorCodec(mask=7)" in repr(pipe)


@pytest.mark.parametrize(
    ("chain", "match"),
    [
        ([], "empty"),
        (["raw", "nope", "zip9"], r"'nope', 'zip9'"),
        ("raw", "list"),
        ([42], "id or a dict"),
        ([{"mask": 1}], "needs a string 'id'"),
        ([{"id": "test-xor", "colour": 1}], "colour"),
        ([{"id": "raw", "level": 3}], "level"),
        (["test-xor", "raw"], "start with an array-to-bytes"),
        (["raw", "test-raw2"], "more than one array-to-bytes codec: test-raw2"),
        (["raw", "test-tag", "test-xor"], "test-tag must be last"),
    ],
)
def test_invalid_chains_rejected(chain: list[ChainEntry], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_pipeline(chain)


@pytest.mark.parametrize(
    ("chain", "match"),
    [
        ([], "empty"),
        (["raw", "nope"], "'nope'"),
        (["raw", {"id": "test-xor", "colour": 1}], "colour"),
        (["raw", "test-tag", "test-xor"], "test-tag must be last"),
        (["test-xor"], "start with"),
    ],
)
def test_validate_only_rejects(chain: list[ChainEntry], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_pipeline(chain, validate_only=True)


def test_validate_only_does_not_build_codecs(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_build(*args: object) -> None:
        raise AssertionError("validate_only built a codec")

    monkeypatch.setattr(XorCodec, "__init__", no_build)
    build_pipeline(["raw", {"id": "test-xor", "mask": 3}, "test-tag"], validate_only=True)
    with pytest.raises(AssertionError, match="built a codec"):
        build_pipeline(["raw", {"id": "test-xor", "mask": 3}])


def test_codec_class_uses_registry() -> None:
    assert _codec_class("test-xor") is XorCodec
    assert _codec_class("raw") is RawCodec
    assert _codec_class("never-registered") is None


# ----- encode ----------------------------------------------------------------------------------------------
def test_encode_accepts_tensor_numpy_and_bytes() -> None:
    pipe = build_pipeline(["raw"])
    t = _array()
    frame = pipe.encode(t, SPEC, KEY)
    assert len(frame) == pipe.max_frame_size(SPEC)
    assert frame[read_header(frame).header_len :] == _bytes(t)
    assert pipe.encode(_bytes(t), SPEC, KEY) == frame
    assert pipe.encode(bytearray(_bytes(t)), SPEC, KEY) == frame
    assert pipe.encode(np.frombuffer(_bytes(t), np.uint8), SPEC, KEY) == frame
    fp32 = KVSpec(2, 2, 4, "float32", tokens=5)
    arr = np.arange(fp32.nbytes // 4, dtype=np.float32).reshape(fp32.shape)
    assert pipe.decode(pipe.encode(arr, fp32, KEY), KEY)[0].numpy().tobytes() == arr.tobytes()


def test_encode_non_contiguous_tensor() -> None:
    pipe = build_pipeline(["raw"])
    t = _array()
    nc = t.transpose(0, 1).contiguous().transpose(0, 1)
    assert not nc.is_contiguous()
    out, _ = pipe.decode(pipe.encode(nc, SPEC, KEY), KEY)
    assert _bytes(out) == _bytes(t)


def test_encode_rejects_wrong_size_and_dtype() -> None:
    pipe = build_pipeline(["raw"])
    with pytest.raises(ValueError, match="bytes"):
        pipe.encode(bytes(SPEC.nbytes + 1), SPEC, KEY)
    same_size = torch.zeros(SPEC.nbytes // 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        pipe.encode(same_size, SPEC, KEY)


def test_encode_into_caller_buffer() -> None:
    pipe = build_pipeline(["raw", "test-xor", "test-tag"])
    t = _array()
    buf = bytearray(pipe.max_frame_size(SPEC) + 10)
    n = pipe.encode_into(t, SPEC, KEY, buf)
    assert n < pipe.max_frame_size(SPEC)  # the tag codec's bound is loose
    assert bytes(buf[:n]) == bytes(pipe.encode(t, SPEC, KEY))
    out, _ = pipe.decode(memoryview(buf)[:n], KEY)
    assert _bytes(out) == _bytes(t)
    arr = np.zeros(pipe.max_frame_size(SPEC), np.uint8)
    assert pipe.encode_into(t, SPEC, KEY, arr) == n
    with pytest.raises(ValueError, match="smaller"):
        pipe.encode_into(t, SPEC, KEY, bytearray(n - 1))


def test_codecs_see_key_and_static_header() -> None:
    seen: list[CodecContext] = []

    class Spy(XorCodec):
        def encode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
            seen.append(ctx)
            return super().encode_into(src, dst, spec, ctx)

        def decode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
            seen.append(ctx)
            return super().decode_into(src, dst, spec, ctx)

    pipe = build_pipeline(["raw", Spy()])
    frame = pipe.encode(_array(), SPEC, KEY)
    pipe.decode(frame, KEY)
    header = read_header(frame)
    assert seen[0] == seen[1] == CodecContext(KEY, bytes(frame[: header.static_len]))
    assert seen[0].aad == pipe.static_header(SPEC, KEY)


# ----- decode ----------------------------------------------------------------------------------------------
def test_decode_returns_tensor_of_spec() -> None:
    pipe = build_pipeline(["raw", "test-xor"])
    t = _array()
    out, spec = pipe.decode(pipe.encode(t, SPEC, KEY), KEY)
    assert spec == SPEC
    assert out.dtype == torch.bfloat16
    assert tuple(out.shape) == SPEC.shape
    assert _bytes(out) == _bytes(t)


def test_decode_into_numpy_and_tensor() -> None:
    pipe = build_pipeline(["raw"])
    t = _array()
    frame = pipe.encode(t, SPEC, KEY)
    arr = np.zeros(SPEC.nbytes, np.uint8)
    assert pipe.decode_into(frame, KEY, arr) == SPEC
    assert arr.tobytes() == _bytes(t)
    dst = torch.zeros(SPEC.shape, dtype=torch.bfloat16)
    pipe.decode_into(frame, KEY, dst, expected_spec=SPEC)
    assert _bytes(dst) == _bytes(t)


def test_decode_into_rejects_bad_destinations() -> None:
    pipe = build_pipeline(["raw"])
    frame = pipe.encode(_array(), SPEC, KEY)
    with pytest.raises(ValueError, match="read-only"):
        pipe.decode_into(frame, KEY, bytes(SPEC.nbytes))
    nc = torch.zeros((SPEC.shape[1], SPEC.shape[0], *SPEC.shape[2:]), dtype=torch.bfloat16).transpose(0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        pipe.decode_into(frame, KEY, nc)
    with pytest.raises(FrameError, match="destination"):
        pipe.decode_into(frame, KEY, torch.zeros(SPEC.shape[0], dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        (["raw", "test-xor"], ["raw"]),
        (["raw"], ["raw", "test-xor"]),
        ([{"id": "raw"}, {"id": "test-xor", "mask": 1}], [{"id": "raw"}, {"id": "test-xor", "mask": 2}]),
        (["raw"], ["test-raw2"]),
    ],
)
def test_chain_mismatch_is_frame_error(writer: list[object], reader: list[object]) -> None:
    frame = build_pipeline(writer).encode(_array(), SPEC, KEY)  # type: ignore[arg-type]
    with pytest.raises(FrameError, match="chain"):
        build_pipeline(reader).decode(frame, KEY)  # type: ignore[arg-type]


def test_wrong_key_and_spec_are_frame_errors() -> None:
    pipe = build_pipeline(["raw"])
    frame = pipe.encode(_array(), SPEC, KEY)
    with pytest.raises(FrameError, match="another key"):
        pipe.decode(frame, "tc1.other")
    with pytest.raises(FrameError, match="expected"):
        pipe.decode(frame, KEY, expected_spec=SPEC.with_layers(0, 1))
    with pytest.raises(FrameError, match="not a frame"):
        pipe.decode(12345, KEY)
    with pytest.raises(FrameError, match="header describes"):
        pipe.decode(frame + b"\x00", KEY)
    with pytest.raises(FrameError, match="header describes"):
        pipe.decode(frame[:-1], KEY)


def test_tag_codec_rejects_moved_payload() -> None:
    """A payload re-framed under another spec with a valid checksum still fails the AAD-bound tag."""
    from tiercache.serde.frame import pack_header, payload_checksum

    pipe = build_pipeline(["raw", "test-tag"])
    frame = pipe.encode(_array(), SPEC, KEY)
    header = read_header(frame)
    payload = bytes(frame[header.header_len :])
    other = KVSpec(2, 2, 4, "float16", tokens=5)  # same size, other dtype
    forged = pack_header(
        other, [("raw", b""), ("test-tag", b"")], KEY, len(payload), payload_checksum(payload)
    )
    with pytest.raises(FrameError, match="test-tag"):
        pipe.decode(forged + payload, KEY)


@pytest.mark.parametrize(
    ("codec_id", "match"),
    [("test-fail", "boom"), ("test-overflow", "over its bound")],
)
def test_codec_failures_become_frame_errors(codec_id: str, match: str) -> None:
    pipe = build_pipeline(["raw", codec_id])
    frame = pipe.encode(_array(), SPEC, KEY)
    with pytest.raises(FrameError, match=match) as info:
        pipe.decode(frame, KEY)
    if codec_id == "test-fail":
        assert isinstance(info.value.__cause__, RuntimeError)


def test_short_array_decode_is_frame_error() -> None:
    pipe = build_pipeline(["test-short"])
    frame = pipe.encode(_array(), SPEC, KEY)
    with pytest.raises(FrameError, match="decoded"):
        pipe.decode(frame, KEY)


def test_check_frame_verifies_without_decoding() -> None:
    pipe = build_pipeline(["raw"])
    frame = pipe.encode(_array(), SPEC, KEY)
    assert pipe.check_frame(frame, KEY).spec == SPEC
    bad = bytearray(frame)
    bad[-1] ^= 0x80
    with pytest.raises(FrameError, match="checksum"):
        pipe.check_frame(bad, KEY)


# ----- buffers ---------------------------------------------------------------------------------------------
def test_readable_views_share_memory() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    mv = as_readable_bytes(arr)
    assert mv.format == "B"
    assert len(mv) == 48
    assert mv.ndim == 1
    arr[0, 0] = 99.0
    assert bytes(mv[:4]) == np.float32(99.0).tobytes()  # a view, not a copy
    t = torch.arange(6, dtype=torch.bfloat16)
    tv = as_readable_bytes(t)
    t[0] = 5
    assert bytes(tv[:2]) == t[:1].view(torch.uint8).numpy().tobytes()
    assert len(as_readable_bytes(np.zeros((2, 3), np.int16).data)) == 12
    assert bytes(as_readable_bytes(memoryview(b"abcdef")[::2])) == b"ace"
    assert len(as_readable_bytes(torch.zeros(0, 3, dtype=torch.float8_e4m3fn))) == 0
    with pytest.raises(TypeError):
        as_readable_bytes(3.5)


def test_writable_views() -> None:
    t = torch.zeros(4, dtype=torch.float16)
    mv = as_writable_bytes(t)
    mv[:2] = np.float16(1.0).tobytes()
    assert float(t[0]) == 1.0
    buf = bytearray(4)
    as_writable_bytes(memoryview(buf))[1] = 7
    assert buf[1] == 7
    for bad in (b"1234", memoryview(b"1234"), np.zeros(4)[::2], torch.zeros(4, 2).t(), object()):
        with pytest.raises((ValueError, TypeError)):
            as_writable_bytes(bad)
    ro = np.zeros(4)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        as_writable_bytes(ro)


def test_import_serde_does_not_import_torch() -> None:
    code = "import sys, tiercache, tiercache.serde; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd="/", check=False).returncode == 0


# ----- copies (speed is measured by benchmarks/codec_bench.py, not asserted here) ------------------------
def test_raw_decode_copies_the_payload_straight_into_the_destination() -> None:
    """A 32 MiB raw decode allocates no intermediate buffer (traced allocations stay far below one copy)."""
    import tracemalloc

    spec = KVSpec(32, 8, 128, "bfloat16", tokens=256)  # 32 MiB
    assert spec.nbytes == 32 << 20
    pipe = build_pipeline(["raw"])
    src = torch.ones(spec.shape, dtype=torch.bfloat16)
    frame = pipe.encode(src, spec, KEY)
    dst = torch.empty(spec.shape, dtype=torch.bfloat16)
    pipe.decode_into(frame, KEY, dst)  # warm: one-off imports and caches are not the decode's copies
    dst.zero_()
    tracemalloc.start()
    try:
        pipe.decode_into(frame, KEY, dst)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(dst, src)
    assert peak < (1 << 20), f"decode allocated {peak} bytes (one copy of the payload is {spec.nbytes})"


def test_pipeline_constructor_validates_directly() -> None:
    with pytest.raises(ConfigError):
        CodecPipeline([])
