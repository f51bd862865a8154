"""The L1 contract the engine relies on, run against the in-process ``L1Cache`` and the shared L1 of a real
``tiercache.server`` process (``SharedL1``): the same scenarios, the same expected outcomes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.unit._l1_helpers import SLOT, SPEC, pattern, put, read
from tiercache.server.client import SharedL1
from tiercache.spec import KVSpec
from tiercache.store.l1 import L1Cache, ObjectState
from tiercache.testing.harness.processes import NodeServer, socket_dir

Factory = Callable[[int], Any]


@pytest.fixture(params=["in_process", "shared"])
def make(request: pytest.FixtureRequest) -> Iterator[Factory]:
    servers: list[NodeServer] = []
    tmp = str(socket_dir("tc-l1c-"))

    def in_process(slots: int) -> L1Cache:
        return L1Cache(slots * SLOT, SLOT, pinned=False)

    def shared(slots: int) -> SharedL1:
        path = os.path.join(tmp, f"{len(servers)}.sock")
        # one client may hold every slot here
        servers.append(NodeServer(path, "--max-share", "1", slot_bytes=SLOT, slots=slots))
        assert servers[-1].ready, servers[-1].log()
        return SharedL1(path)

    yield in_process if request.param == "in_process" else shared
    for server in servers:
        server.stop()
        server.log_path.unlink()
    os.rmdir(tmp)  # each server removed its socket and lock file


def test_writing_is_invisible_until_finish(make: Factory) -> None:
    c = make(4)
    obj = c.reserve_write("a", SPEC)
    assert obj is not None
    assert (obj.state, obj.key, obj.spec) == (ObjectState.WRITING, "a", SPEC)
    assert not c.contains("a")
    assert c.batched_contains(["a"]) == [False]
    assert c.acquire("a") is None
    assert (c.stats().writing, c.stats().ready) == (1, 0)
    obj.buffer()[:] = pattern("a", SLOT)
    c.finish_write(obj)
    assert obj.state is ObjectState.READY
    assert c.contains("a")
    assert read(c, "a") == pattern("a", SLOT)
    with pytest.raises(ValueError, match="WRITING"):
        c.finish_write(obj)
    with pytest.raises(ValueError, match="WRITING"):
        c.abort_write(obj)


def test_first_writer_wins_and_abort_frees(make: Factory) -> None:
    c = make(1)
    first = c.reserve_write("a", SPEC)
    assert first is not None
    assert c.reserve_write("a", SPEC) is None
    c.abort_write(first)
    assert not c.contains("a")
    second = c.reserve_write("b", SPEC)  # the only slot is free again
    assert second is not None
    second.buffer()[:] = pattern("b", SLOT)
    c.finish_write(second)
    assert c.reserve_write("b", SPEC.with_tokens(2)) is None
    assert read(c, "b") == pattern("b", SLOT)
    assert c.stats().alloc_failures == 0


def test_lru_evicts_oldest_and_keeps_recently_acquired(make: Factory) -> None:
    c = make(3)
    for k in "abc":
        put(c, k)
    lease = c.acquire("a")  # a becomes most recently used
    assert lease is not None
    lease.release()
    assert c.contains("b")  # a presence check does not reorder
    put(c, "d")  # evicts b
    assert c.batched_contains(["a", "b", "c", "d"]) == [True, False, True, True]
    put(c, "e")  # evicts c
    put(c, "f")  # evicts a
    assert c.batched_contains(["a", "b", "c", "d", "e", "f"]) == [False, False, False, True, True, True]
    assert (c.stats().evictions, c.stats().alloc_failures) == (3, 0)
    for k in "def":
        assert read(c, k) == pattern(k, SLOT)


def test_writing_and_leased_objects_are_never_evicted(make: Factory) -> None:
    c = make(3)
    w = c.reserve_write("w", SPEC)
    assert w is not None
    put(c, "a")
    put(c, "b")
    la = c.acquire("a")
    lb = c.acquire("b")
    assert la is not None
    assert lb is not None
    assert c.reserve_write("c", SPEC) is None
    assert c.stats().alloc_failures == 1
    assert c.stats().leased == 2
    lb.release()
    put(c, "c")  # b, released, is the only victim
    assert c.batched_contains(["a", "b", "c"]) == [True, False, True]
    assert la.valid()
    assert read(c, "a") == pattern("a", SLOT)
    la.release()
    assert not la.valid()
    la.release()  # idempotent
    c.abort_write(w)
    assert c.stats().writing == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_tensor_view_is_bit_exact(make: Factory, dtype: str) -> None:
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=dtype, tokens=2)
    c = make(2)
    obj = c.reserve_write("t", spec)
    assert obj is not None
    src = torch.randn(spec.shape, generator=torch.Generator().manual_seed(3)).to(getattr(torch, dtype))
    obj.tensor().copy_(src)
    c.finish_write(obj)
    lease = c.acquire("t")
    assert lease is not None
    got = lease.obj.tensor()
    assert got.shape == src.shape
    assert got.dtype == src.dtype
    assert torch.equal(got, src)
    assert bytes(lease.obj.buffer()) == src.reshape(-1).view(torch.uint8).numpy().tobytes()
    lease.release()


def test_batched_forms_match_the_single_ones(make: Factory) -> None:
    """The L1Surface batch calls the manager uses (one round trip each on the shared L1)."""
    c = make(4)
    objs = c.batched_reserve_write(["a", "b", "c"], [SPEC] * 3)
    assert all(o is not None for o in objs)
    for obj in objs:
        obj.buffer()[:] = pattern(obj.key, SLOT)
    c.batched_abort_write([objs[2]])
    c.batched_finish_write(objs[:2])
    assert [o.state for o in objs[:2]] == [ObjectState.READY] * 2
    assert c.batched_contains(["a", "b", "c"]) == [True, True, False]
    again = c.batched_reserve_write(["a", "d"], [SPEC] * 2)
    assert again[0] is None  # present: first writer wins
    assert again[1] is not None
    c.batched_abort_write([again[1]])
    leases = c.batched_acquire(["a", "b", "c", "d"])
    assert [lease is not None for lease in leases] == [True, True, False, False]
    held = [lease for lease in leases if lease is not None]
    assert [bytes(x.obj.buffer()) for x in held] == [pattern("a", SLOT), pattern("b", SLOT)]
    assert c.stats().leased == 2
    c.batched_release(held)
    assert not any(x.valid() for x in held)
    assert c.stats().leased == 0
