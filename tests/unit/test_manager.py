"""Storage manager: multi-tier prefixes, background stores, prefetch, deadlines, circuits, corrupt frames."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tiercache.adapters import Adapter
from tiercache.adapters.memory import MemoryAdapter
from tiercache.adapters.posix import PosixAdapter
from tiercache.config import ManagerConfig
from tiercache.serde import build_pipeline
from tiercache.spec import KVSpec
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import L1_TIER, StorageManager
from tiercache.testing.fakes import FakeClock, FaultInjectingAdapter

pytestmark = pytest.mark.asyncio

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", tokens=8)
POLICY = ManagerConfig(
    l2_deadline_s=0.5, lookup_deadline_s=0.2, store_queue_size=64, circuit_failures=2, circuit_cooldown_s=0.3
)
"""Short deadlines for the tests whose fakes hang or fail (a deadline must pass quickly)."""
ROOMY = dataclasses.replace(POLICY, l2_deadline_s=30.0, lookup_deadline_s=30.0)
"""For a real tier that must answer (its file I/O on a worker thread may take a loaded machine long)."""


def make_l1(slots: int = 32) -> L1Cache:
    return L1Cache(SPEC.nbytes * slots, SPEC.nbytes)


def payload(key: str) -> bytes:
    """Key-derived bytes, never all zeros."""
    seed = int.from_bytes(key.encode()[-4:].rjust(4, b"\x01"), "little")
    return bytes((seed * 31 + i * 7 + 1) % 251 + 1 for i in range(SPEC.nbytes))


async def put_all(manager: StorageManager, keys: Sequence[str]) -> None:
    objects = await manager.batched_allocate(keys, [SPEC] * len(keys))
    ready = []
    for key, obj in zip(keys, objects, strict=True):
        assert obj is not None
        obj.buffer()[:] = payload(key)
        ready.append(obj)
    await manager.batched_put(ready)


async def put_frames(tier: Adapter, keys: Sequence[str]) -> None:
    """Put each key's ``payload`` into ``tier`` as the raw pipeline's frame (stored by someone else)."""
    raw = build_pipeline(["raw"])
    frames = [raw.encode(payload(k), SPEC, k) for k in keys]
    assert await tier.batched_put(list(keys), frames) == [True] * len(keys)


def keys_of(n: int) -> list[str]:
    return [f"k{i:04d}" for i in range(n)]


@pytest_asyncio.fixture
async def posix_dir(tmp_path: Path) -> AsyncIterator[str]:
    yield f"file://{tmp_path}/l2"


async def test_store_then_fresh_node_restores_from_l2_bit_exact(posix_dir: str) -> None:
    raw = build_pipeline(["raw"])
    async with StorageManager(
        make_l1(), [("disk", await PosixAdapter.open(posix_dir), raw)], ROOMY
    ) as prefill:
        await put_all(prefill, keys_of(5))
        await prefill.drain()
        assert prefill.metrics.value("tiercache_stores_total", tier="disk") == 5
    async with StorageManager(
        make_l1(), [("disk", await PosixAdapter.open(posix_dir), raw)], ROOMY
    ) as decode:
        hit = await decode.lookup_prefix(keys_of(6), [SPEC] * 6)
        assert hit.chunks == 5
        assert hit.tiers == ("disk",) * 5
        leases = await decode.batched_get(keys_of(5), [SPEC] * 5)
        for key, lease in zip(keys_of(5), leases, strict=True):
            assert lease is not None
            assert bytes(lease.obj.buffer()) == payload(key)
            lease.release()
        assert (await decode.lookup_prefix(keys_of(5))).tiers == (L1_TIER,) * 5


async def test_multi_tier_prefix_stops_at_the_gap() -> None:
    raw = build_pipeline(["raw"])
    a, b = MemoryAdapter(), MemoryAdapter()
    keys = keys_of(5)
    frames = {k: raw.encode(payload(k), SPEC, k) for k in keys}
    await a.batched_put([keys[0], keys[1]], [frames[keys[0]], frames[keys[1]]])
    await b.batched_put([keys[3], keys[4]], [frames[keys[3]], frames[keys[4]]])
    async with StorageManager(make_l1(), [("a", a, raw), ("b", b, raw)], POLICY) as manager:
        hit = await manager.lookup_prefix(keys, prefetch=False)
        assert hit.chunks == 2  # hits {0, 1, 3, 4}: the prefix ends at chunk 2
        assert hit.tiers == ("a", "a")
        contains = await manager.batched_contains(keys)
        assert [h.tier if h else None for h in contains] == ["a", "a", None, "b", "b"]


async def test_lookup_prefixes_answers_each_list_as_lookup_prefix_would_in_one_query() -> None:
    raw = build_pipeline(["raw"])
    a = FaultInjectingAdapter(MemoryAdapter())  # no faults: counts the calls
    keys = keys_of(8)
    await put_frames(a, keys[4:6])
    async with StorageManager(make_l1(), [("a", a, raw)], POLICY) as manager:
        await put_all(manager, keys[:3])
        lists = [keys[:4], keys[4:8], [], keys[1:3], [keys[6], keys[4]]]
        contains = a.calls["contains"]
        got = await manager.lookup_prefixes(lists)
        assert a.calls["contains"] == contains + 1  # one query for every list
        assert [(h.chunks, h.tiers) for h in got] == [
            (3, (L1_TIER,) * 3),
            (2, ("a", "a")),
            (0, ()),
            (2, (L1_TIER,) * 2),
            (0, ()),  # its first key is nowhere: no prefix, though its second is in "a"
        ]
        for keys_, hit in zip(lists, got, strict=True):
            assert hit == await manager.lookup_prefix(keys_, prefetch=False)
        paired = await manager.lookup_prefixes([keys[:4], keys[2:6]], group=2)  # a chunk = a key pair
        assert [h.chunks for h in paired] == [1, 0]  # (k0,k1) whole, (k2,k3) not: k3 is nowhere
        with pytest.raises(ValueError, match="groups of 2"):
            await manager.lookup_prefixes([keys[:3]], group=2)


async def test_l1_first_then_l2_in_order() -> None:
    raw = build_pipeline(["raw"])
    a, b = MemoryAdapter(), MemoryAdapter()
    keys = keys_of(3)
    await put_frames(b, keys)
    await put_frames(a, keys[1:2])
    async with StorageManager(make_l1(), [("a", a, raw), ("b", b, raw)], POLICY) as manager:
        await put_all(manager, keys[:1])
        hit = await manager.lookup_prefix(keys, prefetch=False)
        assert hit.tiers == (L1_TIER, "a", "b")


async def test_dead_tier_is_a_miss_within_the_deadline_and_opens_the_circuit() -> None:
    raw = build_pipeline(["raw"])
    dead = FaultInjectingAdapter(hang=True)
    clock = FakeClock()
    async with StorageManager(make_l1(), [("dead", dead, raw)], POLICY, clock=clock) as manager:
        hit = await manager.lookup_prefix(keys_of(4))  # the call hangs forever: only the deadline ends it
        assert hit.chunks == 0
        assert dead.faults["hang"] == 1
        await manager.lookup_prefix(keys_of(4))  # second failure opens the circuit
        assert manager.metrics.value("tiercache_circuit_open", tier="dead") == 1
        calls = dead.calls["contains"]
        assert (await manager.lookup_prefix(keys_of(4))).chunks == 0
        assert dead.calls["contains"] == calls  # open circuit: no call at all
        assert manager.metrics.value("tiercache_tier_errors_total", tier="dead", op="contains") == 2
        # The tier recovers: before the cool-down no call goes out; after it one probe closes the circuit.
        dead.hang = False
        clock.now += POLICY.circuit_cooldown_s / 2
        await manager.lookup_prefix(keys_of(4))
        assert dead.calls["contains"] == calls
        clock.now += POLICY.circuit_cooldown_s
        await manager.lookup_prefix(keys_of(4))
        assert dead.calls["contains"] == calls + 1
        assert manager.metrics.value("tiercache_circuit_open", tier="dead") == 0


async def test_failing_tier_errors_are_misses_not_exceptions() -> None:
    raw = build_pipeline(["raw"])
    broken = FaultInjectingAdapter(fail_rate=1.0)
    async with StorageManager(make_l1(), [("broken", broken, raw)], POLICY) as manager:
        await put_all(manager, keys_of(3))
        await manager.drain()
        assert manager.metrics.value("tiercache_stores_dropped_total", tier="broken", reason="failed") == 3
        leases = await manager.batched_get(keys_of(4))
        assert [lease is not None for lease in leases] == [True, True, True, False]
        for lease in leases:
            if lease is not None:
                lease.release()


async def test_a_failed_store_leaves_no_visible_object() -> None:
    raw = build_pipeline(["raw"])
    inner = MemoryAdapter()
    flaky = FaultInjectingAdapter(inner, fail_rate=1.0, fail_ops=frozenset({"put"}))
    async with StorageManager(make_l1(), [("flaky", flaky, raw)], POLICY) as manager:
        await put_all(manager, keys_of(2))
        await manager.drain()
        assert await inner.batched_contains(keys_of(2)) == [False, False]
        assert manager.metrics.value("tiercache_stores_dropped_total", tier="flaky", reason="failed") == 2


async def test_corrupt_frame_is_a_miss_and_ends_the_prefix() -> None:
    raw = build_pipeline(["raw"])
    keys = keys_of(3)
    corrupting = FaultInjectingAdapter(await stored_in_memory(3))
    async with StorageManager(make_l1(), [("bad", corrupting, raw)], POLICY) as manager:
        assert (await manager.lookup_prefix(keys, prefetch=False)).chunks == 3
        corrupting.corrupt_rate = 1.0
        leases = await manager.batched_get(keys, [SPEC] * 3)
        assert leases == [None, None, None]
        assert manager.metrics.value("tiercache_frames_rejected_total", tier="bad") == 3
        assert not manager.l1.contains(keys[0])


async def test_frame_stored_under_another_key_is_rejected() -> None:
    raw = build_pipeline(["raw"])
    inner = MemoryAdapter()
    await inner.batched_put(["victim"], [raw.encode(payload("other"), SPEC, "other")])
    async with StorageManager(make_l1(), [("m", inner, raw)], POLICY) as manager:
        assert await manager.batched_get(["victim"]) == [None]
        assert manager.metrics.value("tiercache_frames_rejected_total", tier="m") == 1


class _Blocking(MemoryAdapter):
    """Puts never finish (until cancelled): the store queue fills up."""

    async def batched_put(
        self, keys: Sequence[str], values: Sequence[bytes | bytearray | memoryview]
    ) -> list[bool]:
        await asyncio.Event().wait()
        return []


async def test_full_store_queue_drops_and_counts_without_blocking() -> None:
    raw = build_pipeline(["raw"])
    policy = ManagerConfig(l2_deadline_s=30.0, lookup_deadline_s=0.2, store_queue_size=2)
    async with StorageManager(make_l1(), [("slow", _Blocking(), raw)], policy, store_batch=1) as manager:
        for key in keys_of(10):
            completes_without_suspending(put_all(manager, [key]))  # a put that waited would suspend here
        dropped = manager.metrics.value("tiercache_stores_dropped_total", tier="slow", reason="queue_full")
        assert dropped >= 10 - 2 - policy.store_parallel  # queue of 2, a batch in flight per worker
        assert manager.l1.contains("k0009")  # L1 still has everything


async def test_l1_under_pressure_refuses_cleanly() -> None:
    async with StorageManager(make_l1(slots=2), [], POLICY) as manager:
        keys = keys_of(3)
        objs = await manager.batched_allocate(keys[:2], [SPEC, SPEC])
        assert all(o is not None for o in objs)
        assert await manager.batched_allocate(keys[2:], [SPEC]) == [None]  # both slots still being written
        assert manager.metrics.value("tiercache_l1_alloc_failures_total") == 1


async def test_metrics_render_prometheus_text() -> None:
    async with StorageManager(
        make_l1(), [("m", MemoryAdapter(), build_pipeline(["raw"]))], POLICY
    ) as manager:
        await manager.lookup_prefix(keys_of(2))
        text = manager.metrics.render()
        assert "tiercache_misses_total" in text
        assert 'tiercache_tier_latency_seconds_bucket{le="0.0005",op="contains",tier="m"}' in text


async def test_open_from_config(tmp_path: Path) -> None:
    from tiercache.config import config_from_dict

    config = config_from_dict(
        {"l1": {"capacity": SPEC.nbytes * 4}, "tiers": [{"name": "d", "url": f"file://{tmp_path}/d"}]}
    )
    manager = await StorageManager.open(config, SPEC.nbytes)
    try:
        assert [t.name for t in manager.tiers] == ["d"]
        assert isinstance(manager.tiers[0].adapter, Adapter)
        assert manager.l1.num_slots == 4
    finally:
        await manager.aclose()
        await manager.aclose()
    assert (tmp_path / "d").is_dir()


def completes_without_suspending(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` one step: it must finish without ever waiting on anything."""
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    pytest.fail("the coroutine suspended (it waited on something)")


