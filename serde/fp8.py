"""The fp8 codec: KV quantized to float8 e4m3 with float32 absmax scales (ARRAY_TO_BYTES, lossy).

Output layout (little-endian): ``n_scales`` float32 scales, then one e4m3fn byte per element in the array's C
order. ``n_scales`` follows from the spec and the granularity (0 when the object holds no tokens):

- ``granularity = "channel"`` (default): one scale per (plane, layer, channel) over the object's T tokens.
  KV_2LTD [2, L, T, H*D] has 2·L·H·D scales, KV_MLA [L, T, D] has L·D.
- ``granularity = "token"``: one scale per (plane, layer, token, head) = per group of ``head_dim`` values.
  KV_2LTD has 2·L·T·H scales, KV_MLA has L·T.

Why "channel" by default, measured on the real-KV sample (tests/fixtures/kv_sample, bf16 [2, 4, 256, 256]):
per channel 2.63 % relative L2 error, fp8→shuffle→zstd 2.72× smaller than raw bf16; per token 2.40 % error but
only 2.58× (its float32 scales are 3 % of the fp8 bytes, and per-token normalisation leaves less redundancy
for zstd). Both stay under 3 %; only per channel reaches the 2.6× goal. Key outlier channels
(max/median channel absmax 3-4× in the sample) are what per-channel scaling absorbs.
``benchmarks/codec_bench.py`` reports both.

Scale: ``s = max(absmax(group) / 448, 2**-126)`` (the floor keeps all-zero groups finite), ``q = e4m3(x / s)``
(round to nearest even, clamped to ±448), decode ``x' = q · s`` converted to the spec's dtype (bf16, fp16 or
fp32; other source dtypes are refused). Error bound, per element:
``|x' - x| <= 2**-4 · |x| + 2**-10 · s + ulp_dtype(x')/2``, i.e. at most ≈ 0.066 × the group's absmax, and
about 2-3 % relative L2 error on KV-like data. Inputs must be finite (NaN/inf → ValueError on encode).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from tiercache.errors import ConfigError
from tiercache.serde._codec import Codec, CodecContext, Stage
from tiercache.spec import KVFormat

if TYPE_CHECKING:
    from typing import Self

    import torch

    from tiercache.spec import KVSpec

__all__ = ["FP8_MAX", "SCALE_FLOOR", "Fp8Codec"]

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
SCALE_FLOOR = 2.0**-126
"""Smallest scale (smallest normal float32): an all-zero group gets this scale and encodes as zeros."""
_SOURCE_DTYPES = ("bfloat16", "float16", "float32")
_GRANULARITIES = {"token": 1, "channel": 2}
_PARAMS_VERSION = 1


def _tensor_from(buf: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A torch view of ``buf`` (read-only buffers are never written through it)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": only read here
        return torch.frombuffer(buf, dtype=dtype) if len(buf) else torch.empty(0, dtype=dtype)


_TILE_ELEMENTS = 1 << 18  # about 1 MiB of float32 per tile: cache-friendly and reused by the allocator


def _tile_rows(shape: Sequence[int]) -> int:
    """Rows of axis 0 per tile so that a tile holds about ``_TILE_ELEMENTS`` elements (at least one row)."""
    return max(1, _TILE_ELEMENTS // max(1, math.prod(shape[1:])))


class Fp8Codec(Codec):
    """float8 e4m3 values with float32 absmax scales per channel or per (token, head); see the module doc."""

    codec_id: ClassVar[str] = "fp8"
    stage: ClassVar[Stage] = Stage.ARRAY_TO_BYTES
    lossless: ClassVar[bool] = False
    config_options: ClassVar[tuple[str, ...]] = ("granularity",)

    def __init__(self, granularity: str = "channel") -> None:
        """``granularity``: "channel" (per channel over the tokens) or "token" (per token and head)."""
        if granularity not in _GRANULARITIES:
            raise ConfigError(
                f"fp8 granularity must be one of {', '.join(sorted(_GRANULARITIES))}, not {granularity!r}"
            )
        self.granularity = granularity

    # ----- config -----
    @classmethod
    def validate_config(cls, config: Mapping[str, object]) -> None:
        """Check option names and the granularity value."""
        options = cls.check_options(config)
        granularity = options.get("granularity", "channel")
        if granularity not in _GRANULARITIES:
            raise ConfigError(
                f"fp8 granularity must be one of {', '.join(sorted(_GRANULARITIES))}, not {granularity!r}"
            )

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> Self:
        """Build from ``{"id": "fp8", "granularity": "channel" | "token"}``."""
        cls.validate_config(config)
        return cls(str(config.get("granularity", "channel")))

    def get_config(self) -> dict[str, object]:
        """The granularity (always written, so a config pins the on-wire layout)."""
        return {"id": self.codec_id, "granularity": self.granularity}

    def header_params(self) -> bytes:
        """Two bytes: params version (1) and granularity code (1 = token, 2 = channel)."""
        return bytes((_PARAMS_VERSION, _GRANULARITIES[self.granularity]))

    def output_itemsize(self, spec: KVSpec, itemsize: int) -> int:
        """One byte per element (the float32 scales in front are a small prefix)."""
        return 1

    # ----- layout -----
    def _groups(self, spec: KVSpec) -> tuple[tuple[int, ...], int]:
        """(shape the array is viewed as, dim reduced for the absmax) for this granularity."""
        planes = spec.layers if spec.format is KVFormat.KV_MLA else 2 * spec.layers
        if self.granularity == "token":
            return (planes, spec.tokens, spec.num_kv_heads, spec.head_dim), 3
        return (planes, spec.tokens, spec.num_kv_heads * spec.head_dim), 1

    def num_scales(self, spec: KVSpec) -> int:
        """Number of float32 scales in front of the fp8 data."""
        if spec.tokens == 0:
            return 0
        shape, dim = self._groups(spec)
        return math.prod(shape) // shape[dim]

    def _elements(self, spec: KVSpec) -> int:
        return spec.nbytes // spec.itemsize

    def max_encoded_size(self, nbytes: int, spec: KVSpec) -> int:
        """Exactly 4 bytes per scale plus one byte per element."""
        return 4 * self.num_scales(spec) + self._elements(spec)

    def _check_dtype(self, spec: KVSpec) -> None:
        if spec.dtype not in _SOURCE_DTYPES:
            raise ValueError(f"fp8 codec encodes {', '.join(_SOURCE_DTYPES)} arrays, not {spec.dtype}")

    # ----- encode / decode -----
    def encode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        """Quantize ``src`` (the array's bytes) into scales + e4m3 bytes; ValueError on non-finite input."""
        import torch

        self._check_dtype(spec)
        if len(src) != spec.nbytes:
            raise ValueError(f"fp8 codec got {len(src)} bytes for a {spec.nbytes}-byte array")
        n_scales = self.num_scales(spec)
        n = 4 * n_scales + self._elements(spec)
        if n_scales == 0:
            return 0
        shape, dim = self._groups(spec)
        scale_shape = list(shape)
        scale_shape[dim] = 1
        x_all = _tensor_from(src, getattr(torch, spec.dtype)).reshape(shape)
        out = _tensor_from(dst[:n], torch.uint8)
        scales_out = out[: 4 * n_scales].view(torch.float32).reshape(scale_shape)
        q_out = out[4 * n_scales :].view(torch.float8_e4m3fn).reshape(shape)
        # Tiles along the plane axis (never reduced) keep the float32 temporaries small and reused:
        # whole-object temporaries are fresh pages, which fault at about 0.5 GB/s.
        step = _tile_rows(shape)
        tile = torch.empty((step, *shape[1:]), dtype=torch.float32)  # reused: never scales the source
        magnitude = torch.empty_like(tile)
        for a in range(0, shape[0], step):
            rows = min(step, shape[0] - a)
            x = tile[:rows]
            x.copy_(x_all[a : a + rows])
            amax = torch.abs(x, out=magnitude[:rows]).amax(dim=dim, keepdim=True)
            if not bool(torch.isfinite(amax).all()):
                raise ValueError("fp8 codec needs finite input (found NaN or inf)")
            scale = (amax / FP8_MAX).clamp_min_(SCALE_FLOOR)
            scales_out[a : a + rows].copy_(scale)
            q_out[a : a + rows].copy_(x.div_(scale).clamp_(-FP8_MAX, FP8_MAX))
        return n

    def check_payload(self, payload: memoryview, spec: KVSpec) -> None:
        """``ValueError`` unless ``payload`` is a well-formed payload of ``spec`` (its length, and every scale
        finite and positive): what ``decode_into`` checks before it decodes (an fp8 L1 keeps payloads as they
        are and dequantizes them later, on the GPU)."""
        import torch

        n_scales = self.num_scales(spec)
        if len(payload) != 4 * n_scales + self._elements(spec):
            raise ValueError(f"fp8 payload of {len(payload)} bytes does not match {spec}")
        scale = _tensor_from(payload[: 4 * n_scales], torch.float32)
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ValueError("fp8 payload holds an invalid scale")

    def decode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        """Dequantize scales + e4m3 bytes into ``dst`` (``spec.nbytes`` bytes of ``spec.dtype``)."""
        import torch

        self._check_dtype(spec)
        n_scales = self.num_scales(spec)
        if len(src) != 4 * n_scales + self._elements(spec):
            raise ValueError(f"fp8 payload of {len(src)} bytes does not match {spec}")
        if len(dst) != spec.nbytes:
            raise ValueError(f"fp8 destination of {len(dst)} bytes for a {spec.nbytes}-byte array")
        if n_scales == 0:
            return 0
        shape, dim = self._groups(spec)
        raw = _tensor_from(src, torch.uint8)
        scale_shape = list(shape)
        scale_shape[dim] = 1
        scale = raw[: 4 * n_scales].view(torch.float32).reshape(scale_shape)
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ValueError("fp8 payload holds an invalid scale")
        q = raw[4 * n_scales :].view(torch.float8_e4m3fn).reshape(shape)
        out = _tensor_from(dst, getattr(torch, spec.dtype)).reshape(shape)
        step = _tile_rows(shape)
        tile = torch.empty((step, *shape[1:]), dtype=torch.float32)
        for a in range(0, shape[0], step):
            rows = min(step, shape[0] - a)
            x = tile[:rows]
            x.copy_(q[a : a + rows])
            out[a : a + rows].copy_(x.mul_(scale[a : a + rows]))
        return spec.nbytes
