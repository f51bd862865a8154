"""Cache control on one storage manager: delete keys from L1 and every L2 tier that can delete, announced to
an :class:`~tiercache.events.EventSink`.

L2 tiers cannot list their keys, so a keyspace is cleared from the keys a sink saw this process hold (its L1
and its own L2 stores); objects other processes stored in a shared tier stay until deleted by key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

from tiercache.store.hits import L1_TIER

if TYPE_CHECKING:
    from tiercache.events import EventSink
    from tiercache.store.manager import StorageManager

__all__ = ["clear_keyspaces", "delete_keys"]


async def delete_keys(
    manager: StorageManager, keys: Sequence[str], sink: EventSink | None = None, *, unpin: bool = True
) -> int:
    """Delete ``keys`` from L1 (unpinning them first with ``unpin``) and from every L2 tier that supports
    deletes, each under the tier's deadline (a failed tier keeps its copies). Returns the objects deleted."""
    if not keys:
        return 0
    with contextlib.suppress(TimeoutError):
        await manager.drain()  # a store in flight holds its L1 object and would bring the key back to L2
    deleted = 0
    l1 = manager.l1
    gone: list[str] = []
    unpin_fn = getattr(l1, "unpin", None) if unpin else None
    for key in keys:
        if unpin_fn is not None:
            unpin_fn(key)
        with contextlib.suppress(ValueError):
            if l1.delete(key):
                gone.append(key)
    deleted += len(gone)  # the L1's listeners announce them
    for tier in manager.tiers:
        if not tier.adapter.capabilities.delete:
            continue
        adapter = tier.adapter
        done = await tier.call(
            "delete", partial(adapter.batched_delete, list(keys)), manager.policy.l2_deadline_s
        )
        if done is None:
            continue
        removed = [key for key, ok in zip(keys, done, strict=True) if ok]
        deleted += len(removed)
        if sink is not None:
            # a delete that found nothing still means the tier does not hold the key now
            sink.on_tier(tier.name, "deleted", list(keys))
    return deleted


async def clear_keyspaces(manager: StorageManager, sink: EventSink, prefixes: Sequence[str]) -> int:
    """Delete every key starting with one of ``prefixes`` that ``sink`` saw L1 or an L2 tier hold; queue a
    ``Cleared`` event. Returns the objects deleted."""
    keys: dict[str, None] = {}
    for tier in [L1_TIER, *(t.name for t in manager.tiers)]:
        for prefix in prefixes:
            keys.update(dict.fromkeys(sink.held(tier, prefix)))
    deleted = await delete_keys(manager, list(keys), sink)
    sink.cleared()
    return deleted
