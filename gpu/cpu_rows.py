"""Native row copies between CPU paged KV and CPU objects: one C call per gather/scatter (``_rowcopy.c``).

The C kernel (built by setup.py as an optional extension, loaded with ctypes) walks every span, layer,
token, head and plane and copies whole rows with streaming stores (64-byte ones where the CPU has
AVX-512F; ``memcpy`` where rows are not 16-byte aligned), on up to torch's
intra-op thread count (the caller's thread and helper threads the library keeps between calls take (span,
layer) tasks in turn); the torch reference path runs instead
when it is missing or ``TIERCACHE_CPU_KERNELS=0``. Callers validate slots and shapes first:
this module only describes tensors to the kernel and trusts the indices it is given.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["STORES", "Geometry", "RowJob", "copy", "native", "object_fits", "threads"]

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
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, _I64P, ctypes.c_int64, _I64P, _I64P]
                fn.argtypes += [ctypes.c_int64] * 6 + [_I64P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
                _LIB = lib
        except (ImportError, OSError, AttributeError):
            _LIB = None
    return _LIB


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where paged rows lie: each layer's address; block size; byte strides of a block, an in-block
    offset and a head; each plane's byte offset; bytes per row (rows must be dense)."""

    layers: tuple[int, ...]
    block_size: int
    s_blk: int
    s_off: int
    s_head: int
    heads: int
    plane_offsets: tuple[int, ...]
    row_bytes: int


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


def copy(gather: bool, geo: Geometry, jobs: Sequence[RowJob]) -> int:
    """Run the kernel over ``jobs`` (gather: paged -> objects; else objects -> paged, slots < 0 skipped);
    returns the slots >= 0 it covered. The caller has checked every slot and shape."""
    lib = native()
    if lib is None:
        raise RuntimeError("the native row-copy kernel is not loaded")
    slots = torch.cat([j.slots.to(torch.int64) for j in jobs]) if len(jobs) > 1 else jobs[0].slots
    slots = slots.to(torch.int64).contiguous()
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
    layers = (ctypes.c_int64 * len(geo.layers))(*geo.layers)
    spans = (ctypes.c_int64 * len(table))(*table)
    poff = (ctypes.c_int64 * len(geo.plane_offsets))(*geo.plane_offsets)
    return int(
        lib.tc_copy_rows(
            0 if gather else 1,
            len(geo.layers),
            layers,
            len(jobs),
            spans,
            ctypes.cast(slots.data_ptr(), _I64P),
            geo.block_size,
            geo.s_blk,
            geo.s_off,
            geo.s_head,
            geo.heads,
            len(geo.plane_offsets),
            poff,
            geo.row_bytes,
            threads(moved),
            STORES,
        )
    )


def threads(nbytes: int) -> int:
    """Threads for a copy of ``nbytes``: torch's intra-op count, at most one per 8 MiB."""
    return max(1, min(torch.get_num_threads(), nbytes // _BYTES_PER_THREAD))
