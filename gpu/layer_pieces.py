# mypy: disable-error-code="no-untyped-call"
"""A move to / from pinned host objects through device staging, cut into layer pieces, every step issued
straight to the driver.

The move's layers are cut into pieces: a short lead piece (``piece_layers``) and the rest, in at least
``PIECES - 1`` pieces and in as many more as keep each piece within the ``Transfer``'s ``staging_bytes``. A
store gathers piece p of every object into device staging (one bound launch on the current stream) while
the side stream copies piece p-1 to the host; a retrieve mirrors it, its short piece last. Each piece of an
object is one 2D copy: ``planes`` rows (K and V, or the one MLA plane) of the piece's bytes, at the object's
plane pitch on the host and the piece's in staging. Launches, copies, event records and waits are calls of
the launch extension (``gpu/_launch.c``), about a microsecond each, where the object-group pipeline of
``tiercache.gpu.transfer`` issues copies and events from Python and gathers whole objects before their first
copy (measurements: ``docs/performance.md``).

Staging is the ``Transfer``'s two buffers, piece p in buffer ``p % 2``, each used under the transfer's lock
and handed over with its ``free`` event, so this and the other pipelines never overwrite each other's
staging. Slots are checked by the piece kernels themselves (pinned flags, read after the last launch); the
kernels never touch a bad slot, so a bad slot is reported at the end (a gather: ``ValueError``; a scatter:
the exact count) with nothing written for it. Every run returns once host memory is no longer touched; a
checked retrieve also waits for its last scatter. ``prepare`` returns None where this path does not apply
(no launch extension, checks on the host, objects not contiguous pinned memory, launches not bound): the
caller takes another path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tiercache.gpu import launch as _launch
from tiercache.gpu import triton_kernels as tk
from tiercache.gpu.move import Checks, Move
from tiercache.gpu.transfer import STAGING_ALIGN

if TYPE_CHECKING:
    from tiercache.gpu.layouts import KVCaches
    from tiercache.gpu.transfer import Transfer

__all__ = ["LEAD_DIVISOR", "PIECES", "PieceCopy", "PiecedMove", "piece_copies", "piece_layers", "prepare"]

PIECES = 2  # pieces per move at least: the H200 measured 2 ahead of 4 from 8 to 64 MiB (each copy costs)
LEAD_DIVISOR = 8  # the lead piece holds 1/8 of the layers: little to gather before the bus starts


class PieceCopy(NamedTuple):
    """One 2D copy between a host object and its piece in staging: ``height`` rows (planes) of ``width``
    bytes, at ``host_pitch`` from ``host_offset`` in the object, back to back in the piece's staging."""

    host_offset: int
    host_pitch: int
    width: int
    height: int


