"""The one "flat byte view" helper: 1-D uint8 memoryviews over bytes-like objects, numpy arrays and CPU torch
tensors, without a copy whenever the memory is contiguous.

Every adapter, the frame reader and the codec pipeline take their bytes through these two functions; a
third-party adapter or codec should too (``from tiercache.buffers import as_readable_bytes``). numpy and torch
are never imported here to recognise an object: it can only be an ndarray or a Tensor if its module is loaded.
``copy_bytes`` copies a large buffer with the GIL released (a slice assignment holds it for the whole copy).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["as_readable_bytes", "as_writable_bytes", "copy_bytes"]

GIL_FREE_COPY_BYTES = 1 << 20
"""Copies of at least this many bytes run with the GIL released (numpy's copy); smaller ones as a slice."""


def _numpy_array(obj: object) -> Any | None:
    np = sys.modules.get("numpy")
    return obj if np is not None and isinstance(obj, np.ndarray) else None


def _torch_tensor(obj: object) -> Any | None:
    torch = sys.modules.get("torch")
    return obj if torch is not None and isinstance(obj, torch.Tensor) else None


def _flat_view(mv: memoryview) -> memoryview:
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def as_readable_bytes(obj: object) -> memoryview:
    """A C-contiguous 1-D uint8 view of ``obj``'s bytes; copies only non-contiguous or non-CPU input."""
    if isinstance(obj, bytes | bytearray):
        return memoryview(obj)
    if isinstance(obj, memoryview):
        return _flat_view(obj) if obj.c_contiguous else memoryview(obj.tobytes())
    if (arr := _numpy_array(obj)) is not None:
        import numpy as np

        flat = np.ascontiguousarray(arr).reshape(-1)
        return flat.view(np.uint8).data
    if (tensor := _torch_tensor(obj)) is not None:
        import torch

        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
        return memoryview(t.view(torch.uint8).numpy())
    try:
        mv = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"expected bytes-like, numpy array or torch tensor, got {type(obj).__name__}"
        ) from None
    return _flat_view(mv) if mv.c_contiguous else memoryview(mv.tobytes())


def as_writable_bytes(obj: object) -> memoryview:
    """A writable 1-D uint8 view sharing memory with ``obj``; ValueError if read-only or non-contiguous."""
    if isinstance(obj, bytes):
        raise ValueError("bytes is read-only: pass a bytearray, a writable memoryview, an array or a tensor")
    if (arr := _numpy_array(obj)) is not None:
        import numpy as np

        if not arr.flags.c_contiguous or not arr.flags.writeable:
            raise ValueError("destination numpy array must be C-contiguous and writeable")
        view: memoryview = arr.reshape(-1).view(np.uint8).data
        return view
    if (tensor := _torch_tensor(obj)) is not None:
        import torch

        if tensor.device.type != "cpu":
            raise ValueError(f"destination tensor must live on the CPU, not {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError("destination tensor must be contiguous")
        return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())
    try:
        mv = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"expected a writable buffer, array or tensor, got {type(obj).__name__}") from None
    if mv.readonly:
        raise ValueError("destination buffer is read-only")
    if not mv.c_contiguous:
        raise ValueError("destination buffer must be C-contiguous")
    return _flat_view(mv)


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """Copy the bytes of ``src`` into ``dst`` (1-D uint8 views of one length). A large copy releases the GIL,
    so the event loop and other threads run meanwhile (a memoryview slice assignment holds it throughout: a
    32 MiB frame's copy on a codec thread stalled the loop's socket sends for its whole length)."""
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} bytes into {len(dst)}")
    if len(src) < GIL_FREE_COPY_BYTES:
        dst[:] = src
        return
    import numpy as np

    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8), casting="no")