async def test_cancelled_half_open_probe_does_not_keep_the_circuit_open() -> None:
    """A probe cancelled by its caller is resolved; the circuit closes after a cool-down."""
    raw = build_pipeline(["raw"])
    tier = FaultInjectingAdapter(await stored_in_memory(1), fail_rate=1.0, fail_ops=frozenset({"contains"}))
    clock = FakeClock()
    policy = ManagerConfig(
        l2_deadline_s=60, lookup_deadline_s=60, store_queue_size=8, circuit_failures=1, circuit_cooldown_s=5
    )
    async with StorageManager(make_l1(), [("t", tier, raw)], policy, clock=clock) as manager:
        assert await manager.batched_contains(["k0000"]) == [None]  # the failure opens the circuit
        assert manager.metrics.value("tiercache_circuit_open", tier="t") == 1
        clock.now += 6  # cool-down over: the next call is the probe; it hangs and its caller gives up
        tier.fail_rate, tier.hang = 0.0, True
        probe = asyncio.ensure_future(manager.batched_contains(["k0000"]))
        for _ in range(100):
            if tier.faults["hang"]:
                break
            await asyncio.sleep(0)
        assert tier.faults["hang"] == 1
        probe.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probe
        tier.hang = False  # the tier is healthy again
        calls = tier.calls["contains"]
        clock.now += 6
        hits = await manager.batched_contains(["k0000"])
        assert tier.calls["contains"] == calls + 1, "no probe reached the healthy tier"
        assert [h.tier if h else None for h in hits] == ["t"]
        assert manager.metrics.value("tiercache_circuit_open", tier="t") == 0
        assert [h.tier if h else None for h in await manager.batched_contains(["k0000"])] == ["t"]