def piece_layers(
    layers: int, pieces: int, *, lead_last: bool = False, most: int | None = None
) -> list[range]:
    """``layers`` cut into consecutive non-empty ranges of at most ``most`` layers each (default: no bound):
    a short lead piece of ``max(1, layers // LEAD_DIVISOR)`` layers, first (a store: the first copy waits
    only for its gather) or with ``lead_last`` last (a retrieve: only its scatter runs after the last copy),
    and the rest split evenly into ``pieces - 1`` ranges, or into as many more as the bound needs, the earlier
    ones one layer longer when they do not divide evenly. ``min(pieces, layers)`` ranges when unbounded."""
    pieces = max(1, min(pieces, layers))
    most = layers if most is None else max(1, most)
    if pieces == 1 and layers <= most:
        return [range(layers)]
    lead = min(max(1, layers // LEAD_DIVISOR), most, layers - max(1, pieces - 1))
    rest = layers - lead
    n_rest = max(pieces - 1, -(-rest // most))
    base, extra = divmod(rest, n_rest)
    sizes = [base + (1 if p < extra else 0) for p in range(n_rest)]
    sizes = [*sizes, lead] if lead_last else [lead, *sizes]
    out, at = [], 0
    for n in sizes:
        out.append(range(at, at + n))
        at += n
    return out


def piece_copies(shape: Sequence[int], itemsize: int, piece: range) -> PieceCopy:
    """The copy of layers ``piece`` of a contiguous object of ``shape`` (``[2, L, T, X]`` or ``[L, T, X]``:
    the layer dimension is third from the end, planes before it) between the object and a contiguous
    staging tensor of the same shape restricted to those layers."""
    layers = shape[-3]
    if not 0 <= piece.start < piece.stop <= layers:
        raise ValueError(f"layers {piece} out of range for an object of {layers} layers")
    layer_bytes = itemsize
    for n in shape[-2:]:
        layer_bytes *= n
    planes = 1
    for n in shape[:-3]:
        planes *= n
    width = len(piece) * layer_bytes
    return PieceCopy(piece.start * layer_bytes, layers * layer_bytes, width, planes)


class PiecedMove:
    """A move prepared once on its KV caches (kept on the ``Move``): per piece, the bound launch into or out
    of its staging views in buffer ``piece % 2``, and the 2D copies of every object's piece. ``run`` as
    ``BoundMove.run``."""

    __slots__ = (
        "_events",
        "bounds",
        "copies",
        "count",
        "events",
        "index",
        "kv_caches",
        "mv",
        "reg",
        "scatter",
        "staging",
        "transfer",
    )

    def __init__(
        self,
        kv_caches: KVCaches,
        move: Move,
        transfer: Transfer,
        bounds: list[tk.BoundMove],
        copies: list[list[Any]],
        staging: tuple[torch.Tensor, ...],
    ) -> None:
        self.kv_caches = kv_caches
        self.transfer = transfer
        self.bounds = bounds
        self.copies = copies  # per piece: the extension's copy handles, one per object
        self.staging = staging  # the staging buffers the launches and copies point into (kept alive)
        self.scatter = move.is_scatter
        self.mv = bounds[0].mv
        self.reg = bounds[0].reg
        self.count = bounds[0].count
        self.index = transfer.index
        # one event per piece (torch creates an event on its first record: each is recorded once here, and
        # the transfer's ``free`` events of the buffers used too if nothing has recorded them yet)
        self._events = [torch.cuda.Event() for _ in bounds]
        unrecorded = [f for f in transfer.free[: len(staging)] if not f.cuda_event]
        with torch.cuda.device(self.index):
            for e in [*self._events, *unrecorded]:
                e.record()
        self.events = [e.cuda_event for e in self._events]

    def valid_for(self, kv_caches: KVCaches) -> bool:
        """True while ``kv_caches`` holds the layer tensors prepared for, and the staging buffers are still
        the transfer's."""
        for buf, kept in zip(self.transfer.buffers, self.staging, strict=False):
            if buf is None or buf.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr():
                return False
        return self.bounds[0].valid_for(kv_caches)  # every piece holds the same layer tensors

    def run(self) -> int:
        """Run the move: the tokens written (a gather's count is unused). ``ValueError`` for a gather's bad
        slots, the exact count for a scatter's."""
        for b in self.bounds:
            if b.flag_bytes is not None:
                b.flag_bytes[:] = b.clear
        if torch._C._cuda_getDevice() != self.index:
            with torch.cuda.device(self.index):
                self._queue()
        else:
            self._queue()
        for b in self.bounds:
            if b.flag_bytes is not None and b.flag_bytes != b.clear:
                return tk.exact_count(b.mv)
        return self.count

    def _queue(self) -> None:
        """Queue every launch, copy and event, and wait for what the run must wait for (holds the
        transfer's lock: its staging buffers and side stream). Piece p waits for its buffer's ``free``
        event (the piece two before it done with the buffer) and records it once done."""
        nat = _launch.native_copies()
        assert nat is not None
        copy, record, wait, t = nat.copy, nat.record, nat.wait_event, self.transfer
        _check(nat.context(self.index))
        cur = torch._C._cuda_getCurrentRawStream(self.index)
        side = t.stream.cuda_stream
        events = self.events
        with t.lock:
            free = [f.cuda_event for f in t.free]
            if self.scatter:
                for p, (b, cps, ev) in enumerate(zip(self.bounds, self.copies, events, strict=True)):
                    _check(wait(side, free[p % 2]))
                    for c in cps:
                        _check(copy(c, side))
                    _check(record(ev, side))
                    _check(wait(cur, ev))
                    b.go()
                    _check(record(free[p % 2], cur))
                _check(nat.sync(cur if self.bounds[0].flag_bytes is not None else side))
            else:
                for p, (b, cps, ev) in enumerate(zip(self.bounds, self.copies, events, strict=True)):
                    _check(wait(cur, free[p % 2]))
                    b.go()
                    _check(record(ev, cur))
                    _check(wait(side, ev))
                    for c in cps:
                        _check(copy(c, side))
                    _check(record(free[p % 2], side))
                _check(nat.sync(side))


def _check(status: int) -> None:
    if status:
        raise RuntimeError(f"CUDA driver call failed with status {status}")


def prepare(kv_caches: KVCaches, move: Move, transfer: Transfer) -> PiecedMove | None:
    """The ``PiecedMove`` of ``move`` (pinned host objects) on ``kv_caches``, or None where this path does not
    apply (see the module docstring). ``Unsupported`` as ``tk.check_move``."""
    nat = _launch.native_copies()
    if (
        nat is None
        or move.fp8
        or move.checks is Checks.HOST
        or not move.objects
        or not tk.pinned_objects(move.objects)
        or any(not o.is_contiguous() for o in move.objects)
    ):
        return None
    shapes = [tuple(o.shape) for o in move.objects]
    dtype = move.objects[0].dtype
    itemsize = move.objects[0].element_size()
    layer_bytes = max(1, sum(o.numel() * itemsize // o.shape[-3] for o in move.objects))
    most = (transfer.staging_bytes - STAGING_ALIGN * len(shapes)) // layer_bytes  # layers a buffer holds
    cuts = piece_layers(len(move.layers), PIECES, lead_last=move.is_scatter, most=most)
    piece_shapes = [[(*s[:-3], len(cut), *s[-2:]) for s in shapes] for cut in cuts]
    specs = [[(shp, dtype) for shp in shps] for shps in piece_shapes]
    with transfer.lock:
        # twice: the first pass grows each buffer to its largest piece, the second carves every piece from it
        for _ in range(2):
            views = [transfer.staging_views(p % 2, spec) for p, spec in enumerate(specs)]
        staging = tuple(b for b in transfer.buffers[: min(2, len(cuts))] if b is not None)  # all, once carved
    bounds: list[tk.BoundMove] = []
    copies: list[list[Any]] = []
    first = move.layers.start
    trusted = move.checks is Checks.NONE
    for cut, staged in zip(cuts, views, strict=True):
        layers = range(first + cut.start, first + cut.stop)
        lay, sm, spans = move.layout, move.slot_mapping, move.spans
        if move.is_scatter:
            sub = Move.scatter(lay, sm, spans, staged, move.skips or 0, layers=layers, trusted=trusted)
        else:
            sub = Move.gather(lay, sm, spans, staged, layers=layers, trusted=trusted)
        b = tk.bind(kv_caches, sub)
        if b is None:
            return None
        bounds.append(b)
        handles = []
        for obj, st, shape in zip(move.objects, staged, shapes, strict=True):
            pc = piece_copies(shape, itemsize, cut)
            host = (obj.data_ptr() + pc.host_offset, False, pc.host_pitch)
            dev = (st.data_ptr(), True, pc.width)
            dst, src = (dev, host) if move.is_scatter else (host, dev)
            handles.append(nat.make_copy(*dst, *src, pc.width, pc.height))
        copies.append(handles)
    return PiecedMove(kv_caches, move, transfer, bounds, copies, staging)
