"""Torch reference gather/scatter between paged KV and contiguous KV objects; any device, bit-exact.

Per span and layer this is one vectorized index op per KV plane (``index_select`` into the object, or
``index_copy_`` into the paged view); there is no per-token Python loop. Data moves as same-width integer bit
patterns, so every dtype (fp8 included) round-trips exactly. Slots are ``block_id * block_size + offset``.
CPU_BLOCKS layouts move whole blocks (opaque pages) with one ``index_select``/``index_copy_`` per layer;
VLLM_BLOCKS moves run as such page moves (``block_pages``: a block of every layer is one page).
CPU tensors take the native row kernel when it is built (``cpu_rows``: one call for all spans and layers).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from tiercache import fp8_math
from tiercache.gpu import block_pages, cpu_rows
from tiercache.gpu.layouts import LayoutKind, PagedLayout, layer_tensors, object_spec
from tiercache.gpu.move import Move

if TYPE_CHECKING:
    import numpy.typing as npt

    from tiercache.gpu.layouts import KVCaches

__all__ = ["block_firsts", "gather", "scatter"]

_BITS: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def gather(kv_caches: KVCaches, move: Move) -> None:
    """Run a gather ``move`` (``Move.gather``): copy the KV of its spans' tokens into its objects; an fp8
    move (``Move.gather_fp8``) writes each span's channel-scaled ``tiercache.fp8_math`` payload instead (the
    reference of the fused fp8 kernel; ``ValueError`` for non-finite input).

    ``ValueError`` for a slot < 0 (a token without KV cannot be stored), a slot past the paged KV, and
    CPU_BLOCKS spans that are not block-aligned. The reference always checks the slots (``move.checks`` is
    for the kernel paths).
    """
    if move.is_scatter:
        raise ValueError(f"{move!r} is a scatter")
    kv_caches, move = block_pages.as_pages(kv_caches, move)
    if move.fp8:
        _gather_fp8(kv_caches, move)
        return
    _gather(move.layers, kv_caches, move.layout, move.slot_mapping, move.spans, move.objects)


def scatter(kv_caches: KVCaches, move: Move) -> int:
    """Run a scatter ``move`` (``Move.scatter``): write its objects' tokens into the paged KV; return the
    tokens written per layer. An fp8 move (``Move.scatter_fp8``) dequantizes each payload first
    (``tiercache.fp8_math``; the reference of the fused dequantize-scatter kernel).

    The skipped tokens at the head of each span (already on the GPU) and slots < 0 are left untouched.
    CPU_BLOCKS writes whole pages (skips block-aligned).
    """
    if not move.is_scatter:
        raise ValueError(f"{move!r} is a gather")
    kv_caches, move = block_pages.as_pages(kv_caches, move)
    objects = _decode_fp8(kv_caches, move) if move.fp8 else move.objects
    return _scatter(
        move.layers, objects, kv_caches, move.layout, move.slot_mapping, move.spans, move.span_skips
    )


def _gather_fp8(kv_caches: KVCaches, move: Move) -> None:
    """Gather each span of an fp8 ``move`` and quantize it into its payload."""
    layout = move.layout
    for (s, e), o in zip(move.spans, move.objects, strict=True):
        spec = object_spec(layout, e - s)
        obj = torch.empty(spec.shape, dtype=getattr(torch, layout.dtype), device=o.device)
        _gather(move.layers, kv_caches, layout, move.slot_mapping, [(s, e)], [obj])
        payload = bytearray(fp8_math.payload_nbytes(spec))
        src = obj.cpu().contiguous().view(torch.uint8).reshape(-1)
        n = fp8_math.quantize_into(memoryview(src.numpy()), memoryview(payload), spec)  # type: ignore[arg-type]
        o.copy_(torch.frombuffer(payload, dtype=torch.uint8)[:n])


def _decode_fp8(kv_caches: KVCaches, move: Move) -> list[torch.Tensor]:
    """The objects of an fp8 scatter ``move``: each payload dequantized, on the KV device."""
    kv_device = layer_tensors(kv_caches)[0].device
    objects = []
    for (s, e), p in zip(move.spans, move.objects, strict=True):
        spec = object_spec(move.layout, e - s)
        obj = torch.empty(spec.shape, dtype=getattr(torch, move.layout.dtype))
        src = p.detach().cpu().contiguous()
        dst = memoryview(obj.view(torch.uint8).reshape(-1).numpy()).cast("B")  # type: ignore[arg-type]
        fp8_math.dequantize_into(memoryview(src.numpy()), dst, spec)  # type: ignore[arg-type]
        objects.append(obj.to(kv_device))
    return objects


# --------------------------------------------------------------------------------------------- internals


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as a same-width integer dtype (exact copies of any float, fp8 included)."""
    return t.view(_BITS[t.element_size()])


