"""The conformance kit must fail deliberately broken adapters (each bug caught by the test meant for it)."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, ClassVar

import pytest

from tiercache.adapters._base import Buffer, Capabilities, check_lengths
from tiercache.adapters.memory import MemoryAdapter
from tiercache.testing.adapters import AdapterConformance

if TYPE_CHECKING:
    from pathlib import Path

    from tiercache.adapters._base import Adapter

pytest_plugins = ["pytester"]


# -- broken adapters: each is the real MemoryAdapter with one bug ----------------------------------------


class StaleOverwrite(MemoryAdapter):
    """Keeps serving the first value written under a key (a stale cache)."""

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        check_lengths(keys, values)
        stored = await self.batched_contains(keys)
        for k, v, old in zip(keys, values, stored, strict=True):
            if not old:
                await super().batched_put([k], [v])
        return [True] * len(keys)


class TornWrite(MemoryAdapter):
    """Writes the value piece by piece, yielding in between (readers see prefixes)."""

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        check_lengths(keys, values)
        for k, v in zip(keys, values, strict=True):
            data = bytes(v)
            step = max(1, len(data) // 8)
            await super().batched_put([k], [b""])
            for i in range(0, len(data), step):
                await super().batched_put([k], [data[: i + step]])
                await asyncio.sleep(0)
        return [True] * len(keys)


class WrongOrder(MemoryAdapter):
    """Returns get results sorted by key instead of in the order asked."""

    async def batched_get(self, keys: Sequence[str]) -> list[Buffer | None]:
        return await super().batched_get(sorted(keys))


class DropsLastByte(MemoryAdapter):
    """Loses the last byte of values of 1 MiB and more."""

    async def batched_get(self, keys: Sequence[str]) -> list[Buffer | None]:
        out = await super().batched_get(keys)
        return [v[:-1] if v is not None and len(v) >= 1 << 20 else v for v in out]


class RaisesOnMiss(MemoryAdapter):
    """Raises KeyError for a missing key instead of returning None."""

    async def batched_get(self, keys: Sequence[str]) -> list[Buffer | None]:
        out = await super().batched_get(keys)
        if None in out:
            raise KeyError(keys[out.index(None)])
        return out

    async def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        await self.batched_get(keys)
        return [True] * len(keys)


class AliasesBuffers(MemoryAdapter):
    """Keeps references to the caller's buffers instead of copying them."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, Buffer] = {}

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        self.held.update(zip(keys, values, strict=True))
        return await super().batched_put(keys, values)

    async def batched_get(self, keys: Sequence[str]) -> list[Buffer | None]:
        out = await super().batched_get(keys)
        return [bytes(self.held[k]) if v is not None else None for k, v in zip(keys, out, strict=True)]


class NoKeyChecks(MemoryAdapter):
    """Accepts any key (e.g. '../x'), as a path-based store with a traversal bug would."""

    async def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        out: list[bool] = []
        for k in keys:
            try:
                out += await super().batched_contains([k])
            except ValueError:
                out.append(False)
        return out


class DeleteDropsAll(MemoryAdapter):
    """Delete clears every key, not only the ones named."""

    async def batched_delete(self, keys: Sequence[str]) -> list[bool]:
        out = await self.batched_contains(keys)
        await super().batched_delete(list(self._data))
        return out


class UsableAfterClose(MemoryAdapter):
    """aclose does nothing: later calls still work instead of raising AdapterUnavailable."""

    async def aclose(self) -> None:
        return None


class ClaimsPersistence(MemoryAdapter):
    """Says it is persistent but every open starts empty."""

    capabilities: ClassVar[Capabilities] = Capabilities(persistent=True)


class NotesDeleteButLacksIt(MemoryAdapter):
    """Capabilities say delete=False but the inherited delete works (kit expects Unsupported)."""

    capabilities: ClassVar[Capabilities] = Capabilities(delete=False)


class LeaksOnCancel(MemoryAdapter):
    """Reserves space before writing; a cancelled put never gives it back (like a leaked slab slot)."""

    def __init__(self) -> None:
        super().__init__(capacity=2 << 20)
        self.reserved = 0

    @property
    def used_bytes(self) -> int:
        return super().used_bytes + self.reserved

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        check_lengths(keys, values)
        out: list[bool] = []
        for k, v in zip(keys, values, strict=True):
            data = bytes(v)
            if self.reserved + len(data) > self.capacity:
                out.append(False)
                continue
            self.reserved += len(data)
            for _ in range(4):  # the write; a cancel here skips the release below
                await asyncio.sleep(0)
            self.reserved -= len(data)
            out += await super().batched_put([k], [data])
        return out


