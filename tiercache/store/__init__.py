"""``tiercache.store``: the running store built on the contracts in ``tiercache``.

- ``tiercache.store.l1``: the host-memory tier (``L1Cache``, ``KVObject``, ``L1Lease``).
- ``tiercache.store.l1_surface``: ``L1Surface``, the L1 protocol the manager and engine use (``L1Cache`` and
  the server's ``SharedL1`` implement it).
- ``tiercache.store.circuit``: the per-tier circuit breaker.
- ``tiercache.store.tier``: ``TierClient`` — one L2 tier under deadlines, circuit and metrics.
- ``tiercache.store.store_controller``: ``StoreController`` — write-behind L1 -> L2.
- ``tiercache.store.prefetch_controller``: ``PrefetchController`` — L2 -> decode -> L1.
- ``tiercache.store.hits``: ``TierHit``, ``PrefixHit``.
- ``tiercache.store.manager``: ``StorageManager`` — the façade over L1, the tiers and both controllers.
- ``tiercache.store.engine``: ``CacheEngine`` — token database + GPU moves + manager.

Importing this package is light; the modules import torch when they are imported.
"""

from __future__ import annotations
