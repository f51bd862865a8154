"""Native row copies between CPU paged KV and CPU objects: one C call per gather/scatter (``_rowcopy.c``).

The C kernel (built by setup.py as an optional extension, loaded with ctypes) walks every span, layer,
token, head and plane and copies whole rows with streaming stores (64-byte ones where the CPU has
AVX-512F; ``memcpy`` where rows are not 16-byte aligned), on up to torch's
intra-op thread count (an OpenMP team on torch's own libgomp pool takes (span, layer) tasks in turn; a
forked child copies on its caller's thread); the torch reference path runs instead
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
    "native",
    "object_fits",
    "threads",
]

_SPAN_FIELDS = 7
_I64P = ctypes.POINTER(ctypes.c_int64)
_LIB: ctypes.CDLL | None = None
_TRIED = False
_BYTES_PER_THREAD = 8 << 20  # a smaller call runs on the caller's thread alone
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
    """One span's object: its planes as ``[layers, tokens, heads * row]`` views (K, V or latent) whose
    token ``tok0 + t`` pairs with ``slots[t]``."""

    planes: Sequence[torch.Tensor]
    slots: torch.Tensor
    tok0: int = 0


def object_fits(plane: torch.Tensor, row_elems: int, heads: int) -> bool:
    """True when an object plane ``[layers, tokens, heads * row]`` holds each head's row contiguously."""
    return plane.device.type == "cpu" and plane.shape[2] == heads * row_elems and plane.stride(2) == 1


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
    if len(jobs) == 1:
        slots = jobs[0].slots
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
    else:
        slots = torch.cat([j.slots.to(torch.int64) for j in jobs])
    table: list[int] = []
    at = 0
    e = jobs[0].planes[0].element_size()
    for j in jobs:
        p0 = j.planes[0]
        o_plane = (j.planes[1].data_ptr() - p0.data_ptr()) if len(j.planes) > 1 else 0
        n = j.slots.numel()
        table += [p0.data_ptr(), o_plane, p0.stride(0) * e, p0.stride(1) * e, at, n, j.tok0]
        at += n
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


def threads(nbytes: int) -> int:
    """Threads for a copy of ``nbytes``: torch's intra-op count, at most one per 8 MiB."""
    return max(1, min(torch.get_num_threads(), nbytes // _BYTES_PER_THREAD))
