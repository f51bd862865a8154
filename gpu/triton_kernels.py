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
accepts it as is. Each program owns one (span, layer, plane, channel chunk) and reads its tokens twice
(absmax, then quantize; the second read mostly hits L2).

Kernels are compiled lazily (``TRITON_INTERPRET=1`` is read when they are first built, so tests can run them
on the CPU through Triton's interpreter).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tiercache.gpu.layouts import LayoutKind, PagedLayout, layer_tensors, object_spec

if TYPE_CHECKING:
    KVCaches = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]

__all__ = [
    "TileConfig",
    "Unsupported",
    "available",
    "gather",
    "gather_fp8",
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


DEFAULT_CONFIG = TileConfig(tile_bytes=32768, num_warps=8)  # best gather tile on the H200 (gpu_bench)
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
        scale_ptr = (out_ptr + o_off).to(tl.pointer_type(tl.float32))
        tl.store(scale_ptr + group * hd + chan, scale, mask=dmask)
        q_base = out_ptr + o_off + 4 * P * num_layers * hd + group * n_tok * hd
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


def _geometry(
    kv_caches: KVCaches, layout: PagedLayout, layers: range, extra_ptrs: Sequence[int]
) -> _Geometry:
    if layout.kind is LayoutKind.CPU_BLOCKS:
        raise Unsupported("CPU_BLOCKS moves whole pages: reference only")
    kv = layer_tensors(kv_caches)
    if len(kv) != layout.num_layers:
        raise ValueError(f"{len(kv)} KV cache tensors for a layout of {layout.num_layers} layers")
    nbs = {layout.num_blocks_of(t) for t in kv}
    if len(nbs) != 1:
        raise ValueError(f"layers hold different block counts: {sorted(nbs)}")
    first = kv[0]
    if len({t.stride() for t in kv}) != 1 or len({t.device for t in kv}) != 1:
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
    all_ptrs = [base, *extra_ptrs]
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

    return _Geometry(
        word=word,
        vec=vec,
        kv_base=_alias(first, _WORDS[word]),
        layer_off=[(ptrs[i] - base) // word for i in layers],
        s_plane=w(s_plane, layout.planes),
        s_blk=w(s_blk, nb),
        s_off=w(s_off, layout.block_size),
        s_head=w(s_head, layout.num_kv_heads),
        n_slots=nb * layout.block_size,
        device=first.device,
    )


def _check_objects(
    objs: Sequence[torch.Tensor], layout: PagedLayout, spans: list[tuple[int, int]], layers: range, what: str
) -> None:
    for i, ((s, e), obj) in enumerate(zip(spans, objs, strict=True)):
        spec = object_spec(layout, e - s)
        if len(layers) != layout.num_layers:
            spec = spec.with_layers(layers.start, layers.stop)
        if tuple(obj.shape) != spec.shape:
            raise ValueError(f"{what}[{i}] has shape {tuple(obj.shape)}, expected {spec.shape}")
        if str(obj.dtype).removeprefix("torch.") != layout.dtype:
            raise ValueError(f"{what}[{i}] has dtype {obj.dtype}, layout dtype is {layout.dtype}")
        if not obj.is_contiguous():
            raise Unsupported("objects must be contiguous")


def _spans(spans: Sequence[tuple[int, int]], n: int, count: int) -> list[tuple[int, int]]:
    if len(spans) != count:
        raise ValueError(f"{len(spans)} spans for {count} objects")
    out = [(int(s), int(e)) for s, e in spans]
    for s, e in out:
        if not 0 <= s <= e <= n:
            raise ValueError(f"span ({s}, {e}) outside the slot mapping of {n} tokens")
    return out


def _skips(skip_prefix: int | Sequence[int], spans: list[tuple[int, int]]) -> list[int]:
    if isinstance(skip_prefix, int):
        skips = [skip_prefix if i == 0 else 0 for i in range(len(spans))]
    else:
        skips = [int(k) for k in skip_prefix]
        if len(skips) != len(spans):
            raise ValueError(f"{len(skips)} skip counts for {len(spans)} spans")
    for k, (s, e) in zip(skips, spans, strict=True):
        if not 0 <= k <= e - s:
            raise ValueError(f"skip_prefix {k} outside span ({s}, {e})")
    return skips


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


@dataclass
class MovePlan:
    """Everything one launch needs; built once by ``plan_gather``/``plan_scatter`` (validation, one sync)."""

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
    stats: torch.Tensor | None = None
    span_list: list[tuple[int, int]] | None = None

    def finish(self) -> int:
        """Read the slot checks (one sync): ``ValueError`` on bad slots, else the tokens written."""
        return check_stats(
            self.stats, self.geo.n_slots, self.slots, self.span_list or [], scatter=self.scatter
        )

    def launch(self, cfg: TileConfig = DEFAULT_CONFIG) -> None:
        if self.num_spans == 0 or self.tiles_per_span == 0:
            return
        k = _kernels()
        block_d, ndc, block_t = _tiles(self.dw, self.geo.word, self.tiles_per_span, cfg)
        tiles = -(-self.tiles_per_span // block_t)
        grid = (self.num_spans * tiles, self.layers * self.planes, self.heads * ndc)
        layer_off = self._layer_off
        with torch.cuda.device(self.geo.device) if self.geo.device.type == "cuda" else _null():
            k.move[grid](
                self.geo.kv_base,
                self.obj_base,
                layer_off,
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

    @property
    def _layer_off(self) -> torch.Tensor:
        return _layer_offsets(self.geo)


_LAYER_OFFSETS: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _layer_offsets(geo: _Geometry) -> torch.Tensor:
    """The per-layer word offsets as a device int64 tensor (cached: engines keep their KV tensors)."""
    key = (geo.device, tuple(geo.layer_off))
    t = _LAYER_OFFSETS.get(key)
    if t is None:
        if len(_LAYER_OFFSETS) > 64:
            _LAYER_OFFSETS.clear()
        t = torch.tensor(geo.layer_off, dtype=torch.int64).to(geo.device, non_blocking=True)
        _LAYER_OFFSETS[key] = t
    return t


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
        s = s.to(device)
    return s.contiguous()


def slot_stats(
    slots: torch.Tensor, span_list: list[tuple[int, int]], skips: list[int]
) -> torch.Tensor | None:
    """[min, max, count >= 0] of the slots a move touches, as a device tensor (no sync); None if none."""
    ranges = [(s + k, e) for (s, e), k in zip(span_list, skips, strict=True) if e > s + k]
    if not ranges:
        return None
    if all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1)):
        sel = slots[ranges[0][0] : ranges[-1][1]].to(torch.int64)
    else:
        sel = torch.cat([slots[a:b] for a, b in ranges]).to(torch.int64)
    return torch.stack([sel.min(), sel.max(), (sel >= 0).sum()])


def check_stats(
    stats: torch.Tensor | None,
    n_slots: int,
    slots: torch.Tensor,
    span_list: list[tuple[int, int]],
    *,
    scatter: bool,
) -> int:
    """Read ``slot_stats`` (one sync): ``ValueError`` for a slot past the KV, or < 0 in a gather; returns
    the number of slots >= 0 (the tokens a scatter writes). The kernels never touch such slots."""
    if stats is None:
        return 0
    lo, hi, written = stats.tolist()
    if hi >= n_slots:
        raise ValueError(f"slot {hi} outside the paged KV of {n_slots} slots")
    if not scatter and lo < 0:
        bad = next((s, e) for (s, e) in span_list if e > s and int(slots[s:e].min()) < 0)
        raise ValueError(f"span {bad} has slots < 0: a token without KV cannot be stored")
    return int(written)


def check_move(
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    objs: Sequence[torch.Tensor],
    layers: range,
    skip_prefix: int | Sequence[int] | None,
) -> tuple[list[tuple[int, int]], list[int], Callable[[], int]]:
    """Validate a move whose objects live elsewhere (host): (spans, skips, finish). The slot checks are
    queued on the device; ``finish()`` reads them (one sync), raises ``ValueError`` or returns the tokens
    written.

    ``skip_prefix`` None means a gather (slots < 0 refused). ``Unsupported`` if the kernels cannot do it.
    """
    _check_layer_range(layers, layout)
    span_list = _spans(spans, slot_mapping.shape[0], len(objs))
    skips = [0] * len(span_list) if skip_prefix is None else _skips(skip_prefix, span_list)
    _check_objects(objs, layout, span_list, layers, "out" if skip_prefix is None else "objects")
    geo = _geometry(kv_caches, layout, layers, [])
    slots = _device_slots(slot_mapping, geo.device)
    stats = slot_stats(slots, span_list, skips)

    def finish() -> int:
        return check_stats(stats, geo.n_slots, slots, span_list, scatter=skip_prefix is not None)

    return span_list, skips, finish


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
) -> MovePlan:
    """Validate (one sync when ``check``) and build the launch plan of one move."""
    _check_layer_range(layers, layout)
    span_list = _spans(spans, slot_mapping.shape[0], len(objs))
    _check_objects(objs, layout, span_list, layers, "objects" if scatter else "out")
    geo = _geometry(kv_caches, layout, layers, [o.data_ptr() for o in objs])
    dev = geo.device
    if any(o.device != dev for o in objs):
        raise Unsupported("objects are not on the KV device")
    es = torch.empty((), dtype=objs[0].dtype).element_size() if objs else 1
    word = geo.word
    dw = layout.head_dim * es // word
    slots = _device_slots(slot_mapping, dev)
    obj_base = _alias(objs[0], _WORDS[word]) if objs else geo.kv_base
    base_ptr = objs[0].data_ptr() if objs else 0
    rows = []
    max_tokens = 0
    if skips is None:
        skips = [0] * len(span_list)
    for (s, e), k, o in zip(span_list, skips, objs, strict=True):
        if (o.data_ptr() - base_ptr) % word:
            raise Unsupported("misaligned object")
        rows.append([s, e - s, k, (o.data_ptr() - base_ptr) // word])
        max_tokens = max(max_tokens, e - s - k)
    table = torch.tensor(rows or [[0, 0, 0, 0]], dtype=torch.int64).to(dev, non_blocking=True)
    stats = slot_stats(slots, span_list, skips) if check else None
    return MovePlan(
        geo=geo,
        obj_base=obj_base,
        span_table=table,
        slots=slots,
        tiles_per_span=max_tokens,
        num_spans=len(span_list),
        layers=len(layers),
        planes=layout.planes,
        heads=layout.num_kv_heads,
        dw=dw,
        block_size=layout.block_size,
        scatter=scatter,
        stats=stats,
        span_list=span_list,
    )


def plan_gather(
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    out: Sequence[torch.Tensor],
    layers: range | None = None,
    *,
    check: bool = True,
) -> MovePlan:
    """Validate a gather (one sync when ``check``) and return its launch plan."""
    layers = range(layout.num_layers) if layers is None else layers
    return _plan(kv_caches, layout, slot_mapping, spans, out, layers, None, scatter=False, check=check)


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
) -> MovePlan:
    """Validate a scatter (one sync when ``check``: it also counts the tokens written) and plan it."""
    layers = range(layout.num_layers) if layers is None else layers
    span_list = _spans(spans, slot_mapping.shape[0], len(objects))
    skips = _skips(skip_prefix, span_list)
    return _plan(
        kv_caches, layout, slot_mapping, span_list, objects, layers, skips, scatter=True, check=check
    )


def gather(
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    out: Sequence[torch.Tensor],
    layers: range | None = None,
    cfg: TileConfig = DEFAULT_CONFIG,
) -> None:
    """One-launch gather into device objects (same contract as ``reference.gather``)."""
    plan = plan_gather(kv_caches, layout, slot_mapping, spans, out, layers)
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
) -> int:
    """One-launch scatter from device objects; returns the tokens written per layer (reference contract)."""
    plan = plan_scatter(objects, kv_caches, layout, slot_mapping, spans, skip_prefix, layers)
    plan.launch(cfg)
    return plan.finish()


# --------------------------------------------------------------------------------------------- fp8


def fp8_payload_nbytes(layout: PagedLayout, tokens: int) -> int:
    """Bytes of one span's fused-fp8 payload: float32 channel scales then one e4m3 byte per element."""
    if tokens == 0:
        return 0
    spec = object_spec(layout, tokens)
    elements = spec.nbytes // spec.itemsize
    return 4 * (elements // tokens) + elements


def gather_fp8(
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    out: Sequence[torch.Tensor],
    *,
    block_t: int = 32,
    block_d: int = 128,
    num_warps: int = 4,
    check: bool = True,
    soft_convert: bool | None = None,
) -> None:
    """Fused gather + fp8 quantize: ``out[i]`` (uint8, ``fp8_payload_nbytes`` bytes, on the KV device)
    receives exactly the ``Fp8Codec("channel")`` payload of span i (see the module doc).

    ``ValueError`` for slots < 0 or out of range and, when ``check``, for non-finite input (one sync).
    ``soft_convert`` rounds to e4m3 with integer ops instead of the hardware conversion (default: only under
    the interpreter); both give the codec's bytes.
    """
    if layout.dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"fp8 gather encodes bfloat16, float16 or float32 KV, not {layout.dtype}")
    layers = range(layout.num_layers)
    span_list = _spans(spans, slot_mapping.shape[0], len(out))
    for i, ((s, e), o) in enumerate(zip(span_list, out, strict=True)):
        n = fp8_payload_nbytes(layout, e - s)
        if o.dtype != torch.uint8 or o.numel() != n or not o.is_contiguous():
            raise ValueError(f"out[{i}] must be a contiguous uint8 tensor of {n} bytes")
    geo = _geometry(kv_caches, layout, layers, [])
    kv = layer_tensors(kv_caches)
    es = kv[0].element_size()
    if any(o.device != geo.device for o in out):
        raise Unsupported("outputs are not on the KV device")
    slots = _device_slots(slot_mapping, geo.device)
    stats = slot_stats(slots, span_list, [0] * len(span_list))
    base_ptr = out[0].data_ptr() if out else 0
    rows = [[s, e - s, 0, o.data_ptr() - base_ptr] for (s, e), o in zip(span_list, out, strict=True)]
    if not rows or max(r[1] for r in rows) == 0:
        return
    table = torch.tensor(rows, dtype=torch.int64).to(geo.device, non_blocking=True)
    # element (not word) offsets: the fp8 kernel reads real values
    scale = geo.word // es
    layer_off = torch.tensor([x * scale for x in geo.layer_off], dtype=torch.int64).to(geo.device)
    k = _kernels()
    d = layout.head_dim
    bd = min(block_d, triton_next_pow2(d))
    ndc = -(-d // bd)
    grid = (len(rows), len(layers) * layout.planes, layout.num_kv_heads * ndc)
    with torch.cuda.device(geo.device) if geo.device.type == "cuda" else _null():
        k.fp8[grid](
            _alias(kv[0], kv[0].dtype),
            out[0],
            layer_off,
            table,
            slots,
            geo.s_plane * scale,
            geo.s_blk * scale,
            geo.s_off * scale,
            geo.s_head * scale,
            len(layers),
            layout.num_kv_heads,
            geo.n_slots,
            BS=layout.block_size,
            P=layout.planes,
            D=d,
            BLOCK_T=block_t,
            BLOCK_D=bd,
            NDC=ndc,
            SOFT_CVT=_interpret() if soft_convert is None else soft_convert,
            VEC=max(1, geo.vec * geo.word // es) if d % max(1, geo.vec * geo.word // es) == 0 else 1,
            OVEC=16 if all(o.data_ptr() % 16 == 0 for o in out) else 1,
            num_warps=num_warps,
        )
    check_stats(stats, geo.n_slots, slots, span_list, scatter=False)
    if check:
        finite = [
            o[: 4 * (fp8_payload_nbytes(layout, e - s) - _elements(layout, e - s)) // 4].view(torch.float32)
            for (s, e), o in zip(span_list, out, strict=True)
            if e > s
        ]
        if not bool(torch.isfinite(torch.cat(finite)).all()):
            raise ValueError("fp8 gather needs finite input (found NaN or inf)")


def _elements(layout: PagedLayout, tokens: int) -> int:
    spec = object_spec(layout, tokens)
    return spec.nbytes // spec.itemsize
