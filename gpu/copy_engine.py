# mypy: disable-error-code="no-untyped-call"
"""Moves between CUDA paged KV and pinned host objects on the copy engines alone: no kernel, so a model
running beside them keeps every SM.

A move of whole pages (``CPU_BLOCKS``, and ``VLLM_BLOCKS`` as ``tiercache.gpu.block_pages`` makes it one: a
block of every layer in one run of bytes) becomes one copy per run of consecutive blocks. A move of tokens
becomes 2D copies (``plan``), per run of tokens whose KV follows at the token pitch (consecutive
slots of a block, or of blocks that follow each other). Where a token's row of a plane is contiguous
(``VLLM_LEGACY``, ``VLLM_MLA``): one copy per run and plane, its rows the move's layers, when the layer
tensors lie at one pitch in device memory (``layer_rows``), else one per run and layer, its rows the planes
(K and V, or the MLA latent). Where it is one piece per head (``VLLM_FLASH`` on vLLM's NHD allocation, K
and V of a head side by side): one copy per run, plane and layer, its rows the heads of the run's tokens. It
needs the slots on the host (a CPU slot mapping or ``host_slots``: where the copies go is known before they
are issued), the launch extension (``gpu/_launch.c``) to issue them, and contiguous objects in pinned host
memory. ``prepare(..., batched=True)`` issues every row of the plan as one 1D copy of a batch
(``cuMemcpyBatchAsync``; 2D copies on the legacy default stream, which batches refuse), in sub-batches of
doubling size (``sub_batches``): the driver takes about as long to issue a 32 KiB copy as the bus takes to
carry it, and a batch starts moving only once it is issued, so the copy engines carry one sub-batch while the
next is issued. ``streams=k`` cuts the batch in ``k`` on as many streams (small copies: faster in some
rounds, erratic in others, ``gpu_overlap_copy_streams_h100.json``, measured before the sub-batches).
``prepare`` returns None where the path does not apply. Slots are checked on the host before anything
moves (``ValueError`` as the reference: a gather's slot < 0, any slot past the paged KV); a scatter leaves
slots < 0 alone.
``run_on_host`` carries out a plan with ``memmove`` on CPU tensors: the CPU reference of the address
arithmetic that tests hold against ``tiercache.gpu.reference``.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from tiercache.gpu.layouts import LayoutKind, layer_tensors
from tiercache.gpu.move import Move

if TYPE_CHECKING:
    import numpy.typing as npt

    from tiercache.gpu.layouts import KVCaches

__all__ = [
    "SUB_BATCH_FIRST",
    "SUB_BATCH_MAX",
    "Copy2D",
    "CopyMove",
    "Geometry",
    "batches_available",
    "batches_supported",
    "flat_copies",
    "geometry",
    "plan",
    "prepare",
    "run_on_host",
    "sub_batches",
]


class Copy2D(NamedTuple):
    """``height`` rows of ``width`` bytes between the paged KV (from ``kv``, rows ``kv_pitch`` apart) and an
    object (from ``obj``, rows ``obj_pitch`` apart); addresses in bytes."""

    kv: int
    kv_pitch: int
    obj: int
    obj_pitch: int
    width: int
    height: int


class Geometry(NamedTuple):
    """Where a token's rows lie in the paged KV, in bytes: each layer tensor's base, the planes and their
    distance, the distance of the blocks and of the tokens of a block, one plane's row of a token in an object
    (all heads), how it lies in the KV (``pieces`` pieces of ``piece`` bytes, ``piece_pitch`` apart: one piece
    where it is contiguous, one per head in vLLM's ``[NB, BS, H, K|V]`` allocation), the blocks' size in
    tokens, the slots, and the pitch of the layer tensors (None unless every layer lies at one pitch)."""

    bases: tuple[int, ...]
    planes: int
    plane_stride: int
    block_stride: int
    token_stride: int
    row: int
    pieces: int
    piece: int
    piece_pitch: int
    block_size: int
    n_slots: int
    layer_pitch: int | None

    @property
    def contiguous(self) -> bool:
        """True when a token's plane row is one run of bytes and the tokens of a block follow each other."""
        return self.pieces == 1 and self.token_stride == self.row


def geometry(kv_caches: KVCaches, move: Move) -> Geometry | None:
    """The ``Geometry`` of ``move``'s layout on ``kv_caches``, or None where the layers differ in shape, dtype
    or strides, or a token's plane row is not whole heads at one pitch with the tokens of a block at that
    pitch times the heads (vLLM's HND allocation), or the pages of a whole-page layout (``CPU_BLOCKS``) are
    not dense.
    ``VLLM_BLOCKS``: None (``tiercache.gpu.block_pages`` makes its moves page moves first)."""
    layout = move.layout
    layers = layer_tensors(kv_caches)
    if len(layers) != layout.num_layers or layout.kind is LayoutKind.VLLM_BLOCKS:
        return None
    first = layers[0]
    if any(t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype for t in layers):
        return None
    e = first.element_size()
    st = [x * e for x in first.stride()]
    h, d = layout.num_kv_heads, layout.head_dim
    row = h * d * e
    if layout.block_aligned:  # whole pages (CPU_BLOCKS), each dense: a token's row is a share of its page
        nb = first.shape[0]
        if nb and not first[0].is_contiguous():
            return None
        bases = tuple(t.data_ptr() for t in layers)
        share = layout.page_elems * e // layout.block_size
        bs = layout.block_size
        return Geometry(bases, 1, 0, st[0], share, share, 1, share, share, bs, nb * bs, None)
    if layout.kind is LayoutKind.VLLM_LEGACY:  # [2, NB, BS, H, D]: heads back to back
        if st[4] != e or (h > 1 and st[3] != d * e):
            return None
        planes, plane, block, token, nb = 2, st[0], st[1], st[2], first.shape[1]
        pieces, piece, piece_pitch = 1, row, token
    elif layout.kind is LayoutKind.VLLM_MLA:  # [NB, 1, BS, C]
        if st[3] != e:
            return None
        planes, plane, block, token, nb = 1, 0, st[0], st[2], first.shape[0]
        pieces, piece, piece_pitch = 1, row, token
    else:  # VLLM_FLASH [NB, H, BS, 2D]: per head K then V
        if st[3] != e or (h > 1 and st[2] != h * st[1]):
            return None
        planes, plane, block, token, nb = 2, d * e, st[0], st[2], first.shape[0]
        pieces, piece, piece_pitch = h, d * e, st[1] if h > 1 else token
    bases = tuple(t.data_ptr() for t in layers)
    span = bases[move.layers.start : move.layers.stop]
    pitch: int | None = None
    if len(span) > 1:
        steps = {b - a for a, b in itertools.pairwise(span)}
        if len(steps) == 1 and (p := steps.pop()) >= row:
            pitch = p
    return Geometry(
        bases,
        planes,
        plane,
        block,
        token,
        row,
        pieces,
        piece,
        piece_pitch,
        layout.block_size,
        nb * layout.block_size,
        pitch,
    )


def plan(
    geo: Geometry, move: Move, slots: npt.NDArray[np.int64], *, layer_rows: bool = True
) -> tuple[list[Copy2D], int]:
    """The copies of ``move`` (``slots``: its slot mapping on the host) and the tokens a scatter writes per
    layer. A run is tokens whose KV follows at the token pitch. Contiguous rows: one copy per run and plane
    with the layers as rows where ``layer_rows`` and the layers lie at one pitch (and more layers than planes
    move), else one per run and layer with the planes as rows. Rows in pieces: one copy per run, plane and
    layer with the pieces as rows. ``ValueError`` for a slot past the paged KV and a gather's slot < 0,
    before any copy is made."""
    if move.layout.block_aligned:
        return _page_plan(geo, move, slots)
    layers = move.layers
    nl = len(layers)
    pitch = geo.layer_pitch if layer_rows and nl > geo.planes else None
    row, bs = geo.row, geo.block_size
    copies: list[Copy2D] = []
    count = 0
    for (s, e), k, obj in zip(move.spans, move.span_skips, move.objects, strict=True):
        sl = slots[s + k : e]
        if not sl.size:
            continue
        if int(sl.max()) >= geo.n_slots:
            raise ValueError(f"slot {int(sl.max())} outside the paged KV of {geo.n_slots} slots")
        neg = sl < 0
        if not move.is_scatter and neg.any():
            raise ValueError(f"span {(s, e)} has slots < 0: a token without KV cannot be stored")
        off = (sl // bs) * geo.block_stride + (sl % bs) * geo.token_stride
        cut = np.ones(sl.size, dtype=bool)
        cut[1:] = (off[1:] != off[:-1] + geo.token_stride) | neg[1:] | neg[:-1]
        starts = np.flatnonzero(cut)
        ends = np.append(starts[1:], sl.size)
        keep = ~neg[starts]
        count += int(sl.size - neg.sum())
        t, base = e - s, obj.data_ptr()
        for a, z in zip(starts[keep].tolist(), ends[keep].tolist(), strict=True):
            width, kv_off, at = (z - a) * row, int(off[a]), (k + a) * row
            if not geo.contiguous:  # rows of pieces: a copy per plane and layer
                height = (z - a) * geo.pieces
                for p in range(geo.planes):
                    for j, layer in enumerate(layers):
                        kv = geo.bases[layer] + p * geo.plane_stride + kv_off
                        obj_at = base + (p * nl + j) * t * row + at
                        copies.append(Copy2D(kv, geo.piece_pitch, obj_at, geo.piece, geo.piece, height))
            elif pitch is not None and width <= pitch:
                for p in range(geo.planes):
                    kv = geo.bases[layers.start] + p * geo.plane_stride + kv_off
                    copies.append(Copy2D(kv, pitch, base + p * nl * t * row + at, t * row, width, nl))
            elif geo.planes == 1 or geo.plane_stride >= width:
                kv_pitch = geo.plane_stride if geo.planes > 1 else width
                obj_pitch = nl * t * row if geo.planes > 1 else width
                for j, layer in enumerate(layers):
                    kv = geo.bases[layer] + kv_off
                    copies.append(Copy2D(kv, kv_pitch, base + j * t * row + at, obj_pitch, width, geo.planes))
            else:  # planes closer than the run is long: a copy per plane and layer
                for p in range(geo.planes):
                    for j, layer in enumerate(layers):
                        kv = geo.bases[layer] + p * geo.plane_stride + kv_off
                        obj_at = base + (p * nl + j) * t * row + at
                        copies.append(Copy2D(kv, width, obj_at, width, width, 1))
    return copies, count


def _page_plan(geo: Geometry, move: Move, slots: npt.NDArray[np.int64]) -> tuple[list[Copy2D], int]:
    """The copies of a move of whole pages (``CPU_BLOCKS``, and ``VLLM_BLOCKS`` as ``block_pages`` makes it
    one): per layer, one copy per run of consecutive blocks (one row where the blocks lie back to back, else
    a row per page); a scatter leaves its skipped pages and the pages of slots < 0 alone. Spans, skips and
    slots are checked as the reference checks them (``ValueError``), before any copy is made."""
    from tiercache.gpu.reference import block_firsts

    bs = geo.block_size
    page = geo.row * bs
    layers = move.layers
    final = int(slots.shape[0])
    copies: list[Copy2D] = []
    count = 0
    for (s, e), k, obj in zip(move.spans, move.span_skips, move.objects, strict=True):
        if k == e - s:
            continue
        firsts = block_firsts(slots, bs, geo.n_slots, (s, e), e == final, move.is_scatter, k)
        count += int(np.count_nonzero(slots[s + k : e] >= 0))
        blocks = np.where(firsts >= 0, firsts // bs, -1)
        cut = np.ones(blocks.size, dtype=bool)
        cut[1:] = (blocks[1:] != blocks[:-1] + 1) | (blocks[1:] < 0) | (blocks[:-1] < 0)
        starts = np.flatnonzero(cut)
        ends = np.append(starts[1:], blocks.size)
        pages, p0, base = -(-(e - s) // bs), k // bs, obj.data_ptr()
        for a, z in zip(starts.tolist(), ends.tolist(), strict=True):
            if blocks[a] < 0:
                continue
            for j, layer in enumerate(layers):
                kv = geo.bases[layer] + int(blocks[a]) * geo.block_stride
                at = base + (j * pages + p0 + a) * page
                if geo.block_stride == page:
                    copies.append(Copy2D(kv, (z - a) * page, at, (z - a) * page, (z - a) * page, 1))
                else:
                    copies.append(Copy2D(kv, geo.block_stride, at, page, page, z - a))
    return copies, count


def run_on_host(copies: Sequence[Copy2D], *, to_kv: bool) -> None:
    """Carry out ``copies`` between CPU tensors (``memmove`` per row): the CPU reference of a plan."""
    for c in copies:
        for r in range(c.height):
            kv, obj = c.kv + r * c.kv_pitch, c.obj + r * c.obj_pitch
            dst, src = (kv, obj) if to_kv else (obj, kv)
            ctypes.memmove(dst, src, c.width)


def _host_slot_array(move: Move) -> npt.NDArray[np.int64] | None:
    """The move's slot mapping as int64 on the host (a view where it already is), or None if it is only on
    the device."""
    src = move.host_slots if move.host_slots is not None else move.slot_mapping
    if src.device.type != "cpu":
        return None
    arr = src.numpy()
    return arr if arr.dtype == np.int64 else arr.astype(np.int64)


def flat_copies(copies: Sequence[Copy2D]) -> tuple[npt.NDArray[np.uint64], ...]:
    """Every row of ``copies`` as a 1D copy: (KV addresses, object addresses, sizes), uint64 arrays."""
    if not copies:
        return tuple(np.empty(0, dtype=np.uint64) for _ in range(3))
    c = np.array(copies, dtype=np.uint64)  # columns as Copy2D's fields
    rows = c[:, 5].astype(np.int64)
    r = np.arange(int(rows.sum()), dtype=np.uint64) - np.repeat(np.cumsum(rows) - rows, rows).astype(
        np.uint64
    )
    kv = np.repeat(c[:, 0], rows) + r * np.repeat(c[:, 1], rows)
    obj = np.repeat(c[:, 2], rows) + r * np.repeat(c[:, 3], rows)
    return kv, obj, np.repeat(c[:, 4], rows)


class CopyMove:
    """A move prepared as copy-engine copies (``prepare``); ``run`` issues them on the current stream and
    returns once they are done. Planned again when the host slots changed since the last run. ``batched``:
    every row of the plan as one 1D copy of a batch (the driver's ``cuMemcpyBatchAsync``, copy engines
    preferred) instead of one 2D copy each; ``batches`` holds, per stream, its sub-batches in issue order."""

    def __init__(
        self,
        kv_caches: KVCaches,
        move: Move,
        geo: Geometry,
        index: int,
        layer_rows: bool,
        nat: Any,
        batched: bool,
        streams: int = 1,
    ) -> None:
        self.kv_caches = kv_caches
        self.layers = tuple(layer_tensors(kv_caches))
        self.move = move
        self.geo = geo
        self.index = index
        self.layer_rows = layer_rows
        self.nat = nat
        self.batched = batched
        self.streams = max(1, streams)
        self.slots: npt.NDArray[np.int64] = np.empty(0, dtype=np.int64)
        self.handles: list[Any] = []
        self.batches: list[list[Any]] = []
        self.copies: list[Copy2D] = []
        self.issued = 0
        self.count = 0
        self.replan()

    def replan(self) -> None:
        """Plan the copies for the move's current host slots and make the extension's copy handles."""
        slots = _host_slot_array(self.move)
        assert slots is not None
        self.copies, self.count = plan(self.geo, self.move, slots, layer_rows=self.layer_rows)
        to_kv = self.move.is_scatter
        self.handles, self.batches = [], []
        if self.batched:
            kv, obj, size = flat_copies(self.copies)
            order = np.argsort(obj, kind="stable")  # host memory in address order
            kv, obj, size = kv[order], obj[order], size[order]
            dst, src = (kv, obj) if to_kv else (obj, kv)
            make = self.nat.make_batch
            self.batches = [  # per stream a run of the host addresses, in sub-batches
                [
                    make(dst[a:z].tobytes(), src[a:z].tobytes(), size[a:z].tobytes())
                    for a, z in sub_batches(int(c[0]), int(c[-1]) + 1)
                ]
                for c in np.array_split(np.arange(len(size)), max(1, min(self.streams, len(size))))
                if len(c)  # a move with no copies (every slot < 0) has no batches
            ]
            self.issued = len(size)
        else:
            self._make_handles()
            self.issued = len(self.handles)
        self.slots = slots.copy()

    def _make_handles(self) -> None:
        """The extension's 2D copy handles of the plan."""
        make, to_kv = self.nat.make_copy, self.move.is_scatter
        self.handles = [
            make(c.kv, True, c.kv_pitch, c.obj, False, c.obj_pitch, c.width, c.height)
            if to_kv
            else make(c.obj, False, c.obj_pitch, c.kv, True, c.kv_pitch, c.width, c.height)
            for c in self.copies
        ]

    @property
    def mean_copy_bytes(self) -> float:
        """Bytes per copy issued by the current plan (0 for a move with nothing to copy)."""
        return sum(c.width * c.height for c in self.copies) / self.issued if self.issued else 0.0

    @property
    def mean_row_bytes(self) -> float:
        """Bytes per contiguous piece (a row of a 2D copy) of the current plan: what the copy engines' speed
        follows (0 for a move with nothing to copy)."""
        rows = sum(c.height for c in self.copies)
        return sum(c.width * c.height for c in self.copies) / rows if rows else 0.0

    def valid_for(self, kv_caches: KVCaches) -> bool:
        """True while ``kv_caches`` holds the layer tensors prepared for, at the same addresses."""
        if kv_caches is not self.kv_caches:
            return False
        layers = layer_tensors(kv_caches)
        return len(layers) == len(self.layers) and all(
            a is b and a.data_ptr() == base
            for a, b, base in zip(layers, self.layers, self.geo.bases, strict=True)
        )

    def _run_batches(self) -> None:
        """Issue each stream's batch on a stream of its own, after the current stream's work, the streams'
        sub-batches in turn; the current stream then waits for all of them."""
        import torch

        from tiercache.gpu.launch import current_stream

        sides = _SIDES.setdefault(self.index, [])
        while len(sides) < len(self.batches):
            sides.append(torch.cuda.Stream(self.index))
        sides = sides[: len(self.batches)]
        cur = current_stream(self.index)
        for side in sides:
            side.wait_stream(cur)
        handles = [side.cuda_stream for side in sides]
        try:
            for turn in itertools.zip_longest(*self.batches):
                for handle, batch in zip(handles, turn, strict=True):
                    if batch is not None:
                        _check(self.nat.batch(batch, handle))
        finally:  # the current stream waits for what was issued, a failed issue too
            for side in sides:
                cur.wait_stream(side)

    def run(self) -> int:
        """Issue the copies on the current stream and wait for them: the tokens written per layer (a gather's
        count is unused). ``ValueError`` for bad slots (nothing moved)."""
        import torch

        slots = _host_slot_array(self.move)
        if slots is None or not np.array_equal(slots, self.slots):
            self.replan()
        nat = self.nat
        _check(nat.context(self.index))
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        try:
            if self.batches and stream != 0:
                if len(self.batches) == 1:
                    for batch in self.batches[0]:
                        _check(nat.batch(batch, stream))
                else:
                    self._run_batches()
            else:
                if self.copies and not self.handles:  # batched, on the legacy default stream
                    self._make_handles()
                if getattr(nat, "copies", None) is not None:
                    _check(nat.copies(self.handles, stream))
                else:  # an extension built before copies()
                    for h in self.handles:
                        _check(nat.copy(h, stream))
        finally:  # what was issued is done before the caller lets the objects go, after a failed issue too
            status = nat.sync(stream)
        _check(status)
        return self.count


SUB_BATCH_FIRST = 16  # copies in a batch's first sub-batch: the copy engines start after issuing these
SUB_BATCH_MAX = 256  # copies in a sub-batch at most: the driver's cost per call stays a small share


def sub_batches(start: int, stop: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut in sub-batches of ``SUB_BATCH_FIRST`` copies doubling up to ``SUB_BATCH_MAX``:
    the first is short, so the copy engines start soon, and the later ones long, so the calls stay few."""
    cuts, size = [], SUB_BATCH_FIRST
    while start < stop:
        cuts.append((start, min(start + size, stop)))
        start, size = cuts[-1][1], min(2 * size, SUB_BATCH_MAX)
    return cuts


def batches_available() -> bool:
    """True when the launch extension is built and it and the driver can issue batched copies."""
    from tiercache.gpu import launch

    nat = launch.native_copies()
    return nat is not None and batches_supported(nat)


def batches_supported(nat: Any) -> bool:
    """True when the extension and the driver can issue batched copies (``cuMemcpyBatchAsync``)."""
    global _BATCHES
    if _BATCHES is None:
        one = np.ones(1, dtype=np.uint64).tobytes()
        try:
            _BATCHES = hasattr(nat, "make_batch") and nat.make_batch(one, one, one) is not None
        except OSError:
            _BATCHES = False
    return _BATCHES


_BATCHES: bool | None = None
_SIDES: dict[int, list[Any]] = {}  # per device: the streams that batches cut in several run on


def prepare(
    kv_caches: KVCaches,
    move: Move,
    *,
    layer_rows: bool = True,
    batched: bool = False,
    streams: int = 1,
    checked_pinned: bool = False,
) -> CopyMove | None:
    """The ``CopyMove`` of ``move`` (CUDA KV, pinned host objects), or None where the copy engines cannot
    take it (see the module docstring). ``batched``: one batch of 1D copies instead of 2D copies (None where
    the driver has no batched copies), cut in ``streams`` batches on as many streams. ``ValueError`` for bad
    slots.
    ``checked_pinned``: the caller knows the objects are pinned."""
    from tiercache.gpu import launch
    from tiercache.gpu import triton_kernels as tk

    nat = launch.native_copies()
    if nat is None or move.fp8 or not move.objects or _host_slot_array(move) is None:
        return None
    if any(o.is_cuda or not o.is_contiguous() for o in move.objects):
        return None
    if not checked_pinned and not tk.pinned_objects(move.objects):
        return None
    geo = geometry(kv_caches, move)
    if geo is None:
        return None
    if batched and not batches_supported(nat):
        return None
    index = layer_tensors(kv_caches)[0].device.index or 0
    return CopyMove(kv_caches, move, geo, index, layer_rows, nat, batched, streams)


def _check(status: int) -> None:
    if status:
        raise RuntimeError(f"CUDA driver call failed with status {status}")
