# mypy: disable-error-code="no-untyped-call,unreachable"
"""The GPU <-> L1 staging pipeline: gather into device staging, copy to pinned host on a side stream.

Store (``store_to_host``): spans are cut into groups of at most ``staging_bytes``; group g is gathered by one
Triton launch on the current stream into staging buffer ``g % 2``, an event hands it to a side stream that
copies each object to its host tensor (an L1 object view on the pinned pool), and a second event gives the
buffer back. So gathering group g+1 overlaps copying group g, and the copy engine is never idle waiting on
the host. Retrieve (``load_from_host``) mirrors it: host-to-device copies on the side stream into staging,
one scatter launch per group on the current stream.

The loops themselves (``Transfer.run_store`` / ``run_load``, over ``Stage``s: a staging buffer, a launch
and copy pairs, as ``Transfer.stage`` cuts host objects) also run the fp8 pipeline of
``tiercache.gpu.fp8_transfer``. Both return after the host memory is no longer touched: the caller may
release its L1 leases at once.
What a move needs (groups, staging views, bound launches, copy pairs) is prepared on its first run and kept
on the ``Move``, so a repeated run is the launches, the copies and the events. Slots checked on the device
are checked by the move kernels themselves (per-span flags in pinned memory, read once the last launch is
done: a retrieve waits for its last scatter); slots checked on the host (``host_slots``) by a ``SlotCheck``
queued after a store's last gather or during a retrieve's first copy. The kernels never touch a bad slot, so
a bad slot is reported at the end and nothing was written for it. ``tiercache.errors.Unsupported`` means
"use the reference".
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from tiercache.gpu import triton_kernels as tk
from tiercache.gpu.launch import current_stream, prebound_enabled
from tiercache.gpu.layouts import layer_tensors
from tiercache.gpu.move import Move

if TYPE_CHECKING:
    from tiercache.gpu.layouts import KVCaches

__all__ = ["DEFAULT_STAGING_BYTES", "STAGING_ALIGN", "Stage", "Transfer", "load_from_host", "store_to_host"]

DEFAULT_STAGING_BYTES = 64 << 20
DEFAULT_COALESCE = False
STAGING_ALIGN = 256  # each staging view starts at a multiple of this


def _groups(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive index groups whose byte sizes (each aligned) sum to at most ``limit`` (>= 1 each); the
    first group holds one object, so that the first copy starts as early as possible."""
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(sizes):
        n = -(-n // STAGING_ALIGN) * STAGING_ALIGN
        if cur and (used + n > limit or len(groups) == 0):
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


def _runs(objs: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first, stop, nbytes) of the runs of ``objs`` that lie back to back in one host storage and at the
    same distances in staging (``offsets``): each run moves as one copy."""
    runs: list[tuple[int, int, int]] = []
    prev_end = prev_off = prev_store = -1
    for i, o in enumerate(objs):
        n = o.numel() * o.element_size()
        store = o.untyped_storage().data_ptr()
        if runs and store == prev_store and o.data_ptr() == prev_end and offsets[i] == prev_off:
            a, _, total = runs[-1]
            runs[-1] = (a, i + 1, total + n)
        else:
            runs.append((i, i + 1, n))
        prev_end, prev_off, prev_store = o.data_ptr() + n, offsets[i] + n, store
    return runs


def _flat(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes from ``t``'s first element, as a uint8 view of its storage (may run past ``t``)."""
    start = t.storage_offset() * t.element_size()
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    out.set_(t.untyped_storage(), start, (nbytes,), (1,))
    return out


class Transfer:
    """Per-device staging buffers (two), a side stream for the copies and the events that order them.

    ``coalesce``: objects that lie back to back in host memory (L1 slots handed out in order) move as one
    copy per run instead of one per object. (A second copy stream, one per staging buffer, was measured on
    the H200 and gained nothing.)
    """

    def __init__(
        self,
        device: torch.device,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        *,
        coalesce: bool = DEFAULT_COALESCE,
    ) -> None:
        self.device = device
        self.index = device.index or 0
        self.staging_bytes = staging_bytes
        self.coalesce = coalesce
        self.stream = torch.cuda.Stream(device)
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.ready = [torch.cuda.Event(), torch.cuda.Event()]
        self.free = [torch.cuda.Event(), torch.cuda.Event()]
        self.done = torch.cuda.Event()
        self.lock = threading.Lock()

    def stage(
        self, objs: Sequence[torch.Tensor], coalesce: bool | None = None
    ) -> tuple[list[list[int]], list[torch.Tensor], list[list[tuple[torch.Tensor, torch.Tensor]]]]:
        """Cut host ``objs`` into the pipeline's groups: the groups (indices into ``objs``), each object's
        device view in staging buffer ``group % 2`` and each group's (host, staging) copy pairs (one per run
        of back-to-back objects with ``coalesce``, default ``self.coalesce``). Hold ``self.lock`` from here
        until the run (``run_store`` / ``run_load``) is done."""
        coalesce = self.coalesce if coalesce is None else coalesce
        groups = _groups([o.numel() * o.element_size() for o in objs], self.staging_bytes)
        views: list[torch.Tensor] = list(objs)
        copies = []
        for g, idx in enumerate(groups):
            part = [objs[i] for i in idx]
            vs = self.staging_views(g % 2, [(tuple(o.shape), o.dtype) for o in part])
            for i, v in zip(idx, vs, strict=True):
                views[i] = v
            copies.append(self._copies(g % 2, part, vs, coalesce))
        return groups, views, copies

    def run_store(self, stages: Sequence[Stage], queue_checks: Callable[[], None]) -> None:
        """Launch each stage into its staging buffer on the current stream while the side stream copies the
        previous one to host; ``queue_checks`` after the last launch; returns once the copies are done
        (hold ``self.lock``)."""
        cur = current_stream(self.index)
        for st in stages:
            b = st.buffer
            cur.wait_event(self.free[b])
            st.launch()
            self.ready[b].record(cur)
            self.stream.wait_event(self.ready[b])
            self._side_copies(cur, st.copies, to_host=True)
            self.free[b].record(self.stream)
        queue_checks()  # after the last launch: the next group's gather never waits for them
        self.stream.synchronize()  # the copies waited for every launch

    def run_load(
        self, stages: Sequence[Stage], queue_checks: Callable[[], None], *, wait_launches: bool = False
    ) -> None:
        """Copy each stage to staging on the side stream while the current stream launches the previous one;
        ``queue_checks`` while the first copy runs; returns once host memory is no longer read, or, with
        ``wait_launches``, once the last launch is done (hold ``self.lock``)."""
        cur = current_stream(self.index)
        for g, st in enumerate(stages):
            b = st.buffer
            self.stream.wait_event(self.free[b])
            self._side_copies(cur, st.copies, to_host=False)
            self.ready[b].record(self.stream)
            if g == 0:
                queue_checks()  # while the first copy runs, ahead of the launches
            cur.wait_event(self.ready[b])
            st.launch()
            self.free[b].record(cur)
        if wait_launches:
            self.done.record(cur)
            self.done.synchronize()
        else:
            self.stream.synchronize()  # host memory is no longer read: leases may be released

    def _side_copies(
        self, cur: torch.cuda.Stream, copies: Sequence[tuple[torch.Tensor, torch.Tensor]], to_host: bool
    ) -> None:
        """Queue ``copies`` (host, staging) on the side stream, staging to host or back; ``cur`` is current
        again afterwards."""
        self._on_side()
        try:
            for h, v in copies:
                if to_host:
                    h.copy_(v, non_blocking=True)
                else:
                    v.copy_(h, non_blocking=True)
        finally:
            self._back_to(cur)

    def _copies(
        self, b: int, objs: Sequence[torch.Tensor], views: Sequence[torch.Tensor], coalesce: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host, staging) tensor pairs to copy for ``objs`` and their staging ``views``: one pair per object,
        or per run of back-to-back objects with ``coalesce``."""
        if not coalesce or len(objs) < 2:
            return list(zip(objs, views, strict=True))
        buf = self.buffers[b]
        assert buf is not None
        base = buf.data_ptr()
        offsets = [v.data_ptr() - base for v in views]
        pairs = []
        for a, z, n in _runs(objs, offsets):
            if z - a == 1:
                pairs.append((objs[a], views[a]))
            else:
                pairs.append((_flat(objs[a], n), buf[offsets[a] : offsets[a] + n]))
        return pairs

    def staging_views(
        self, b: int, shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]
    ) -> list[torch.Tensor]:
        """Contiguous device tensors of these (shape, dtype)s carved in order from staging buffer ``b``
        (grown when too small; hold ``self.lock``)."""
        nbytes = [torch.Size(shape).numel() * dt.itemsize for shape, dt in shapes]
        sizes = [-(-n // STAGING_ALIGN) * STAGING_ALIGN for n in nbytes]
        need = sum(sizes)
        buf = self.buffers[b]
        if buf is None or buf.numel() < need:
            # the old buffer may still be in use by queued work: wait for it before dropping it
            torch.cuda.current_stream(self.device).wait_event(self.free[b])
            buf = torch.empty(max(need, self.staging_bytes), dtype=torch.uint8, device=self.device)
            self.buffers[b] = buf
        out, at = [], 0
        for (shape, dt), n, size in zip(shapes, nbytes, sizes, strict=True):
            out.append(buf[at : at + n].view(dt).view(shape))
            at += size
        return out

    def _prepare(self, kv_caches: KVCaches, move: Move, cfg: tk.TileConfig) -> _Pipeline:
        """The pipeline of ``move`` (groups, staging views, bound launches), kept on the move."""
        key = ("pipeline", id(kv_caches), cfg, id(self))
        pipe = move.prepared.get(key)
        if pipe is not None and pipe.valid_for(kv_caches):
            return pipe  # type: ignore[no-any-return]
        mv = tk.check_move(kv_caches, move)
        objs = move.objects
        if move.is_scatter:
            todo = [i for i, ((s, e), k) in enumerate(zip(mv.span_list, mv.skips, strict=True)) if e - s > k]
        else:
            todo = list(range(len(objs)))
        flags = None
        fused = (
            mv.check_args is not None
            and mv.check_args[1] is None
            and mv.slots.device.type == "cuda"
            and mv.slots is move.slot_mapping
            and prebound_enabled()
        )
        if fused:
            flags = torch.zeros((max(1, len(todo)), 4), dtype=torch.int64, pin_memory=True)
        groups = []
        cut, views, copies = self.stage([objs[i] for i in todo])
        row = 0
        for g, pos in enumerate(cut):
            idx = [todo[p] for p in pos]
            plan = mv.plan(idx, [views[p] for p in pos])
            status = None if flags is None else flags[row : row + len(idx)]
            row += len(idx)
            go = plan.bound(cfg, status) if prebound_enabled() else None
            groups.append(Stage(g % 2, go or functools.partial(plan.launch, cfg), copies[g]))
        pipe = _Pipeline(kv_caches, mv, groups, flags)
        if len(move.prepared) > 8:
            move.prepared.clear()
        move.prepared[key] = pipe
        return pipe

    def _on_side(self) -> None:
        """Make the side stream current (``_back_to`` restores the caller's): the raw call behind
        ``torch.cuda.stream``, without its Python layers."""
        s = self.stream
        torch._C._cuda_setStream(
            stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type
        )

    def _back_to(self, cur: torch.cuda.Stream) -> None:
        torch._C._cuda_setStream(
            stream_id=cur.stream_id, device_index=cur.device_index, device_type=cur.device_type
        )

    def store(self, kv_caches: KVCaches, move: Move, cfg: tk.TileConfig = tk.DEFAULT_CONFIG) -> int:
        """Run a gather ``move`` into host objects (``reference.gather`` contract) through the pipeline;
        returns 0 (a gather writes no KV)."""
        with self.lock:
            pipe = self._prepare(kv_caches, move, cfg)
            if not pipe.groups:
                return 0
            pipe.start()
            self.run_store(pipe.groups, pipe.queue_checks)  # the copies waited for the flags' writers too
        pipe.finish()  # bad slots: ValueError (their rows were not moved; the caller aborts the objects)
        return 0

    def load(self, kv_caches: KVCaches, move: Move, cfg: tk.TileConfig = tk.DEFAULT_CONFIG) -> int:
        """Run a scatter ``move`` from host objects into the paged KV (``reference.scatter`` contract);
        returns the tokens written."""
        with self.lock:
            pipe = self._prepare(kv_caches, move, cfg)
            if not pipe.groups:
                return pipe.finish()
            pipe.start()
            # the scatters set the flags: with flags, wait for the last one
            self.run_load(pipe.groups, pipe.queue_checks, wait_launches=pipe.flags is not None)
        return pipe.finish()


class Stage:
    """One pipeline group: its staging buffer (0 or 1), its launch on the current stream and its copies
    (host tensor, staging view)."""

    __slots__ = ("buffer", "copies", "launch")

    def __init__(
        self, buffer: int, launch: Callable[[], None], copies: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self.buffer = buffer
        self.launch = launch
        self.copies = copies


class _Pipeline:
    """A move's pipeline, prepared once (``Transfer._prepare``): its groups, and either the pinned flags its
    launches set for bad slots (read once the launches are done) or the move's slot checks."""

    def __init__(
        self,
        kv_caches: KVCaches,
        mv: tk.MoveCheck,
        groups: list[Stage],
        flags: torch.Tensor | None,
    ) -> None:
        self.kv_caches = kv_caches
        self.reg = tk.registration(kv_caches, mv)
        self.mv = mv
        self.groups = groups
        self.flags = flags
        self.flags_np = None if flags is None else flags.numpy()
        self.count = sum(max(0, e - s - k) for (s, e), k in zip(mv.span_list, mv.skips, strict=True))

    def valid_for(self, kv_caches: KVCaches) -> bool:
        """True while ``kv_caches`` holds the layer tensors prepared for."""
        return kv_caches is self.kv_caches and tk.same_layers(self.reg, kv_caches)

    def start(self) -> None:
        """Before a run: zero the flags, or forget the last run's slot checks."""
        if self.flags_np is not None:
            self.flags_np.fill(0)
        else:
            self.mv.reset()

    def queue_checks(self) -> None:
        if self.flags_np is None:
            self.mv.queue_checks()

    def finish(self) -> int:
        """``ValueError`` on bad slots, else the tokens written (flags: read after the launches finished)."""
        if self.flags_np is None:
            return self.mv.finish()
        if self.flags_np[:, :2].any():
            return tk.exact_count(self.mv)
        return self.count


_TRANSFERS: dict[torch.device, Transfer] = {}
_LOCK = threading.Lock()


def transfer_for(device: torch.device) -> Transfer:
    """The process-wide Transfer of ``device`` (created on first use)."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _LOCK:
        t = _TRANSFERS.get(device)
        if t is None:
            t = Transfer(device)
            _TRANSFERS[device] = t
        return t


def store_to_host(kv_caches: KVCaches, move: Move) -> None:
    """Run a gather ``move`` from CUDA paged KV into host objects (L1 views on the pinned pool)."""
    device = layer_tensors(kv_caches)[0].device
    transfer_for(device).store(kv_caches, move)


def load_from_host(kv_caches: KVCaches, move: Move) -> int:
    """Run a scatter ``move`` from host objects into CUDA paged KV; returns the tokens written."""
    device = layer_tensors(kv_caches)[0].device
    return transfer_for(device).load(kv_caches, move)