class SlowPuts(MemoryAdapter):
    """Puts land only when the test opens the gate, and cannot be stopped once started (like a thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def batched_put(
        self, keys: Sequence[str], values: Sequence[bytes | bytearray | memoryview]
    ) -> list[bool]:
        await asyncio.shield(self.gate.wait())
        return await super().batched_put(keys, values)


async def test_store_past_its_deadline_is_counted_when_it_lands() -> None:
    """A put that outlives the deadline but lands is counted stored, not failed."""
    raw = build_pipeline(["raw"])
    slow = SlowPuts()
    policy = ManagerConfig(l2_deadline_s=0.01, lookup_deadline_s=1, store_queue_size=8, circuit_failures=5)
    async with StorageManager(make_l1(), [("slow", slow, raw)], policy) as manager:
        await put_all(manager, keys_of(2))
        await asyncio.gather(*manager.tiers[0].workers)  # the put timed out at its deadline; still pending
        assert manager.metrics.value("tiercache_stores_total", tier="slow") == 0
        assert len(manager.tiers[0].late) == 1
        slow.gate.set()
        (late,) = manager.tiers[0].late
        await late
        assert await slow.batched_contains(keys_of(2)) == [True, True]
        assert manager.metrics.value("tiercache_stores_total", tier="slow") == 2
        assert manager.metrics.value("tiercache_stores_dropped_total", tier="slow", reason="failed") == 0


class FailsToEncode:
    """A codec pipeline that raises for one key (a codec bug) and encodes the others with ``raw``."""

    def __init__(self, *bad_keys: str) -> None:
        self.raw = build_pipeline(["raw"])
        self.bad_keys = set(bad_keys)

    def encode(self, data: object, spec: KVSpec, key: str) -> bytearray:
        if key in self.bad_keys:
            raise RuntimeError("codec bug")
        return self.raw.encode(data, spec, key)  # type: ignore[arg-type]

    def encode_into(self, data: object, spec: KVSpec, key: str, dst: object) -> int:
        if key in self.bad_keys:
            raise RuntimeError("codec bug")
        return self.raw.encode_into(data, spec, key, dst)

    def __getattr__(self, name: str) -> object:
        return getattr(self.raw, name)


async def test_store_worker_survives_a_codec_exception(caplog: pytest.LogCaptureFixture) -> None:
    """A codec exception no longer kills the store worker or strands leases."""
    inner = MemoryAdapter()
    pipeline = FailsToEncode("k0000", "k0002")
    async with StorageManager(
        make_l1(),
        [("t", inner, pipeline)],
        POLICY,
        store_batch=1,  # type: ignore[list-item]
    ) as manager:
        await put_all(manager, keys_of(4))
        await manager.drain()
        assert await inner.batched_contains(keys_of(4)) == [False, True, False, True]
        assert manager.metrics.value("tiercache_stores_dropped_total", tier="t", reason="error") == 2
        assert manager.metrics.value("tiercache_stores_total", tier="t") == 2
        for key in keys_of(4):  # every lease was released
            assert not manager.l1._objects[key]._leases, f"{key} still leased"
        await put_all(manager, ["k0009"])
        await manager.drain()
        assert await inner.batched_contains(["k0009"]) == [True]
    assert sum("codec bug" in r.getMessage() for r in caplog.records) == 1  # logged once, then counted


async def test_posix_stores_past_the_deadline_stay_within_capacity_and_are_counted(tmp_path: Path) -> None:
    """Through the manager: stores cut off by the deadline land on a POSIX tier; the tier stays
    within its capacity and the manager counts as stored at least every object that is on disk."""
    capacity = 8 * SPEC.nbytes
    tier = await PosixAdapter.open(f"file://{tmp_path}/l2", capacity=capacity, fsync=True)  # slow writes
    policy = ManagerConfig(
        l2_deadline_s=1e-3, lookup_deadline_s=1, store_queue_size=64, circuit_failures=10**6
    )
    manager = StorageManager(make_l1(64), [("disk", tier, build_pipeline(["raw"]))], policy, store_batch=1)
    for start in range(0, 40, 8):
        await put_all(manager, keys_of(40)[start : start + 8])
        await manager.drain()
    await manager.aclose()
    files = [p for p in (tmp_path / "l2").rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert sum(p.stat().st_size for p in files) <= capacity
    stored = manager.metrics.value("tiercache_stores_total", tier="disk")
    failed = manager.metrics.value("tiercache_stores_dropped_total", tier="disk", reason="failed")
    assert stored >= len(files) > 0, f"{len(files)} objects on disk, {stored} counted stored, {failed} failed"


# ----- sessions, reuse of a lookup, batched decode, contract surface ---------------------------------------


async def test_writing_session_publishes_on_exit_and_aborts_on_error() -> None:
    raw = build_pipeline(["raw"])
    tier = MemoryAdapter()
    async with StorageManager(make_l1(slots=2), [("m", tier, raw)], POLICY) as manager:
        keys = keys_of(2)

        async def failing_gather() -> None:
            async with manager.writing(keys, [SPEC, SPEC]) as objects:
                assert all(obj is not None for obj in objects)
                raise RuntimeError("gather failed")

        with pytest.raises(RuntimeError, match="gather failed"):
            await failing_gather()
        assert manager.l1.batched_contains(keys) == [False, False]  # nothing half-written is visible
        async with manager.writing(keys, [SPEC, SPEC]) as objects:  # both slots were given back
            for key, obj in zip(keys, objects, strict=True):
                assert obj is not None
                obj.buffer()[:] = payload(key)
        assert manager.l1.batched_contains(keys) == [True, True]
        await manager.drain()
        assert await tier.batched_contains(keys) == [True, True]
        async with manager.writing(keys, [SPEC, SPEC]) as again:
            assert again == [None, None]  # already stored: nothing to write


async def test_batched_get_reuses_the_lookup_hits_without_asking_l2_again() -> None:
    raw = build_pipeline(["raw"])
    keys = keys_of(3)
    tier = FaultInjectingAdapter(await stored_in_memory(3))
    async with StorageManager(make_l1(), [("t", tier, raw)], POLICY) as manager:
        hit = await manager.lookup_prefix(keys, [SPEC] * 3, prefetch=False)
        assert hit.chunks == 3
        assert [h.tier if h else None for h in hit.hits] == ["t"] * 3
        contains = tier.calls["contains"]
        leases = await manager.batched_get(keys, [SPEC] * 3, hits=hit.hits)
        assert tier.calls["contains"] == contains  # the lookup's answer was reused
        assert [bytes(lease.obj.buffer()) if lease else None for lease in leases] == [
            payload(k) for k in keys
        ]
        for lease in leases:
            assert lease is not None
            lease.release()
        with pytest.raises(ValueError, match="2 hits for 3 keys"):
            await manager.batched_get(keys, [SPEC] * 3, hits=hit.hits[:2])


async def test_each_frame_is_decoded_in_one_executor_job_with_one_header_parse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tiercache.serde.pipeline as pipeline_module

    raw = build_pipeline(["raw"])
    tier = MemoryAdapter()
    keys = keys_of(4)
    frames = [raw.encode(payload(k), SPEC, k) for k in keys]
    frames[2] = bytearray(frames[2])
    frames[2][-1] ^= 0xFF  # corrupt: a miss, counted, the prefix ends there
    await tier.batched_put(keys, frames)
    parses_in_pipeline = 0
    real_read_header = pipeline_module.read_header

    def counting_read_header(frame: object) -> Any:
        nonlocal parses_in_pipeline
        parses_in_pipeline += 1
        return real_read_header(frame)

    monkeypatch.setattr(pipeline_module, "read_header", counting_read_header)
    async with StorageManager(make_l1(), [("m", tier, raw)], POLICY) as manager:
        jobs = 0
        real_run = manager.prefetch._run

        async def counting_run(fn: Any) -> Any:
            nonlocal jobs
            jobs += 1
            return await real_run(fn)

        monkeypatch.setattr(manager.prefetch, "_run", counting_run)
        loaded = await manager.start_prefetch(keys, ["m"] * 4, [SPEC] * 4)
        assert loaded == 2
        assert jobs == 4  # streaming reads: each frame decodes as it lands, one job each (the bad one too)
        assert parses_in_pipeline == 0  # the manager's parse is handed to the pipeline
        assert manager.l1.batched_contains(keys) == [True, True, False, True]
        assert manager.metrics.value("tiercache_frames_rejected_total", tier="m") == 1
        assert manager.metrics.value("tiercache_prefetched_total", tier="m") == 3


class SmallValues(MemoryAdapter):
    """An in-memory tier whose values are limited to one byte less than a raw frame of SPEC."""

    capabilities = dataclasses.replace(
        MemoryAdapter.capabilities,
        max_value_bytes=len(build_pipeline(["raw"]).encode(bytes(SPEC.nbytes), SPEC, "k")) - 1,
    )

    def __init__(self) -> None:
        super().__init__()
        self.put_keys: list[str] = []

    async def batched_put(
        self, keys: Sequence[str], values: Sequence[bytes | bytearray | memoryview]
    ) -> list[bool]:
        self.put_keys.extend(keys)
        return await super().batched_put(keys, values)


async def test_a_frame_over_the_tiers_max_value_bytes_is_skipped_and_counted_not_sent() -> None:
    raw = build_pipeline(["raw"])
    small, roomy = SmallValues(), MemoryAdapter()
    async with StorageManager(make_l1(), [("small", small, raw), ("roomy", roomy, raw)], POLICY) as manager:
        await put_all(manager, keys_of(3))
        await manager.drain()
        assert small.put_keys == []
        assert manager.metrics.value("tiercache_stores_dropped_total", tier="small", reason="too_large") == 3
        assert manager.metrics.value("tiercache_stores_total", tier="roomy") == 3
        assert await roomy.batched_contains(keys_of(3)) == [True] * 3


# ----- streaming L2 reads: chunk gets in prefix order, a deadline scaled with the bytes keeps what landed ---


class GatedAdapter(FaultInjectingAdapter):
    """Fault injection: each key's get waits until the test opens its gate; records the order of requests."""

    def __init__(self, inner: MemoryAdapter) -> None:
        super().__init__(inner)
        self.gates: dict[str, asyncio.Event] = {}
        self.requested: list[str] = []
        self.in_flight: set[str] = set()

    async def batched_get(self, keys: Sequence[str]) -> list[bytes | None]:  # type: ignore[override]
        for key in keys:
            self.requested.append(key)
            self.in_flight.add(key)
        try:
            for key in keys:
                await self.gates.setdefault(key, asyncio.Event()).wait()
        finally:
            self.in_flight.difference_update(keys)
        return await super().batched_get(keys)  # type: ignore[return-value]


