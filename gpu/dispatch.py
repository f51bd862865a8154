"""Run a ``Move`` on the Triton kernels or the torch reference, picked at run time.

Same semantics as ``tiercache.gpu.reference`` (bit-exact, ``ValueError`` on bad input):

- KV on CUDA, objects on the same device: one Triton launch (``triton_kernels``); a move run again costs
  one pre-bound launch plus, unless trusted, the wait for its slot flags.
- KV on CUDA, objects in pinned host memory (L1 views of the pinned pool), slots on the host: the copy
  engines, no kernel (``tiercache.gpu.copy_engine``: 2D copies of long block runs), as ``HOST_PATH``
  picks.
- Otherwise, KV on CUDA, objects in pinned host memory: from ``PIECED_MIN_BYTES`` to
  ``PIECED_MAX_BYTES``, staged in layer pieces with every step issued to the driver
  (``tiercache.gpu.layer_pieces``); below that one launch that reads / writes them in place over the bus;
  above it (or without the launch extension, or with slot checks on the host, from ``ZERO_COPY_BYTES``)
  the object-group pipeline of ``tiercache.gpu.transfer`` (kernel into device staging, copies on a side
  stream). All return once the host memory is no longer touched.
- An fp8 move (``Move.gather_fp8`` / ``Move.scatter_fp8``) on CUDA: the fused fp8 kernel on device
  payloads (pinned host payloads read / written in place by ``triton_kernels`` when called directly), the
  staged pipeline of ``tiercache.gpu.fp8_transfer`` for host payloads (an fp8 L1).
- Whole pages (``CPU_BLOCKS``; ``VLLM_BLOCKS`` as ``tiercache.gpu.block_pages`` makes its moves page moves):
  the copy engines between CUDA KV and pinned host objects with the slots on the host (one copy per run of
  consecutive blocks, issued as one batch), the reference otherwise.
- Anything else (CPU tensors, triton missing, layers with different strides, misaligned
  pointers) or ``TIERCACHE_GPU_KERNELS=0``: the torch reference.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tiercache.errors import Unsupported
from tiercache.gpu import block_pages, reference
from tiercache.gpu.layouts import PagedLayout, layer_tensors
from tiercache.gpu.move import Move

if TYPE_CHECKING:
    from tiercache.gpu import transfer
    from tiercache.gpu.copy_engine import CopyMove
    from tiercache.gpu.layer_pieces import PiecedMove
    from tiercache.gpu.layouts import KVCaches
    from tiercache.gpu.triton_kernels import BoundMove

__all__ = ["copy_engine_ahead", "gather", "host_path", "kernels_enabled", "scatter"]

_TRITON_OK: bool | None = None
# Moves into / out of pinned host memory from PIECED_MIN_BYTES to PIECED_MAX_BYTES are staged in layer pieces
# with every step issued to the driver (tiercache.gpu.layer_pieces), smaller ones run as one kernel over the
# bus, larger ones through the object-group pipeline of tiercache.gpu.transfer; where pieces do not apply,
# moves up to ZERO_COPY_BYTES go over the bus. Pieces of at most one staging buffer (64 MiB) each: every
# object's piece is one more copy, and the H200 measured ~3 us of copy-engine time per copy, so from 256 MiB
# of 256-token objects the pipeline's one copy per object is ahead (512 MiB: 0.976 against 0.933 in 11
# pieces), while up to 128 MiB pieces are (0.964-0.973 against 0.958-0.964; one 128 MiB object: 0.966-0.971
# against 0.928-0.937).
ZERO_COPY_BYTES = 64 << 20
PIECED_MIN_BYTES = 16 << 20  # the H200: over the bus ahead below 16 MiB, pieces ahead from 32 MiB
PIECED_MAX_BYTES = 128 << 20  # two staging buffers' worth: pieces no bigger than the pipeline's groups
# Which path moves KV to and from pinned host objects: "copy_engine" (tiercache.gpu.copy_engine: DMA only,
# where it applies), "kernel" (the kernel paths above) or "auto": 2D copies on the copy engines where the
# slots are on the host, a token's plane row is contiguous and the move's contiguous pieces average
# COPY_ENGINE_MIN_ROW_BYTES, the kernel paths otherwise. On an H100
# beside a model's matmuls, 2D copies of 8 MiB (block runs of 128 tokens at Llama-8B's shape) moved KV at
# 0.81-0.96 of the pinned ceiling with the model -0.1-1.2 % slower, copies of 1 MiB at 0.50-0.57, and vLLM's
# [NB, H, BS, K|V] layout (a 256-byte row per head) at 0.18-0.19 alone (gpu_overlap_every_path_h100.json).
# On a shuffled table of 16-token blocks the copy engines' batches of 32 KiB copies moved KV at 0.45-0.63 of
# the ceiling (gpu_overlap_every_path_h100.json), 2D copies of 1 MiB at 0.50-0.57, where the kernel paths
# moved it at 0.73-0.98 with the model 0.2-5.0 % slower (gpu_overlap_h100.json,
# gpu_overlap_every_path_h100.json): behind at 256 and 4096 tokens, so auto leaves such tables to the kernel
# paths. On vLLM's block-outermost allocation (VLLM_BLOCKS) a block of every layer is one copy of 2 MiB at
# that shape, and whole-page moves take the copy engines wherever they apply (_pages_run).
# Read from TIERCACHE_GPU_HOST_PATH at import.
HOST_PATH = os.environ.get("TIERCACHE_GPU_HOST_PATH", "auto")
_HOST_PATHS = ("auto", "copy_engine", "kernel")
COPY_ENGINE_MIN_ROW_BYTES = 256 << 10
_REFERENCE = "reference"  # the path a move took on some KV caches (Move.prepared[id(kv_caches)])


def kernels_enabled(kv_caches: KVCaches, layout: PagedLayout) -> bool:
    """True when this call would try the Triton path (CUDA tensors, a token layout, triton importable)."""
    global _TRITON_OK
    if os.environ.get("TIERCACHE_GPU_KERNELS", "1") == "0" or layout.block_aligned:
        return False
    layers = layer_tensors(kv_caches)
    if not layers or layers[0].device.type != "cuda":
        return False
    if _TRITON_OK is None:
        from tiercache.gpu import triton_kernels

        _TRITON_OK = triton_kernels.available()
    return _TRITON_OK


def _where(objs: Sequence[torch.Tensor], device: torch.device) -> str:
    """'device' if every object is on ``device``, 'host' if every one is on the CPU, else 'mixed'."""
    if all(o.device == device for o in objs):
        return "device"
    if all(o.device.type == "cpu" for o in objs):
        return "host"
    return "mixed"


def _kernel_run(kv_caches: KVCaches, move: Move) -> int | None:
    """Run ``move`` on a kernel path: the tokens written (a gather's count is unused), or None when the
    reference must do it. What the first run picked is remembered on the move for these KV caches, so a
    repeated run goes straight to its bound launch or its prepared pipeline."""
    picked = move.prepared.get(id(kv_caches))
    if picked is not None and picked[1] is kv_caches:  # the path this move took before on these caches
        path = picked[0]
        if path == "bound":
            bound = picked[2]
            if bound.valid_for(kv_caches):
                return bound.run()  # type: ignore[no-any-return]
        elif path == _REFERENCE:
            return None
    if move.layout.block_aligned:
        return _pages_run(kv_caches, move)
    if move.fp8:
        return _fp8_run(kv_caches, move)
    if not move.objects or not kernels_enabled(kv_caches, move.layout):  # CPU KV, no triton
        move.prepared[id(kv_caches)] = (_REFERENCE, kv_caches)
        return None
    from tiercache.gpu import transfer
    from tiercache.gpu import triton_kernels as tk

    if picked is not None and picked[1] is kv_caches and picked[0] == "pipeline":
        xfer: transfer.Transfer = picked[2]
        return xfer.load(kv_caches, move) if move.is_scatter else xfer.store(kv_caches, move)
    path = _REFERENCE
    n: int | None = None
    device = layer_tensors(kv_caches)[0].device
    where = _where(move.objects, device)
    try:
        if where == "device":
            b = tk.bind(kv_caches, move)
            if b is not None:
                n = b.run()
                move.prepared[id(kv_caches)] = ("bound", kv_caches, b)
                return n
            p = tk.plan(kv_caches, move)
            p.launch()
            path, n = "plan", p.finish()
        elif where == "host":
            nbytes = sum(o.numel() * o.element_size() for o in move.objects)
            xfer = transfer.transfer_for(device)
            prepared = _host_move(kv_caches, move, xfer, nbytes)
            if prepared is not None:
                n = prepared.run()
                move.prepared[id(kv_caches)] = ("bound", kv_caches, prepared)
                return n
            n = xfer.load(kv_caches, move) if move.is_scatter else xfer.store(kv_caches, move)
            move.prepared[id(kv_caches)] = ("pipeline", kv_caches, xfer)
            return n
    except Unsupported:
        path, n = _REFERENCE, None
    move.prepared[id(kv_caches)] = (path, kv_caches)
    return n


def _pages_run(kv_caches: KVCaches, move: Move) -> int | None:
    """Run a move of whole pages on the copy engines (CUDA KV, pinned host objects, slots on the host,
    ``host_path`` not ``kernel``): one batch of copies where the driver has batches, else a 2D copy per
    run of blocks; the tokens written, or None when the reference must do it. On an H100 beside a model,
    2 MiB blocks of a shuffled table moved at 0.92-0.93 / 0.97-0.98 of the pinned ceiling in one batch at 256
    / 4096 tokens and at 0.89-0.90 / 0.91-0.92 issued one by one (the copy engines spend a few microseconds
    on each copy handed to them alone), the model slowed about as much as by one copy of the same bytes
    (gpu_overlap_h100.json)."""
    from tiercache.gpu import copy_engine

    layers = layer_tensors(kv_caches)
    ce = None
    if (
        not move.fp8
        and host_path() != "kernel"
        and layers[0].device.type == "cuda"
        and _where(move.objects, layers[0].device) == "host"
    ):
        ce = copy_engine.prepare(kv_caches, move, batched=copy_engine.batches_available())
    if ce is None:
        move.prepared[id(kv_caches)] = (_REFERENCE, kv_caches)
        return None
    move.prepared[id(kv_caches)] = ("bound", kv_caches, ce)
    return ce.run()


def host_path() -> str:
    """The ``HOST_PATH`` setting, checked: ``auto``, ``copy_engine`` or ``kernel``."""
    if HOST_PATH not in _HOST_PATHS:
        raise ValueError(
            f"TIERCACHE_GPU_HOST_PATH must be one of {', '.join(_HOST_PATHS)}, not {HOST_PATH!r}"
        )
    return HOST_PATH


def _host_move(
    kv_caches: KVCaches, move: Move, xfer: transfer.Transfer, nbytes: int
) -> CopyMove | PiecedMove | BoundMove | None:
    """The prepared run of a move of ``nbytes`` to or from pinned objects: on the copy engines where they
    take it (``host_path``; ``auto``: where ``copy_engine_ahead``), else
    staged in layer pieces from ``PIECED_MIN_BYTES`` to ``PIECED_MAX_BYTES`` (where the launch extension can
    issue the copies), else up to ``ZERO_COPY_BYTES`` one kernel over the bus; None for the object-group
    pipeline."""
    from tiercache.gpu import copy_engine, layer_pieces
    from tiercache.gpu import triton_kernels as tk

    choice = host_path()
    if choice != "kernel":
        ce = copy_engine.prepare(kv_caches, move)
        if ce is not None and (
            choice == "copy_engine" or copy_engine_ahead(ce.geo.contiguous, ce.mean_row_bytes)
        ):
            return ce
    if PIECED_MIN_BYTES <= nbytes <= PIECED_MAX_BYTES:
        pieced = layer_pieces.prepare(kv_caches, move, xfer)
        if pieced is not None:
            return pieced
    return tk.bind(kv_caches, move, host=True) if nbytes <= ZERO_COPY_BYTES else None


def copy_engine_ahead(contiguous: bool, mean_row_bytes: float) -> bool:
    """``auto``'s pick of the copy engines' 2D copies: contiguous token rows, pieces of
    ``COPY_ENGINE_MIN_ROW_BYTES`` or more on average."""
    return contiguous and mean_row_bytes >= COPY_ENGINE_MIN_ROW_BYTES


def _fp8_run(kv_caches: KVCaches, move: Move) -> int | None:
    """Run an fp8 ``move`` on a kernel path (tokens written; 0 for a gather), or None for the reference."""
    if not move.objects or not kernels_enabled(kv_caches, move.layout):
        return None
    from tiercache.gpu import fp8_transfer
    from tiercache.gpu import triton_kernels as tk

    where = _where(move.objects, layer_tensors(kv_caches)[0].device)
    try:
        if where == "device":
            if move.is_scatter:
                return tk.scatter_fp8(kv_caches, move)
            tk.gather_fp8(kv_caches, move)
            return 0
        if where == "host":
            if move.is_scatter:
                return fp8_transfer.load_fp8_from_host(kv_caches, move)
            fp8_transfer.store_fp8_to_host(kv_caches, move)
            return 0
    except Unsupported:
        pass
    return None


def gather(kv_caches: KVCaches, move: Move) -> None:
    """Run a gather ``move`` (``Move.gather`` or ``Move.gather_fp8``; ``reference.gather`` contract): one
    Triton launch, or the staged pipeline into host objects, on CUDA; the reference elsewhere."""
    if move.is_scatter:
        raise ValueError(f"{move!r} is a scatter")
    kv_caches, move = block_pages.as_pages(kv_caches, move)
    if _kernel_run(kv_caches, move) is None:
        reference.gather(kv_caches, move)


def scatter(kv_caches: KVCaches, move: Move) -> int:
    """Run a scatter ``move`` (``Move.scatter`` or ``Move.scatter_fp8``; ``reference.scatter`` contract);
    returns the tokens written per layer (a trusted move on a kernel path counts every token past the
    skips)."""
    if not move.is_scatter:
        raise ValueError(f"{move!r} is a gather")
    kv_caches, move = block_pages.as_pages(kv_caches, move)
    n = _kernel_run(kv_caches, move)
    if n is None:
        return reference.scatter(kv_caches, move)
    return n
