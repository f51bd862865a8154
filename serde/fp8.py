"""The fp8 codec: KV quantized to float8 e4m3 with float32 absmax scales (ARRAY_TO_BYTES, lossy).

The payload (scales, then one e4m3 byte per element) and its error bound are defined in
``tiercache.fp8_math``, which the GPU gather/scatter reference uses too; this module frames it as a codec.
``granularity = "channel"`` (default): one scale per (plane, layer, channel) over the object's tokens
(KV_2LTD [2, L, T, H*D] has 2·L·H·D scales, KV_MLA [L, T, D] has L·D); ``"token"``: one per (plane, layer,
token, head). Channel scaling absorbs the outlier key channels and leaves more redundancy for a following
shuffle + zstd; ``benchmarks/codec_bench.py`` measures both. Inputs must be finite (ValueError on encode).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

from tiercache import fp8_math
from tiercache.errors import ConfigError
from tiercache.fp8_math import FP8_MAX, SCALE_FLOOR
from tiercache.serde._codec import Codec, CodecContext, Stage

if TYPE_CHECKING:
    from typing import Self

    from tiercache.spec import KVSpec

__all__ = ["FP8_MAX", "SCALE_FLOOR", "Fp8Codec"]

_GRANULARITIES = fp8_math.GRANULARITIES


def _granularity(value: object) -> str:
    """``value`` if it names a granularity; ConfigError otherwise."""
    if not isinstance(value, str) or value not in _GRANULARITIES:
        known = ", ".join(sorted(_GRANULARITIES))
        raise ConfigError(f"fp8 granularity must be one of {known}, not {value!r}")
    return value


_PARAMS_VERSION = 1


class Fp8Codec(Codec):
    """float8 e4m3 values with float32 absmax scales per channel or per (token, head); see the module doc."""

    codec_id: ClassVar[str] = "fp8"
    stage: ClassVar[Stage] = Stage.ARRAY_TO_BYTES
    lossless: ClassVar[bool] = False
    config_options: ClassVar[tuple[str, ...]] = ("granularity",)

    def __init__(self, granularity: str = "channel") -> None:
        """``granularity``: "channel" (per channel over the tokens) or "token" (per token and head)."""
        self.granularity = _granularity(granularity)

    # ----- config -----
    @classmethod
    def validate_config(cls, config: Mapping[str, object]) -> None:
        """Check option names and the granularity value."""
        _granularity(cls.check_options(config).get("granularity", "channel"))

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> Self:
        """Build from ``{"id": "fp8", "granularity": "channel" | "token"}``."""
        return cls(_granularity(cls.check_options(config).get("granularity", "channel")))

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
    def num_scales(self, spec: KVSpec) -> int:
        """Number of float32 scales in front of the fp8 data."""
        return fp8_math.num_scales(spec, self.granularity)

    def max_encoded_size(self, nbytes: int, spec: KVSpec) -> int:
        """Exactly 4 bytes per scale plus one byte per element."""
        return fp8_math.payload_nbytes(spec, self.granularity)

    # ----- encode / decode -----
    def encode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        """Quantize ``src`` (the array's bytes) into scales + e4m3 bytes; ValueError on non-finite input."""
        return fp8_math.quantize_into(src, dst, spec, self.granularity)

    def check_payload(self, payload: memoryview, spec: KVSpec) -> None:
        """``ValueError`` unless ``payload`` is a well-formed payload of ``spec`` (its length, and every scale
        finite and positive): what ``decode_into`` checks before it decodes (an fp8 L1 keeps payloads as they
        are and dequantizes them later, on the GPU)."""
        fp8_math.check_payload(payload, spec, self.granularity)

    def decode_into(self, src: memoryview, dst: memoryview, spec: KVSpec, ctx: CodecContext) -> int:
        """Dequantize scales + e4m3 bytes into ``dst`` (``spec.nbytes`` bytes of ``spec.dtype``)."""
        return fp8_math.dequantize_into(src, dst, spec, self.granularity)
