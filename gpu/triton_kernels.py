# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
"""Triton kernels: gather/scatter a whole batch (every layer, every span, K and V) in one launch.

Semantics are the torch reference's (``tiercache.gpu.reference``), bit for bit: data moves as same-width
integer words, a gather refuses slots < 0 (``ValueError``), a scatter skips them and the ``skip_prefix``
tokens at the head of each span. Supported layouts: VLLM_FLASH (any strides with a dense head_dim, e.g. the
NHD ``[NB, BS, H, 2D]`` allocation seen through the ``[NB, H, BS, 2D]`` view), VLLM_LEGACY and VLLM_MLA;
CPU_BLOCKS and anything the kernels cannot address (layers with different strides, misaligned pointers)
raise ``Unsupported`` and the caller (``tiercache.gpu.dispatch``) falls back to the reference.

How the launch addresses memory. Every layer tensor has the same shape and strides (checked), so a paged
element is ``layer_base[l] + p*s_plane + block*s_blk + offset*s_off + head*s_head + d``. The per-layer bases
are word offsets from layer 0 in an int64 tensor (one launch for all layers); objects are contiguous
``[P, L, T, H*D]`` (KV_2LTD, P = 2) or ``[L, T, D]`` (KV_MLA, P = 1) and addressed as word offsets from object
0, one row of a small int64 span table per span. The word is the widest integer (8, 4, 2 or 1 bytes) that
divides head_dim's bytes, every stride and every base offset. Grid: (spans x token tiles, layers x planes,
heads x head_dim chunks); each program moves a ``[BLOCK_T, BLOCK_D]`` tile whose rows are contiguous
head_dim runs, 16-byte aligned when the alignment hints (checked on the host) allow vector loads.

The fused fp8 gather (``gather_fp8``) writes, per span, exactly the payload of ``Fp8Codec("channel")``:
float32 scales ``[P*L, 1, H*D]`` (``max(absmax over the span's tokens / 448, 2**-126)``) then e4m3 bytes
``[P*L, T, H*D]`` (``x / scale`` rounded to nearest even, clamped to +-448), so ``Fp8Codec.decode_into``
accepts it as is. Each program owns one (span, layer, plane, channel block) tile: when the tile fits
(``FP8_ONE_PASS_ELEMS``) it is loaded once and kept in registers for the absmax and the quantize; longer spans
fall back to two passes of 32 tokens (the second read mostly hits L2).

Host side: the tensor-free geometry, object shapes, span tables and layer offsets are cached (keyed by the
layers' pointers/shapes/strides, and by value), and the slot checks are queued without a sync (a CPU slot
mapping is checked on the host; a device one by a few reductions copied to pinned memory behind an event).

Kernels are compiled lazily (``TRITON_INTERPRET=1`` is read when they are first built, so tests can run them
on the CPU through Triton's interpreter).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tiercache.gpu.layouts import LayoutKind, PagedLayout, check_spans, layer_tensors, object_spec, span_skips

if TYPE_CHECKING:
    KVCaches = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]

__all__ = [
    "TileConfig",
    "Unsupported",
    "available",
    "gather",
    "gather_fp8",
    "plan_fp8",
    "scatter",
]

_WORDS: dict[int, torch.dtype] = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
FP8_MAX = 448.0
SCALE_FLOOR = 2.0**-126


class Unsupported(Exception):
    """The kernels cannot move this batch (layout, strides, alignment); use the torch reference."""


def available() -> bool:
    """True when triton imports."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the environment
        return False
    return True


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch shape; ``block_t`` 0 picks tokens per tile from ``tile_bytes``."""

    tile_bytes: int = 16384
    block_t: int = 0
    num_warps: int = 4


# best gather tile of the interleaved H200 A/B (benchmarks/gpu_ab.py; every tile 1686-1702 GB/s, within noise;
# scatter 1538, best 1539)
DEFAULT_CONFIG = TileConfig(tile_bytes=8192, num_warps=8)
_KERNELS: dict[bool, Any] = {}


def _interpret() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernels() -> Any:
    """Build (once per interpret mode) and return the jitted kernels."""
    mode = _interpret()
    k = _KERNELS.get(mode)
    if k is None:
        k = _build()
        _KERNELS[mode] = k
    return k


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _move_kernel(
        kv_ptr,
        obj_ptr,
        layer_off_ptr,
        span_ptr,
        slot_ptr,
        tiles_per_span,
        s_plane,
        s_blk,
        s_off,
        s_head,
        num_layers,
        heads,
        n_slots,
        BS: tl.constexpr,
        P: tl.constexpr,
        DW: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NDC: tl.constexpr,
        VEC: tl.constexpr,
        SCATTER: tl.constexpr,
    ):
        pid0 = tl.program_id(0)
        pid1 = tl.program_id(1).to(tl.int64)
        pid2 = tl.program_id(2)
        span = pid0 // tiles_per_span
        tile = pid0 % tiles_per_span
        row = span_ptr + span * 4
        s_start = tl.load(row)
        n_tok = tl.load(row + 1)
        first = tl.load(row + 2)
        o_off = tl.load(row + 3)
        layer = pid1 // P
        plane = pid1 % P
        head = (pid2 // NDC).to(tl.int64)
        dc = pid2 % NDC
        t = first + tile * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        tmask = t < n_tok
        slot = tl.load(slot_ptr + s_start + t, mask=tmask, other=-1).to(tl.int64)
        tmask = tmask & (slot >= 0) & (slot < n_slots)  # bad slots are reported by the host, never moved
        blk = slot // BS
        off = slot - blk * BS
        l_off = tl.load(layer_off_ptr + layer)
        paged_row = l_off + plane * s_plane + blk * s_blk + off * s_off + head * s_head
        hdw = heads * DW
        obj_row = o_off + ((plane * num_layers + layer) * n_tok + t) * hdw + head * DW
        paged_row = tl.multiple_of(paged_row, VEC)
        obj_row = tl.multiple_of(obj_row, VEC)
        d = dc * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = tmask[:, None] & (d < DW)[None, :]
        paged = kv_ptr + (paged_row[:, None] + d[None, :])
        obj = obj_ptr + (obj_row[:, None] + d[None, :])
        if SCATTER:
            x = tl.load(obj, mask=mask)
            tl.store(paged, x, mask=mask)
        else:
            x = tl.load(paged, mask=mask)
            tl.store(obj, x, mask=mask)

    # The e4m3 conversion below is written out in both fp8 passes on purpose: Triton resolves a called @jit
    # function through the module's globals, and these kernels are built per interpret mode inside _build, so
    # a shared helper here would be invisible to them (and a module-level one would mix the two modes).
    @triton.jit
    def _fp8_kernel(
        kv_ptr,
        out_ptr,
        layer_off_ptr,
        span_ptr,
        slot_ptr,
        s_plane,
        s_blk,
        s_off,
        s_head,
        num_layers,
        heads,
        n_slots,
        BS: tl.constexpr,
        P: tl.constexpr,
        D: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NDC: tl.constexpr,
        SOFT_CVT: tl.constexpr,
        VEC: tl.constexpr,
        OVEC: tl.constexpr,
        ONE_PASS: tl.constexpr,
    ):
        span = tl.program_id(0)
        pid1 = tl.program_id(1).to(tl.int64)
        pid2 = tl.program_id(2)
        row = span_ptr + span * 4
        s_start = tl.load(row)
        n_tok = tl.load(row + 1)
        o_off = tl.multiple_of(tl.load(row + 3), OVEC)  # byte offset of the span's payload from out_ptr
        layer = pid1 // P
        plane = pid1 % P
        head = (pid2 // NDC).to(tl.int64)
        d = (pid2 % NDC) * BLOCK_D + tl.arange(0, BLOCK_D)
        dmask = d < D
        l_off = tl.load(layer_off_ptr + layer)
        base = l_off + plane * s_plane + head * s_head
        group = plane * num_layers + layer  # plane-major, as the codec's [P*L, T, H*D] view
        hd = heads * D
        chan = head * D + d
        scale_ptr = (out_ptr + o_off).to(tl.pointer_type(tl.float32))
        q_base = out_ptr + o_off + 4 * P * num_layers * hd + group * n_tok * hd
        if ONE_PASS:
            # the whole [tokens, BLOCK_D] tile is loaded once and kept in registers: absmax, then quantize
            t = tl.arange(0, BLOCK_T).to(tl.int64)
            tmask = t < n_tok
            slot = tl.load(slot_ptr + s_start + t, mask=tmask, other=0).to(tl.int64)
            tmask = tmask & (slot >= 0) & (slot < n_slots)  # bad slots: reported by the host
            blk = slot // BS
            src = tl.multiple_of(base + blk * s_blk + (slot - blk * BS) * s_off, VEC)
            m = tmask[:, None] & dmask[None, :]
            x = tl.load(kv_ptr + (src[:, None] + d[None, :]), mask=m, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=0)
            scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)
            tl.store(scale_ptr + group * hd + chan, scale, mask=dmask)
            y = tl.math.div_rn(x, scale[None, :])
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
            if SOFT_CVT:
                # e4m3fn by integer rounding (round to nearest even), for Triton's interpreter, whose
                # float8 emulation mis-rounds mantissa carries; |y| <= 448 here, so no overflow
                a = tl.abs(y)
                ab = a.to(tl.int32, bitcast=True)
                r = ab + 0x7FFFF + ((ab >> 20) & 1)
                qn = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
                qs = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
                sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
                q = (tl.where(a < 0.015625, qs, qn) | (sign << 7)).to(tl.uint8)
            else:
                q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            tl.store(q_base + (t[:, None] * hd + chan[None, :]), q, mask=m)
        else:
            amax = tl.zeros([BLOCK_D], dtype=tl.float32)
            for t0 in range(0, n_tok, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
                tmask = t < n_tok
                slot = tl.load(slot_ptr + s_start + t, mask=tmask, other=0).to(tl.int64)
                tmask = tmask & (slot >= 0) & (slot < n_slots)  # bad slots: reported by the host
                blk = slot // BS
                src = tl.multiple_of(base + blk * s_blk + (slot - blk * BS) * s_off, VEC)
                m = tmask[:, None] & dmask[None, :]
                x = tl.load(kv_ptr + (src[:, None] + d[None, :]), mask=m, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
            scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)
            tl.store(scale_ptr + group * hd + chan, scale, mask=dmask)
            for t0 in range(0, n_tok, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
                tmask = t < n_tok
                slot = tl.load(slot_ptr + s_start + t, mask=tmask, other=0).to(tl.int64)
                tmask = tmask & (slot >= 0) & (slot < n_slots)  # bad slots: reported by the host
                blk = slot // BS
                src = tl.multiple_of(base + blk * s_blk + (slot - blk * BS) * s_off, VEC)
                m = tmask[:, None] & dmask[None, :]
                x = tl.load(kv_ptr + (src[:, None] + d[None, :]), mask=m, other=0.0).to(tl.float32)
                y = tl.math.div_rn(x, scale[None, :])
                y = tl.minimum(tl.maximum(y, -448.0), 448.0)
                if SOFT_CVT:
                    # e4m3fn by integer rounding (round to nearest even), for Triton's interpreter, whose
                    # float8 emulation mis-rounds mantissa carries; |y| <= 448 here, so no overflow
                    a = tl.abs(y)
                    ab = a.to(tl.int32, bitcast=True)
                    r = ab + 0x7FFFF + ((ab >> 20) & 1)
                    qn = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
                    qs = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
                    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
                    q = (tl.where(a < 0.015625, qs, qn) | (sign << 7)).to(tl.uint8)
                else:
                    q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
                tl.store(q_base + (t[:, None] * hd + chan[None, :]), q, mask=m)

    class K:
        move = _move_kernel
        fp8 = _fp8_kernel

    return K


# --------------------------------------------------------------------------------------------- planning


def _check_layer_range(layers: range, layout: PagedLayout) -> None:
    if not (0 <= layers.start <= layers.stop <= layout.num_layers) or len(layers) == 0:
        raise ValueError(f"layers {layers} out of range for {layout.num_layers} layers")


@dataclass
class _Geometry:
    """Word size, per-layer word offsets from layer 0 and the paged strides in words."""

    word: int
    vec: int
    kv_base: torch.Tensor  # aliasing layer 0's first element, word dtype
    layer_off: list[int]
    s_plane: int
    s_blk: int
    s_off: int
    s_head: int
    n_slots: int
    device: torch.device
    es: int = 2


@dataclass(frozen=True)
class _GeoInts:
    """The cached, tensor-free part of a ``_Geometry`` (holds no reference to the KV memory)."""

    word: int
    vec: int
    layer_off: tuple[int, ...]
    s_plane: int
    s_blk: int
    s_off: int
    s_head: int
    n_slots: int
    es: int


def _element_strides(t: torch.Tensor, layout: PagedLayout) -> tuple[int, int, int, int, int]:
    """(s_plane, s_blk, s_off, s_head, s_d) in elements of one layer tensor."""
    st = t.stride()
    if layout.kind is LayoutKind.VLLM_LEGACY:  # [2, NB, BS, H, D]
        return st[0], st[1], st[2], st[3], st[4]
    if layout.kind is LayoutKind.VLLM_MLA:  # [NB, 1, BS, C]
        return 0, st[0], st[2], st[1], st[3]
    return layout.head_dim * st[3], st[0], st[2], st[1], st[3]  # FLASH [NB, H, BS, 2D]: V after K


def _alias(t: torch.Tensor, dtype: torch.dtype, byte_offset: int = 0) -> torch.Tensor:
    """A 1-element tensor of ``dtype`` at ``t``'s first element (+ ``byte_offset``), sharing its storage."""
    start = t.storage_offset() * t.element_size() + byte_offset
    size = torch.empty((), dtype=dtype).element_size()
    if start % size:
        raise Unsupported("misaligned storage offset")
    out = torch.empty(0, dtype=dtype, device=t.device)
    out.set_(t.untyped_storage(), start // size, (1,), (1,))
    return out


def _align_of(ptrs: Sequence[int]) -> int:
    """The largest power of two <= 16 dividing every pointer (what the word and vector choice depends on)."""
    a = 16
    for p in ptrs:
        a = min(a, p & -p) if p else a
    return a


_GEO_CACHE: dict[tuple[Any, ...], _GeoInts] = {}


def _geometry(
    kv_caches: KVCaches, layout: PagedLayout, layers: range, extra_ptrs: Sequence[int]
) -> _Geometry:
    """The launch geometry; the integer part is cached by layout, layers and the layers' pointers, shapes
    and strides (engines keep their KV tensors), so a repeated call costs one pass over the layer list."""
    if layout.kind is LayoutKind.CPU_BLOCKS:
        raise Unsupported("CPU_BLOCKS moves whole pages: reference only")
    kv = layer_tensors(kv_caches)
    if len(kv) != layout.num_layers:
        raise ValueError(f"{len(kv)} KV cache tensors for a layout of {layout.num_layers} layers")
    first = kv[0]
    align = _align_of(extra_ptrs)
    key = (
        layout,
        layers.start,
        layers.stop,
        align,
        first.device,
        first.dtype,
        tuple((t.data_ptr(), t.shape, t.stride()) for t in kv),
    )
    g = _GEO_CACHE.get(key)
    if g is None:
        if len({t.device for t in kv}) != 1 or len({t.dtype for t in kv}) != 1:
            raise Unsupported("layers differ in device or dtype")
        g = _geometry_ints(kv, layout, layers, align)
        if len(_GEO_CACHE) > 64:
            _GEO_CACHE.clear()
        _GEO_CACHE[key] = g
    return _Geometry(
        word=g.word,
        vec=g.vec,
        kv_base=_alias(first, _WORDS[g.word]),
        layer_off=list(g.layer_off),
        s_plane=g.s_plane,
        s_blk=g.s_blk,
        s_off=g.s_off,
        s_head=g.s_head,
        n_slots=g.n_slots,
        device=first.device,
        es=g.es,
    )


def _geometry_ints(kv: list[torch.Tensor], layout: PagedLayout, layers: range, align: int) -> _GeoInts:
    nbs = {layout.num_blocks_of(t) for t in kv}
    if len(nbs) != 1:
        raise ValueError(f"layers hold different block counts: {sorted(nbs)}")
    first = kv[0]
    if len({t.stride() for t in kv}) != 1:
        raise Unsupported("layers differ in strides or device")
    es = first.element_size()
    s_plane, s_blk, s_off, s_head, s_d = _element_strides(first, layout)
    if s_d != 1 and layout.head_dim > 1:
        raise Unsupported("head_dim is not the innermost dense dim")
    ptrs = [t.data_ptr() for t in kv]
    base = ptrs[0]
    nb = nbs.pop()
    # strides of dims of size 1 never move the address: they are left out of the divisibility test
    dims = [(s_plane, layout.planes), (s_blk, nb), (s_off, layout.block_size), (s_head, layout.num_kv_heads)]
    terms = [layout.head_dim * es] + [s * es for s, n in dims if n > 1] + [p - base for p in ptrs]
    all_ptrs = [base, align]
    word = next(
        w
        for w in (8, 4, 2, 1)
        if w >= es
        if all(x % w == 0 for x in terms) and all(p % w == 0 for p in all_ptrs)
    )
    vec_words = max(1, 16 // word)
    vec = (
        vec_words
        if all((x // word) % vec_words == 0 for x in terms) and all(p % 16 == 0 for p in all_ptrs)
        else 1
    )

    def w(s: int, n: int) -> int:
        return (s * es) // word if n > 1 else 0

    return _GeoInts(
        word=word,
        vec=vec,
        layer_off=tuple((ptrs[i] - base) // word for i in layers),
        s_plane=w(s_plane, layout.planes),
        s_blk=w(s_blk, nb),
        s_off=w(s_off, layout.block_size),
        s_head=w(s_head, layout.num_kv_heads),
        n_slots=nb * layout.block_size,
        es=es,
    )


_SHAPES: dict[tuple[PagedLayout, int, int, int], tuple[tuple[int, ...], str]] = {}


def _object_shape(layout: PagedLayout, tokens: int, layers: range) -> tuple[tuple[int, ...], str]:
    """(shape, dtype name) of the object of ``tokens`` tokens of ``layers`` (cached)."""
    key = (layout, tokens, layers.start, layers.stop)
    r = _SHAPES.get(key)
    if r is None:
        spec = object_spec(layout, tokens)
        if len(layers) != layout.num_layers:
            spec = spec.with_layers(layers.start, layers.stop)
        r = (tuple(spec.shape), layout.dtype)
        if len(_SHAPES) > 4096:
            _SHAPES.clear()
        _SHAPES[key] = r
    return r


def _check_objects(
    objs: Sequence[torch.Tensor], layout: PagedLayout, spans: list[tuple[int, int]], layers: range, what: str
) -> None:
    for i, ((s, e), obj) in enumerate(zip(spans, objs, strict=True)):
        shape, dtype = _object_shape(layout, e - s, layers)
        if tuple(obj.shape) != shape:
            raise ValueError(f"{what}[{i}] has shape {tuple(obj.shape)}, expected {shape}")
        if str(obj.dtype).removeprefix("torch.") != dtype:
            raise ValueError(f"{what}[{i}] has dtype {obj.dtype}, layout dtype is {dtype}")
        if not obj.is_contiguous():
            raise Unsupported("objects must be contiguous")


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _tiles(dw: int, word: int, max_tokens: int, cfg: TileConfig) -> tuple[int, int, int]:
    """(BLOCK_D, NDC, BLOCK_T) for rows of ``dw`` words."""
    low = dw & -dw  # largest power of two dividing dw
    block_d = min(low, 256) if low == dw or low >= 32 else triton_next_pow2(dw)
    ndc = -(-dw // block_d)
    block_t = cfg.block_t or _pow2_floor(max(1, cfg.tile_bytes // (block_d * word)))
    block_t = max(1, min(block_t, triton_next_pow2(max(1, max_tokens)), 1024))
    return block_d, ndc, block_t


def triton_next_pow2(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()


# ------------------------------------------------------------------------------- small device tensors


_TABLES: dict[tuple[Any, ...], torch.Tensor] = {}


def _device_ints(values: Sequence[int] | Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """An int64 device tensor of ``values``, cached by value (span tables and layer offsets repeat: the
    staging buffers, the KV tensors and the chunking stay put); copied from pinned memory, never a sync."""
    key = (device, tuple(tuple(v) if isinstance(v, Sequence) else v for v in values))
    t = _TABLES.get(key)
    if t is None:
        host = torch.tensor(values, dtype=torch.int64)
        t = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
        if len(_TABLES) > 512:
            _TABLES.clear()
        _TABLES[key] = t
    return t


def _layer_offsets(geo: _Geometry, scale: int = 1) -> torch.Tensor:
    """The per-layer offsets (words, or elements with ``scale``) as a device int64 tensor (cached)."""
    return _device_ints([x * scale for x in geo.layer_off], geo.device)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def _device_slots(slot_mapping: torch.Tensor, device: torch.device) -> torch.Tensor:
    s = slot_mapping
    if s.dtype not in (torch.int32, torch.int64):
        s = s.to(torch.int64)
    if s.device != device:
        if s.device.type == "cpu" and device.type == "cuda":
            s = s.contiguous().pin_memory().to(device, non_blocking=True)
        else:
            s = s.to(device)
    return s.contiguous()


SLOT_CHECK_READ = (
    "event"  # how a device slot check is read: "event" (pinned copy + event) or "sync" (.tolist())
)


def _host_slots(slot_mapping: torch.Tensor, host_slots: torch.Tensor | None) -> torch.Tensor | None:
    """Validate the caller's CPU copy of ``slot_mapping`` (checked on the host instead of the device)."""
    if host_slots is None:
        return None
    if host_slots.device.type != "cpu" or tuple(host_slots.shape) != tuple(slot_mapping.shape):
        raise ValueError(
            f"host_slots must be a CPU tensor shaped like slot_mapping {tuple(slot_mapping.shape)}, "
            f"got {tuple(host_slots.shape)} on {host_slots.device}"
        )
    return host_slots


class SlotCheck:
    """The slot checks of one move, queued without a sync: [min, max, count >= 0] of the slots it touches.

    A CPU ``slot_mapping`` (or the caller's CPU copy of a device one, ``host_slots``) is checked on the host
    at once; a device one by a few reductions whose result is copied to pinned host memory behind an event,
    read by ``result()`` (which waits for that event only, not for the moves queued after it). The kernels
    never touch bad slots, so reading late is safe.
    """

    def __init__(
        self,
        slot_mapping: torch.Tensor,
        slots: torch.Tensor,
        span_list: list[tuple[int, int]],
        skips: list[int],
        *,
        count: bool,
        host_slots: torch.Tensor | None = None,
    ) -> None:
        self.span_list = span_list
        self._values: list[int] | None = None
        self._host: torch.Tensor | None = None
        self._stats: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        ranges = [(s + k, e) for (s, e), k in zip(span_list, skips, strict=True) if e > s + k]
        if host_slots is not None:
            src = host_slots
        else:
            src = slot_mapping if slot_mapping.device.type == "cpu" else slots
        self.slots = src
        if not ranges:
            self._values = [0, -1, 0]
            return
        if all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1)):
            sel = src[ranges[0][0] : ranges[-1][1]]
        else:
            sel = torch.cat([src[a:b] for a, b in ranges])
        if src.device.type == "cpu":
            lo, hi = torch.aminmax(sel)
            self._values = [int(lo), int(hi), int((sel >= 0).sum()) if count else 0]
            return
        lo, hi = torch.aminmax(sel)
        parts = [lo.to(torch.int64), hi.to(torch.int64)]
        if count:
            parts.append((sel >= 0).sum())
        stats = torch.stack(parts)
        if SLOT_CHECK_READ == "sync":
            self._stats = stats
            return
        self._host = torch.empty(stats.shape, dtype=torch.int64, pin_memory=True)
        self._host.copy_(stats, non_blocking=True)
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record()

    def result(self) -> list[int]:
        """[min, max, count] (count 0 unless asked for); waits for the queued checks only."""
        if self._values is None and self._stats is not None:
            v = self._stats.tolist()
            self._values = [v[0], v[1], v[2] if len(v) > 2 else 0]
        if self._values is None:
            assert self._host is not None
            assert self._event is not None
            self._event.synchronize()
            v = self._host.tolist()
            self._values = [v[0], v[1], v[2] if len(v) > 2 else 0]
        return self._values

    def check(self, n_slots: int, *, scatter: bool) -> int:
        """``ValueError`` for a slot past the KV, or < 0 in a gather; else the number of slots >= 0 (the
        tokens a scatter writes). The kernels never touch such slots."""
        lo, hi, written = self.result()
        if hi >= n_slots:
            raise ValueError(f"slot {hi} outside the paged KV of {n_slots} slots")
        if not scatter and lo < 0:
            bad = next((s, e) for (s, e) in self.span_list if e > s and int(self.slots[s:e].min()) < 0)
            raise ValueError(f"span {bad} has slots < 0: a token without KV cannot be stored")
        return written


@dataclass
class MovePlan:
    """Everything one launch needs; built by ``plan_gather``/``plan_scatter`` (checks queued, no sync)."""

    geo: _Geometry
    obj_base: torch.Tensor
    span_table: torch.Tensor
    slots: torch.Tensor
    tiles_per_span: int
    num_spans: int
    layers: int
    planes: int
    heads: int
    dw: int
    block_size: int
    scatter: bool
    checks: SlotCheck | None = None
    unchecked_tokens: int = 0  # what ``finish`` returns without checks (every slot taken as valid)

    def finish(self) -> int:
        """Read the slot checks (waits for them only): ``ValueError`` on bad slots, else tokens written."""
        if self.checks is None:
            return self.unchecked_tokens
        return self.checks.check(self.geo.n_slots, scatter=self.scatter)

    def launch(self, cfg: TileConfig = DEFAULT_CONFIG) -> None:
        if self.num_spans == 0 or self.tiles_per_span == 0:
            return
        k = _kernels()
        block_d, ndc, block_t = _tiles(self.dw, self.geo.word, self.tiles_per_span, cfg)
        tiles = -(-self.tiles_per_span // block_t)
        grid = (self.num_spans * tiles, self.layers * self.planes, self.heads * ndc)
        with torch.cuda.device(self.geo.device) if self.geo.device.type == "cuda" else _null():
            k.move[grid](
                self.geo.kv_base,
                self.obj_base,
                _layer_offsets(self.geo),
                self.span_table,
                self.slots,
                tiles,
                self.geo.s_plane,
                self.geo.s_blk,
                self.geo.s_off,
                self.geo.s_head,
                self.layers,
                self.heads,
                self.geo.n_slots,
                BS=self.block_size,
                P=self.planes,
                DW=self.dw,
                BLOCK_T=block_t,
                BLOCK_D=block_d,
                NDC=ndc,
                VEC=self.geo.vec if block_d % self.geo.vec == 0 else 1,
                SCATTER=self.scatter,
                num_warps=cfg.num_warps,
            )


@dataclass
class MoveCheck:
    """A validated move whose objects live elsewhere (``check_move``): per-group plans reuse all of it."""

    kv_caches: KVCaches
    layout: PagedLayout
    layers: range
    span_list: list[tuple[int, int]]
    skips: list[int]
    slots: torch.Tensor
    checks: SlotCheck | None
    n_slots: int
    scatter: bool

    def finish(self) -> int:
        """``ValueError`` on bad slots, else the tokens written (waits for the checks only); a trusted move
        (no checks) counts every token of its spans past the skips."""
        if self.checks is None:
            return sum(max(0, e - s - k) for (s, e), k in zip(self.span_list, self.skips, strict=True))
        return self.checks.check(self.n_slots, scatter=self.scatter)

    def plan(self, idx: Sequence[int], views: Sequence[torch.Tensor]) -> MovePlan:
        """The launch plan of spans ``idx`` with device objects ``views`` (no checks, no sync)."""
        return _plan_objects(
            self.kv_caches,
            self.layout,
            self.slots,
            [self.span_list[i] for i in idx],
            views,
            self.layers,
            [self.skips[i] for i in idx],
            scatter=self.scatter,
        )


def check_move(
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    objs: Sequence[torch.Tensor],
    layers: range,
    skip_prefix: int | Sequence[int] | None,
    *,
    trusted: bool = False,
    host_slots: torch.Tensor | None = None,
) -> MoveCheck:
    """Validate a move whose objects live elsewhere (host). The slot checks are queued on the device (or
    run on the host with ``host_slots``, a CPU copy of ``slot_mapping``; none when ``trusted``);
    ``finish()`` reads them, raises ``ValueError`` or returns the tokens written.

    ``skip_prefix`` None means a gather (slots < 0 refused). ``Unsupported`` if the kernels cannot do it.
    """
    _check_layer_range(layers, layout)
    span_list = check_spans(spans, slot_mapping.shape[0], len(objs))
    skips = [0] * len(span_list) if skip_prefix is None else span_skips(skip_prefix, span_list)
    _check_objects(objs, layout, span_list, layers, "out" if skip_prefix is None else "objects")
    geo = _geometry(kv_caches, layout, layers, [])
    slots = _device_slots(slot_mapping, geo.device)
    scatter = skip_prefix is not None
    hs = _host_slots(slot_mapping, host_slots)
    checks = (
        None if trusted else SlotCheck(slot_mapping, slots, span_list, skips, count=scatter, host_slots=hs)
    )
    return MoveCheck(kv_caches, layout, layers, span_list, skips, slots, checks, geo.n_slots, scatter)


def _plan_objects(
    kv_caches: KVCaches,
    layout: PagedLayout,
    slots: torch.Tensor,
    span_list: list[tuple[int, int]],
    objs: Sequence[torch.Tensor],
    layers: range,
    skips: list[int],
    *,
    scatter: bool,
) -> MovePlan:
    """The launch plan for checked spans, device slots and device objects."""
    ptrs = [o.data_ptr() for o in objs]
    geo = _geometry(kv_caches, layout, layers, ptrs)
    dev = geo.device
    if any(o.device != dev for o in objs):
        raise Unsupported("objects are not on the KV device")
    es = objs[0].element_size() if objs else 1
    word = geo.word
    dw = layout.head_dim * es // word
    obj_base = _alias(objs[0], _WORDS[word]) if objs else geo.kv_base
    base_ptr = ptrs[0] if objs else 0
    rows = []
    max_tokens = 0
    for (s, e), k, p in zip(span_list, skips, ptrs, strict=True):
        if (p - base_ptr) % word:
            raise Unsupported("misaligned object")
        rows.append((s, e - s, k, (p - base_ptr) // word))
        max_tokens = max(max_tokens, e - s - k)
    return MovePlan(
        geo=geo,
        obj_base=obj_base,
        span_table=_device_ints(rows or [(0, 0, 0, 0)], dev),
        slots=slots,
        tiles_per_span=max_tokens,
        num_spans=len(span_list),
        layers=len(layers),
        planes=layout.planes,
        heads=layout.num_kv_heads,
        dw=dw,
        block_size=layout.block_size,
        scatter=scatter,
    )


def _plan(
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    objs: Sequence[torch.Tensor],
    layers: range,
    skips: list[int] | None,
    *,
    scatter: bool,
    check: bool = True,
    host_slots: torch.Tensor | None = None,
) -> MovePlan:
    """Validate (slot checks queued when ``check``, read by ``finish``) and build the plan of one move."""
    _check_layer_range(layers, layout)
    span_list = check_spans(spans, slot_mapping.shape[0], len(objs))
    _check_objects(objs, layout, span_list, layers, "objects" if scatter else "out")
    if skips is None:
        skips = [0] * len(span_list)
    first = layer_tensors(kv_caches)[0]
    slots = _device_slots(slot_mapping, first.device)
    plan = _plan_objects(kv_caches, layout, slots, span_list, objs, layers, skips, scatter=scatter)
    if check:
        hs = _host_slots(slot_mapping, host_slots)
        plan.checks = SlotCheck(slot_mapping, slots, span_list, skips, count=scatter, host_slots=hs)
    else:
        plan.unchecked_tokens = sum(max(0, e - s - k) for (s, e), k in zip(span_list, skips, strict=True))
    return plan


def plan_gather(
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    out: Sequence[torch.Tensor],
    layers: range | None = None,
    *,
    check: bool = True,
    host_slots: torch.Tensor | None = None,
) -> MovePlan:
    """Validate a gather (slot checks queued when ``check``, on the host with ``host_slots``) and return its
    launch plan."""
    layers = range(layout.num_layers) if layers is None else layers
    return _plan(
        kv_caches,
        layout,
        slot_mapping,
        spans,
        out,
        layers,
        None,
        scatter=False,
        check=check,
        host_slots=host_slots,
    )


def plan_scatter(
    objects: Sequence[torch.Tensor],
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    skip_prefix: int | Sequence[int] = 0,
    layers: range | None = None,
    *,
    check: bool = True,
    host_slots: torch.Tensor | None = None,
) -> MovePlan:
    """Validate a scatter (slot checks queued when ``check``: they also count the tokens written)."""
    layers = range(layout.num_layers) if layers is None else layers
    span_list = check_spans(spans, slot_mapping.shape[0], len(objects))
    skips = span_skips(skip_prefix, span_list)
    return _plan(
        kv_caches,
        layout,
        slot_mapping,
        span_list,
        objects,
        layers,
        skips,
        scatter=True,
        check=check,
        host_slots=host_slots,
    )


def gather(
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    out: Sequence[torch.Tensor],
    layers: range | None = None,
    cfg: TileConfig = DEFAULT_CONFIG,
    *,
    trusted: bool = False,
    host_slots: torch.Tensor | None = None,
) -> None:
    """One-launch gather into device objects (same contract as ``reference.gather``).

    ``host_slots``: a CPU copy of a device ``slot_mapping`` (engines have one), checked on the host instead
    of by device reductions. ``trusted``: the caller vouches that every slot is in ``[0, slots)``, no check
    runs (the kernel still never touches a bad slot: its rows are left as they were).
    """
    plan = plan_gather(
        kv_caches, layout, slot_mapping, spans, out, layers, check=not trusted, host_slots=host_slots
    )
    plan.launch(cfg)
    plan.finish()


def scatter(
    objects: Sequence[torch.Tensor],
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    skip_prefix: int | Sequence[int] = 0,
    layers: range | None = None,
    cfg: TileConfig = DEFAULT_CONFIG,
    *,
    trusted: bool = False,
    host_slots: torch.Tensor | None = None,
) -> int:
    """One-launch scatter from device objects; returns the tokens written per layer (reference contract).
    ``trusted`` / ``host_slots`` as in ``gather`` (trusted: every token past the skips counts as written)."""
    plan = plan_scatter(
        objects,
        kv_caches,
        layout,
        slot_mapping,
        spans,
        skip_prefix,
        layers,
        check=not trusted,
        host_slots=host_slots,
    )
    plan.launch(cfg)
    return plan.finish()


# --------------------------------------------------------------------------------------------- fp8

FP8_ONE_PASS_ELEMS = 16384  # largest [tokens, channels] tile kept in registers by one program
FP8_BLOCK_D = 64  # channels per program: 64 x 8 warps was the fastest bit-exact kernel on the H200 A/B
FP8_NUM_WARPS = 8  # (1174 GB/s of bf16 input alone, vs 921 for 32 x 4 and 894-945 for 128 channels)


def fp8_payload_nbytes(layout: PagedLayout, tokens: int) -> int:
    """Bytes of one span's fused-fp8 payload: float32 channel scales then one e4m3 byte per element."""
    if tokens == 0:
        return 0
    shape, _ = _object_shape(layout, tokens, range(layout.num_layers))
    elements = 1
    for n in shape:
        elements *= n
    return 4 * (elements // tokens) + elements


@dataclass
class Fp8Plan:
    """One fused-fp8 launch, ready to go (``plan_fp8``): ``launch()`` is the kernel alone (no host work but
    the launch); ``finish()`` reads the slot checks and, if asked, checks the scales for non-finite input."""

    launch_fn: Any
    checks: SlotCheck | None
    n_slots: int
    layout: PagedLayout
    span_list: list[tuple[int, int]]
    out: Sequence[torch.Tensor]

    def launch(self) -> None:
        self.launch_fn()

    def finish(self, check_finite: bool = True) -> None:
        if self.checks is not None:
            self.checks.check(self.n_slots, scatter=False)
        if not check_finite:
            return
        lay = self.layout
        scales = [
            o[: fp8_payload_nbytes(lay, e - s) - _elements(lay, e - s)].view(torch.float32)
            for (s, e), o in zip(self.span_list, self.out, strict=True)
            if e > s
        ]
        if scales and not bool(torch.isfinite(torch.cat(scales)).all()):
            raise ValueError("fp8 gather needs finite input (found NaN or inf)")


def plan_fp8(
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    out: Sequence[torch.Tensor],
    *,
    block_t: int = 0,
    block_d: int = FP8_BLOCK_D,
    num_warps: int = FP8_NUM_WARPS,
    one_pass_elems: int = FP8_ONE_PASS_ELEMS,
    soft_convert: bool | None = None,
    trusted: bool = False,
    host_slots: torch.Tensor | None = None,
) -> Fp8Plan:
    """Validate a fused fp8 gather (``gather_fp8``) and return its launch (slot checks queued)."""
    if layout.dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"fp8 gather encodes bfloat16, float16 or float32 KV, not {layout.dtype}")
    layers = range(layout.num_layers)
    span_list = check_spans(spans, slot_mapping.shape[0], len(out))
    for i, ((s, e), o) in enumerate(zip(span_list, out, strict=True)):
        n = fp8_payload_nbytes(layout, e - s)
        if o.dtype != torch.uint8 or o.numel() != n or not o.is_contiguous():
            raise ValueError(f"out[{i}] must be a contiguous uint8 tensor of {n} bytes")
    geo = _geometry(kv_caches, layout, layers, [])
    if any(o.device != geo.device for o in out):
        raise Unsupported("outputs are not on the KV device")
    base_ptr = out[0].data_ptr() if out else 0
    rows = [(s, e - s, 0, o.data_ptr() - base_ptr) for (s, e), o in zip(span_list, out, strict=True)]
    max_tok = max((r[1] for r in rows), default=0)
    if max_tok == 0:
        return Fp8Plan(lambda: None, None, geo.n_slots, layout, span_list, out)
    slots = _device_slots(slot_mapping, geo.device)
    hs = _host_slots(slot_mapping, host_slots)
    checks = (
        None
        if trusted
        else SlotCheck(slot_mapping, slots, span_list, [0] * len(span_list), count=False, host_slots=hs)
    )
    table = _device_ints(rows, geo.device)
    es = geo.es
    scale = geo.word // es  # element (not word) offsets: the fp8 kernel reads real values
    d = layout.head_dim
    bd = min(block_d, triton_next_pow2(d))
    ndc = -(-d // bd)
    if block_t <= 0:
        bt = triton_next_pow2(max_tok)
        if bt * bd > one_pass_elems:
            bt = 32
    else:
        bt = block_t
    vec = max(1, geo.vec * geo.word // es)
    k = _kernels()
    kv0 = layer_tensors(kv_caches)[0]
    grid = (len(rows), len(layers) * layout.planes, layout.num_kv_heads * ndc)
    args = (
        _alias(kv0, kv0.dtype),
        out[0],
        _layer_offsets(geo, scale),
        table,
        slots,
        geo.s_plane * scale,
        geo.s_blk * scale,
        geo.s_off * scale,
        geo.s_head * scale,
        len(layers),
        layout.num_kv_heads,
        geo.n_slots,
    )
    meta = {
        "BS": layout.block_size,
        "P": layout.planes,
        "D": d,
        "BLOCK_T": bt,
        "BLOCK_D": bd,
        "NDC": ndc,
        "SOFT_CVT": _interpret() if soft_convert is None else soft_convert,
        "VEC": vec if d % vec == 0 and bd % vec == 0 else 1,
        "OVEC": 16 if all(o.data_ptr() % 16 == 0 for o in out) else 1,
        "ONE_PASS": bt >= max_tok,
        "num_warps": num_warps,
    }
    device = geo.device

    def launch() -> None:
        with torch.cuda.device(device) if device.type == "cuda" else _null():
            k.fp8[grid](*args, **meta)

    return Fp8Plan(launch, checks, geo.n_slots, layout, span_list, out)


def gather_fp8(
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    out: Sequence[torch.Tensor],
    *,
    block_t: int = 0,
    block_d: int = FP8_BLOCK_D,
    num_warps: int = FP8_NUM_WARPS,
    one_pass_elems: int = FP8_ONE_PASS_ELEMS,
    check: bool = True,
    soft_convert: bool | None = None,
    trusted: bool = False,
    host_slots: torch.Tensor | None = None,
) -> None:
    """Fused gather + fp8 quantize: ``out[i]`` (uint8, ``fp8_payload_nbytes`` bytes, on the KV device)
    receives exactly the ``Fp8Codec("channel")`` payload of span i (see the module doc).

    ``block_t`` 0 (default) loads each (span, layer, plane, channel block) tile once, whole, when it has at
    most ``one_pass_elems`` elements (else 32 tokens at a time, in two passes); ``block_t`` >= the longest
    span is one pass too. ``ValueError`` for slots < 0 or out of range (unless ``trusted``; on the host with
    ``host_slots``, a CPU copy of the mapping) and, when ``check``, for non-finite input (one more sync).
    ``soft_convert`` rounds to e4m3 with integer ops instead of the hardware conversion (default: only under
    the interpreter); both give the codec's bytes.
    """
    plan = plan_fp8(
        kv_caches,
        layout,
        slot_mapping,
        spans,
        out,
        block_t=block_t,
        block_d=block_d,
        num_warps=num_warps,
        one_pass_elems=one_pass_elems,
        soft_convert=soft_convert,
        trusted=trusted,
        host_slots=host_slots,
    )
    plan.launch()
    plan.finish(check)


def _elements(layout: PagedLayout, tokens: int) -> int:
    spec = object_spec(layout, tokens)
    return spec.nbytes // spec.itemsize
