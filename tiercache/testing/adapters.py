"""``AdapterConformance``: the pytest suite every L2 adapter must pass (zarr ``StoreTests`` style).

Subclass it in a ``Test*`` class and provide one fixture, ``adapter_factory``: an async callable that opens a
new adapter on the SAME underlying location each time it is called (so persistence across reopen can be
tested)::

    class TestMyAdapter(AdapterConformance):
        @pytest.fixture
        def adapter_factory(self, tmp_path):
            return lambda: MyAdapter.open(f"my:///{tmp_path}")

Optional class attributes: ``max_object_bytes`` (largest value tested, default 64 MiB) and
``supports_concurrent_overwrite`` (default True; False skips the overwrite-while-reading check). Tests use
fresh random keys, so the location need not be empty. Works under pytest-asyncio strict and auto modes.

An adapter that declares ``capabilities.list_keys`` is held to ``iter_keys`` (``test_iter_keys``): exactly the
keys under a prefix, each once, none of a neighbouring prefix, a deleted key no more, and (persistent ones)
what an earlier opening stored; one that does not must raise ``Unsupported``.

Cancellation is a normal path (the manager's deadlines, callers giving up), so the kit cancels puts and gets
at random points (``test_cancelled_calls_leave_the_adapter_consistent``): afterwards every key must hold its
old value, the new value or nothing; the adapter must stay within its capacity (``used_bytes`` against
``capacity`` where the adapter has them, and the hook ``stored_bytes`` where a subclass can measure the
medium itself); and no reservation may leak (fresh puts of twice the capacity's worth still succeed). It
opens its adapter through the optional fixture ``bounded_adapter_factory`` (default: ``adapter_factory``);
override it to open the same kind of store with a small capacity (a few MiB), so leaks show quickly.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, ClassVar, TypeVar

import pytest
import pytest_asyncio

from tiercache.adapters._base import Adapter, Buffer, Capabilities
from tiercache.errors import AdapterUnavailable, Unsupported

__all__ = ["AdapterConformance", "AdapterFactory", "unique_keys"]

_T = TypeVar("_T")

AdapterFactory = Callable[[], Awaitable[Adapter]]
"""Opens a new adapter on the location under test (the same one on every call)."""

_ROUND_TRIP_SIZES = [0, 1, 4095, 4096, (1 << 20) + 7, "max"]
_TORN_READ_BYTES = 16 << 20


def unique_keys(n: int, tag: str = "k") -> list[str]:
    """``n`` keys no other call returns (``tag``, a random part, ``-i``): tests on one server never meet."""
    prefix = uuid.uuid4().hex[:16]
    return [f"{tag}{prefix}-{i}" for i in range(n)]


def _value(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _same(got: Buffer | None, expected: bytes) -> bool:
    return got is not None and len(got) == len(expected) and bytes(got) == expected


def _describe(got: Buffer | None, expected: bytes) -> str:
    if got is None:
        return f"None instead of {len(expected)} bytes"
    return f"{len(got)} bytes that differ from the {len(expected)} bytes expected"


async def _cancel_randomly(call: Coroutine[Any, Any, _T], rng: random.Random) -> _T | None:
    """Run ``call`` and cancel it at a random point (0-5 loop iterations in, or part-way through I/O);
    its result if it finished first, else None."""
    task = asyncio.ensure_future(call)
    for _ in range(rng.randrange(6)):
        await asyncio.sleep(0)
    if rng.random() < 0.25:
        await asyncio.sleep(rng.random() * 0.003)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return None


async def _listed(adapter: Adapter, prefix: str) -> list[str]:
    """Every key ``iter_keys(prefix)`` yields, in order, batches joined; each batch must be a list of str."""
    out: list[str] = []
    async for batch in adapter.iter_keys(prefix):
        assert isinstance(batch, list), f"iter_keys yielded {type(batch).__name__}, not a list of keys"
        assert all(isinstance(k, str) for k in batch), f"iter_keys yielded non-str keys: {batch[:3]!r}"
        out += batch
    return out


def _key_prefix(keys: list[str]) -> str:
    """The prefix ``_keys`` gave every key of one call (up to and including the ``-``)."""
    return keys[0].rsplit("-", 1)[0] + "-"


async def _put_patiently(adapter: Adapter, key: str, value: bytes) -> bool:
    """Put ``value``; a refusal is retried for about a second (a cancelled put may still be landing and
    hold its space: busy, not leaked). True once stored."""
    for _ in range(100):
        if await adapter.batched_put([key], [value]) == [True]:
            return True
        await asyncio.sleep(0.01)
    return False


class AdapterConformance:
    """Conformance tests for one ``Adapter``; subclasses provide the ``adapter_factory`` fixture."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.asyncio]

    max_object_bytes: ClassVar[int] = 64 * 2**20
    """Largest value size the round-trip test uses."""
    supports_concurrent_overwrite: ClassVar[bool] = True
    """Whether a put over an existing key may race with readers (False skips that part of the check)."""

    @pytest.fixture
    def adapter_factory(self) -> AdapterFactory:
        """Override in the subclass: return an async callable opening an adapter on one fixed location."""
        pytest.fail(f"{type(self).__name__} must define the 'adapter_factory' fixture")

    @pytest.fixture
    def bounded_adapter_factory(self, adapter_factory: AdapterFactory) -> AdapterFactory:
        """Override to open the store with a small capacity for the cancellation test (default: as usual)."""
        return adapter_factory

    async def stored_bytes(self, adapter: Adapter) -> int | None:
        """Override where the medium can be measured directly (e.g. files on disk): bytes it holds now,
        checked against the adapter's ``capacity`` after the cancellation test. Default: not measured."""
        return None

    @pytest_asyncio.fixture
    async def adapter(self, adapter_factory: AdapterFactory) -> AsyncIterator[Adapter]:
        """An opened adapter, closed after the test."""
        opened = await adapter_factory()
        try:
            yield opened
        finally:
            await opened.aclose()

    # -- identity ---------------------------------------------------------------------------------------

    async def test_scheme_and_capabilities(self, adapter: Adapter) -> None:
        """``scheme`` is a non-empty str and ``capabilities`` a Capabilities."""
        assert isinstance(adapter.scheme, str)
        assert adapter.scheme
        assert isinstance(adapter.capabilities, Capabilities)

    # -- basic operations -------------------------------------------------------------------------------

    async def test_contains_on_empty(self, adapter: Adapter) -> None:
        """Keys never written are absent, and an empty batch gives empty results."""
        keys = unique_keys(5)
        assert await adapter.batched_contains(keys) == [False] * 5
        assert list(await adapter.batched_get(keys)) == [None] * 5
        assert await adapter.batched_contains([]) == []
        assert list(await adapter.batched_get([])) == []
        assert await adapter.batched_put([], []) == []

    @pytest.mark.parametrize("size", _ROUND_TRIP_SIZES, ids=lambda s: f"size={s}")
    async def test_round_trip(self, adapter: Adapter, size: int | str) -> None:
        """put, contains, get return exactly the bytes written (random content)."""
        n = self.max_object_bytes if size == "max" else int(size)
        (key,) = unique_keys(1)
        value = _value(n, seed=n)
        assert await adapter.batched_put([key], [value]) == [True]
        assert await adapter.batched_contains([key]) == [True]
        (got,) = await adapter.batched_get([key])
        assert _same(got, value), _describe(got, value)

    async def test_put_accepts_buffer_types_and_copies(self, adapter: Adapter) -> None:
        """bytearray and memoryview values are stored by value: later changes to them are not seen."""
        k1, k2 = unique_keys(2)
        a = bytearray(_value(1000, 1))
        b = bytearray(_value(1000, 2))
        expected_a, expected_b = bytes(a), bytes(b)
        assert await adapter.batched_put([k1, k2], [a, memoryview(b)]) == [True, True]
        a[:] = b"\0" * len(a)
        b[:] = b"\0" * len(b)
        got_a, got_b = await adapter.batched_get([k1, k2])
        assert _same(got_a, expected_a), _describe(got_a, expected_a)
        assert _same(got_b, expected_b), _describe(got_b, expected_b)

    async def test_batch_positional_order(self, adapter: Adapter) -> None:
        """Results follow the order of the keys asked for, not the order of writing."""
        keys = unique_keys(20)
        values = [_value(100 + 37 * i, seed=i) for i in range(20)]
        assert await adapter.batched_put(keys, values) == [True] * 20
        order = list(range(20))
        random.Random(7).shuffle(order)
        got = await adapter.batched_get([keys[i] for i in order])
        assert len(got) == 20
        for pos, i in enumerate(order):
            assert _same(got[pos], values[i]), f"position {pos} (key {i}): {_describe(got[pos], values[i])}"

    async def test_length_mismatch(self, adapter: Adapter) -> None:
        """put with different numbers of keys and values raises ValueError and stores nothing."""
        k1, k2 = unique_keys(2)
        with pytest.raises(ValueError, match=r"(?i)length|mismatch|values"):
            await adapter.batched_put([k1, k2], [b"x"])
        with pytest.raises(ValueError, match=r"(?i)length|mismatch|values"):
            await adapter.batched_put([k1], [b"x", b"y"])
        assert await adapter.batched_contains([k1, k2]) == [False, False]

    async def test_mixed_hits_and_misses(self, adapter: Adapter) -> None:
        """Misses are None/False in place, never an exception, in a batch mixing hits and misses."""
        keys = unique_keys(8)
        hits = keys[::2]
        values = {k: _value(64 + i, seed=i) for i, k in enumerate(hits)}
        assert await adapter.batched_put(hits, list(values.values())) == [True] * len(hits)
        assert await adapter.batched_contains(keys) == [k in values for k in keys]
        got = await adapter.batched_get(keys)
        for k, g in zip(keys, got, strict=True):
            if k in values:
                assert _same(g, values[k]), f"{k}: {_describe(g, values[k])}"
            else:
                assert g is None, f"{k} was never written but returned {len(g)} bytes"

    async def test_overwrite(self, adapter: Adapter) -> None:
        """Each overwrite is seen by the next get and contains (no stale value, no stale size)."""
        (key,) = unique_keys(1)
        for i, size in enumerate([1000, 70_000, 10, 1 << 20, 0, 4096, 3]):
            value = _value(size, seed=100 + i)
            assert await adapter.batched_put([key], [value]) == [True]
            assert await adapter.batched_contains([key]) == [True]
            (got,) = await adapter.batched_get([key])
            assert _same(got, value), f"after overwrite #{i}: {_describe(got, value)}"

    async def test_delete(self, adapter: Adapter) -> None:
        """Delete removes only the named keys and reports whether each existed (or raises Unsupported)."""
        keys = unique_keys(3)
        values = [_value(500 + i, seed=i) for i in range(3)]
        assert await adapter.batched_put(keys, values) == [True] * 3
        if not adapter.capabilities.delete:
            with pytest.raises(Unsupported):
                await adapter.batched_delete(keys[:1])
            return
        (missing,) = unique_keys(1, tag="m")
        assert await adapter.batched_delete([keys[1], missing]) == [True, False]
        assert await adapter.batched_contains(keys) == [True, False, True]
        got = await adapter.batched_get(keys)
        assert got[1] is None
        assert _same(got[0], values[0]), _describe(got[0], values[0])
        assert _same(got[2], values[2]), _describe(got[2], values[2])
        assert await adapter.batched_delete([keys[1]]) == [False]
        assert await adapter.batched_delete([]) == []

    async def test_iter_keys(self, adapter: Adapter) -> None:
        """Where ``capabilities.list_keys``: ``iter_keys(prefix)`` yields exactly the stored keys under the
        prefix, each once (a large value's key once too), none of a neighbouring prefix, and a deleted key no
        more; elsewhere it raises Unsupported."""
        if not adapter.capabilities.list_keys:
            with pytest.raises(Unsupported):
                await _listed(adapter, "k")
            return
        mine, other = unique_keys(5, tag="i"), unique_keys(3, tag="i")
        prefix = _key_prefix(mine)
        neighbour = [prefix[:-1] + "x" + k[len(prefix) - 1 :] for k in other]  # shares all but the "-"
        values = [_value(100 + i, seed=i) for i in range(5)]
        values[4] = _value(min(5 << 20, self.max_object_bytes), seed=4)  # large: split by some backends
        assert await adapter.batched_put(mine, values) == [True] * 5
        assert await adapter.batched_put(other + neighbour, [b"o"] * 6) == [True] * 6
        listed = await _listed(adapter, prefix)
        assert sorted(listed) == sorted(mine), f"iter_keys({prefix!r}) gave {sorted(listed)}"
        assert sorted(await _listed(adapter, _key_prefix(other))) == sorted(other)
        assert await _listed(adapter, prefix + "9-nothing") == []
        assert set(mine) <= set(await _listed(adapter, prefix[:1])), "a shorter prefix must list them too"
        if adapter.capabilities.delete:
            assert await adapter.batched_delete(mine[:2]) == [True, True]
            assert sorted(await _listed(adapter, prefix)) == sorted(mine[2:])

    async def test_invalid_keys(self, adapter: Adapter) -> None:
        """Unsafe keys (path traversal, empty, separators) raise ValueError in every operation."""
        for bad in ("../x", "", "a/b", "/abs", "a\x00b"):
            with pytest.raises(ValueError, match="key"):
                await adapter.batched_contains([bad])
            with pytest.raises(ValueError, match="key"):
                await adapter.batched_get([bad])
            with pytest.raises(ValueError, match="key"):
                await adapter.batched_put([bad], [b"v"])
            if adapter.capabilities.delete:
                with pytest.raises(ValueError, match="key"):
                    await adapter.batched_delete([bad])

    # -- concurrency ------------------------------------------------------------------------------------

    async def test_concurrent_batches(self, adapter: Adapter) -> None:
        """Many puts, gets and contains in flight on one loop (distinct keys) all give the right results."""
        batches = [unique_keys(4, tag=f"c{b}") for b in range(16)]
        values = [[_value(1000 * (b + 1) + 7 * i, seed=b * 10 + i) for i in range(4)] for b in range(16)]
        first = await asyncio.gather(*(adapter.batched_put(batches[b], values[b]) for b in range(8)))
        assert first == [[True] * 4] * 8
        second, gets, contains = await asyncio.gather(
            asyncio.gather(*(adapter.batched_put(batches[b], values[b]) for b in range(8, 16))),
            asyncio.gather(*(adapter.batched_get(batches[b]) for b in range(8))),
            asyncio.gather(*(adapter.batched_contains(batches[b]) for b in range(8))),
        )
        assert second == [[True] * 4] * 8
        assert contains == [[True] * 4] * 8
        gets += await asyncio.gather(*(adapter.batched_get(batches[b]) for b in range(8, 16)))
        for b in range(16):
            for i in range(4):
                got = gets[b][i]
                assert _same(got, values[b][i]), f"batch {b} key {i}: {_describe(got, values[b][i])}"

    async def test_duplicate_keys_in_one_put(self, adapter: Adapter) -> None:
        """A batch naming one key twice stores one of the two values, whole."""
        (key,) = unique_keys(1)
        a, b = _value(3000, 1), _value(5000, 2)
        result = await adapter.batched_put([key, key], [a, b])
        assert len(result) == 2
        assert any(result)
        (got,) = await adapter.batched_get([key])
        assert got is not None
        assert bytes(got) in (a, b), f"got {len(got)} bytes, neither value written"

    async def _watch(
        self,
        adapter: Adapter,
        key: str,
        allowed: tuple[bytes, ...],
        stop: asyncio.Event,
        put: list[asyncio.Future[list[bool]]],
    ) -> int:
        """Get/contains ``key`` until ``stop``; each value seen must be None or exactly one of ``allowed``.

        Returns the reads that started while the put (``put[0]``, once started) was in flight."""
        overlapping = 0
        while not stop.is_set():
            during = bool(put) and not put[0].done()  # this read starts while the put is in flight
            (got,) = await adapter.batched_get([key])
            if got is not None:
                assert any(_same(got, v) for v in allowed), (
                    f"read {len(got)} bytes: a partial or mixed object "
                    f"(allowed sizes {[len(v) for v in allowed]})"
                )
            await adapter.batched_contains([key])
            overlapping += during
            await asyncio.sleep(0)
        return overlapping

    async def _race(self, adapter: Adapter, key: str, allowed: tuple[bytes, ...], write: bytes) -> None:
        """Put ``write`` while a reader watches ``key``; fails if no read started during a put that suspended.

        A put that completes in one step of the event loop never lets a reader of this loop in (atomic by
        construction); while one that suspends is in flight a second reader starts, so at least one read
        starts during it (counted, and the race fails if none did)."""
        stop = asyncio.Event()
        put: list[asyncio.Future[list[bool]]] = []
        watcher = asyncio.ensure_future(self._watch(adapter, key, allowed, stop, put))
        one_step = False
        during: asyncio.Future[int] | None = None
        try:
            await asyncio.sleep(0)  # the reader is reading
            put.append(asyncio.ensure_future(adapter.batched_put([key], [write])))
            await asyncio.sleep(0)  # the put takes its first step
            one_step = put[0].done()
            if not one_step:  # the put is in flight: one more reader starts now, whatever the other does
                during = asyncio.ensure_future(self._watch(adapter, key, allowed, stop, put))
            assert await put[0] == [True]
        finally:
            stop.set()
            overlapping = await watcher  # re-raises the watcher's assertion, if any
            if during is not None:
                overlapping += await during
        assert one_step or overlapping >= 1, "no read started during the put: nothing was checked"

    async def test_no_partial_object_visible(self, adapter: Adapter) -> None:
        """While a big put runs, readers see nothing, the old value or the new one, never a part or a mix."""
        size = min(self.max_object_bytes, _TORN_READ_BYTES)
        (key,) = unique_keys(1)
        a, b = _value(size, seed=11), _value(max(size - 4097, 1), seed=12)
        await self._race(adapter, key, (a,), a)  # the first put: None or all of a
        if not self.supports_concurrent_overwrite:
            return
        for write in (b, a, b):
            await self._race(adapter, key, (a, b), write)
        (got,) = await adapter.batched_get([key])
        assert _same(got, b), _describe(got, b)

    # -- cancellation ---------------------------------------------------------------------------------

    cancel_rounds: ClassVar[int] = 32
    """Puts and gets cancelled by the cancellation test."""
    cancel_value_bytes: ClassVar[int] = 256 << 10
    """Size of the values the cancellation test writes."""

    async def test_cancelled_calls_leave_the_adapter_consistent(
        self, bounded_adapter_factory: AdapterFactory
    ) -> None:
        """Puts and gets cancelled at random points leave every key with its old value, the new value or
        nothing; the adapter within its capacity; no reservation leaked (later puts still succeed)."""
        rng = random.Random(20261201)
        rounds, size = self.cancel_rounds, self.cancel_value_bytes
        keys = unique_keys(rounds, tag="x")
        old = [_value(size, seed=1000 + i) for i in range(rounds)]
        new = [_value(size - 1 - i, seed=2000 + i) for i in range(rounds)]
        adapter = await bounded_adapter_factory()
        try:
            for i in range(rounds):
                assert await _put_patiently(adapter, keys[i], old[i]), f"put of key {i} refused: space leaked"
                op = rng.choice(("put", "put", "get"))
                if op == "put":
                    await _cancel_randomly(adapter.batched_put([keys[i]], [new[i]]), rng)
                else:
                    read = await _cancel_randomly(adapter.batched_get([keys[i]]), rng)
                    got = None if read is None else read[0]
                    assert got is None or _same(got, old[i]), f"cancelled get {i}: {_describe(got, old[i])}"
                self._check_capacity(adapter, f"after cancelled {op} {i}")
            await self._check_medium(adapter, "after the cancelled calls")
            for i, got in enumerate(await adapter.batched_get(keys)):
                assert got is None or _same(got, old[i]) or _same(got, new[i]), (
                    f"after a cancelled call, key {i} holds {len(got)} bytes: neither the old nor the new one"
                )
            self._check_capacity(adapter, "after reading every key back")
            # No leaked reservation: fresh puts of twice the capacity (or of every cancelled value) succeed.
            capacity = getattr(adapter, "capacity", None)
            total = 2 * capacity if isinstance(capacity, int) and capacity <= (64 << 20) else rounds * size
            fresh = unique_keys(max(1, total // size), tag="f")
            for n, key in enumerate(fresh):
                stored = await _put_patiently(adapter, key, old[n % rounds])
                assert stored, f"fresh put {n} of {len(fresh)} refused: a cancelled call leaked space"
                self._check_capacity(adapter, f"after fresh put {n}")
            (got,) = await adapter.batched_get([fresh[-1]])
            assert _same(got, old[(len(fresh) - 1) % rounds]), _describe(got, old[(len(fresh) - 1) % rounds])
        finally:
            await adapter.aclose()  # waits for work the cancelled calls left running
        self._check_capacity(adapter, "after aclose")
        await self._check_medium(adapter, "after aclose")
        if not adapter.capabilities.persistent:
            return
        reopened = await bounded_adapter_factory()
        try:
            got_all = await reopened.batched_get(keys)
            for i, got in enumerate(got_all):
                assert got is None or _same(got, old[i]) or _same(got, new[i]), (
                    f"after reopening, key {i} holds {len(got)} bytes: neither the old nor the new value"
                )
        finally:
            await reopened.aclose()

    async def _check_medium(self, adapter: Adapter, when: str) -> None:
        measured = await self.stored_bytes(adapter)
        capacity = getattr(adapter, "capacity", None)
        if measured is not None and isinstance(capacity, int):
            assert measured <= capacity, (
                f"{when}: the medium holds {measured} bytes, over the capacity {capacity}"
            )

    @staticmethod
    def _check_capacity(adapter: Adapter, when: str) -> None:
        used, capacity = getattr(adapter, "used_bytes", None), getattr(adapter, "capacity", None)
        if isinstance(used, int) and isinstance(capacity, int):
            assert used <= capacity, f"{when}: {used} bytes used, over the capacity of {capacity}"

    # -- lifecycle ------------------------------------------------------------------------------------

    async def test_aclose_idempotent_and_final(self, adapter_factory: AdapterFactory) -> None:
        """aclose twice is fine; every later call raises AdapterUnavailable."""
        adapter = await adapter_factory()
        (key,) = unique_keys(1)
        assert await adapter.batched_put([key], [b"value"]) == [True]
        await adapter.aclose()
        await adapter.aclose()
        with pytest.raises(AdapterUnavailable):
            await adapter.batched_contains([key])
        with pytest.raises(AdapterUnavailable):
            await adapter.batched_get([key])
        with pytest.raises(AdapterUnavailable):
            await adapter.batched_put([key], [b"other"])
        if adapter.capabilities.delete:
            with pytest.raises(AdapterUnavailable):
                await adapter.batched_delete([key])
        if adapter.capabilities.list_keys:
            with pytest.raises(AdapterUnavailable):
                await _listed(adapter, "")

    async def test_persistence_across_reopen(self, adapter_factory: AdapterFactory) -> None:
        """A persistent adapter's objects survive aclose and a reopen on the same location."""
        adapter = await adapter_factory()
        if not adapter.capabilities.persistent:
            await adapter.aclose()
            pytest.skip(f"{type(adapter).__name__} is not persistent (capabilities.persistent=False)")
        keys = unique_keys(3)
        values = [_value(n, seed=n) for n in (0, 4096, (1 << 20) + 3)]
        try:
            assert await adapter.batched_put(keys, values) == [True] * 3
        finally:
            await adapter.aclose()
        reopened = await adapter_factory()
        try:
            assert await reopened.batched_contains(keys) == [True] * 3
            got = await reopened.batched_get(keys)
            for g, v in zip(got, values, strict=True):
                assert _same(g, v), _describe(g, v)
            if reopened.capabilities.list_keys:  # what an earlier process stored can be listed
                assert sorted(await _listed(reopened, _key_prefix(keys))) == sorted(keys)
        finally:
            await reopened.aclose()
