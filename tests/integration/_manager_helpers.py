"""What the integration tests that go through a ``StorageManager`` share: the object spec, a policy that
fails fast (a circuit that opens after two failures) and a store of numbered chunks."""

from __future__ import annotations

from tiercache.config import ManagerConfig
from tiercache.spec import KVSpec
from tiercache.store.manager import StorageManager

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", tokens=8)
FAIL_FAST = ManagerConfig(
    l2_deadline_s=5.0, lookup_deadline_s=3.0, store_queue_size=64, circuit_failures=2, circuit_cooldown_s=5
)
"""A killed tier's calls fail at once (refused connections, the adapter's own timeout); the deadlines are
roomy so that a healthy tier on a loaded machine never misses one (a miss would count as a failure)."""


async def store_chunks(manager: StorageManager, keys: list[str]) -> None:
    """Store one ``SPEC`` object per key (key i filled with byte i + 1) and wait until the tiers hold them."""
    objects = await manager.batched_allocate(keys, [SPEC] * len(keys))
    for i, obj in enumerate(objects):
        assert obj is not None
        obj.buffer()[:] = bytes([i + 1]) * SPEC.nbytes
    await manager.batched_put([o for o in objects if o is not None])
    await manager.drain()