def _layers(kv_caches: KVCaches, layout: PagedLayout) -> tuple[list[torch.Tensor], int]:
    """Per-layer tensors validated against ``layout``, and the number of slots each holds."""
    layers = layer_tensors(kv_caches)
    if len(layers) != layout.num_layers:
        raise ValueError(f"{len(layers)} KV cache tensors for a layout of {layout.num_layers} layers")
    first = layers[0]
    nb = layout.num_blocks_of(first)
    shape, dtype = first.shape, first.dtype
    for t in layers:  # equal shapes and dtypes need no second check (32+ layers per call)
        if t.shape != shape or t.dtype != dtype:
            counts = {layout.num_blocks_of(u) for u in layers}  # raises for a bad shape or dtype
            raise ValueError(f"layers hold different block counts: {sorted(counts)}")
    return layers, nb * layout.block_size


def _slots(slot_mapping: torch.Tensor, start: int, end: int, device: torch.device) -> torch.Tensor:
    """``slot_mapping[start:end]`` as int64 on ``device`` (a view when it already is)."""
    return slot_mapping[start:end].to(device=device, dtype=torch.int64)


def _check_range(slots: torch.Tensor, n_slots: int) -> None:
    """``ValueError`` if a slot lies past the paged KV (negative slots are the caller's business)."""
    if slots.numel() and int(slots.max()) >= n_slots:
        raise ValueError(f"slot {int(slots.max())} outside the paged KV of {n_slots} slots")


def _planes(layer: torch.Tensor, layout: PagedLayout) -> list[torch.Tensor]:
    """Views [NB, BS, H, D] of one layer's K and V planes (one latent plane for MLA), any strides."""
    if layout.kind is LayoutKind.VLLM_LEGACY:
        return [layer[0], layer[1]]
    tok = layer.permute(0, 2, 1, 3)  # [NB, BS, H, C]
    if layout.kind is LayoutKind.VLLM_MLA:
        return [tok]
    d = layout.head_dim
    return [tok[..., :d], tok[..., d:]]


def _merged_stride(sizes: Sequence[int], strides: Sequence[int]) -> int | None:
    """Stride of the one dim that ``sizes`` (outer first) collapse into, or None if they do not."""
    dims = [(n, st) for n, st in zip(sizes, strides, strict=True) if n != 1]
    for (_, s_a), (n_b, s_b) in itertools.pairwise(dims):
        if s_a != n_b * s_b:
            return None
    return dims[-1][1] if dims else 1


