"""Native row copies between CPU paged KV and CPU objects: one C call per gather/scatter (``_rowcopy.c``).

The C kernel (built by setup.py as an optional extension, loaded with ctypes) walks every span, layer,
token, head and plane and copies whole rows with streaming stores (64-byte ones where the CPU has
AVX-512F; ``memcpy`` where rows are not 16-byte aligned), a gather prefetching the paged rows 8 KiB
ahead, on up to torch's intra-op thread count (an OpenMP team on torch's own libgomp pool takes (span,
layer) tasks in turn; a forked child copies on its caller's thread); the torch reference path runs instead
when it is missing or ``TIERCACHE_CPU_KERNELS=0``. The kernel checks every slot before it copies
anything (a bad one: an error code, nothing written); callers validate shapes first.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "NEGATIVE",
    "OUT_OF_RANGE",
    "STORES",
    "Geometry",
    "RowJob",
    "copy",
    "host_slots",
    "native",
    "page_job",
    "threads",
    "token_job",
]

_SPAN_FIELDS = 7
_I64P = ctypes.POINTER(ctypes.c_int64)
_LIB: ctypes.CDLL | None = None
_TRIED = False
# At most one thread per 64 MiB: a second thread joins a copy within microseconds on an idle core but only
# after a scheduler slice when the cores are busy (cpu_copy_bench: 7.8-11.6 ms at load 9 on 2 cores), and a
# call waits for every thread of its team; a one-chunk copy (32 MiB for Llama-8B, ~1.8 ms on one thread) can
# gain at most ~0.6 ms from it, so it runs on the caller's thread (its 2-thread median fell to 5 GB/s).
_BYTES_PER_THREAD = 64 << 20
STORES = 2
"""The kernel's stores: 0 cached (``memcpy``), 1 16-byte streaming, 2 the widest streaming stores the CPU
has (the default: fastest measured, ``vs_lmcache.py cpu``); tests set the others to cover every path."""


def native() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (not built, not loadable, or ``TIERCACHE_CPU_KERNELS=0``)."""
    global _LIB, _TRIED
    if os.environ.get("TIERCACHE_CPU_KERNELS", "1") == "0":
        return None
    if not _TRIED:
        _TRIED = True
        try:
            spec = importlib.util.find_spec("tiercache.gpu._rowcopy")
            if spec is not None and spec.origin:
                lib = ctypes.CDLL(spec.origin)
                fn = lib.tc_copy_rows
                fn.restype = ctypes.c_int64
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, ctypes.c_void_p]
                fn.argtypes += [ctypes.c_int64] * 6 + [_I64P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
                fn.argtypes += [ctypes.c_int64, ctypes.c_int]
                _LIB = lib
        except (ImportError, OSError, AttributeError):
            _LIB = None
    return _LIB


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where paged rows lie: each layer's address; block size; byte strides of a block, an in-block
    offset and a head; each plane's byte offset; bytes per row (rows must be dense); how many slots the
    paged KV holds (blocks for CPU_BLOCKS). Computed once per registered KV caches (``reference``)."""

    layers: tuple[int, ...]
    block_size: int
    s_blk: int
    s_off: int
    s_head: int
    heads: int
    plane_offsets: tuple[int, ...]
    row_bytes: int
    n_slots: int
    c_layers: ctypes.Array[ctypes.c_int64] = field(init=False, compare=False, repr=False)
    c_planes: ctypes.Array[ctypes.c_int64] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        """The layer addresses and plane offsets as the C arrays every call passes (built once)."""
        object.__setattr__(self, "c_layers", (ctypes.c_int64 * len(self.layers))(*self.layers))
        planes = self.plane_offsets
        object.__setattr__(self, "c_planes", (ctypes.c_int64 * len(planes))(*planes))


@dataclass(frozen=True, slots=True)
class RowJob:
    """One span's object rows as addresses: plane p (K, V or latent) of object layer j, token ``tok0 + t``
    lies at ``obj + p * o_plane + j * o_layer + (tok0 + t) * o_tok`` and pairs with ``slots[slot0 + t]``
    for ``t < n``. ``slots``: an int64 contiguous CPU tensor, which several jobs may share."""

    obj: int
    o_plane: int
    o_layer: int
    o_tok: int
    slots: torch.Tensor
    slot0: int
    n: int
    tok0: int = 0

    def span_slots(self) -> torch.Tensor:
        """The job's own slots, ``slots[slot0 : slot0 + n]``."""
        return self.slots[self.slot0 : self.slot0 + self.n]


def token_job(
    geo: Geometry, obj: torch.Tensor, planes: int, slots: torch.Tensor, slot0: int, n: int, tok0: int
) -> RowJob | None:
    """The job of an object ``[2, layers, tokens, heads * row]`` (K and V; ``planes=1``: the latent,
    ``[layers, tokens, heads * row]``) whose token ``tok0 + t`` pairs with ``slots[slot0 + t]``; None
    unless the object is on the CPU with each head's row dense. Read from its strides: no view is made."""
    if obj.device.type != "cpu":
        return None
    st = obj.stride()
    lead = 0 if planes == 1 else 1  # the plane dim, when there are two
    if obj.shape[lead + 2] * obj.element_size() != geo.heads * geo.row_bytes or st[lead + 2] != 1:
        return None
    e = obj.element_size()
    o_plane = st[0] * e if lead else 0
    return RowJob(obj.data_ptr(), o_plane, st[lead] * e, st[lead + 1] * e, slots, slot0, n, tok0)


def page_job(geo: Geometry, obj: torch.Tensor, pages: int, blocks: torch.Tensor, page0: int) -> RowJob | None:
    """The job of a CPU_BLOCKS object (contiguous; per layer ``pages`` pages of ``geo.row_bytes``) whose
    page ``page0 + i`` pairs with block ``blocks[i]`` (an int64 contiguous CPU tensor); None off the CPU."""
    if obj.device.type != "cpu":
        return None
    row = geo.row_bytes
    return RowJob(obj.data_ptr(), 0, pages * row, row, blocks, 0, blocks.numel(), page0)


NEGATIVE = -1
"""``copy``'s answer when a slot < 0 is not allowed (a gather): nothing was copied."""
OUT_OF_RANGE = -2
"""``copy``'s answer when a slot lies past the paged KV (``Geometry.n_slots``): nothing was copied."""


def copy(gather: bool, geo: Geometry, jobs: Sequence[RowJob], negative_ok: bool) -> int:
    """Run the kernel over ``jobs`` (gather: paged -> objects; else objects -> paged): the slots >= 0 it
    covered, or ``NEGATIVE`` / ``OUT_OF_RANGE`` when a slot of any job is bad (< 0 unless ``negative_ok``,
    or past the paged KV): the kernel checks every slot before it copies, so then nothing is written. The
    caller has checked the shapes."""
    lib = native()
    if lib is None:
        raise RuntimeError("the native row-copy kernel is not loaded")
    slots = jobs[0].slots
    shared = all(j.slots is slots for j in jobs)
    if not shared:  # one array for the kernel: the jobs' own slots, one after another
        slots = torch.cat([j.span_slots() for j in jobs])
    table: list[int] = []
    at = 0
    for j in jobs:
        table += [j.obj, j.o_plane, j.o_layer, j.o_tok, j.slot0 if shared else at, j.n, j.tok0]
        at += j.n
    moved = at * len(geo.layers) * geo.heads * len(geo.plane_offsets) * geo.row_bytes
    return int(
        lib.tc_copy_rows(
            0 if gather else 1,
            len(geo.layers),
            geo.c_layers,
            len(jobs),
            (ctypes.c_int64 * len(table))(*table),
            slots.data_ptr(),
            geo.block_size,
            geo.s_blk,
            geo.s_off,
            geo.s_head,
            geo.heads,
            len(geo.plane_offsets),
            geo.c_planes,
            geo.row_bytes,
            threads(moved),
            STORES,
            geo.n_slots,
            1 if negative_ok else 0,
        )
    )


def host_slots(slot_mapping: torch.Tensor) -> torch.Tensor:
    """``slot_mapping`` as the kernel reads slots: int64, contiguous, on the CPU (itself when it is)."""
    if (
        slot_mapping.dtype is torch.int64
        and slot_mapping.device.type == "cpu"
        and slot_mapping.is_contiguous()
    ):
        return slot_mapping
    return slot_mapping.to(device="cpu", dtype=torch.int64).contiguous()


def threads(nbytes: int) -> int:
    """Threads for a copy of ``nbytes``: torch's intra-op count, at most one per 64 MiB."""
    return max(1, min(torch.get_num_threads(), nbytes // _BYTES_PER_THREAD))
