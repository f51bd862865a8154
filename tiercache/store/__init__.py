"""``tiercache.store``: the running store built on the contracts in ``tiercache``.

- ``tiercache.store.l1``: the host-memory tier (``L1Cache``, ``KVObject``, ``L1Lease``).
- ``tiercache.store.circuit``: the per-tier circuit breaker.
- ``tiercache.store.manager``: ``StorageManager`` — the L2 tier client (deadlines, circuit, metrics), the
  store controller (background fan-out to L2) and the prefetch controller (L2 -> decode -> L1).
- ``tiercache.store.engine``: ``CacheEngine`` — token database + GPU moves + manager.

Importing this package is light; the modules import torch when they are imported.
"""

from __future__ import annotations
