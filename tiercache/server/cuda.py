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


def register(data: mmap.mmap) -> float | None:
    """Register ``data`` (a client's data mapping) with CUDA; the seconds it took, or None where CUDA is not
    in use here (torch not imported, no device) or the registration failed."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    start = time.perf_counter()
    err = torch.cuda.cudart().cudaHostRegister(_address(data), len(data), _PORTABLE)
    if int(err) != 0:
        log.warning("cudaHostRegister of the shared L1 (%d bytes) failed: %s", len(data), err)
        return None
    return time.perf_counter() - start


def unregister(data: mmap.mmap) -> None:
    """Undo :func:`register` (before the mapping goes away); a no-op where nothing was registered."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(_address(data))
