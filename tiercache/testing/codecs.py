"""CodecConformance: the test kit every codec chain (built-in or third-party) must pass.

Subclass it in a test module under a ``Test*`` name and set ``chain``::

    class TestMyCodec(CodecConformance):
        chain = ["raw", {"id": "mycodec", "level": 3}]
        golden_dir = str(Path(__file__).parent / "golden" / "mycodec")  # optional

Golden files: ``TIERCACHE_REGEN_GOLDEN=1`` rewrites them from the current implementation; otherwise frames are
compared byte for byte. Inputs are a fixed formula (``golden_values``), never random.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache.buffers import as_readable_bytes
from tiercache.errors import ConfigError, FrameError
from tiercache.serde import CodecContext, CodecPipeline, build_pipeline, read_header
from tiercache.spec import DTYPE_SIZES, KVFormat, KVSpec

if TYPE_CHECKING:
    import torch

    from tiercache.serde.pipeline import ChainEntry

__all__ = [
    "DEFAULT_GOLDEN_CASES",
    "GOLDEN_ENV",
    "CodecConformance",
    "GoldenCase",
    "assert_close",
    "check_golden",
    "golden_array",
    "golden_values",
    "kv_specs",
    "load_golden_cases",
    "load_kv_sample",
    "random_array",
    "write_golden",
]

GOLDEN_ENV = "TIERCACHE_REGEN_GOLDEN"
_GOLDEN_FORMULA = "element i (C order) = ((i * 37 + 11) mod 251 - 125) / 64, converted to the spec's dtype"
_SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.differing_executors, HealthCheck.too_slow],
)
_FLOAT_DTYPES = frozenset({"bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"})


@dataclass(frozen=True, slots=True)
class GoldenCase:
    """One fixed input of the golden files: a spec, the key it is stored under and its file name."""

    name: str
    spec: KVSpec
    key: str

    @property
    def file(self) -> str:
        """File name of the encoded frame."""
        return f"{self.name}.bin"


DEFAULT_GOLDEN_CASES: tuple[GoldenCase, ...] = (
    GoldenCase("kv2ltd_bf16", KVSpec(2, 2, 4, "bfloat16", KVFormat.KV_2LTD, tokens=3), "golden.kv2ltd.bf16"),
    GoldenCase(
        "mla_fp16_layers1to3",
        KVSpec(4, 1, 8, "float16", KVFormat.KV_MLA, tokens=2, layer_start=1, layer_end=3),
        "golden.mla.fp16",
    ),
)


# ----- inputs ----------------------------------------------------------------------------------------------
@st.composite
def kv_specs(draw: st.DrawFn, dtypes: Sequence[str] = tuple(DTYPE_SIZES), max_tokens: int = 300) -> KVSpec:
    """Random small KVSpecs: both formats, the given dtypes, 0..max_tokens tokens, any layer range."""
    fmt = draw(st.sampled_from(list(KVFormat)))
    num_layers = draw(st.integers(1, 4))
    start = draw(st.integers(0, num_layers - 1))
    end = draw(st.integers(start + 1, num_layers))
    heads = 1 if fmt is KVFormat.KV_MLA else draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    tokens = draw(st.integers(0, max_tokens))
    dtype = draw(st.sampled_from(sorted(dtypes)))
    return KVSpec(num_layers, heads, head_dim, dtype, fmt, tokens, start, end)


def random_array(spec: KVSpec, seed: int, *, floats: bool = False) -> torch.Tensor:
    """A tensor of ``spec`` from ``seed``: random non-zero bytes, or (``floats``) finite normal values."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    dtype = getattr(torch, spec.dtype)
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    if floats and spec.dtype in _FLOAT_DTYPES:
        values = rng.standard_normal(spec.shape, dtype=np.float32) * 4.0 + 0.5
        return torch.from_numpy(values).to(dtype)
    raw = rng.integers(1, 256, size=spec.nbytes, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(spec.shape)


def golden_values(n: int) -> list[float]:
    """The fixed golden input: ``((i * 37 + 11) % 251 - 125) / 64`` (exact in bf16, fp16 and fp32)."""
    return [((i * 37 + 11) % 251 - 125) / 64 for i in range(n)]


def golden_array(spec: KVSpec) -> torch.Tensor:
    """The golden input tensor of ``spec``."""
    import math

    import torch

    values = torch.tensor(golden_values(math.prod(spec.shape)), dtype=torch.float32)
    return values.to(getattr(torch, spec.dtype)).reshape(spec.shape)


def load_kv_sample(directory: Path) -> tuple[torch.Tensor, KVSpec]:
    """The KV sample saved in ``directory`` (``kv.json``: its spec; ``kv.bin``: its bytes) as a tensor and
    its spec; ValueError when the bytes are not the spec's size."""
    import torch

    s = json.loads((directory / "kv.json").read_text())["spec"]
    spec = KVSpec(
        s["num_layers"], s["num_kv_heads"], s["head_dim"], s["dtype"], KVFormat[s["format"]], s["tokens"]
    )
    data = bytearray((directory / "kv.bin").read_bytes())
    if len(data) != spec.nbytes:
        raise ValueError(f"{directory / 'kv.bin'} holds {len(data)} bytes, its spec {spec.nbytes}")
    return torch.frombuffer(data, dtype=getattr(torch, spec.dtype)).reshape(spec.shape), spec


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(as_readable_bytes(tensor))


def assert_close(
    expected: torch.Tensor, actual: torch.Tensor, lossless: bool, max_relative_error: float
) -> None:
    """Bit-exact when ``lossless``, else max|a - e| <= max_relative_error * max|e| (in float32)."""
    import torch

    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    if lossless:
        assert _raw_bytes(actual) == _raw_bytes(expected), "lossless round trip changed the data"
        return
    if expected.numel() == 0:
        return
    e = expected.to(torch.float32)
    a = actual.to(torch.float32)
    assert bool(torch.isfinite(a).all()), "lossy round trip produced non-finite values"
    err = float((a - e).abs().max())
    scale = float(e.abs().max())
    assert err <= max_relative_error * scale, f"error {err} over {max_relative_error} x {scale}"


def _expect_frame_error(pipe: CodecPipeline, frame: bytes | bytearray, key: str, what: str) -> None:
    try:
        pipe.decode(frame, key)
    except FrameError:
        return
    pytest.fail(f"{what} was not detected: the damaged frame decoded")


# ----- golden files ----------------------------------------------------------------------------------------
def _spec_json(spec: KVSpec) -> dict[str, object]:
    d = asdict(spec)
    d["format"] = spec.format.name
    return d


def _spec_from_json(d: dict[str, Any]) -> KVSpec:
    return KVSpec(**{**d, "format": KVFormat[d["format"]]})


def write_golden(
    pipeline: CodecPipeline, golden_dir: str | Path, cases: Sequence[GoldenCase] = DEFAULT_GOLDEN_CASES
) -> None:
    """(Re)write ``spec.json`` and one ``<case>.bin`` frame per case in ``golden_dir``."""
    root = Path(golden_dir)
    root.mkdir(parents=True, exist_ok=True)
    doc = {
        "chain": pipeline.get_config(),
        "values": _GOLDEN_FORMULA,
        "cases": [{"name": c.name, "file": c.file, "key": c.key, "spec": _spec_json(c.spec)} for c in cases],
    }
    (root / "spec.json").write_text(json.dumps(doc, indent=2) + "\n")
    for case in cases:
        (root / case.file).write_bytes(bytes(pipeline.encode(golden_array(case.spec), case.spec, case.key)))


def load_golden_cases(golden_dir: str | Path) -> list[GoldenCase]:
    """The cases described by ``golden_dir/spec.json``."""
    doc = json.loads((Path(golden_dir) / "spec.json").read_text())
    return [GoldenCase(c["name"], _spec_from_json(c["spec"]), c["key"]) for c in doc["cases"]]


def check_golden(
    pipeline: CodecPipeline,
    golden_dir: str | Path,
    *,
    deterministic: bool = True,
    max_relative_error: float = 0.0,
) -> None:
    """Encode the golden inputs and compare with the stored frames byte for byte; decode the stored frames.

    With ``TIERCACHE_REGEN_GOLDEN=1`` the files are rewritten first.
    """
    if os.environ.get(GOLDEN_ENV) == "1":
        write_golden(pipeline, golden_dir)
    root = Path(golden_dir)
    if not (root / "spec.json").exists():
        pytest.fail(f"no golden files in {root}: run with {GOLDEN_ENV}=1 to create them")
    cases = load_golden_cases(root)
    assert cases
    for case in cases:
        stored = (root / case.file).read_bytes()
        header = read_header(stored)
        assert header.spec == case.spec
        assert header.chain == pipeline.chain
        expected = golden_array(case.spec)
        if deterministic:
            frame = bytes(pipeline.encode(expected, case.spec, case.key))
            assert frame == stored, f"{case.file}: encoding changed (frame format or codec output drifted)"
        tensor, spec = pipeline.decode(stored, case.key)
        assert spec == case.spec
        assert_close(expected, tensor, pipeline.lossless, max_relative_error)


# ----- the kit ---------------------------------------------------------------------------------------------
class CodecConformance:
    """Contract tests for a codec chain; subclass with a ``Test*`` name and set ``chain``."""

    chain: ClassVar[list[ChainEntry]]
    """The pipeline under test, as ``build_pipeline`` takes it (e.g. ``["raw"]``)."""
    golden_dir: ClassVar[str | None] = None
    """Folder with ``spec.json`` and golden frames; None skips the golden test."""
    max_relative_error: ClassVar[float] = 0.0
    """For lossy chains: allowed max|decoded - input| relative to max|input|."""
    dtypes: ClassVar[Sequence[str]] = tuple(DTYPE_SIZES)
    """Input dtypes the chain accepts."""
    deterministic: ClassVar[bool] = True
    """False for chains whose frames differ per encode (random nonces): goldens are then only decoded."""
    key: ClassVar[str] = "tc1.conformance.key"

    # ----- helpers -----
    def make_pipeline(self) -> CodecPipeline:
        """The pipeline under test."""
        return build_pipeline(self.chain)

    def make_array(self, spec: KVSpec, seed: int) -> torch.Tensor:
        """Input data for ``spec``: arbitrary non-zero bytes when lossless, finite floats when lossy."""
        return random_array(spec, seed, floats=not self.make_pipeline().lossless)

    def small_frame(self) -> tuple[CodecPipeline, KVSpec, torch.Tensor, bytes]:
        """A pipeline, spec, input and frame small enough to tamper with exhaustively."""
        pipe = self.make_pipeline()
        dtype = "bfloat16" if "bfloat16" in self.dtypes else sorted(self.dtypes)[0]
        spec = KVSpec(2, 1, 8, dtype, KVFormat.KV_2LTD, tokens=3)
        array = self.make_array(spec, 1234)
        return pipe, spec, array, bytes(pipe.encode(array, spec, self.key))

    # ----- round trip -----
    @_SETTINGS
    @given(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def test_round_trip(self, data: st.DataObject, seed: int) -> None:
        spec = data.draw(kv_specs(self.dtypes))
        pipe = self.make_pipeline()
        array = self.make_array(spec, seed)
        frame = pipe.encode(array, spec, self.key)
        header = read_header(frame)
        assert header.spec == spec
        assert header.chain == pipe.chain
        assert header.frame_len == len(frame)
        assert len(frame) <= pipe.max_frame_size(spec)
        for form in (bytes(frame), memoryview(frame)):
            tensor, got = pipe.decode(form, self.key)
            assert got == spec
            assert tuple(tensor.shape) == spec.shape
            assert_close(array, tensor, pipe.lossless, self.max_relative_error)

    @_SETTINGS
    @given(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def test_stage_output_within_bound(self, data: st.DataObject, seed: int) -> None:
        spec = data.draw(kv_specs(self.dtypes))
        pipe = self.make_pipeline()
        ctx = CodecContext(key=self.key, aad=pipe.static_header(spec, self.key))
        src = as_readable_bytes(self.make_array(spec, seed))
        n_in = len(src)
        for codec in pipe.codecs:
            bound = codec.max_encoded_size(n_in, spec)
            assert bound >= 0
            dst = memoryview(bytearray(bound))
            n = codec.encode_into(src, dst, spec, ctx)
            assert 0 <= n <= bound, f"{codec.codec_id} wrote {n} bytes, bound {bound}"
            src, n_in = dst[:n], n
        frame = pipe.encode(self.make_array(spec, seed), spec, self.key)
        assert read_header(frame).payload_len <= pipe.bounds(spec)[-1]

    @_SETTINGS
    @given(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def test_decode_into_writes_exactly_the_destination(self, data: st.DataObject, seed: int) -> None:
        spec = data.draw(kv_specs(self.dtypes))
        pipe = self.make_pipeline()
        array = self.make_array(spec, seed)
        frame = pipe.encode(array, spec, self.key)
        guard = 64
        buf = bytearray(b"\xa5" * (spec.nbytes + 2 * guard))
        got = pipe.decode_into(frame, self.key, memoryview(buf)[guard : guard + spec.nbytes], spec)
        assert got == spec
        assert buf[:guard] == b"\xa5" * guard, "decode_into wrote before its destination"
        assert buf[guard + spec.nbytes :] == b"\xa5" * guard, "decode_into wrote past its destination"
        tensor, _ = pipe.decode(frame, self.key)
        assert bytes(buf[guard : guard + spec.nbytes]) == _raw_bytes(tensor)
        for size in (spec.nbytes - 1, spec.nbytes + 1):
            if size >= 0:
                with pytest.raises(FrameError):
                    pipe.decode_into(frame, self.key, bytearray(size))

    def test_decode_into_tensor(self) -> None:
        import torch

        pipe, spec, array, frame = self.small_frame()
        out = torch.empty(spec.shape, dtype=array.dtype)
        assert pipe.decode_into(frame, self.key, out) == spec
        assert_close(array, out, pipe.lossless, self.max_relative_error)

    def test_zero_tokens(self) -> None:
        pipe = self.make_pipeline()
        spec = KVSpec(3, 2, 4, sorted(self.dtypes)[0], tokens=0)
        array = self.make_array(spec, 0)
        tensor, got = pipe.decode(pipe.encode(array, spec, self.key), self.key)
        assert got == spec
        assert tuple(tensor.shape) == spec.shape

    # ----- config -----
    def test_config_round_trip(self) -> None:
        pipe = self.make_pipeline()
        for codec in pipe.codecs:
            config = codec.get_config()
            assert config["id"] == codec.codec_id
            json.dumps(config)  # JSON-compatible
            again = type(codec).from_config(config)
            assert again.get_config() == config
            assert again.header_params() == codec.header_params()
            with pytest.raises(ConfigError, match="no_such_option"):
                type(codec).from_config({**config, "no_such_option": 1})
        rebuilt = build_pipeline(pipe.get_config())
        assert rebuilt.chain == pipe.chain
        _, _, array, frame = self.small_frame()
        tensor, _ = rebuilt.decode(frame, self.key)
        assert_close(array, tensor, pipe.lossless, self.max_relative_error)

    def test_wrong_array_size_rejected(self) -> None:
        pipe, spec, array, _ = self.small_frame()
        with pytest.raises(ValueError, match="bytes"):
            pipe.encode(_raw_bytes(array)[:-1], spec, self.key)

    # ----- tampering -----
    def test_wrong_key_rejected(self) -> None:
        pipe, _, _, frame = self.small_frame()
        with pytest.raises(FrameError):
            pipe.decode(frame, self.key + "x")

    def test_expected_spec_mismatch_rejected(self) -> None:
        pipe, spec, _, frame = self.small_frame()
        with pytest.raises(FrameError):
            pipe.decode_into(frame, self.key, bytearray(spec.nbytes), spec.with_tokens(spec.tokens + 1))

    def test_every_flipped_bit_rejected(self) -> None:
        pipe, _, _, frame = self.small_frame()
        header_len = read_header(frame).header_len
        positions = [(i, bit) for i in range(header_len) for bit in range(8)]
        payload = range(header_len, len(frame))
        positions += [(i, (i * 3) % 8) for i in payload]  # every payload byte, rotating bits
        positions += [(i, bit) for i in (payload[0], payload[-1]) for bit in range(8)]
        for pos, bit in positions:
            bad = bytearray(frame)
            bad[pos] ^= 1 << bit
            _expect_frame_error(pipe, bad, self.key, f"flipping bit {bit} of byte {pos}")

    def test_truncated_or_extended_rejected(self) -> None:
        pipe, _, _, frame = self.small_frame()
        for n in range(len(frame)):
            _expect_frame_error(pipe, frame[:n], self.key, f"truncating to {n} bytes")
        _expect_frame_error(pipe, frame + b"\x00", self.key, "appending a byte")

    # ----- golden -----
    def test_golden(self) -> None:
        if self.golden_dir is None:
            pytest.skip("no golden_dir set for this chain")
        check_golden(
            self.make_pipeline(),
            self.golden_dir,
            deterministic=self.deterministic,
            max_relative_error=self.max_relative_error,
        )
