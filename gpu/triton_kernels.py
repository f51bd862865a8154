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
divides head_dim's bytes, every stride and every base offset. Grid: (spans x token tiles, layers, head chunks
x head_dim chunks); each program moves a ``[BLOCK_T, HB, BLOCK_D]`` tile (tokens, heads, words) of every
plane in turn, so K and V of a token, which share one paged row in vLLM's NHD allocation, are read back to
back and neighbouring programs read neighbouring token rows; 16-byte vector loads where the alignment hints
(checked on the host) allow. ``benchmarks/gpu_ab.py`` compares tilings (results: ``docs/performance.md``).

Slot checks: a move kernel checks its own slots (per-span flags it sets in pinned memory; the host counts
exactly only when one is set); the fp8 kernels, and moves launched through Triton's own ``run``, use one small
check kernel (one program per span) queued after the move (``SlotCheck``); a CPU slot mapping (or the
caller's CPU copy) is checked on the host. The moves never touch a bad slot, so a late report loses nothing.

The fused fp8 gather (``gather_fp8``) writes, per span, exactly the channel payload of ``tiercache.fp8_math``:
float32 scales ``[P*L, 1, H*D]`` (``max(absmax over the span's tokens / 448, 2**-126)``) then e4m3 bytes
``[P*L, T, H*D]`` (``x / scale`` rounded to nearest even, clamped to +-448), so ``fp8_math.dequantize_into``
accepts it as is. Each program owns one (span, layer, plane, channel block) tile: when the tile fits
(``FP8_ONE_PASS_ELEMS``) it is loaded once and kept in registers for the absmax and the quantize; longer spans
fall back to two passes of 32 tokens (the second read mostly hits L2). Channel blocks vary fastest in the grid
(programs running together read neighbouring head rows), and the kernel counts
non-finite input into its span's status word, so the finite check needs no pass of its own.

Host side: a ``Move`` (``tiercache.gpu.move``) is validated once; its first run here computes the launch
(geometry per registered KV caches, span table, tiles) and binds it (``BoundMove``: the compiled kernel's
launcher with its arguments as ints, plus the flags), kept on the move and shared by later moves of the same
request shape (same KV caches, slot-mapping and object addresses, spans, skips, layers, checks), so a
repeated run costs one launcher call and, unless trusted, one stream sync and a read of the flags.

Kernels are compiled lazily (``TRITON_INTERPRET=1`` is read when they are first built, so tests can run them
on the CPU through Triton's interpreter).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tiercache.errors import Unsupported
from tiercache.gpu.launch import SAME_ITEMS as _SAME_ITEMS
from tiercache.gpu.launch import Ptr, bind_launch, launch, prebound_enabled, sync_stream
from tiercache.gpu.layouts import (
    LayoutKind,
    PagedLayout,
    fp8_payload_nbytes,
    layer_tensors,
    object_spec,
)
from tiercache.gpu.move import Checks, Move

if TYPE_CHECKING:
    from tiercache.gpu.layouts import KVCaches

__all__ = [
    "BoundMove",
    "TileConfig",
    "available",
    "bind",
    "check_move",
    "fp8_payload_nbytes",
    "gather",
    "gather_fp8",
    "plan",
    "plan_fp8",
    "scatter",
    "scatter_fp8",
]

_WORDS: dict[int, torch.dtype] = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


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


# the fastest tile of benchmarks/gpu_ab.py's interleaved rounds on an H200 (the others within 1 %)
DEFAULT_CONFIG = TileConfig(tile_bytes=4096, num_warps=4)
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
        n_slots,
        status_ptr,
        H: tl.constexpr,
        BS: tl.constexpr,
        P: tl.constexpr,
        DW: tl.constexpr,
        BLOCK_T: tl.constexpr,
        HB: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NDC: tl.constexpr,
        VEC: tl.constexpr,
        SCATTER: tl.constexpr,
        CHECK: tl.constexpr,
    ):
        # one program: BLOCK_T tokens x HB heads x BLOCK_D words of one layer, every plane (K and V read from
        # the same paged rows back to back, so a token's whole page row is fetched together)
        pid0 = tl.program_id(0)
        layer = tl.program_id(1).to(tl.int64)
        pid2 = tl.program_id(2)
        span = pid0 // tiles_per_span
        tile = pid0 % tiles_per_span
        row = span_ptr + span * 4
        s_start = tl.load(row)
        n_tok = tl.load(row + 1)
        first = tl.load(row + 2)
        o_off = tl.load(row + 3)
        h = (pid2 // NDC) * HB + tl.arange(0, HB).to(tl.int64)
        d = (pid2 % NDC) * BLOCK_D + tl.arange(0, BLOCK_D)
        t = first + tile * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        tmask = t < n_tok
        slot = tl.load(slot_ptr + s_start + t, mask=tmask, other=-1).to(tl.int64)
        if CHECK:  # noqa: SIM102  # a compile-time branch, kept apart from the runtime one below
            # flag the span (word 0: a slot < 0, word 1: a slot past the KV; the host counts exactly): one
            # program per tile reduces, the others skip the reduction
            if (layer == 0) & (pid2 == 0):
                neg = tl.sum((tmask & (slot < 0)).to(tl.int32), axis=0)
                high = tl.sum((tmask & (slot >= n_slots)).to(tl.int32), axis=0)
                tl.store(status_ptr + span * 4, 1, mask=neg > 0)
                tl.store(status_ptr + span * 4 + 1, 1, mask=high > 0)
        tmask = tmask & (slot >= 0) & (slot < n_slots)  # bad slots are reported by the checks, never moved
        blk = slot // BS
        paged_t = tl.load(layer_off_ptr + layer) + blk * s_blk + (slot - blk * BS) * s_off
        paged_h = tl.multiple_of(h * s_head, VEC)
        obj_h = tl.multiple_of(h * DW, VEC)
        mask = tmask[:, None, None] & (h < H)[None, :, None] & (d < DW)[None, None, :]
        for p in tl.static_range(P):
            paged_row = tl.multiple_of(paged_t + p * s_plane, VEC)
            obj_row = tl.multiple_of(o_off + ((p * num_layers + layer) * n_tok + t) * (H * DW), VEC)
            paged = kv_ptr + (paged_row[:, None, None] + paged_h[None, :, None] + d[None, None, :])
            obj = obj_ptr + (obj_row[:, None, None] + obj_h[None, :, None] + d[None, None, :])
            if SCATTER:
                tl.store(paged, tl.load(obj, mask=mask), mask=mask)
            else:
                tl.store(obj, tl.load(paged, mask=mask), mask=mask)

    @triton.jit
    def _check_kernel(slot_ptr, span_ptr, out_ptr, n_slots, BLOCK: tl.constexpr):
        # one program per span: words 0-2 of its status row = [slots < 0, slots >= n_slots, slots in range]
        # over the span's tokens past its skip (word 3 is the fused fp8 kernel's non-finite count)
        span = tl.program_id(0)
        row = span_ptr + span * 4
        s_start = tl.load(row)
        n_tok = tl.load(row + 1)
        first = tl.load(row + 2)
        neg = tl.zeros([BLOCK], dtype=tl.int64)
        high = tl.zeros([BLOCK], dtype=tl.int64)
        for t0 in range(0, n_tok, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            m = (t < n_tok) & (t >= first)
            s = tl.load(slot_ptr + s_start + t, mask=m, other=0).to(tl.int64)
            neg += (m & (s < 0)).to(tl.int64)
            high += (m & (s >= n_slots)).to(tl.int64)
        n_neg = tl.sum(neg, axis=0)
        n_high = tl.sum(high, axis=0)
        tl.store(out_ptr + span * 4, n_neg)
        tl.store(out_ptr + span * 4 + 1, n_high)
        tl.store(out_ptr + span * 4 + 2, tl.maximum(n_tok - first, 0) - n_neg - n_high)

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
        status_ptr,
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
        FINITE: tl.constexpr,
        CH_FAST: tl.constexpr,
    ):
        if CH_FAST:  # channel blocks vary fastest: programs running together read neighbouring head rows
            pid2 = tl.program_id(0)
            pid1 = tl.program_id(1).to(tl.int64)
            span = tl.program_id(2)
        else:
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
            if FINITE:  # count channels with non-finite input into the span's status word 3 (max() hides
                # a NaN; x * 0 is NaN exactly for NaN and infinities, and its sum never overflows)
                bad = tl.sum(tl.where(tl.sum(x * 0.0, axis=0) == 0.0, 0, 1), axis=0)
                tl.atomic_add(status_ptr + span * 4 + 3, bad.to(tl.int64), mask=bad > 0)
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
                if FINITE:
                    bad = tl.sum(tl.where(tl.sum(x * 0.0, axis=0) == 0.0, 0, 1), axis=0)
                    tl.atomic_add(status_ptr + span * 4 + 3, bad.to(tl.int64), mask=bad > 0)
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

    @triton.jit
    def _fp8_scatter_kernel(
        kv_ptr,
        in_ptr,
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
        SOFT_BF16: tl.constexpr,
        VEC: tl.constexpr,
        CH_FAST: tl.constexpr,
    ):
        # the inverse of _fp8_kernel: one (span, layer, plane, channel block) per program; e4m3 bytes times
        # the channel's float32 scale, rounded once to the KV dtype (the codec's decode, bit for bit)
        if CH_FAST:
            pid2 = tl.program_id(0)
            pid1 = tl.program_id(1).to(tl.int64)
            span = tl.program_id(2)
        else:
            span = tl.program_id(0)
            pid1 = tl.program_id(1).to(tl.int64)
            pid2 = tl.program_id(2)
        row = span_ptr + span * 4
        s_start = tl.load(row)
        n_tok = tl.load(row + 1)
        first = tl.load(row + 2)
        i_off = tl.load(row + 3)  # byte offset of the span's payload from in_ptr
        layer = pid1 // P
        plane = pid1 % P
        head = (pid2 // NDC).to(tl.int64)
        d = (pid2 % NDC) * BLOCK_D + tl.arange(0, BLOCK_D)
        dmask = d < D
        l_off = tl.load(layer_off_ptr + layer)
        base = l_off + plane * s_plane + head * s_head
        group = plane * num_layers + layer
        hd = heads * D
        chan = head * D + d
        scale_ptr = (in_ptr + i_off).to(tl.pointer_type(tl.float32))
        scale = tl.load(scale_ptr + group * hd + chan, mask=dmask, other=0.0)
        q_base = in_ptr + i_off + 4 * P * num_layers * hd + group * n_tok * hd
        for t0 in range(0, n_tok, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
            tmask = (t < n_tok) & (t >= first)
            slot = tl.load(slot_ptr + s_start + t, mask=tmask, other=-1).to(tl.int64)
            tmask = tmask & (slot >= 0) & (slot < n_slots)  # slots < 0 skipped; past the KV: reported
            m = tmask[:, None] & dmask[None, :]
            q = tl.load(q_base + (t[:, None] * hd + chan[None, :]), mask=m, other=0)
            if SOFT_CVT:  # e4m3fn decoded with integer ops (the interpreter's float8 emulation is unreliable)
                qi = q.to(tl.int32)
                e = (qi >> 3) & 15
                mnt = (qi & 7).to(tl.float32)
                mag = tl.where(e == 0, mnt * 0.001953125, (mnt + 8.0) * tl.exp2((e - 10).to(tl.float32)))
                x = tl.where((qi & 128) != 0, -mag, mag)
            else:
                x = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            y = x * scale[None, :]
            if SOFT_BF16:  # round to nearest even by hand: the interpreter's float32 -> bfloat16 truncates
                yb = y.to(tl.int32, bitcast=True)
                yb = (yb + 0x7FFF + ((yb >> 16) & 1)) & -65536
                y = yb.to(tl.float32, bitcast=True)
            blk = slot // BS
            dst = tl.multiple_of(base + blk * s_blk + (slot - blk * BS) * s_off, VEC)
            tl.store(kv_ptr + (dst[:, None] + d[None, :]), y.to(kv_ptr.dtype.element_ty), mask=m)

    class K:
        move = _move_kernel
        fp8 = _fp8_kernel
        fp8_scatter = _fp8_scatter_kernel
        check = _check_kernel

    return K


# --------------------------------------------------------------------------------------------- planning


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
    offsets: dict[int, torch.Tensor] = field(default_factory=dict)  # layer offsets on the device, by scale


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


def _ptr(t: torch.Tensor, dtype: torch.dtype) -> Ptr | torch.Tensor:
    """``t``'s first element as a ``dtype`` pointer argument (the typed alias is only built when Triton's
    own launch needs it)."""
    if t.dtype == dtype:
        return t
    return Ptr(t.data_ptr(), dtype, lambda: _alias(t, dtype))


def _host_ptr(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> Ptr:
    """A pinned host tensor's first element as a ``dtype`` pointer (the kernel reads / writes it over the
    bus); compiling sees an aligned device stand-in of the same dtype."""
    return Ptr(t.data_ptr(), dtype, lambda: torch.empty(16, dtype=dtype, device=device))


def _align_of(ptrs: Sequence[int]) -> int:
    """The largest power of two <= 16 dividing every pointer (what the word and vector choice depends on)."""
    a = 16
    for p in ptrs:
        a = min(a, p & -p) if p else a
    return a


_GEO_CACHE: dict[tuple[Any, ...], _GeoInts] = {}


@dataclass
class _Registered:
    """KV caches seen before: the object itself, its layer tensors (what a repeated call re-checks, by
    identity), the first layer's address and the geometry key computed once for them."""

    kv_caches: Any
    layers: tuple[torch.Tensor, ...]
    first_ptr: int
    key: tuple[Any, ...]
    geos: dict[int, _Geometry] = field(default_factory=dict)  # by the alignment of the objects
    bound: dict[tuple[Any, ...], Any] = field(default_factory=dict)  # BoundMoves by ``_launch_key``


_REGISTERED: dict[tuple[int, PagedLayout, int, int], _Registered] = {}


def _same_layers(reg: _Registered, kv_caches: KVCaches) -> bool:
    """True when ``kv_caches`` still holds exactly the registered tensors (identity, not values): one C call
    for a list, a tuple or a dict where the launch extension is built."""
    same = _SAME_ITEMS(kv_caches, reg.layers) if _SAME_ITEMS is not None else None
    if same is not None:
        return same and reg.layers[0].data_ptr() == reg.first_ptr
    layers = kv_caches.values() if isinstance(kv_caches, Mapping) else kv_caches
    if len(layers) != len(reg.layers):
        return False
    return all(map(operator.is_, layers, reg.layers)) and reg.layers[0].data_ptr() == reg.first_ptr


def _register(kv_caches: KVCaches, layout: PagedLayout, layers: range) -> _Registered:
    """The registration of these KV caches: what the geometry depends on besides alignment (layout, layers
    and the layers' pointers, shapes and strides) and the geometries, computed once per KV caches object. A
    later call with the same object holding the same tensor objects reuses it (an identity check per layer
    instead of reading and hashing every pointer, shape and stride)."""
    if layout.kind is LayoutKind.CPU_BLOCKS:
        raise Unsupported("CPU_BLOCKS moves whole pages: reference only")
    rkey = (id(kv_caches), layout, layers.start, layers.stop)
    reg = _REGISTERED.get(rkey)
    if reg is not None and reg.kv_caches is kv_caches and _same_layers(reg, kv_caches):
        return reg
    kv = layer_tensors(kv_caches)
    if len(kv) != layout.num_layers:
        raise ValueError(f"{len(kv)} KV cache tensors for a layout of {layout.num_layers} layers")
    first = kv[0]
    key = (
        layout,
        layers.start,
        layers.stop,
        first.device,
        first.dtype,
        tuple((t.data_ptr(), t.shape, t.stride()) for t in kv),
    )
    if len(_REGISTERED) > 16:
        _REGISTERED.clear()
    reg = _REGISTERED[rkey] = _Registered(kv_caches, tuple(kv), first.data_ptr(), key)
    return reg


def _geometry_key(kv_caches: KVCaches, layout: PagedLayout, layers: range) -> tuple[Any, ...]:
    """The registration's key (see ``_register``)."""
    return _register(kv_caches, layout, layers).key


def _geometry(
    kv_caches: KVCaches,
    layout: PagedLayout,
    layers: range,
    extra_ptrs: Sequence[int],
    key: tuple[Any, ...] | None = None,
) -> _Geometry:
    """The launch geometry, kept by the KV caches' registration per alignment of ``extra_ptrs`` (it holds
    the layer-0 alias and the device layer offsets); the integer part is also cached by key across
    registrations of the same tensors. ``key``: unused, kept for callers that computed it."""
    reg = _register(kv_caches, layout, layers)
    align = _align_of(extra_ptrs)
    geo = reg.geos.get(align)
    if geo is not None:
        return geo
    kv = layer_tensors(kv_caches)
    first = kv[0]
    gkey = (*reg.key, align)
    g = _GEO_CACHE.get(gkey)
    if g is None:
        if len({t.device for t in kv}) != 1 or len({t.dtype for t in kv}) != 1:
            raise Unsupported("layers differ in device or dtype")
        g = _geometry_ints(kv, layout, layers, align)
        if len(_GEO_CACHE) > 64:
            _GEO_CACHE.clear()
        _GEO_CACHE[gkey] = g
    geo = reg.geos[align] = _Geometry(
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
    return geo


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


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _tiles(dw: int, word: int, heads: int, max_tokens: int, cfg: TileConfig) -> tuple[int, int, int, int]:
    """(BLOCK_D, NDC, HB, BLOCK_T) for head rows of ``dw`` words: a plane's tile is BLOCK_T tokens x HB
    heads x BLOCK_D words, about ``cfg.tile_bytes``, as many whole heads of a token as fit."""
    low = dw & -dw  # largest power of two dividing dw
    block_d = min(low, 256) if low == dw or low >= 32 else triton_next_pow2(dw)
    ndc = -(-dw // block_d)
    row = block_d * word
    hb = min(triton_next_pow2(heads), _pow2_floor(max(1, cfg.tile_bytes // row)))
    block_t = cfg.block_t or _pow2_floor(max(1, cfg.tile_bytes // (hb * row)))
    block_t = max(1, min(block_t, triton_next_pow2(max(1, max_tokens)), 1024))
    return block_d, ndc, hb, block_t


def triton_next_pow2(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()


# ------------------------------------------------------------------------------- small device tensors


_TABLES: dict[tuple[Any, ...], torch.Tensor] = {}


def _device_ints(values: Sequence[int] | Sequence[tuple[int, ...]], device: torch.device) -> torch.Tensor:
    """An int64 device tensor of ``values`` (ints, or rows as tuples), cached by value (span tables and layer
    offsets repeat: the staging buffers, the KV tensors and the chunking stay put); copied from pinned
    memory, never a sync."""
    key = (device, tuple(values))
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
    t = geo.offsets.get(scale)
    if t is None:
        t = geo.offsets[scale] = _device_ints([x * scale for x in geo.layer_off], geo.device)
    return t


def _on(device: torch.device) -> Any:
    """A context that makes ``device`` current for a launch (nothing to do when it already is, or on CPU)."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


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


CHECK_BLOCK = 1024  # slots per step of the check kernel (one program per span)


def _host_slots(slot_mapping: torch.Tensor, host_slots: torch.Tensor | None) -> torch.Tensor | None:
    """The CPU tensor the slot checks run on: ``slot_mapping`` itself on the CPU, else the caller's CPU copy
    ``host_slots`` (validated), else None (checked on the device)."""
    if host_slots is None:
        return slot_mapping if slot_mapping.device.type == "cpu" else None
    if host_slots.device.type != "cpu" or tuple(host_slots.shape) != tuple(slot_mapping.shape):
        raise ValueError(
            f"host_slots must be a CPU tensor shaped like slot_mapping {tuple(slot_mapping.shape)}, "
            f"got {tuple(host_slots.shape)} on {host_slots.device}"
        )
    return host_slots


_STATUS_POOL: list[torch.Tensor] = []  # pinned int64 [rows, 4] buffers the check kernel writes in place
_ZERO_COPY = [True]  # cleared for good if a launch refuses pinned host memory
_EVENT_POOL: list[torch.cuda.Event] = []  # events of read zero-copy statuses, recorded again by the next


def _take_status(rows: int) -> torch.Tensor:
    """A pinned status buffer of at least ``rows`` rows (from the pool, else new); give it back once read."""
    for i, buf in enumerate(_STATUS_POOL):
        if buf.shape[0] >= rows:
            return _STATUS_POOL.pop(i)
    return torch.empty((max(rows, 64), 4), dtype=torch.int64, pin_memory=True)


class SlotCheck:
    """The slot checks of one move, queued without a sync; ``check()`` reads them.

    Queued by ``queue()``, after the move's kernels (the kernels never touch bad slots, so checking late is
    safe and the host work overlaps the move). A CPU slot mapping (or the caller's CPU copy of a device one,
    ``host``) is checked on the host (min, max, count). A device one by one launch of the check kernel, which
    writes per span ``[slots < 0, slots >= n_slots, slots in range]`` (past the span's skip) into words 0-2
    of a status row (pinned host memory the kernel writes in place when launches are pre-bound, else a
    device row copied to pinned memory); word 3 is where the fused fp8 kernel counts non-finite input
    (``flags``:
    a status even when the slots are checked on the host, or not at all with ``check=False``). ``seal()``
    queues the status's copy to pinned host memory behind an event; ``result()`` waits for that event only.
    """

    def __init__(
        self,
        slots: torch.Tensor,
        span_list: list[tuple[int, int]],
        skips: list[int],
        n_slots: int,
        *,
        host: torch.Tensor | None = None,
        check: bool = True,
        flags: bool = False,
    ) -> None:
        self.span_list = span_list
        self.skips = skips
        self.n_slots = n_slots
        self.slots = host if host is not None else slots
        self.device_slots = slots
        self.ranges = [(s + k, e) for (s, e), k in zip(span_list, skips, strict=True) if e > s + k]
        self.on_host = check and host is not None
        self.status: torch.Tensor | None = None
        self.flags = flags
        self._pool_buf: torch.Tensor | None = None
        self._pinned: torch.Tensor | None = None
        if flags:  # word 3 is summed into by the fp8 kernel: zeroed
            self.status = torch.zeros((len(span_list), 4), dtype=torch.int64, device=slots.device)
        elif check and host is None:  # the check kernel writes words 0-2 of every row; word 3 is not read
            if _ZERO_COPY[0] and slots.device.type == "cuda" and prebound_enabled():
                # written in place in pinned host memory: no device status, no copy, no allocation
                self._pool_buf = _take_status(len(span_list))
                self.status = self._pool_buf[: len(span_list)]
                self._pinned = self.status
            else:
                self.status = torch.empty((len(span_list), 4), dtype=torch.int64, device=slots.device)
        self._run_kernel = check and host is None
        self._host_values: tuple[int, int, int] | None = None
        self._queued = False
        self._event: torch.cuda.Event | None = None
        self._values: tuple[int, int, int, int] | None = None
        self._rows: list[list[int]] | None = None

    def queue(self) -> None:
        """Run the checks (device: launch the check kernel, then ``seal``); once, after the move's kernels."""
        if self._queued:
            return
        self._queued = True
        if self.on_host:
            self._host_values = self._check_on_host(self.slots)
        if self._run_kernel:
            assert self.status is not None
            dev = self.device_slots.device
            rows = [(s, e - s, k, 0) for (s, e), k in zip(self.span_list, self.skips, strict=True)]
            with _on(dev):
                table = _device_ints(rows, dev)
                try:
                    launch(
                        _kernels().check,
                        (len(rows), 1, 1),
                        (self.device_slots, table, _payload_ptr(self.status), self.n_slots),
                        {"BLOCK": CHECK_BLOCK},
                        dev,
                    )
                except Exception:
                    if self.status.device.type != "cpu":
                        raise
                    # this Triton does not take pinned host memory: device status and a copy, from now on
                    _ZERO_COPY[0] = False
                    self._pinned = self._pool_buf = None
                    self.status = torch.empty((len(rows), 4), dtype=torch.int64, device=dev)
                    launch(
                        _kernels().check,
                        (len(rows), 1, 1),
                        (self.device_slots, table, self.status, self.n_slots),
                        {"BLOCK": CHECK_BLOCK},
                        dev,
                    )
        self.seal()

    def _check_on_host(self, host: torch.Tensor) -> tuple[int, int, int]:
        if not self.ranges:
            return (0, 0, 0)
        r = self.ranges
        if all(r[i][1] == r[i + 1][0] for i in range(len(r) - 1)):
            sel = host[r[0][0] : r[-1][1]]
        else:
            sel = torch.cat([host[a:b] for a, b in r])
        lo, hi = torch.aminmax(sel)
        ok = int(((sel >= 0) & (sel < self.n_slots)).sum())
        return (int(lo < 0), int(hi >= self.n_slots), ok)

    def seal(self) -> None:
        """Queue the status's read (after every kernel that writes it); ``result()`` waits for this."""
        st = self.status
        if st is not None and st is self._pinned:  # written in place: only the event (pooled)
            self._event = _EVENT_POOL.pop() if _EVENT_POOL else torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
            return
        if st is None or st.device.type != "cuda":
            return
        if self._pinned is None:
            self._pinned = torch.empty(st.shape, dtype=torch.int64, pin_memory=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._pinned.copy_(st, non_blocking=True)
        assert self._event is not None
        self._event.record()

    def rows(self) -> list[list[int]]:
        """Per span ``[slots < 0, slots past the KV, slots in range, non-finite inputs]`` (device status)."""
        self.queue()
        if self._rows is None:
            st = self.status
            if st is None:
                self._rows = [[0, 0, 0, 0] for _ in self.span_list]
            elif self._pinned is not None:
                assert self._event is not None
                self._event.synchronize()
                self._rows = self._pinned.tolist()
                if self._pool_buf is not None:  # read: the buffer and its event go back to the pools
                    _STATUS_POOL.append(self._pool_buf)
                    _EVENT_POOL.append(self._event)
                    self._pool_buf = None
            else:
                self._rows = st.tolist()
            if not self.flags:  # word 3 of an unflagged status was never written
                for row in self._rows:
                    row[3] = 0
        return self._rows

    def result(self) -> tuple[int, int, int, int]:
        """(slots < 0, slots past the KV, slots in range, non-finite inputs): each > 0 when that happened."""
        if self._values is None:
            rows = self.rows()
            neg, high, ok, nonfinite = (sum(col) for col in zip(*rows, strict=True)) if rows else (0, 0, 0, 0)
            if self._host_values is not None:
                neg, high, ok = self._host_values
            self._values = (neg, high, ok, nonfinite)
        return self._values

    def check(self, *, scatter: bool) -> int:
        """``ValueError`` for a slot past the KV, or < 0 in a gather; else the number of slots in range (the
        tokens a scatter writes). The kernels never touch such slots."""
        neg, high, written, _ = self.result()
        if high:
            worst = max(int(self.slots[a:b].max()) for a, b in self.ranges)
            raise ValueError(f"slot {worst} outside the paged KV of {self.n_slots} slots")
        if not scatter and neg:
            bad = next((s, e) for (s, e) in self.span_list if e > s and int(self.slots[s:e].min()) < 0)
            raise ValueError(f"span {bad} has slots < 0: a token without KV cannot be stored")
        return written

    def nonfinite(self) -> int:
        """Non-finite inputs the fused fp8 kernel counted (0 without ``flags``)."""
        return self.result()[3]


def _slot_check(
    slot_mapping: torch.Tensor,
    slots: torch.Tensor,
    span_list: list[tuple[int, int]],
    skips: list[int],
    n_slots: int,
    host_slots: torch.Tensor | None,
    *,
    flags: bool = False,
) -> SlotCheck:
    """The checks of one move (``queue()`` them after its kernels): on the host for a CPU mapping or
    ``host_slots``, else on the device."""
    return SlotCheck(
        slots, span_list, skips, n_slots, host=_host_slots(slot_mapping, host_slots), flags=flags
    )


@dataclass
class MovePlan:
    """Everything one launch needs (``MoveCheck.plan``). A whole move's plan (``plan``)
    carries its ``MoveCheck``: ``launch`` queues the slot checks right after the kernel,
    ``finish`` reads them; a pipeline group's plan has none (its move is checked once, by the pipeline)."""

    geo: _Geometry
    obj_base: torch.Tensor | Ptr
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
    move: MoveCheck | None = None

    def finish(self) -> int:
        """Read the slot checks (waits for them only): ``ValueError`` on bad slots, else tokens written."""
        assert self.move is not None, "a pipeline group's plan is finished through its MoveCheck"
        return self.move.finish()

    def _launch_args(
        self, cfg: TileConfig, status: torch.Tensor | None
    ) -> tuple[Any, tuple[int, int, int], tuple[Any, ...], dict[str, Any]]:
        """(kernel, grid, runtime arguments, constexprs and options) of this launch; ``status``: the pinned
        flags the kernel sets for spans with bad slots (None: no check in the kernel)."""
        block_d, ndc, hb, block_t = _tiles(self.dw, self.geo.word, self.heads, self.tiles_per_span, cfg)
        tiles = -(-self.tiles_per_span // block_t)
        grid = (self.num_spans * tiles, self.layers, -(-self.heads // hb) * ndc)
        geo = self.geo
        args = (
            geo.kv_base,
            self.obj_base,
            _layer_offsets(geo),
            self.span_table,
            self.slots,
            tiles,
            geo.s_plane,
            geo.s_blk,
            geo.s_off,
            geo.s_head,
            self.layers,
            geo.n_slots,
            self.slots if status is None else _payload_ptr(status),
        )
        meta = {
            "H": self.heads,
            "BS": self.block_size,
            "P": self.planes,
            "DW": self.dw,
            "BLOCK_T": block_t,
            "HB": hb,
            "BLOCK_D": block_d,
            "NDC": ndc,
            "VEC": geo.vec if block_d % geo.vec == 0 else 1,
            "SCATTER": self.scatter,
            "CHECK": status is not None,
            "num_warps": cfg.num_warps,
        }
        return _kernels().move, grid, args, meta

    def launch(self, cfg: TileConfig = DEFAULT_CONFIG) -> None:
        if self.num_spans == 0 or self.tiles_per_span == 0:
            return
        status = self.move.fused_status() if self.move is not None else None
        kernel, grid, args, meta = self._launch_args(cfg, status)
        with _on(self.geo.device):
            launch(kernel, grid, args, meta, self.geo.device)
        if self.move is not None:
            if status is not None:
                self.move.fused_launched()
            else:
                self.move.queue_checks()  # after the kernel: its host work overlaps the move

    def bound(self, cfg: TileConfig, status: torch.Tensor | None) -> Callable[[], None]:
        """This launch pre-bound (``launch.bind_launch``): a call launches it on the current stream of the
        KV's device with the same arguments; ``status`` as in ``_launch_args`` (zeroed by the caller)."""
        if self.num_spans == 0 or self.tiles_per_span == 0:
            return _nothing
        kernel, grid, args, meta = self._launch_args(cfg, status)
        with _on(self.geo.device):
            return bind_launch(kernel, grid, args, meta, self.geo.device)


def _nothing() -> None:
    return None


@dataclass
class MoveCheck:
    """A validated move (``check_move``): its plans, one launch or one per pipeline group, reuse all of it.

    The slot checks are only set up by ``queue_checks`` (or ``finish``), so that the first group's launch
    does not wait for them."""

    kv_caches: KVCaches
    layout: PagedLayout
    layers: range
    span_list: list[tuple[int, int]]
    skips: list[int]
    slots: torch.Tensor
    n_slots: int
    scatter: bool
    geo_key: tuple[Any, ...]
    check_args: tuple[torch.Tensor, torch.Tensor | None] | None  # (slot_mapping, host_slots); None: trusted
    checks: SlotCheck | None = None
    geos: dict[int, _Geometry] = field(default_factory=dict)  # by the alignment of a group's views
    fused: torch.Tensor | None = None  # pinned flags the move kernel sets for spans with bad slots
    fused_event: torch.cuda.Event | None = None

    def fused_status(self) -> torch.Tensor | None:
        """Zeroed pinned flags for the move kernel to check its own slots (one launch, no check kernel, no
        copy), when the slots are checked on the device and launches are pre-bound; else None."""
        if self.check_args is None or self.checks is not None or not (_ZERO_COPY[0] and prebound_enabled()):
            return None
        mapping, host_slots = self.check_args
        if self.slots.device.type != "cuda" or _host_slots(mapping, host_slots) is not None:
            return None
        buf = _take_status(len(self.span_list))
        buf[: len(self.span_list)].zero_()
        self.fused = buf
        return buf

    def fused_launched(self) -> None:
        """The fused move is queued: an event (pooled) marks when its flags can be read."""
        self.fused_event = _EVENT_POOL.pop() if _EVENT_POOL else torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.fused_event.record()

    def _finish_fused(self, buf: torch.Tensor) -> int:
        assert self.fused_event is not None
        self.fused_event.synchronize()
        flags = buf[: len(self.span_list), :2].any().item()
        _STATUS_POOL.append(buf)
        _EVENT_POOL.append(self.fused_event)
        self.fused = self.fused_event = None
        if flags:  # a bad slot somewhere: count exactly on the host (the same errors and counts)
            mapping, _ = self.check_args or (self.slots, None)
            self.check_args = (mapping, mapping.cpu())
            self.queue_checks()
            assert self.checks is not None
            return self.checks.check(scatter=self.scatter)
        return sum(max(0, e - s - k) for (s, e), k in zip(self.span_list, self.skips, strict=True))

    def finish(self) -> int:
        """``ValueError`` on bad slots, else the tokens written (waits for the checks only); a trusted move
        (no checks) counts every token of its spans past the skips."""
        if self.fused is not None:
            return self._finish_fused(self.fused)
        self.queue_checks()
        if self.checks is None:
            return sum(max(0, e - s - k) for (s, e), k in zip(self.span_list, self.skips, strict=True))
        return self.checks.check(scatter=self.scatter)

    def reset(self) -> None:
        """Forget the last run's slot checks (before running the same move again)."""
        self.checks = None
        self.fused = None
        self.fused_event = None

    def queue_checks(self) -> None:
        """Queue the slot checks (once; best right after the first launch, so they overlap the move)."""
        if self.checks is None and self.check_args is not None:
            mapping, host_slots = self.check_args
            self.checks = _slot_check(
                mapping, self.slots, self.span_list, self.skips, self.n_slots, host_slots
            )
            self.checks.queue()

    def plan(self, idx: Sequence[int], objs: Sequence[torch.Tensor], *, host: bool = False) -> MovePlan:
        """The launch plan of spans ``idx`` with device objects ``objs`` (no checks, no sync); ``host``:
        the objects are in pinned host memory (the caller checked), read or written in place over the bus
        (pre-bound launches only)."""
        ptrs = [o.data_ptr() for o in objs]
        align = _align_of(ptrs)
        geo = self.geos.get(align)
        if geo is None:
            geo = self.geos[align] = _geometry(
                self.kv_caches, self.layout, self.layers, [align], self.geo_key
            )
        if not host and any(o.device != geo.device for o in objs):
            raise Unsupported("objects are not on the KV device")
        word = geo.word
        base_ptr = ptrs[0] if objs else 0
        rows = []
        max_tokens = 0
        for i, p in zip(idx, ptrs, strict=True):
            (s, e), k = self.span_list[i], self.skips[i]
            if (p - base_ptr) % word:
                raise Unsupported("misaligned object")
            rows.append((s, e - s, k, (p - base_ptr) // word))
            max_tokens = max(max_tokens, e - s - k)
        lay = self.layout
        return MovePlan(
            geo=geo,
            obj_base=_host_ptr(objs[0], _WORDS[word], geo.device)
            if host and objs
            else (_ptr(objs[0], _WORDS[word]) if objs else geo.kv_base),
            span_table=_device_ints(rows or [(0, 0, 0, 0)], geo.device),
            slots=self.slots,
            tiles_per_span=max_tokens,
            num_spans=len(rows),
            layers=len(self.layers),
            planes=lay.planes,
            heads=lay.num_kv_heads,
            dw=lay.head_dim * (objs[0].element_size() if objs else 1) // word,
            block_size=lay.block_size,
            scatter=self.scatter,
        )


def check_move(kv_caches: KVCaches, move: Move) -> MoveCheck:
    """The kernels' view of a validated ``move`` (objects on the device for one launch, or in host memory
    for the pipeline); ``Unsupported`` if the kernels cannot do it. The slot checks (``move.checks``) are
    queued by ``queue_checks()`` and read by ``finish()``, which raises ``ValueError`` or returns the tokens
    written."""
    if any(not o.is_contiguous() for o in move.objects):
        raise Unsupported("objects must be contiguous")
    layers = move.layers
    key = _geometry_key(kv_caches, move.layout, layers)
    geo = _geometry(kv_caches, move.layout, layers, [], key)
    slots = _device_slots(move.slot_mapping, geo.device)
    args = None if move.checks is Checks.NONE else (move.slot_mapping, move.host_slots)
    mv = MoveCheck(
        kv_caches,
        move.layout,
        layers,
        list(move.spans),
        list(move.span_skips),
        slots,
        geo.n_slots,
        move.is_scatter,
        key,
        args,
    )
    mv.geos[16] = geo  # staging views are 256-byte aligned: the groups' plans reuse this geometry
    return mv


def plan(kv_caches: KVCaches, move: Move, *, host: bool = False) -> MovePlan:
    """``move`` (device objects, or pinned host objects with ``host``) as one launch: ``launch`` queues its
    slot checks (or sets the fused flags), ``finish`` reads them."""
    mv = check_move(kv_caches, move)
    p = mv.plan(range(len(mv.span_list)), move.objects, host=host)
    p.move = mv
    return p


class BoundMove:
    """A move prepared once for one KV-caches object (kept on the ``Move``): the pre-bound launch with its
    arguments and, for device-checked slots, the pinned flags the kernel sets. ``run()`` costs one launch,
    and a wait for the kernel when the flags must be read or the objects are in host memory (``wait``: the
    caller may read them, or release them, once the call returns)."""

    __slots__ = (
        "clear",
        "count",
        "flag_bytes",
        "flags",
        "go",
        "index",
        "kv_caches",
        "mv",
        "plan",
        "reg",
        "wait",
    )

    def __init__(self, kv_caches: KVCaches, p: MovePlan, cfg: TileConfig, *, wait: bool = False) -> None:
        mv = p.move
        assert mv is not None
        self.kv_caches = kv_caches
        self.reg = _register(kv_caches, mv.layout, mv.layers)
        self.plan = p  # holds the span table, the slots and the geometry the launch points into
        self.mv = mv
        self.count = sum(max(0, e - s - k) for (s, e), k in zip(mv.span_list, mv.skips, strict=True))
        self.flags: torch.Tensor | None = None
        self.flag_bytes: memoryview | None = None  # the flags' bytes (the kernel sets words 0-1 of a span)
        if mv.check_args is not None:
            self.flags = torch.zeros((max(1, len(mv.span_list)), 4), dtype=torch.int64, pin_memory=True)
            self.flag_bytes = self.flags.numpy().data.cast("B")
        self.clear = bytes(0 if self.flag_bytes is None else len(self.flag_bytes))
        self.wait = wait or self.flags is not None
        self.go = p.bound(cfg, self.flags)
        self.index = p.geo.device.index or 0

    def valid_for(self, kv_caches: KVCaches) -> bool:
        """True while ``kv_caches`` is the object prepared for, holding the same layer tensors."""
        return kv_caches is self.kv_caches and _same_layers(self.reg, kv_caches)

    def run(self) -> int:
        """Launch; with flags, wait for the kernel and count exactly on the host only if one is set
        (``ValueError`` for bad slots). Returns the tokens written (every token past the skips when none is
        flagged or the move is trusted)."""
        flags = self.flag_bytes
        if flags is not None:
            flags[:] = self.clear
        self.go()
        if not self.wait:
            return self.count
        sync_stream(self.index)  # the move is the stream's last work: it waits for it only
        if flags is not None and flags != self.clear:
            return exact_count(self.mv)
        return self.count


def registration(kv_caches: KVCaches, mv: MoveCheck) -> _Registered:
    """The registration of ``kv_caches`` for ``mv``'s layers (what ``same_layers`` re-checks)."""
    return _register(kv_caches, mv.layout, mv.layers)


def same_layers(reg: _Registered, kv_caches: KVCaches) -> bool:
    """True when ``kv_caches`` still holds exactly the registered layer tensors (identity)."""
    return _same_layers(reg, kv_caches)


def exact_count(mv: MoveCheck) -> int:
    """The slot checks of ``mv`` counted exactly on a host copy of its slot mapping (after a flagged run)."""
    assert mv.check_args is not None
    mapping = mv.check_args[0]
    sc = _slot_check(mapping, mv.slots, mv.span_list, mv.skips, mv.n_slots, mapping.cpu())
    sc.queue()
    return sc.check(scatter=mv.scatter)


_BOUND_MOVES_MAX = 64  # bound launches kept per KV-caches registration (they live as long as it does)


def _launch_key(kv_caches: KVCaches, move: Move, cfg: TileConfig) -> tuple[Any, ...]:
    """Everything a bound launch of ``move`` depends on: the KV caches, the addresses of the slot mapping
    and of the objects (not the tensor objects), spans, skips, layers, checks and tile."""
    sm = move.slot_mapping
    return (
        id(kv_caches),
        move.layout,
        sm.data_ptr(),
        sm.dtype,
        sm.shape[0],
        move.spans,
        tuple(o.data_ptr() for o in move.objects),
        move.skips,
        move.layers.start,
        move.layers.stop,
        move.checks,
        cfg,
    )


def pinned_objects(objs: Sequence[torch.Tensor]) -> bool:
    """True when every object lies in pinned host memory (one query per storage: L1 objects share one)."""
    seen: set[int] = set()
    for o in objs:
        if o.is_cuda:
            return False
        base = o.untyped_storage().data_ptr()
        if base not in seen:
            if not o.is_pinned():
                return False
            seen.add(base)
    return True


def bind(
    kv_caches: KVCaches, move: Move, cfg: TileConfig = DEFAULT_CONFIG, *, host: bool = False
) -> BoundMove | None:
    """The ``BoundMove`` of ``move`` on ``kv_caches``, or None when this move takes the general path
    (checks on the host, a slot mapping that is not a contiguous int tensor on the KV device, launches not
    pre-bound, objects not on the device; with ``host``, objects not all in pinned host memory: the kernel
    then reads / writes them in place and every run waits for it). Kept on the move; and across moves of
    the same request shape (a new ``Move`` of the same KV caches, slot-mapping and object addresses, spans,
    skips, layers and checks reuses the launch prepared for an earlier one). ``Unsupported`` as
    ``check_move``."""
    key = ("bound", id(kv_caches), cfg)
    b = move.prepared.get(key)
    if b is not None and b.valid_for(kv_caches):
        return b  # type: ignore[no-any-return]
    sm = move.slot_mapping
    if (
        move.checks is Checks.HOST
        or not prebound_enabled()
        or not _ZERO_COPY[0]
        or not move.objects
        or not sm.is_cuda
        or sm.dtype not in (torch.int32, torch.int64)
        or not sm.is_contiguous()
        or not (pinned_objects(move.objects) if host else all(o.is_cuda for o in move.objects))
    ):
        return None
    lkey = _launch_key(kv_caches, move, cfg)
    shared = _register(kv_caches, move.layout, move.layers).bound
    b = shared.get(lkey)
    if b is None or not b.valid_for(kv_caches):
        p = plan(kv_caches, move, host=host)
        if p.slots is not sm or (not host and any(o.device != p.geo.device for o in move.objects)):
            return None
        b = BoundMove(kv_caches, p, cfg, wait=host)
        if len(shared) >= _BOUND_MOVES_MAX:
            del shared[next(iter(shared))]
        shared[lkey] = b
    if len(move.prepared) > 8:
        move.prepared.clear()
    move.prepared[key] = b
    return b


def _run(kv_caches: KVCaches, move: Move, cfg: TileConfig) -> int:
    b = bind(kv_caches, move, cfg)
    if b is not None:
        return b.run()
    p = plan(kv_caches, move)
    p.launch(cfg)
    return p.finish()


def gather(kv_caches: KVCaches, move: Move, cfg: TileConfig = DEFAULT_CONFIG) -> None:
    """Run a gather ``move`` into device objects in one launch (``reference.gather`` contract); a repeated
    run of the same move costs one pre-bound launch (and, unless trusted, a wait for the slot flags)."""
    if move.is_scatter:
        raise ValueError(f"{move!r} is a scatter")
    _run(kv_caches, move, cfg)


def scatter(kv_caches: KVCaches, move: Move, cfg: TileConfig = DEFAULT_CONFIG) -> int:
    """Run a scatter ``move`` from device objects in one launch; returns the tokens written per layer
    (``reference.scatter`` contract; a trusted move counts every token past the skips)."""
    if not move.is_scatter:
        raise ValueError(f"{move!r} is a gather")
    return _run(kv_caches, move, cfg)


# --------------------------------------------------------------------------------------------- fp8

FP8_ONE_PASS_ELEMS = 16384  # largest [tokens, channels] tile kept in registers by one program
FP8_BLOCK_D = 64  # channels per program: 64 x 8 warps was the fastest bit-exact kernel on the H200 A/B
FP8_CHANNELS_FAST = True  # grid order: channel blocks of one (layer, plane) fastest, spans slowest
FP8_NUM_WARPS = 8  # (1174 GB/s of bf16 input alone, vs 921 for 32 x 4 and 894-945 for 128 channels)


@dataclass
class Fp8Plan:
    """One fused-fp8 launch, ready to go (``plan_fp8``, ``plan_fp8_scatter``): ``launch()`` is the kernel
    alone over every span (no host work but the launch), then the checks are queued; ``launch_rows(a, b)``
    launches spans ``a..b`` only (a pipeline launches its groups so, then ``queue_checks()`` once);
    ``finish()`` reads the slot checks and, if asked, checks the scales for non-finite input."""

    launch_fn: Any
    checks: SlotCheck | None
    rows: int = 0
    after: Any = None
    """Queued after the last launch besides ``checks`` (a scatter's ``MoveCheck.queue_checks``)."""

    def launch(self) -> None:
        self.launch_rows(0, self.rows)
        self.queue_checks()

    def launch_rows(self, a: int, b: int) -> None:
        """Launch the kernel over spans ``a..b`` (rows of the plan's span table) only."""
        if b > a:
            self.launch_fn(a, b)

    def queue_checks(self) -> None:
        """Queue the slot checks (after the last launch that writes the spans' status)."""
        if self.checks is not None:
            self.checks.queue()
        if self.after is not None:
            self.after()

    def finish(self) -> None:
        """``ValueError`` for bad slots (unless trusted) or non-finite input (when planned with
        ``check_finite``); waits for the checks only."""
        if self.checks is None:
            return
        self.checks.check(scatter=False)
        if self.checks.nonfinite():
            raise ValueError("fp8 gather needs finite input (found NaN or inf)")


def _row_launcher(
    kernel: Any,
    grid: tuple[int, int, int],
    ch_fast: bool,
    args: tuple[Any, ...],
    table_at: int,
    status_at: int | None,
    meta: dict[str, Any],
    device: torch.device,
) -> Any:
    """A ``launch_fn(a, b)`` of the fused fp8 kernels: the span table (``args[table_at]``) and the status
    (``args[status_at]``) seen from row ``a``, ``b - a`` spans in the grid's span dimension."""

    def run(a: int, b: int) -> None:
        call = list(args)
        if a:
            call[table_at] = args[table_at][a:]
            if status_at is not None:
                call[status_at] = args[status_at][a:]
        g = (grid[0], grid[1], b - a) if ch_fast else (b - a, grid[1], grid[2])
        with _on(device):
            launch(kernel, g, tuple(call), meta, device)

    return run


def _fp8_move(move: Move, scatter: bool) -> None:
    """``ValueError`` unless ``move`` is an fp8 scatter (``scatter``) or an fp8 gather."""
    if not move.fp8 or move.is_scatter != scatter:
        raise ValueError(f"{move!r} is not an fp8 {'scatter' if scatter else 'gather'}")


def plan_fp8(
    kv_caches: KVCaches,
    move: Move,
    *,
    block_t: int = 0,
    block_d: int = FP8_BLOCK_D,
    num_warps: int = FP8_NUM_WARPS,
    one_pass_elems: int = FP8_ONE_PASS_ELEMS,
    soft_convert: bool | None = None,
    check_finite: bool = True,
    channels_fast: bool = FP8_CHANNELS_FAST,
) -> Fp8Plan:
    """The launch of a fused fp8 gather ``move`` (``Move.gather_fp8``; slot checks queued after it; the
    kernel counts non-finite input when ``check_finite``)."""
    _fp8_move(move, scatter=False)
    layout, slot_mapping, span_list, out = move.layout, move.slot_mapping, list(move.spans), move.objects
    trusted, host_slots = move.checks is Checks.NONE, move.host_slots
    layers = range(layout.num_layers)
    geo = _geometry(kv_caches, layout, layers, [])
    if any(o.device != geo.device and not _pinned_host(o) for o in out):
        raise Unsupported("outputs are neither on the KV device nor in pinned host memory")
    base_ptr = out[0].data_ptr() if out else 0
    rows = [(s, e - s, 0, o.data_ptr() - base_ptr) for (s, e), o in zip(span_list, out, strict=True)]
    max_tok = max((r[1] for r in rows), default=0)
    if max_tok == 0:
        return Fp8Plan(lambda a, b: None, None)
    slots = _device_slots(slot_mapping, geo.device)
    skips = [0] * len(span_list)
    checks: SlotCheck | None = None
    if not trusted:
        checks = _slot_check(
            slot_mapping, slots, span_list, skips, geo.n_slots, host_slots, flags=check_finite
        )
    elif check_finite:
        checks = SlotCheck(slots, span_list, skips, geo.n_slots, check=False, flags=True)
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
    ch_fast = channels_fast and len(rows) < 65536  # grid dims 1 and 2 hold at most 65535
    grid = (len(rows), len(layers) * layout.planes, layout.num_kv_heads * ndc)
    if ch_fast:
        grid = (grid[2], grid[1], grid[0])
    args = (
        _ptr(kv0, kv0.dtype),
        _payload_ptr(out[0]),
        _layer_offsets(geo, scale),
        table,
        slots,
        checks.status if checks is not None and checks.status is not None else slots,
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
        "FINITE": check_finite,
        "CH_FAST": ch_fast,
        "num_warps": num_warps,
    }
    status_at = 5 if checks is not None and checks.status is not None else None
    run = _row_launcher(k.fp8, grid, ch_fast, args, 3, status_at, meta, geo.device)
    return Fp8Plan(run, checks, len(rows))


def gather_fp8(
    kv_caches: KVCaches,
    move: Move,
    *,
    block_t: int = 0,
    block_d: int = FP8_BLOCK_D,
    num_warps: int = FP8_NUM_WARPS,
    one_pass_elems: int = FP8_ONE_PASS_ELEMS,
    check: bool = True,
    soft_convert: bool | None = None,
) -> None:
    """Run a gather ``move`` (``Move.gather_fp8``), fused with the fp8 quantize: payload i (on the KV device
    or pinned host memory written in place) receives exactly the ``Fp8Codec("channel")`` payload of span i
    (see the module doc).

    ``block_t`` 0 (default) loads each (span, layer, plane, channel block) tile once, whole, when it has at
    most ``one_pass_elems`` elements (else 32 tokens at a time, in two passes); ``block_t`` >= the longest
    span is one pass too. ``ValueError`` for slots < 0 or out of range (unless trusted; on the host with the
    move's ``host_slots``) and, when ``check``, for non-finite input (one more sync).
    ``soft_convert`` rounds to e4m3 with integer ops instead of the hardware conversion (default: only under
    the interpreter); both give the codec's bytes.
    """
    plan = plan_fp8(
        kv_caches,
        move,
        block_t=block_t,
        block_d=block_d,
        num_warps=num_warps,
        one_pass_elems=one_pass_elems,
        soft_convert=soft_convert,
        check_finite=check,
    )
    plan.launch()
    plan.finish()


def _pinned_host(t: torch.Tensor) -> bool:
    """A CPU tensor in pinned (page-locked, device-mapped) memory: the fp8 kernels read / write it in place
    when launches are pre-bound."""
    return t.device.type == "cpu" and prebound_enabled() and t.is_pinned()


def _payload_ptr(t: torch.Tensor) -> torch.Tensor | Ptr:
    """A payload pointer argument: the tensor itself on the device; a pinned host tensor by its address
    (the kernel reads / writes it over the bus; only compiling sees an aligned device stand-in of the same
    dtype, the pre-bound launch passes the host address)."""
    if t.device.type != "cpu" or not prebound_enabled():  # the interpreter runs on CPU tensors as they are
        return t
    if t.data_ptr() % 16:
        raise Unsupported("pinned host payloads must be 16-byte aligned")
    return Ptr(t.data_ptr(), t.dtype, lambda: torch.empty(16, dtype=t.dtype, device="cuda"))


def plan_fp8_scatter(
    kv_caches: KVCaches,
    move: Move,
    *,
    block_t: int = 32,
    block_d: int = FP8_BLOCK_D,
    num_warps: int = FP8_NUM_WARPS,
    soft_convert: bool | None = None,
    channels_fast: bool = FP8_CHANNELS_FAST,
) -> tuple[Fp8Plan, MoveCheck]:
    """The launch of a fused dequantize + scatter ``move`` (``Move.scatter_fp8``: ``gather_fp8``'s bytes, on
    the KV device or in pinned host memory) and its check (``finish()``: slot checks, tokens written)."""
    _fp8_move(move, scatter=True)
    layout, slot_mapping, span_list, payloads = move.layout, move.slot_mapping, list(move.spans), move.objects
    trusted, host_slots, skips = move.checks is Checks.NONE, move.host_slots, list(move.span_skips)
    layers = range(layout.num_layers)
    key = _geometry_key(kv_caches, layout, layers)
    geo = _geometry(kv_caches, layout, layers, [], key)
    host = [_pinned_host(o) for o in payloads]
    if any(o.device != geo.device and not h for o, h in zip(payloads, host, strict=True)):
        raise Unsupported("payloads are neither on the KV device nor in pinned host memory")
    if any(host) and not all(host):
        raise Unsupported("payloads are partly on the device, partly in host memory")
    slots = _device_slots(slot_mapping, geo.device)
    if host_slots is not None:
        _host_slots(slot_mapping, host_slots)
    args_check = None if trusted else (slot_mapping, host_slots)
    mv = MoveCheck(kv_caches, layout, layers, span_list, skips, slots, geo.n_slots, True, key, args_check)
    base_ptr = payloads[0].data_ptr() if payloads else 0
    rows = [
        (s, e - s, k, o.data_ptr() - base_ptr)
        for (s, e), k, o in zip(span_list, skips, payloads, strict=True)
    ]
    max_tok = max((r[1] for r in rows), default=0)
    if max_tok == 0:
        return Fp8Plan(lambda a, b: None, None, after=mv.queue_checks), mv
    table = _device_ints(rows, geo.device)
    scale = geo.word // geo.es
    d = layout.head_dim
    bd = min(block_d, triton_next_pow2(d))
    ndc = -(-d // bd)
    bt = max(1, min(block_t, triton_next_pow2(max_tok)))
    vec = max(1, geo.vec * geo.word // geo.es)
    soft = _interpret() if soft_convert is None else soft_convert
    k = _kernels()
    kv0 = layer_tensors(kv_caches)[0]
    ch_fast = channels_fast and len(rows) < 65536
    grid = (len(rows), len(layers) * layout.planes, layout.num_kv_heads * ndc)
    if ch_fast:
        grid = (grid[2], grid[1], grid[0])
    args = (
        _ptr(kv0, kv0.dtype),
        _payload_ptr(payloads[0]),
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
        "SOFT_CVT": soft,
        "SOFT_BF16": soft and layout.dtype == "bfloat16",
        "VEC": vec if d % vec == 0 and bd % vec == 0 else 1,
        "CH_FAST": ch_fast,
        "num_warps": num_warps,
    }
    run = _row_launcher(k.fp8_scatter, grid, ch_fast, args, 3, None, meta, geo.device)
    return Fp8Plan(run, None, len(rows), after=mv.queue_checks), mv


def scatter_fp8(
    kv_caches: KVCaches,
    move: Move,
    *,
    block_t: int = 32,
    block_d: int = FP8_BLOCK_D,
    num_warps: int = FP8_NUM_WARPS,
    soft_convert: bool | None = None,
) -> int:
    """Run a scatter ``move`` (``Move.scatter_fp8``), fused with the dequantize: span i's payload (on the KV
    device, or pinned host memory read in place) is decoded as the codec decodes it (bit for bit) and
    written into the paged KV like ``reference.scatter`` (skips, slots < 0 skipped, ``ValueError`` for slots
    past the KV unless trusted); returns tokens written per layer.
    """
    plan, mv = plan_fp8_scatter(
        kv_caches,
        move,
        block_t=block_t,
        block_d=block_d,
        num_warps=num_warps,
        soft_convert=soft_convert,
    )
    plan.launch()
    return mv.finish()