class HalfWriteOnCancel(MemoryAdapter):
    """A cancelled put leaves the first half of the new value under the key."""

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        check_lengths(keys, values)
        for k, v in zip(keys, values, strict=True):
            data = bytes(v)
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                await super().batched_put([k], [data[: len(data) // 2]])
                raise
            await super().batched_put([k], [data])
        return [True] * len(keys)


# -- running kit tests programmatically ---------------------------------------------------------------


class ListsEveryKey(MemoryAdapter):
    """iter_keys ignores the prefix."""

    async def iter_keys(self, prefix: str) -> AsyncIterator[list[str]]:
        yield list(self._data)


class ListsStoredNames(MemoryAdapter):
    """iter_keys returns its own storage names (a prefix of its own left on), not the keys."""

    async def iter_keys(self, prefix: str) -> AsyncIterator[list[str]]:
        yield [f"store:{k}" for k in self._data if k.startswith(prefix)]


class ListsTwice(MemoryAdapter):
    """iter_keys yields every key twice (two overlapping pages)."""

    async def iter_keys(self, prefix: str) -> AsyncIterator[list[str]]:
        async for batch in super().iter_keys(prefix):
            yield batch
            yield batch


class ListsDeletedKeys(MemoryAdapter):
    """iter_keys lists from a record of puts that deletes never update."""

    def __init__(self) -> None:
        super().__init__()
        self.ever: dict[str, None] = {}

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        self.ever.update(dict.fromkeys(keys))
        return await super().batched_put(keys, values)

    async def iter_keys(self, prefix: str) -> AsyncIterator[list[str]]:
        yield [k for k in self.ever if k.startswith(prefix)]


class ListsButDoesNotSaySo(MemoryAdapter):
    """Capabilities say list_keys=False but the inherited iter_keys works (kit expects Unsupported)."""

    capabilities: ClassVar[Capabilities] = Capabilities(delete=True)


class _Kit(AdapterConformance):
    max_object_bytes = 2 << 20


async def _outcome(test: str, cls: type[MemoryAdapter], **params: object) -> str:
    """Run one kit test against a fresh ``cls`` the way pytest would; 'passed', 'failed' or 'skipped'."""

    async def factory() -> Adapter:
        return cls()

    method = getattr(_Kit(), test)
    wanted = inspect.signature(method).parameters
    adapter = await factory()
    args: dict[str, object] = {
        "adapter": adapter,
        "adapter_factory": factory,
        "bounded_adapter_factory": factory,
        **params,
    }
    try:
        await method(**{name: args[name] for name in wanted})
    except (AssertionError, pytest.fail.Exception, KeyError):
        return "failed"
    except pytest.skip.Exception:
        return "skipped"
    finally:
        await adapter.aclose()
    return "passed"


KIT_TESTS = sorted(name for name in dir(AdapterConformance) if name.startswith("test_"))


@pytest.mark.asyncio
@pytest.mark.parametrize("test", KIT_TESTS)
async def test_reference_fake_passes_every_kit_test(test: str) -> None:
    params: dict[str, object] = {"size": "max"} if test == "test_round_trip" else {}
    expected = "skipped" if test == "test_persistence_across_reopen" else "passed"
    assert await _outcome(test, MemoryAdapter, **params) == expected


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("cls", "test", "params"),
    [
        (StaleOverwrite, "test_overwrite", {}),
        (StaleOverwrite, "test_no_partial_object_visible", {}),
        (TornWrite, "test_no_partial_object_visible", {}),
        (WrongOrder, "test_batch_positional_order", {}),
        (DropsLastByte, "test_round_trip", {"size": (1 << 20) + 7}),
        (DropsLastByte, "test_round_trip", {"size": "max"}),
        (RaisesOnMiss, "test_mixed_hits_and_misses", {}),
        (RaisesOnMiss, "test_contains_on_empty", {}),
        (AliasesBuffers, "test_put_accepts_buffer_types_and_copies", {}),
        (NoKeyChecks, "test_invalid_keys", {}),
        (DeleteDropsAll, "test_delete", {}),
        (UsableAfterClose, "test_aclose_idempotent_and_final", {}),
        (ClaimsPersistence, "test_persistence_across_reopen", {}),
        (NotesDeleteButLacksIt, "test_delete", {}),
        (LeaksOnCancel, "test_cancelled_calls_leave_the_adapter_consistent", {}),
        (HalfWriteOnCancel, "test_cancelled_calls_leave_the_adapter_consistent", {}),
        (ListsEveryKey, "test_iter_keys", {}),
        (ListsStoredNames, "test_iter_keys", {}),
        (ListsTwice, "test_iter_keys", {}),
        (ListsDeletedKeys, "test_iter_keys", {}),
        (ListsButDoesNotSaySo, "test_iter_keys", {}),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else (str(v) if isinstance(v, str) else ""),
)
async def test_kit_fails_broken_adapter(
    cls: type[MemoryAdapter], test: str, params: dict[str, object]
) -> None:
    assert await _outcome(test, cls, **params) == "failed"


class SlowReadsCountedPuts(MemoryAdapter):
    """A correct adapter whose gets take longer than a whole put (a watcher's read started before the put
    ends after it), recording for each put how many gets started while it was in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.putting = False
        self.gets_during_puts: list[int] = []

    async def batched_get(self, keys: Sequence[str]) -> list[Buffer | None]:
        if self.putting:
            self.gets_during_puts[-1] += 1
        for _ in range(64):
            await asyncio.sleep(0)
        return await super().batched_get(keys)

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        self.putting = True
        self.gets_during_puts.append(0)
        try:
            for _ in range(4):
                await asyncio.sleep(0)
            return await super().batched_put(keys, values)
        finally:
            self.putting = False


@pytest.mark.asyncio
async def test_torn_read_check_reads_during_every_put() -> None:
    """The kit's torn-read check never passes without looking: a read starts during every put that
    suspends, even when the watcher is still busy with a read it began before the put."""
    adapter = SlowReadsCountedPuts()
    await _Kit().test_no_partial_object_visible(adapter)
    assert len(adapter.gets_during_puts) == 4  # the first put, then b, a, b
    assert all(n >= 1 for n in adapter.gets_during_puts), adapter.gets_during_puts


@pytest.mark.asyncio
@pytest.mark.parametrize("test", ["test_round_trip", "test_overwrite", "test_batch_positional_order"])
async def test_torn_write_still_passes_serial_tests(test: str) -> None:
    """Sanity: the bugs are specific; a torn writer still passes the tests that never race."""
    params: dict[str, object] = {"size": 4096} if test == "test_round_trip" else {}
    assert await _outcome(test, TornWrite, **params) == "passed"


# -- the real mechanism: a third-party style suite run by pytest (strict asyncio mode) -----------------

_SUITE = """
import asyncio
import pytest
from tiercache.adapters import check_lengths
from tiercache.testing import InMemoryAdapter  # the kit's old name of MemoryAdapter
from tiercache.testing.adapters import AdapterConformance


class TornWrite(InMemoryAdapter):
    async def batched_put(self, keys, values):
        check_lengths(keys, values)
        for k, v in zip(keys, values):
            data = bytes(v)
            step = max(1, len(data) // 8)
            await super().batched_put([k], [b""])
            for i in range(0, len(data), step):
                await super().batched_put([k], [data[: i + step]])
                await asyncio.sleep(0)
        return [True] * len(keys)


class TestGood(AdapterConformance):
    max_object_bytes = 1 << 20

    @pytest.fixture
    def adapter_factory(self):
        return lambda: InMemoryAdapter.open("memory://good")


class TestTorn(AdapterConformance):
    max_object_bytes = 1 << 20

    @pytest.fixture
    def adapter_factory(self):
        return lambda: TornWrite.open("memory://torn")
"""


def test_kit_through_pytest(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_thirdparty=_SUITE)
    result = pytester.runpytest_subprocess(
        "-rA",
        "-p",
        "no:cacheprovider",
        "-o",
        "asyncio_mode=strict",
        "-o",
        "asyncio_default_fixture_loop_scope=function",
    )
    out = result.stdout.str()
    failed = set(re.findall(r"^FAILED \S+::(Test\w+::test_\w+)", out, re.M))
    passed = set(re.findall(r"^PASSED \S+::(Test\w+::test_\w+)", out, re.M))
    assert failed == {
        "TestTorn::test_no_partial_object_visible",
        "TestTorn::test_cancelled_calls_leave_the_adapter_consistent",  # a cancelled torn put leaves a part
    }, out[-3000:]
    assert "TestGood::test_no_partial_object_visible" in passed
    assert "TestGood::test_concurrent_batches" in passed
    outcomes = result.parseoutcomes()
    assert outcomes["failed"] == 2
    assert outcomes["skipped"] == 2  # persistence, once per class
    assert "errors" not in outcomes


def _write_in_place(
    directory: str,
    path: str,
    key: str,
    value: Buffer,
    fsync: bool,
    victims: Sequence[str],
    spare: tuple[int, str] | None = None,
) -> bool:
    """The classic bug: write the object at its final path in pieces (no temp file + rename)."""
    import os
    import time

    if spare is not None:  # a temp file made ahead: not used by this bug
        os.close(spare[0])
        os.unlink(spare[1])

    os.makedirs(directory, exist_ok=True)
    view = memoryview(value)
    with open(path, "wb", buffering=0) as f:
        for i in range(0, len(view), 1 << 18):
            f.write(view[i : i + (1 << 18)])
            time.sleep(0.001)
    return True


@pytest.mark.asyncio
async def test_kit_fails_posix_writing_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tiercache.adapters import posix

    monkeypatch.setattr(posix, "_write_file", _write_in_place)
    kit = _Kit()
    adapter = await posix.PosixAdapter.open(f"file://{tmp_path}")
    try:
        with pytest.raises(AssertionError, match="partial or mixed"):
            await kit.test_no_partial_object_visible(adapter)
    finally:
        await adapter.aclose()