def _widen(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tensors viewed as the widest integer type both allow (fewer, larger elements to move)."""
    for wide in (torch.int64, torch.int32):
        if wide.itemsize <= a.element_size():
            break
        try:
            return a.view(wide), b.view(wide)
        except RuntimeError:
            continue
    return a, b


class _Rows:
    """The token rows one span touches: ``slots`` [T], and per-head row indices for each paged geometry."""

    def __init__(self, slots: torch.Tensor, block_size: int, heads: int) -> None:
        self.slots = slots
        self.block_size = block_size
        self.heads = heads
        self._index: dict[tuple[int, int, int, int], torch.Tensor] = {}

    def head_rows(self, strides: tuple[int, int, int], row: int) -> torch.Tensor:
        """Index [T*H] (token-major) of each (token, head) row in a [*, D] view of row stride ``row``."""
        key = (*strides, row)
        index = self._index.get(key)
        if index is None:
            s_blk, s_off, s_head = strides
            base = (self.slots // self.block_size) * s_blk + (self.slots % self.block_size) * s_off
            heads = torch.arange(self.heads, device=self.slots.device) * s_head
            index = ((base[:, None] + heads) // row).reshape(-1)
            self._index[key] = index
        return index


def _row_views(
    plane: torch.Tensor, obj: torch.Tensor, rows: _Rows
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(paged [R, D], object [T*H, D], index [T*H]) row views when the last dims are dense; else None.

    Every (block, offset, head) of the paged plane starts at a multiple of the gcd ``row`` of its strides, so
    the plane is a [R, D] view with row stride ``row`` whatever its layout (NHD, HND, legacy, padded heads).
    """
    nb, bs, h, d = plane.shape
    if d > 1 and (plane.stride(3) != 1 or obj.stride(2) != 1):
        return None
    obj_rows = _merged_stride(obj.shape[:2], obj.stride()[:2])
    strides = (plane.stride(0), plane.stride(1), plane.stride(2))
    row = math.gcd(*(st for n, st in zip((nb, bs, h), strides, strict=True) if n > 1))
    if obj_rows is None or row == 0 or (row < d and plane.numel() > d):
        return None
    last = ((nb - 1) * strides[0] + (bs - 1) * strides[1] + (h - 1) * strides[2]) // row
    paged = plane.as_strided((last + 1, d), (row, 1), plane.storage_offset())
    flat = obj.as_strided((obj.shape[0] * h, d), (obj_rows, 1), obj.storage_offset())
    return paged, flat, rows.head_rows(strides, row)


def _read_rows(plane: torch.Tensor, rows: _Rows, dst: torch.Tensor) -> None:
    """dst[t] = plane row of ``rows.slots[t]`` (plane: [NB, BS, H, D] view; dst: [T, H, D])."""
    views = _row_views(plane, dst, rows)
    if views is None:
        bs = plane.shape[1]
        dst.copy_(plane[rows.slots // bs, rows.slots % bs])
        return
    paged, flat, index = _widened(views)
    torch.index_select(paged, 0, index, out=flat)


def _write_rows(plane: torch.Tensor, rows: _Rows, src: torch.Tensor) -> None:
    """Plane row of ``rows.slots[t]`` = src[t]; writes through the view into the paged KV."""
    views = _row_views(plane, src, rows)
    if views is None:
        bs = plane.shape[1]
        plane.index_put_((rows.slots // bs, rows.slots % bs), src)
        return
    paged, flat, index = _widened(views)
    paged.index_copy_(0, index, flat)


def _widened(
    views: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row views re-typed to the widest integer both allow."""
    paged, flat, index = views
    paged, flat = _widen(paged, flat)
    return paged, flat, index


def _obj_planes(obj: torch.Tensor, layout: PagedLayout, j: int) -> list[torch.Tensor]:
    """Planes [T, H, D] of the object's j-th layer (K and V, or the MLA latent)."""
    h, d = layout.num_kv_heads, layout.head_dim
    rows = [obj[j]] if layout.planes == 1 else [obj[0, j], obj[1, j]]
    return [r.view(r.shape[0], h, d) for r in rows]


@functools.lru_cache(maxsize=64)
def _block_offsets(tokens: int, block_size: int) -> npt.NDArray[np.int64]:
    """``arange(tokens) % block_size``, made once per span length (read-only)."""
    offs = np.arange(tokens, dtype=np.int64) % block_size
    offs.flags.writeable = False
    return offs


def block_firsts(
    slots: npt.NDArray[np.int64],
    block_size: int,
    n_slots: int,
    span: tuple[int, int],
    final: bool,
    allow_negative: bool,
    skip: int = 0,
) -> npt.NDArray[np.int64]:
    """First slot of each block of a block-aligned span of ``slots`` past its first ``skip`` tokens (the whole
    slot mapping on the host; < 0: page not on the GPU). ``ValueError`` for a skip that is not whole blocks, a
    span that is not whole blocks (but a ``final`` one), a slot past the paged KV, slots that do not map whole
    blocks in order, and slots < 0 unless ``allow_negative``. Checked in numpy (a dozen small torch ops cost
    ~50 us a span)."""
    if skip % block_size:
        raise ValueError(f"skip_prefix {skip} is not a multiple of block_size {block_size}; whole pages move")
    start, end = span[0] + skip, span[1]
    if start % block_size or (end % block_size and not final):
        raise ValueError(
            f"span {span} is not block-aligned (block_size {block_size}); CPU_BLOCKS copies whole pages only"
        )
    host = slots[start:end]
    if host.size and int(host.max()) >= n_slots:
        raise ValueError(f"slot {int(host.max())} outside the paged KV of {n_slots} slots")
    firsts = host[::block_size]
    per_token = np.repeat(firsts, block_size)[: host.shape[0]]
    offs = _block_offsets(host.shape[0], block_size)
    ok = np.where(per_token >= 0, (host == per_token + offs) & (per_token % block_size == 0), host < 0)
    if not ok.all():
        raise ValueError(f"slot_mapping of span {span} does not map whole blocks in order")
    if not allow_negative and (firsts < 0).any():
        raise ValueError(f"span {span} has slots < 0: a token without KV cannot be stored")
    return firsts


def _gather(
    layers: range,
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    out: Sequence[torch.Tensor],
) -> None:
    """gather/gather_layer for the layers in ``layers`` (object layer j = layers[j]); spans and object shapes
    as a ``Move`` checked them. Every span's slots are checked before any object is written (a bad slot
    anywhere writes nothing), kernel path or torch path."""
    reg = _registered(kv_caches, layout)
    kv, n_slots = reg.layers, reg.n_slots
    device = kv[0].device
    geo = reg.geometry(layers, layout)
    host = None if geo is None or layout.block_aligned else cpu_rows.host_slots(slot_mapping)
    page_slots = cpu_rows.host_slots(slot_mapping).numpy() if layout.block_aligned else None
    jobs: list[cpu_rows.RowJob] = []
    job_spans: list[tuple[int, int]] = []
    work: list[tuple[torch.Tensor, torch.Tensor]] = []  # torch path: (object, slots or pages), checked
    final = int(slot_mapping.shape[0])
    for (start, end), obj in zip(spans, out, strict=True):
        if page_slots is not None:  # CPU_BLOCKS
            firsts = block_firsts(page_slots, layout.block_size, n_slots, (start, end), end == final, False)
            blocks = torch.from_numpy(firsts // layout.block_size)
            job = _page_job(geo, obj, len(firsts), blocks, 0, device)
            idx = blocks
        else:  # the kernel checks its slots itself
            job = _token_job(geo, host, obj, layout, start, end - start, 0)
            if job is None:
                idx = _slots(slot_mapping, start, end, device)
                _check_slots((start, end), idx, n_slots, negative_ok=False)
        if job is not None:
            jobs.append(job)
            job_spans.append((start, end))
        else:
            work.append((obj, idx.to(device)))
    if jobs and geo is not None:
        _run_kernel(True, geo, jobs, job_spans, negative_ok=False)
    for obj, idx in work:
        stage = obj if obj.device == device else torch.empty_like(obj, device=device)
        if layout.block_aligned:
            pages = _object_pages(stage, len(layers), idx.numel())
            for j, layer in enumerate(layers):
                paged, dst = _page_pair(kv[layer], pages[j])
                torch.index_select(paged, 0, idx, out=dst)
        else:
            _gather_tokens(layers, kv, layout, idx, stage)
        if stage is not obj:
            obj.copy_(stage)


def _scatter(
    layers: range,
    objects: Sequence[torch.Tensor],
    kv_caches: KVCaches,
    layout: PagedLayout,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    skips: Sequence[int],
) -> int:
    """scatter/scatter_layer for the layers in ``layers``; returns tokens written (per layer). Spans, skips
    and object shapes as a ``Move`` checked them; every span's slots are checked before the paged KV is
    written (a bad slot anywhere writes nothing), kernel path or torch path."""
    reg = _registered(kv_caches, layout)
    kv, n_slots = reg.layers, reg.n_slots
    device = kv[0].device
    written = 0
    geo = reg.geometry(layers, layout)
    host = None if geo is None or layout.block_aligned else cpu_rows.host_slots(slot_mapping)
    page_slots = cpu_rows.host_slots(slot_mapping).numpy() if layout.block_aligned else None
    jobs: list[cpu_rows.RowJob] = []
    job_spans: list[tuple[int, int]] = []
    work: list[Callable[[], int]] = []  # torch path: each span's copy, run once every span is checked
    final = int(slot_mapping.shape[0])
    bs = layout.block_size
    for (start, end), skip, obj in zip(spans, skips, objects, strict=True):
        if skip == end - start:
            continue
        job: cpu_rows.RowJob | None
        if page_slots is not None:  # CPU_BLOCKS
            firsts = block_firsts(page_slots, bs, n_slots, (start, end), end == final, True, skip)
            kept = int(np.count_nonzero(page_slots[start + skip : end] >= 0))
            if not kept:
                continue
            pages = -(-(end - start) // bs)
            job = _page_job(geo, obj, pages, torch.from_numpy(firsts // bs), skip // bs, device)
            if job is not None:
                written += kept  # the kernel counts pages: count the tokens here
                jobs.append(job)
                job_spans.append((start + skip, end))
            else:
                pages_left = _object_pages(_bits(obj.to(device)), len(layers), pages)[:, skip // bs :]
                firsts_t = torch.from_numpy(firsts).to(device)
                work.append(functools.partial(_scatter_pages, layers, kv, pages_left, firsts_t, kept, bs))
            continue
        job = _token_job(geo, host, obj, layout, start + skip, end - start - skip, skip)
        if job is not None:
            jobs.append(job)
            job_spans.append((start + skip, end))
            continue
        slots = _slots(slot_mapping, start + skip, end, device)
        _check_slots((start + skip, end), slots, n_slots, negative_ok=True)
        src_obj = _bits(obj.to(device))
        work.append(functools.partial(_scatter_tokens, layers, kv, layout, slots, src_obj, skip))
    if jobs and geo is not None:
        covered = _run_kernel(False, geo, jobs, job_spans, negative_ok=True)
        if not layout.block_aligned:  # CPU_BLOCKS counted its tokens already (the kernel counts pages)
            written += covered
    for copy in work:
        written += copy()
    return written


def _check_slots(span: tuple[int, int], slots: torch.Tensor, n_slots: int, *, negative_ok: bool) -> None:
    """``ValueError`` for a slot past the paged KV, or < 0 unless ``negative_ok`` (a gather needs KV)."""
    _check_range(slots, n_slots)
    if not negative_ok and slots.numel() and int(slots.min()) < 0:
        raise ValueError(f"span {span} has slots < 0: a token without KV cannot be stored")


def _run_kernel(
    gather: bool,
    geo: cpu_rows.Geometry,
    jobs: list[cpu_rows.RowJob],
    spans: list[tuple[int, int]],
    *,
    negative_ok: bool,
) -> int:
    """One kernel call for every job (the slots >= 0 it covered); ``ValueError`` naming the bad slot when
    the kernel refused one (it checks all of them first: nothing was written)."""
    covered = cpu_rows.copy(gather, geo, jobs, negative_ok)
    if covered >= 0:
        return covered
    for span, job in zip(spans, jobs, strict=True):  # the kernel said which kind of slot; find where
        _check_slots(span, job.span_slots(), geo.n_slots, negative_ok=negative_ok)
    raise RuntimeError(f"the row kernel refused a slot ({covered}) that the host finds good")


# ----- registered KV caches: the layers, their slot count and row geometry, computed once ---------------


@dataclass(slots=True)
class _Registered:
    """KV caches seen before: the object, its layer tensors (a later call re-checks them by identity), the
    first layer's address, the slots each layer holds, and the native row geometry per layer range."""

    kv_caches: object
    layers: tuple[torch.Tensor, ...]
    first_ptr: int
    n_slots: int
    geos: dict[tuple[int, int], cpu_rows.Geometry | None] = field(default_factory=dict)

    def holds(self, kv_caches: KVCaches) -> bool:
        """True while ``kv_caches`` is the registered object holding exactly the registered tensors."""
        if kv_caches is not self.kv_caches:
            return False
        layers = kv_caches.values() if isinstance(kv_caches, Mapping) else kv_caches
        return (
            len(layers) == len(self.layers)
            and all(map(operator.is_, layers, self.layers))
            and self.layers[0].data_ptr() == self.first_ptr
        )

    def geometry(self, layers: range, layout: PagedLayout) -> cpu_rows.Geometry | None:
        """The kernel's row geometry of ``layers`` (None off the CPU, without the kernel, or where the
        layers' rows do not suit it)."""
        if cpu_rows.native() is None:
            return None
        key = (layers.start, layers.stop)
        if key not in self.geos:
            self.geos[key] = _native_geometry(self.layers, layers, layout, self.n_slots)
        return self.geos[key]


_REGISTERED: dict[tuple[int, PagedLayout], _Registered] = {}


def _registered(kv_caches: KVCaches, layout: PagedLayout) -> _Registered:
    """The registration of ``kv_caches`` for ``layout``: validated and measured once per KV caches object
    (``ValueError`` for a wrong layer count, shape or dtype); a later call with the same object holding the
    same tensors reuses it (an identity check per layer instead of reading every shape and stride)."""
    key = (id(kv_caches), layout)
    reg = _REGISTERED.get(key)
    if reg is not None and reg.holds(kv_caches):
        return reg
    kv, n_slots = _layers(kv_caches, layout)
    if len(_REGISTERED) > 16:
        _REGISTERED.clear()
    reg = _REGISTERED[key] = _Registered(kv_caches, tuple(kv), kv[0].data_ptr(), n_slots)
    return reg


# ----- CPU tensors: the native row kernel (``cpu_rows``), one call for every span and layer ------------


def _native_geometry(
    kv: Sequence[torch.Tensor], layers: range, layout: PagedLayout, n_slots: int
) -> cpu_rows.Geometry | None:
    """Row geometry of ``layers`` for the native kernel, read from the layers' strides; None when not on
    the CPU, the layers differ in strides or a row is not dense.

    Token layouts: a row is one head's K, V or latent of one token. CPU_BLOCKS: a row is a whole page
    (blocks are addressed by block id, block size 1)."""
    first = kv[layers.start]
    if first.device.type != "cpu":
        return None
    st = first.stride()
    if any(kv[layer].stride() != st for layer in layers):
        return None
    e = first.element_size()
    ptrs = tuple(kv[layer].data_ptr() for layer in layers)
    if layout.block_aligned:
        try:
            _bits(first).view(first.shape[0], -1)  # pages dense (every layer: same strides)
        except RuntimeError:
            return None
        blocks = n_slots // layout.block_size
        return cpu_rows.Geometry(ptrs, 1, st[0] * e, 0, 0, 1, (0,), layout.page_elems * e, blocks)
    d = layout.head_dim
    if layout.kind is LayoutKind.VLLM_LEGACY:  # [2, NB, BS, H, D]: V one stride(0) after K
        _, s_blk, s_off, s_head, inner = st
        offsets: tuple[int, ...] = (0, st[0] * e)
    else:  # [NB, H, BS, C]: C = K | V, or the MLA latent
        s_blk, s_head, s_off, inner = st
        offsets = (0,) if layout.planes == 1 else (0, d * inner * e)
    if inner != 1 and d > 1:
        return None
    heads, bs = layout.num_kv_heads, layout.block_size
    return cpu_rows.Geometry(ptrs, bs, s_blk * e, s_off * e, s_head * e, heads, offsets, d * e, n_slots)


def _token_job(
    geo: cpu_rows.Geometry | None,
    host: torch.Tensor | None,
    obj: torch.Tensor,
    layout: PagedLayout,
    slot0: int,
    n: int,
    tok0: int,
) -> cpu_rows.RowJob | None:
    """The kernel job of a token-layout object (``cpu_rows.token_job``; ``host``: the slot mapping as the
    kernel reads it), or None for the torch path."""
    if geo is None or host is None:
        return None
    return cpu_rows.token_job(geo, obj, layout.planes, host, slot0, n, tok0)


def _page_job(
    geo: cpu_rows.Geometry | None,
    obj: torch.Tensor,
    pages: int,
    blocks: torch.Tensor,
    page0: int,
    device: torch.device,
) -> cpu_rows.RowJob | None:
    """The kernel job of a CPU_BLOCKS object (``pages`` pages per layer; page ``page0 + i`` pairs with
    ``blocks[i]``), or None for the torch path; ``ValueError`` unless the object is contiguous."""
    if not obj.is_contiguous():
        raise ValueError("CPU_BLOCKS objects hold raw pages and must be contiguous")
    if geo is None or obj.device != device:
        return None
    return cpu_rows.page_job(geo, obj, pages, blocks.contiguous(), page0)


# ----- token layouts: whole blocks in one op per layer, the ragged ends row by row ----------------------
#
# For chunk-aligned spans the slots of a block are contiguous (block_id * BS + 0..BS-1), so the tokens of
# whole blocks move with one index op over the block dim per layer (slices of a whole block instead of one
# row per token and head). Gather: one ``index_select`` straight into the object view (native width). Scatter:
# one ``copy_`` per run of consecutive blocks: a multi-threaded ``index_copy_`` over the block dim ran at
# 0.05-0.3 of a bare copy on a loaded 2-core box, the copies of 64 KiB blocks (single-threaded) at ~0.6.
# (CPU tensors take the native kernel of ``cpu_rows`` when it is built; this is the path without it.)


def _whole_blocks(slots: torch.Tensor, block_size: int) -> tuple[int, torch.Tensor] | None:
    """``(k0, blocks)`` when ``slots[k0 : k0 + len(blocks) * block_size]`` map whole blocks in order.

    ``k0`` is the number of tokens before the first block boundary; None when there is no whole block or the
    slots do not follow the block pattern (negative slots, shuffled offsets): the caller then moves rows.
    """
    t = slots.numel()
    if block_size <= 1 or t < block_size:
        return None
    first = int(slots[0])
    if first < 0:
        return None
    k0 = (-first) % block_size
    n = (t - k0) // block_size
    if n == 0:
        return None
    body = slots[k0 : k0 + n * block_size].view(n, block_size)
    firsts = body[:, 0]
    offs = torch.arange(block_size, device=slots.device, dtype=slots.dtype)
    if not bool(((body == firsts[:, None] + offs) & (firsts[:, None] >= 0)).all()):
        return None
    if bool((firsts % block_size).any()):  # every run starts a block (41, 42 with block size 2 is none)
        return None
    return k0, firsts // block_size


def _split_blocks(
    slots: torch.Tensor, block_size: int
) -> tuple[tuple[int, torch.Tensor] | None, list[tuple[int, int]]]:
    """``_whole_blocks`` of ``slots`` and the non-empty token ranges ``[a, b)`` left to move by rows (all of
    them when there is no whole block)."""
    t = slots.numel()
    found = _whole_blocks(slots, block_size)
    if found is None:
        return None, [(0, t)] if t else []
    k0, blocks = found
    k1 = k0 + blocks.numel() * block_size
    return found, [(a, b) for a, b in ((0, k0), (k1, t)) if a < b]


def _block_runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """``(index, block, length)`` of each run of consecutive block ids in ``blocks``."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(blocks):
        if runs and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, b, 1))
    return runs


def _widened_pair(
    layer: torch.Tensor, obj: torch.Tensor, layout: PagedLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer and object as same-width integers (bit-exact moves). Not widened further: on the CPU an
    ``index_select`` over these strided 5-d views runs several times slower on int64 than on the native
    width (0.5 vs 4.5 GB/s for the Llama-8B NHD pages, against a 5.0 GB/s bare copy on the same box)."""
    del layout
    return _bits(layer), _bits(obj)


def _paged5(layer: torch.Tensor, layout: PagedLayout) -> torch.Tensor:
    """A (widened) layer, or pages laid out like its blocks, as [P, NB, BS, H, D'] (P = 2 planes or 1)."""
    if layout.kind is LayoutKind.VLLM_LEGACY:
        return layer
    tok = layer.permute(0, 2, 1, 3)  # [NB, BS, H, C']
    if layout.kind is LayoutKind.VLLM_MLA:
        return tok.unsqueeze(0)
    nb, bs, h, c = tok.shape
    return tok.view(nb, bs, h, 2, c // 2).permute(3, 0, 1, 2, 4)


def _object5(obj: torch.Tensor, layout: PagedLayout, j: int, k0: int, nb: int) -> torch.Tensor:
    """Tokens ``k0 .. k0 + nb * BS`` of object layer ``j`` (widened) as [P, nb, BS, H, D']."""
    bs, h = layout.block_size, layout.num_kv_heads
    span = slice(k0, k0 + nb * bs)
    if layout.planes == 1:
        lat = obj[j, span]  # [T, D']
        return lat.view(1, nb, bs, 1, lat.shape[1])
    kv = obj[:, j, span]  # [2, T, H*D']
    return kv.view(2, nb, bs, h, kv.shape[2] // h)


def _gather_tokens(
    layers: range, kv: Sequence[torch.Tensor], layout: PagedLayout, slots: torch.Tensor, stage: torch.Tensor
) -> None:
    """Token-layout gather of one span into ``stage``: whole blocks per layer in one op, the ends by rows."""
    found, parts = _split_blocks(slots, layout.block_size)
    if found is not None:
        k0, blocks = found
        nb = blocks.numel()
        for j, layer in enumerate(layers):
            lw, ow = _widened_pair(kv[layer], stage, layout)
            torch.index_select(_paged5(lw, layout), 1, blocks, out=_object5(ow, layout, j, k0, nb))
    for a, b in parts:
        rows = _Rows(slots[a:b], layout.block_size, layout.num_kv_heads)
        for j, layer in enumerate(layers):
            src_planes = _planes(_bits(kv[layer]), layout)
            for src_p, dst_p in zip(src_planes, _obj_planes(_bits(stage), layout, j), strict=True):
                _read_rows(src_p, rows, dst_p[a:b])


def _scatter_tokens(
    layers: range,
    kv: Sequence[torch.Tensor],
    layout: PagedLayout,
    slots: torch.Tensor,
    src_obj: torch.Tensor,
    skip: int,
) -> int:
    """Token-layout scatter of object tokens ``skip..`` to ``slots`` (< 0: left alone; checked spans): whole
    blocks, then rows (rows alone when some slots are < 0); returns the tokens written."""
    keep = slots >= 0
    n_keep = int(keep.sum())
    if n_keep != slots.numel():
        if n_keep == 0:
            return 0
        sel = keep.nonzero().squeeze(1)
        kept = _Rows(slots[sel], layout.block_size, layout.num_kv_heads)
        sel = sel + skip
        for j, layer in enumerate(layers):
            dst_planes = _planes(_bits(kv[layer]), layout)
            for dst, src in zip(dst_planes, _obj_planes(src_obj, layout, j), strict=True):
                _write_rows(dst, kept, src.index_select(0, sel))
        return n_keep
    found, parts = _split_blocks(slots, layout.block_size)
    if found is not None:
        k0, blocks = found
        nb = blocks.numel()
        runs = _block_runs(blocks.tolist())
        for j, layer in enumerate(layers):
            lw, ow = _widened_pair(kv[layer], src_obj, layout)
            paged, src = _paged5(lw, layout), _object5(ow, layout, j, skip + k0, nb)
            for i, b, n in runs:
                paged[:, b : b + n].copy_(src[:, i : i + n])
    for a, b in parts:
        rows = _Rows(slots[a:b], layout.block_size, layout.num_kv_heads)
        for j, layer in enumerate(layers):
            dst_planes = _planes(_bits(kv[layer]), layout)
            for dst_p, src_p in zip(dst_planes, _obj_planes(src_obj, layout, j), strict=True):
                _write_rows(dst_p, rows, src_p[skip + a : skip + b])
    return n_keep


def _page_pair(layer: torch.Tensor, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer as [NB, page] integer rows, object pages [n, page]) at the widest width both allow.

    A layer whose inner dims are not dense keeps its shape; the object pages are then shaped like its blocks.
    """
    bits = _bits(layer)
    try:
        paged = bits.view(bits.shape[0], -1)
    except RuntimeError:
        return bits, pages.view(pages.shape[0], *bits.shape[1:])
    return _widen(paged, pages)


def _object_pages(obj: torch.Tensor, layers: int, pages: int) -> torch.Tensor:
    """A CPU_BLOCKS object as [layers, pages, page] integer rows; ``ValueError`` unless it is contiguous."""
    if not obj.is_contiguous():
        raise ValueError("CPU_BLOCKS objects hold raw pages and must be contiguous")
    return _bits(obj).view(layers, pages, -1)


def _scatter_pages(
    layers: range,
    kv: Sequence[torch.Tensor],
    pages: torch.Tensor,
    firsts: torch.Tensor,
    kept: int,
    bs: int,
) -> int:
    """Torch path of one checked CPU_BLOCKS scatter span: object ``pages[:, i]`` to the block of
    ``firsts[i]`` (< 0: left alone); returns ``kept``, the span's tokens with a slot >= 0."""
    keep = firsts >= 0
    if bool(keep.all()):
        blocks, sel = firsts // bs, None
    else:
        idx = keep.nonzero().squeeze(1)
        blocks, sel = firsts[idx] // bs, idx
    for j, layer in enumerate(layers):
        src = pages[j] if sel is None else pages[j].index_select(0, sel)
        paged, src = _page_pair(kv[layer], src)
        paged.index_copy_(0, blocks, src)
    return kept
