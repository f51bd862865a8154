"""A reset after a restart: a second storage manager over the same persistent tier (file, nvme+slab,
Redis, Valkey, S3 on moto) clears a keyspace another process stored, found by listing the tier; another
keyspace's objects in the same tier stay. A listing that fails or hangs never fails the reset."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration._manager_helpers import SPEC, store_chunks
from tiercache._open import open_adapter
from tiercache.adapters._base import Adapter
from tiercache.adapters.memory import MemoryAdapter
from tiercache.config import ManagerConfig
from tiercache.events import Cleared, EventSink
from tiercache.serde import build_pipeline
from tiercache.store.control import LIST_DEADLINES, clear_keyspaces
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager
from tiercache.testing.fakes import FaultInjectingAdapter
from tiercache.testing.harness import s3 as s3_servers

POLICY = ManagerConfig(l2_deadline_s=5.0, lookup_deadline_s=5.0)
BUCKET = "reset-listing"
Opener = Callable[[], Awaitable[Adapter]]


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A moto server with the test bucket and dummy credentials; stopped by PID on leaving."""
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with s3_servers.aws_test_env(), s3_servers.moto_with_bucket(BUCKET, log) as server:
        yield server


@pytest.fixture(params=["file", "slab", "redis", "valkey", "s3"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    """Opens a new adapter on one persistent location (the same one on every call)."""
    kind, tag = request.param, uuid.uuid4().hex[:8]
    if kind == "file":
        return lambda: open_adapter(f"file://{tmp_path}/l2")
    if kind == "slab":
        return lambda: open_adapter(f"nvme+slab://{tmp_path}/slab?capacity=64MiB&max_object=1MiB")
    if kind in ("redis", "valkey"):
        server = request.getfixturevalue(f"{kind}_server")
        return lambda: open_adapter(f"{kind}://127.0.0.1:{server.port}/0", prefix=f"t{tag}:")
    moto = request.getfixturevalue("moto")
    url = f"s3://{BUCKET}/r{tag}"
    return lambda: open_adapter(url, endpoint_url=moto.endpoint, addressing_style="path")


def _manager(adapter: Adapter, policy: ManagerConfig = POLICY) -> StorageManager:
    return StorageManager(
        L1Cache(SPEC.nbytes * 16, SPEC.nbytes), [("l2", adapter, build_pipeline(["raw"]))], policy
    )


def _keyspaces() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:12]
    return f"tc1.{tag}a.", f"tc1.{tag}b."


@pytest.mark.asyncio
async def test_reset_after_restart_clears_what_an_earlier_process_stored(opener: Opener) -> None:
    """The second manager's sink saw nothing stored, yet the reset deletes every object of its keyspace
    (announced by the Cleared event alone) and leaves the other keyspace's objects."""
    mine, other = _keyspaces()
    ours, theirs = [f"{mine}{i:04x}" for i in range(5)], [f"{other}{i:04x}" for i in range(3)]
    first = _manager(await opener())
    try:
        await store_chunks(first, ours + theirs)
        assert all(h is not None and h.level > 0 for h in await first.batched_contains(ours, ["l2"]))
    finally:
        await first.aclose()

    second = _manager(await opener())
    sink = EventSink()
    detach = sink.attach(second)
    try:
        assert all(h is not None for h in await second.batched_contains(ours))  # found after the restart
        assert await clear_keyspaces(second, sink, [mine]) == len(ours)
        assert await second.batched_contains(ours) == [None] * len(ours)
        assert all(h is not None for h in await second.batched_contains(theirs))
        assert sink.take() == [Cleared()]
    finally:
        detach()
        await second.aclose()

    third = _manager(await opener())  # and the objects are gone from the backend, not only hidden
    try:
        assert await third.batched_contains(ours) == [None] * len(ours)
        assert all(h is not None for h in await third.batched_contains(theirs))
    finally:
        await third.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("hang", [False, True])
async def test_a_failed_listing_is_counted_and_the_reset_still_deletes_what_the_sink_saw(hang: bool) -> None:
    """A listing that raises or hangs is a counted tier error, bounded by LIST_DEADLINES deadlines; the
    keys the sink saw stored are deleted all the same and the reset returns normally."""
    policy = ManagerConfig(l2_deadline_s=0.05, lookup_deadline_s=0.05)
    faulty = FaultInjectingAdapter(MemoryAdapter(), fail_rate=1.0, fail_ops=frozenset({"list"}), hang=hang)
    manager = _manager(faulty, policy)
    sink = EventSink()
    detach = sink.attach(manager)
    mine, _ = _keyspaces()
    seen = [f"{mine}{i:04x}" for i in range(3)]
    unseen = f"{mine}ffff"
    try:
        await store_chunks(manager, seen)
        assert await faulty.wrapped.batched_put([unseen], [b"x"]) == [True]  # stored by someone else
        started = time.monotonic()
        deleted = await clear_keyspaces(manager, sink, [mine])
        assert time.monotonic() - started < policy.l2_deadline_s * LIST_DEADLINES + 2.0
        assert deleted == 2 * len(seen)  # L1 and the tier
        assert await faulty.wrapped.batched_contains([*seen, unseen]) == [False, False, False, True]
        assert manager.metrics.value("tiercache_tier_errors_total", tier="l2", op="list") == 1
        assert faulty.faults["hang" if hang else "error"] == 1
    finally:
        detach()
        await manager.aclose()


@pytest.mark.asyncio
async def test_a_reset_deletes_keys_in_batches() -> None:
    """More keys than one delete call carries: every one is listed and deleted."""
    adapter = MemoryAdapter()
    manager = _manager(adapter)
    sink = EventSink()
    mine, other = _keyspaces()
    keys = [f"{mine}{i:05x}" for i in range(2500)]
    try:
        assert await adapter.batched_put([*keys, f"{other}0"], [b"v"] * (len(keys) + 1)) == [True] * 2501
        assert await clear_keyspaces(manager, sink, [mine]) == len(keys)
        assert len(adapter) == 1
    finally:
        await manager.aclose()


@pytest.mark.asyncio
async def test_a_tier_back_after_a_failed_start_lists_through_its_stand_in() -> None:
    """A tier that was down at start lists nothing (and says so) until it is back, then lists its keys."""
    from tiercache.errors import AdapterUnavailable
    from tiercache.store._reopen import ReopeningAdapter

    inner = MemoryAdapter()
    assert await inner.batched_put(["ks.a", "ks.b", "other.c"], [b"1", b"2", b"3"]) == [True] * 3

    async def opener() -> Adapter:
        return inner

    stand_in = ReopeningAdapter("l2", opener, AdapterUnavailable("down"), first_delay_s=0.01)
    try:
        if not stand_in.up:
            assert not stand_in.capabilities.list_keys
        await asyncio.wait_for(stand_in.reopened.wait(), 5)
        assert stand_in.capabilities.list_keys
        assert sorted(k for batch in [b async for b in stand_in.iter_keys("ks.")] for k in batch) == [
            "ks.a",
            "ks.b",
        ]
    finally:
        await stand_in.aclose()


@pytest.mark.asyncio
async def test_s3_listing_follows_pages_and_skips_foreign_names(
    moto: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages of two keys: every key of a shard holding five is listed once; an object in the wrong shard or
    with a name that is no key is not listed."""
    from tiercache.adapters import s3

    monkeypatch.setattr(s3, "_LIST_PAGE", 2)
    tag = uuid.uuid4().hex[:8]
    url = f"s3://{BUCKET}/p{tag}"
    by_shard: dict[str, list[str]] = {}
    i = 0
    while not any(len(keys) >= 5 for keys in by_shard.values()):
        key = f"ks{tag}.{i:04x}"
        by_shard.setdefault(s3.object_name("", key).split("/")[0], []).append(key)
        i += 1
    keys = [k for group in by_shard.values() for k in group]
    adapter = await open_adapter(url, endpoint_url=moto.endpoint, addressing_style="path")
    try:
        assert await adapter.batched_put(keys, [b"v"] * len(keys)) == [True] * len(keys)
        shard = s3.object_name("", keys[0]).split("/")[0]
        wrong = next(s for s in by_shard if s != shard)
        raw = moto.boto3_client()
        raw.put_object(Bucket=BUCKET, Key=f"p{tag}/{wrong}/{keys[0]}", Body=b"misplaced")
        raw.put_object(Bucket=BUCKET, Key=f"p{tag}/{shard}/ks{tag}.bad#0", Body=b"not a key")
        listed = [k async for batch in adapter.iter_keys(f"ks{tag}.") for k in batch]
        assert sorted(listed) == sorted(keys)
    finally:
        await adapter.aclose()
