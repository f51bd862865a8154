"""Page-locking a client's mapping of the shared L1 for CUDA, so GPU <-> shared-L1 copies run as they do from
``torch.empty(pin_memory=True)`` (the kernels and the staged pipeline see the slots as pinned host memory).

No CUDA in the server: only a client that already uses torch with a CUDA device registers its mapping
(``cudaHostRegister``, portable); anywhere else this is a no-op. A failed registration leaves the mapping
usable (copies fall back to pageable speed) and is logged once.
"""

from __future__ import annotations

import logging
import mmap
import sys
import time

import numpy as np

__all__ = ["register", "unregister"]

log = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process


def _address(data: mmap.mmap) -> int:
    return int(np.frombuffer(data, dtype=np.uint8).ctypes.data)


def _pieces(total: int, piece_bytes: int | None) -> list[tuple[int, int]]:
    step = piece_bytes or total
    return [(off, min(step, total - off)) for off in range(0, total, step)]


def register(data: mmap.mmap, piece_bytes: int | None = None) -> float | None:
    """Register ``data`` (a client's data mapping) with CUDA, one call per ``piece_bytes`` (the segment's
    regions: no object spans two, and each call holds the process's memory map for a bounded time); the
    seconds it took, or None where CUDA is not in use here (torch not imported, no device) or a piece failed
    (the pieces done are unregistered again)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    cudart = torch.cuda.cudart()
    base = _address(data)
    start = time.perf_counter()
    done: list[int] = []
    for off, size in _pieces(len(data), piece_bytes):
        err = cudart.cudaHostRegister(base + off, size, _PORTABLE)
        if int(err) != 0:
            log.warning("cudaHostRegister of the shared L1 failed at byte %d of %d: %s", off, len(data), err)
            for addr in done:
                cudart.cudaHostUnregister(addr)
            return None
        done.append(base + off)
    return time.perf_counter() - start


def unregister(data: mmap.mmap, piece_bytes: int | None = None) -> None:
    """Undo :func:`register` with the same ``piece_bytes`` (before the mapping goes away); a no-op where
    nothing was registered."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        cudart = torch.cuda.cudart()
        base = _address(data)
        for off, _ in _pieces(len(data), piece_bytes):
            cudart.cudaHostUnregister(base + off)
