"""A tier that is down when the manager opens and comes back later: the listeners the event sink added to the
stand-in (``ReopeningAdapter``) hear the re-opened adapter's evictions, so they are announced."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.unit.test_events import SPEC, check_two_object_disk_evicts_first
from tiercache.adapters import Adapter
from tiercache.adapters.posix import PosixAdapter
from tiercache.config import ManagerConfig
from tiercache.errors import AdapterUnavailable
from tiercache.events import MEDIUM_DISK, EventSink
from tiercache.serde import build_pipeline
from tiercache.store._reopen import ReopeningAdapter
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager


@pytest.mark.asyncio
async def test_evictions_of_a_tier_reopened_after_start_are_announced(tmp_path: Path) -> None:
    """The file tier (room for two objects) fails to open once, is re-opened in the background, then evicts
    for room: the DISK removal reaches the sink that attached while the tier was down."""
    attempts: list[int] = []

    async def opener() -> Adapter:
        attempts.append(1)
        if len(attempts) == 1:
            raise AdapterUnavailable("the disk is not mounted yet")
        return await PosixAdapter.open(f"file://{tmp_path}/l2", capacity=2 * SPEC.nbytes + 1500)

    try:
        await opener()
    except AdapterUnavailable as exc:
        down = ReopeningAdapter("disk", opener, exc, first_delay_s=0.01)
    policy = ManagerConfig(l2_deadline_s=2.0, lookup_deadline_s=1.0)
    manager = StorageManager(
        L1Cache(SPEC.nbytes * 8, SPEC.nbytes), [("disk", down, build_pipeline(["raw"]))], policy
    )
    sink = EventSink({"disk": MEDIUM_DISK})
    detach = sink.attach(manager)  # while the tier is down
    try:
        assert down.capabilities.persistent is False  # nothing known while down
        await asyncio.wait_for(down.reopened.wait(), 10)
        assert down.capabilities == PosixAdapter.capabilities  # the opened adapter's limits apply
        await check_two_object_disk_evicts_first(manager, sink)
        # a listener added after the re-open goes straight to the opened adapter
        heard: list[tuple[str, list[str]]] = []
        remove = down.add_listener(lambda kind, keys: heard.append((kind, list(keys))))
        await down.batched_delete(["ks.c"])
        assert ("deleted", ["ks.c"]) in heard
        remove()
    finally:
        detach()
        await manager.aclose()
