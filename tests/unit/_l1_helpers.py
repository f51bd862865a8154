"""What the L1 tests share: the object spec, a key-derived byte pattern, and put / read through any L1
(the in-process ``L1Cache`` or the shared L1's client ``SharedL1``: the same reserve/finish/acquire API)."""

from __future__ import annotations

import hashlib
from typing import Any

from tiercache.spec import KVSpec

# [2, L=2, T=4, H*D=8] bf16 -> 256 bytes
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", tokens=4)
SLOT = SPEC.nbytes


def pattern(key: str, n: int) -> bytes:
    """A key-derived byte pattern of length n."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (n // len(seed) + 1))[:n]


def put(cache: Any, key: str, spec: KVSpec = SPEC) -> Any:
    """Write ``key``'s pattern through a two-phase write; the READY object."""
    obj = cache.reserve_write(key, spec)
    assert obj is not None, key
    obj.buffer()[:] = pattern(key, spec.nbytes)
    cache.finish_write(obj)
    return obj


def read(cache: Any, key: str) -> bytes | None:
    """``key``'s bytes under a lease (checked still valid after the copy), or None when absent."""
    lease = cache.acquire(key)
    if lease is None:
        return None
    with lease:
        data = bytes(lease.obj.buffer())
        assert lease.valid()
    return data
