"""Cache control on the node server (``CONTROL``, admin connections): pin and unpin, delete, prefetch L2 -> L1
and per-tenant stats, on listed keys or every published key under a prefix (and of a tenant).

Pins are kept in ``PINS_SUFFIX`` next to the socket; a restarted server loads the pinned keys its L2 tiers
hold back into L1 and pins them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tiercache.store.control import delete_keys, listed_keys

if TYPE_CHECKING:
    from tiercache.events import EventSink
    from tiercache.server.slots import SlotTable
    from tiercache.server.storage import ServerStorage

__all__ = ["PINS_SUFFIX", "CacheControl"]

log = logging.getLogger(__name__)

PINS_SUFFIX = ".pins"
"""The pin file: ``<socket path>.pins``, a JSON list of pinned keys."""


class CacheControl:
    """The ``CONTROL`` actions of one server: its slot table, L2 storage (None: L1 only) and event sink."""

    def __init__(
        self, table: SlotTable, storage: ServerStorage | None, events: EventSink | None, pins_path: str
    ) -> None:
        self.table = table
        self.storage = storage
        self.events = events
        self.pins_path = pins_path
        self.pins: set[str] = set()
        """Keys pinned on request (what the pin file holds)."""

    async def handle(self, body: dict[str, Any]) -> dict[str, Any]:
        """One validated ``CONTROL`` request's answer."""
        action = body["action"]
        if action == "stats":
            return {
                "tenants": self.table.tenant_stats(),
                "keyspaces": self._keyspaces(),
                "pins": len(self.pins),
            }
        keys = self._keys(body)
        if action == "pin":
            return await self.pin(keys, body["wait_s"])
        if action == "unpin":
            done = [self.table.unpin(k) for k in keys]
            self.pins.difference_update(keys)
            self._save()
            return {"unpinned": sum(done), "keys": len(keys)}
        if action == "prefetch":
            await self._load(keys, body["wait_s"])
            published = set(self.table.keys(""))
            return {"in_l1": sum(k in published for k in keys), "keys": len(keys)}
        return await self.delete(keys, body)

    def _keyspaces(self) -> dict[str, int]:
        """Published objects per key prefix up to the chunk hash (``tc1.<keyspace digest>.``: one model's
        layout and process salt)."""
        counts: dict[str, int] = {}
        for key in self.table.keys(""):
            head, dot, _ = key.rpartition(".")
            prefix = head + dot if key.startswith("tc") and head.count(".") == 1 else ""
            counts[prefix] = counts.get(prefix, 0) + 1
        return counts

    def _keys(self, body: dict[str, Any]) -> list[str]:
        """The listed keys, or every published key under ``prefix`` / of ``tenant``."""
        keys: list[str] = list(body["keys"])
        if body["prefix"] is not None or body["tenant"] is not None:
            keys += self.table.keys(body["prefix"] or "", body["tenant"])
        return list(dict.fromkeys(keys))

    async def pin(self, keys: Sequence[str], wait_s: float) -> dict[str, Any]:
        """Load what L2 holds of ``keys`` into L1 (bounded by ``wait_s``), then pin them; a key over its
        tenant's pin bound stays unpinned (``refused``)."""
        await self._load(keys, wait_s)
        done = [k for k in keys if self.table.pin(k)]
        self.pins.update(done)
        self._save()
        return {"pinned": len(done), "refused": len(keys) - len(done), "keys": len(keys)}

    async def delete(self, keys: Sequence[str], body: dict[str, Any]) -> dict[str, Any]:
        """Delete ``keys`` from L1 and every L2 tier that deletes (with a prefix and no tenant: also the keys
        the L2 tiers that list keys hold under it, and those the event sink saw the other tiers hold)."""
        wanted = list(keys)
        if body["prefix"] is not None and body["tenant"] is None:
            if self.events is not None:  # tiers that cannot list: what this server stored or saw stored
                for tier in self.events.tiers():
                    wanted += self.events.held(tier, body["prefix"])
            if self.storage is not None:
                wanted += await listed_keys(self.storage.manager, [body["prefix"]])
        wanted = list(dict.fromkeys(wanted))
        self.pins.difference_update(wanted)
        self._save()
        if self.storage is None:
            for key in wanted:
                self.table.unpin(key)
            deleted = sum(self.table.delete(k) for k in wanted)
        else:
            deleted = await delete_keys(self.storage.manager, wanted, self.events)
        if self.events is not None and body["prefix"] == "" and not body["keys"]:
            self.events.cleared()
        return {"deleted": deleted, "keys": len(wanted)}

    async def _load(self, keys: Sequence[str], wait_s: float) -> None:
        """Bring the keys an L2 tier holds (and L1 does not) into L1, waiting at most ``wait_s``."""
        if self.storage is None or not keys or wait_s <= 0:
            return
        manager = self.storage.manager
        hits = await manager.batched_contains(keys)
        below = [(k, h.tier) for k, h in zip(keys, hits, strict=True) if h is not None and h.level > 0]
        if not below:
            return
        task = manager.start_prefetch([k for k, _ in below], [t for _, t in below])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), wait_s)

    # ----- the pin file ------------------------------------------------------------------------------------
    def _save(self) -> None:
        """Write the pin set (atomically: temp file + rename); a failure is logged, pins stay in memory."""
        tmp = self.pins_path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(sorted(self.pins), f)
            os.replace(tmp, self.pins_path)
        except OSError as exc:
            log.warning("cache control: cannot write %s (%s); pins are not kept across a restart", tmp, exc)

    def _read(self) -> list[str]:
        """The pin file's keys ([] when there is none or it is unreadable)."""
        try:
            with open(self.pins_path) as f:
                found = json.load(f)
        except (OSError, ValueError):
            return []
        return [k for k in found if isinstance(k, str)] if isinstance(found, list) else []

    async def restore(self, wait_s: float = 60.0) -> int:
        """Pin again the keys of the pin file that L1 or an L2 tier holds (after a restart); the number
        pinned. Keys no tier holds any more are dropped from the file."""
        saved = self._read()
        if not saved:
            return 0
        result = await self.pin(saved, wait_s)
        log.info("cache control: %d of %d pinned keys restored", result["pinned"], len(saved))
        return int(result["pinned"])
