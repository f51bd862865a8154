"""fp8 payload math: KV quantized to float8 e4m3 with float32 absmax scales, and back.

The one definition of the fp8 payload that the ``fp8`` codec (``tiercache.serde.fp8``) frames and the GPU
kernels' torch reference (``tiercache.gpu.reference``) gathers and scatters; it knows no frame format.

Payload layout (little-endian): ``num_scales`` float32 scales, then one e4m3fn byte per element in the
array's C order; empty when the object holds no tokens. Granularity ``"channel"``: one scale per (plane,
layer, channel) over the object's tokens; ``"token"``: one per (plane, layer, token, head). Scale
``s = max(absmax(group) / 448, 2**-126)``, ``q = e4m3(x / s)`` (nearest even, clamped to ±448), decoded
``x' = q · s`` in the spec's dtype (bf16, fp16 or fp32). Inputs must be finite (ValueError otherwise).
torch is imported by the functions that need it, never at module import.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tiercache.spec import KVFormat

if TYPE_CHECKING:
    import torch

    from tiercache.spec import KVSpec

__all__ = [
    "FP8_MAX",
    "GRANULARITIES",
    "SCALE_FLOOR",
    "SOURCE_DTYPES",
    "check_payload",
    "dequantize_into",
    "groups",
    "num_scales",
    "payload_nbytes",
    "quantize_into",
]

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
SCALE_FLOOR = 2.0**-126
"""Smallest scale (smallest normal float32): an all-zero group gets this scale and encodes as zeros."""
SOURCE_DTYPES = ("bfloat16", "float16", "float32")
"""The dtypes a payload quantizes from and decodes to."""
GRANULARITIES = {"token": 1, "channel": 2}
"""Granularity names and their codes (the codes the fp8 codec writes in its frame header)."""

_TILE_ELEMENTS = 1 << 18  # about 1 MiB of float32 per tile: cache-friendly and reused by the allocator


def groups(spec: KVSpec, granularity: str = "channel") -> tuple[tuple[int, ...], int]:
    """(shape the array is viewed as, the dim each scale's absmax reduces) for ``granularity``."""
    planes = spec.layers if spec.format is KVFormat.KV_MLA else 2 * spec.layers
    if granularity == "token":
        return (planes, spec.tokens, spec.num_kv_heads, spec.head_dim), 3
    if granularity == "channel":
        return (planes, spec.tokens, spec.num_kv_heads * spec.head_dim), 1
    names = ", ".join(sorted(GRANULARITIES))
    raise ValueError(f"fp8 granularity must be one of {names}, not {granularity!r}")


def num_scales(spec: KVSpec, granularity: str = "channel") -> int:
    """Number of float32 scales in front of the e4m3 bytes (0 for an object of no tokens)."""
    if spec.tokens == 0:
        return 0
    shape, dim = groups(spec, granularity)
    return math.prod(shape) // shape[dim]


def payload_nbytes(spec: KVSpec, granularity: str = "channel") -> int:
    """Exact payload size: 4 bytes per scale plus one byte per element (0 for an object of no tokens)."""
    if spec.tokens == 0:
        return 0
    return 4 * num_scales(spec, granularity) + spec.nbytes // spec.itemsize


def _tensor_from(buf: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A torch view of ``buf`` (read-only buffers are never written through it)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": only read here
        return torch.frombuffer(buf, dtype=dtype) if len(buf) else torch.empty(0, dtype=dtype)


def _tile_rows(shape: Sequence[int]) -> int:
    """Rows of axis 0 per tile so that a tile holds about ``_TILE_ELEMENTS`` elements (at least one row)."""
    return max(1, _TILE_ELEMENTS // max(1, math.prod(shape[1:])))


def _check_dtype(spec: KVSpec) -> None:
    if spec.dtype not in SOURCE_DTYPES:
        raise ValueError(f"fp8 codec encodes {', '.join(SOURCE_DTYPES)} arrays, not {spec.dtype}")


def quantize_into(src: memoryview, dst: memoryview, spec: KVSpec, granularity: str = "channel") -> int:
    """Quantize ``src`` (the array's bytes) into the payload at the head of ``dst``; return its size.

    ``ValueError`` for a source dtype other than ``SOURCE_DTYPES``, a wrong source size or non-finite input.
    """
    import torch

    _check_dtype(spec)
    if len(src) != spec.nbytes:
        raise ValueError(f"fp8 codec got {len(src)} bytes for a {spec.nbytes}-byte array")
    n_scales = num_scales(spec, granularity)
    n = payload_nbytes(spec, granularity)
    if n_scales == 0:
        return 0
    shape, dim = groups(spec, granularity)
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


def check_payload(payload: memoryview, spec: KVSpec, granularity: str = "channel") -> None:
    """``ValueError`` unless ``payload`` is a well-formed payload of ``spec``: its exact size, and every
    scale finite and positive (what ``dequantize_into`` checks before it decodes)."""
    import torch

    n_scales = num_scales(spec, granularity)
    if len(payload) != payload_nbytes(spec, granularity):
        raise ValueError(f"fp8 payload of {len(payload)} bytes does not match {spec}")
    scale = _tensor_from(payload[: 4 * n_scales], torch.float32)
    if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise ValueError("fp8 payload holds an invalid scale")


def dequantize_into(src: memoryview, dst: memoryview, spec: KVSpec, granularity: str = "channel") -> int:
    """Decode the payload ``src`` into ``dst`` (``spec.nbytes`` bytes of ``spec.dtype``); return
    ``spec.nbytes``. ``ValueError`` for a malformed payload (``check_payload``) or a wrong ``dst`` size."""
    import torch

    _check_dtype(spec)
    check_payload(src, spec, granularity)
    if len(dst) != spec.nbytes:
        raise ValueError(f"fp8 destination of {len(dst)} bytes for a {spec.nbytes}-byte array")
    n_scales = num_scales(spec, granularity)
    if n_scales == 0:
        return 0
    shape, dim = groups(spec, granularity)
    raw = _tensor_from(src, torch.uint8)
    scale_shape = list(shape)
    scale_shape[dim] = 1
    scale = raw[: 4 * n_scales].view(torch.float32).reshape(scale_shape)
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
