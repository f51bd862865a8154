"""Cache control on one storage manager: delete keys from L1 and every L2 tier that can delete, announced to
an :class:`~tiercache.events.EventSink`.

Clearing a keyspace reaches every key an L2 tier that lists its keys (``capabilities.list_keys``) holds
under the keyspace's prefix, whoever stored it, plus the keys the sink saw L1 and the other tiers hold;
objects other processes stored in a tier that cannot list its keys stay until deleted by key.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

from tiercache.store.hits import L1_TIER

if TYPE_CHECKING:
    from tiercache.events import EventSink
    from tiercache.store.manager import StorageManager
    from tiercache.store.tier import TierClient

__all__ = ["DELETE_BATCH", "LIST_DEADLINES", "clear_keyspaces", "delete_keys", "listed_keys"]

log = logging.getLogger(__name__)

DELETE_BATCH = 1000
"""Keys one L2 delete call carries (each call under the tier's ``l2_deadline_s``)."""
LIST_DEADLINES = 5
"""A tier's listing of the prefixes may take this many ``l2_deadline_s``; past it (or on a backend failure)
the keys listed so far are still deleted; the failure is logged and counted (``tier_errors{op="list"}``)."""


async def delete_keys(
    manager: StorageManager, keys: Sequence[str], sink: EventSink | None = None, *, unpin: bool = True
) -> int:
    """Delete ``keys`` from L1 (unpinning them first with ``unpin``) and from every L2 tier that supports
    deletes, ``DELETE_BATCH`` keys a call, each under the tier's deadline (a failed call keeps its copies).
    Returns the objects deleted."""
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
        for start in range(0, len(keys), DELETE_BATCH):
            batch = list(keys[start : start + DELETE_BATCH])
            done = await tier.call(
                "delete", partial(adapter.batched_delete, batch), manager.policy.l2_deadline_s
            )
            if done is None:
                continue
            deleted += sum(done)
            if sink is not None:
                # a delete that found nothing still means the tier does not hold the key now
                sink.on_tier(tier.name, "deleted", batch)
    return deleted


async def _list_tier(tier: TierClient, prefixes: Sequence[str], found: dict[str, None]) -> bool:
    for prefix in prefixes:
        async for batch in tier.adapter.iter_keys(prefix):
            found.update(dict.fromkeys(batch))
    return True


async def listed_keys(manager: StorageManager, prefixes: Sequence[str]) -> list[str]:
    """The keys starting with one of ``prefixes`` that the L2 tiers able to list (``capabilities.list_keys``)
    hold now, each tier's listing bounded by ``LIST_DEADLINES`` deadlines; a tier that fails or runs out of
    time gives what it listed so far (logged, counted). Never raises for a backend."""
    keys: dict[str, None] = {}
    deadline_s = manager.policy.l2_deadline_s * LIST_DEADLINES
    for tier in manager.tiers:
        if not tier.adapter.capabilities.list_keys:
            continue
        found: dict[str, None] = {}
        if await tier.call("list", partial(_list_tier, tier, prefixes, found), deadline_s) is None:
            log.warning(
                "tiercache: listing tier %s under %s failed or took over %.1f s; %d keys found are deleted",
                tier.name,
                list(prefixes),
                deadline_s,
                len(found),
            )
        keys.update(found)
    return list(keys)


async def clear_keyspaces(manager: StorageManager, sink: EventSink, prefixes: Sequence[str]) -> int:
    """Delete every key starting with one of ``prefixes`` that a listing L2 tier holds (``listed_keys``) or
    that ``sink`` saw L1 or an L2 tier hold; queue a ``Cleared`` event. Removals of keys the sink described
    are announced as ``Removed``; the others only by the ``Cleared``. Returns the objects deleted."""
    keys: dict[str, None] = {}
    for tier in [L1_TIER, *(t.name for t in manager.tiers)]:
        for prefix in prefixes:
            keys.update(dict.fromkeys(sink.held(tier, prefix)))
    keys.update(dict.fromkeys(await listed_keys(manager, prefixes)))
    deleted = await delete_keys(manager, list(keys), sink)
    sink.cleared()
    return deleted