class ManualTimer:
    """An injected deadline: records each requested duration and ends only when the test fires it."""

    def __init__(self) -> None:
        self.asked: list[float] = []
        self.fired = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.asked.append(seconds)
        await self.fired.wait()


async def until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` while the loop (and the codec threads) run; bounded: a stuck condition fails."""
    for i in range(20_000):
        if condition():
            return
        await asyncio.sleep(0 if i < 1000 else 0.001)
    raise AssertionError("condition never held")


STREAM_POLICY = ManagerConfig(
    l2_deadline_s=0.5, lookup_deadline_s=5.0, l2_read_floor_s=30.0, l2_read_mib_per_s=2.0, l2_read_parallel=2
)


async def stored_in_memory(n: int) -> MemoryAdapter:
    """A memory tier holding the frames of ``keys_of(n)``."""
    tier = MemoryAdapter()
    await put_frames(tier, keys_of(n))
    return tier


async def test_streaming_read_keeps_the_prefix_that_landed_by_the_deadline() -> None:
    inner = await stored_in_memory(6)
    slow = GatedAdapter(inner)
    timer = ManualTimer()
    async with StorageManager(
        make_l1(), [("mem", slow, build_pipeline(["raw"]))], STREAM_POLICY, read_timer=timer
    ) as reader:
        keys = keys_of(6)
        got = asyncio.ensure_future(reader.batched_get(keys, [SPEC] * 6))
        await until(lambda: bool(timer.asked))
        # the deadline scales with the bytes asked for: floor + bytes / (MiB/s * 2**20)
        assert timer.asked == [pytest.approx(30.0 + 6 * SPEC.nbytes / (2.0 * 2**20))]
        for key in ("k0000", "k0001", "k0002", "k0004"):
            slow.gates.setdefault(key, asyncio.Event()).set()
        await until(lambda: all(reader.l1.contains(k) for k in ("k0000", "k0001", "k0002", "k0004")))
        assert not reader.l1.contains("k0003")
        timer.fired.set()  # the deadline passes with k0003 and k0005 still outstanding
        leases = await got
        assert [lease is not None for lease in leases] == [True, True, True, False, False, False]
        for key, lease in zip(keys, leases[:3], strict=False):
            assert lease is not None
            assert bytes(lease.obj.buffer()) == payload(key)
            lease.release()
        assert not slow.in_flight  # the outstanding gets were cancelled, not left running
        assert reader.metrics.value("tiercache_tier_errors_total", tier="mem", op="get") == 1


async def test_streaming_read_requests_chunks_in_prefix_order_with_bounded_parallelism() -> None:
    inner = await stored_in_memory(5)
    slow = GatedAdapter(inner)
    timer = ManualTimer()
    async with StorageManager(
        make_l1(), [("mem", slow, build_pipeline(["raw"]))], STREAM_POLICY, read_timer=timer
    ) as reader:
        got = asyncio.ensure_future(reader.batched_get(keys_of(5), [SPEC] * 5))
        await until(lambda: len(slow.requested) == 2)
        assert slow.requested == ["k0000", "k0001"]  # l2_read_parallel = 2, earliest chunks first
        slow.gates.setdefault("k0001", asyncio.Event()).set()
        await until(lambda: len(slow.requested) == 3)
        assert slow.requested[2] == "k0002"
        await until(lambda: reader.l1.contains("k0001"))  # landed out of order: in L1 at once
        assert not reader.l1.contains("k0000")
        for key in keys_of(5):
            slow.gates.setdefault(key, asyncio.Event()).set()
        leases = await got
        assert all(lease is not None for lease in leases)
        assert slow.requested == keys_of(5)
        for lease in leases:
            assert lease is not None
            lease.release()
        assert reader.metrics.value("tiercache_tier_errors_total", tier="mem", op="get") == 0


class GatedPuts(MemoryAdapter):
    """Puts wait for the test's gate; records how many are in flight at once."""

    def __init__(self, reach: int) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.reached = asyncio.Event()
        self.reach = reach
        self.in_flight = 0
        self.peak = 0

    async def batched_put(
        self, keys: Sequence[str], values: Sequence[bytes | bytearray | memoryview]
    ) -> list[bool]:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        if self.in_flight >= self.reach:
            self.reached.set()
        try:
            await self.gate.wait()
            return await super().batched_put(keys, values)
        finally:
            self.in_flight -= 1


async def test_background_puts_to_one_tier_run_concurrently_up_to_store_parallel() -> None:
    tier = GatedPuts(reach=3)
    policy = ManagerConfig(l2_deadline_s=30.0, lookup_deadline_s=1.0, store_queue_size=16, store_parallel=3)
    tiers = [("g", tier, build_pipeline(["raw"]))]
    async with StorageManager(make_l1(), tiers, policy, store_batch=1) as manager:
        keys = keys_of(7)
        await put_all(manager, keys)
        await asyncio.wait_for(tier.reached.wait(), 30)  # a deadlock guard: 3 puts in flight at once
        tier.gate.set()
        await manager.drain()
        assert tier.peak == 3  # never more than store_parallel
        frames = await tier.batched_get(keys)
        assert all(f is not None and bytes(f).endswith(payload(k)) for f, k in zip(frames, keys, strict=True))
        assert manager.metrics.value("tiercache_stores_total", tier="g") == 7
