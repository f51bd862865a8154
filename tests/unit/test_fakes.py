"""The fault-injection wrapper: transparent without faults, injects exactly what it is told to."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from tiercache.adapters.memory import MemoryAdapter
from tiercache.errors import AdapterTimeout, AdapterUnavailable, Unsupported
from tiercache.testing.adapters import AdapterConformance
from tiercache.testing.fakes import ALL_OPS, FaultInjectingAdapter

if TYPE_CHECKING:
    from pathlib import Path

    from tiercache.adapters import Adapter
    from tiercache.testing.adapters import AdapterFactory


class TestFaultWrapperPassThroughConformance(AdapterConformance):
    """With no faults configured the wrapper is transparent."""

    max_object_bytes = 4 << 20

    @pytest.fixture
    def adapter_factory(self) -> AdapterFactory:
        async def factory() -> Adapter:
            return FaultInjectingAdapter()  # around a new MemoryAdapter

        return factory


def test_lazy_exports_do_not_import_pytest(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys, tiercache.testing; assert 'pytest' not in sys.modules; "
        "import tiercache.testing.fakes; assert 'pytest' not in sys.modules; "
        "import tiercache.testing.plugin, tiercache.testing as t; "
        "assert 'tiercache.adapters.posix' not in sys.modules and 'torch' not in sys.modules; "
        "from tiercache.adapters.memory import MemoryAdapter; "
        "assert t.InMemoryAdapter is MemoryAdapter and t.FaultInjectingAdapter().wrapped.scheme == 'memory'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)  # cwd: not the source tree


@pytest.mark.asyncio
async def test_fail_rate_switchable_at_runtime() -> None:
    fake = FaultInjectingAdapter(seed=1)
    assert await fake.batched_put(["k"], [b"v"]) == [True]
    fake.fail_rate = 1.0
    with pytest.raises(AdapterUnavailable, match="injected"):
        await fake.batched_get(["k"])
    with pytest.raises(AdapterUnavailable):
        await fake.batched_contains(["k"])
    fake.fail_rate = 0.0
    assert await fake.batched_get(["k"]) == [b"v"]
    assert fake.faults["error"] == 2
    assert fake.calls["get"] == 2
    assert fake.calls["contains"] == 1
    await fake.aclose()
    with pytest.raises(AdapterUnavailable):
        await fake.batched_get(["k"])


@pytest.mark.asyncio
async def test_fail_ops_and_error_type() -> None:
    fake = FaultInjectingAdapter(fail_rate=1.0, fail_ops=frozenset({"put"}), error=AdapterTimeout)
    with pytest.raises(AdapterTimeout):
        await fake.batched_put(["k"], [b"v"])
    assert await fake.batched_get(["k"]) == [None]  # get is not in fail_ops
    with pytest.raises(ValueError, match="fail_ops"):
        FaultInjectingAdapter(fail_ops=frozenset({"gett"}))


async def _listed(adapter: FaultInjectingAdapter) -> list[list[str]]:
    return [batch async for batch in adapter.iter_keys("")]


@pytest.mark.asyncio
@pytest.mark.parametrize("op", sorted(ALL_OPS))
async def test_each_op_name_fails_exactly_its_own_method(op: str) -> None:
    """Every name in ALL_OPS selects one batched method; the others keep working."""
    fake = FaultInjectingAdapter(fail_rate=1.0, fail_ops=frozenset({op}))
    calls = {
        "contains": lambda: fake.batched_contains(["k"]),
        "get": lambda: fake.batched_get(["k"]),
        "put": lambda: fake.batched_put(["k"], [b"v"]),
        "delete": lambda: fake.batched_delete(["k"]),
        "list": lambda: _listed(fake),
    }
    assert set(calls) == ALL_OPS
    for name, call in calls.items():
        if name == op:
            with pytest.raises(AdapterUnavailable):
                await call()
        else:
            await call()
    assert fake.faults["error"] == 1


@pytest.mark.asyncio
async def test_fail_rate_is_probabilistic_and_seeded() -> None:
    async def count(seed: int) -> int:
        fake = FaultInjectingAdapter(fail_rate=0.3, seed=seed)
        failures = 0
        for _ in range(1000):
            try:
                await fake.batched_contains(["k"])
            except AdapterUnavailable:
                failures += 1
        assert fake.faults["error"] == failures
        return failures

    first = await count(7)
    assert 230 < first < 370
    assert await count(7) == first


@pytest.mark.asyncio
async def test_latency_waits_before_every_call() -> None:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    fake = FaultInjectingAdapter(latency=0.05, fail_ops=frozenset({"get"}), sleep=sleep)
    await fake.batched_contains(["k"])
    await fake.batched_put(["k"], [b"v"])
    assert slept == [0.05, 0.05]  # every op, also those not in fail_ops
    assert fake.faults["latency"] == 2


@pytest.mark.asyncio
async def test_hang_until_cancelled() -> None:
    fake = FaultInjectingAdapter(hang=True, fail_ops=frozenset({"get"}))
    assert await fake.batched_put(["k"], [b"v"]) == [True]
    hung = asyncio.ensure_future(fake.batched_get(["k"]))
    for _ in range(100):  # bounded: the call reaches its hang within a few loop turns
        await asyncio.sleep(0)
    assert not hung.done()
    assert fake.faults["hang"] == 1
    hung.cancel()
    with pytest.raises(asyncio.CancelledError):
        await hung
    fake.hang = False
    assert await fake.batched_get(["k"]) == [b"v"]


@pytest.mark.asyncio
async def test_corrupt_rate_flips_one_byte() -> None:
    inner = MemoryAdapter()
    fake = FaultInjectingAdapter(inner, corrupt_rate=1.0)
    value = bytes(range(256)) * 4
    assert await fake.batched_put(["k", "e"], [value, b""]) == [True, True]
    got, empty = await fake.batched_get(["k", "e"])
    assert got is not None
    assert empty == b""
    assert len(got) == len(value)
    assert sum(a != b for a, b in zip(got, value, strict=True)) == 1
    assert await inner.batched_get(["k"]) == [value]  # the stored object is untouched
    assert fake.faults["corrupt"] == 1


@pytest.mark.asyncio
async def test_capabilities_mirror_wrapped() -> None:
    class NoDelete(MemoryAdapter):
        from tiercache.adapters import Capabilities

        capabilities = Capabilities(delete=False, persistent=True)

        async def batched_delete(self, keys: object) -> list[bool]:  # type: ignore[override]
            raise Unsupported("no delete")

    fake = FaultInjectingAdapter(NoDelete())
    assert fake.capabilities.delete is False
    assert fake.capabilities.persistent is True
    assert fake.scheme == "memory"
    with pytest.raises(Unsupported):
        await fake.batched_delete(["k"])
    with pytest.raises(Unsupported):
        await FaultInjectingAdapter.open("fault://x")
