# mypy: disable-error-code="no-untyped-call"
"""The moves' stream against the model's on CUDA (skipped without it): a model stream (as vLLM queues its
forward on) shares no order with the moves' thread, so a save issued right after the forward is queued reads
stale KV unless it waited for a ``caller_fence``, and the model reads a load's KV before its last write
unless it holds the load's ``moves_fence``; with the fences both see the right bytes, and waiting for a fence
leaves the event loop free. The forward's and the load's late writes are held back on the device by
``torch.cuda._sleep``, so the stale cases are not a race the test may lose."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from tiercache.gpu import LayoutKind, Move, PagedLayout, dispatch, object_spec, reference
from tiercache.gpu.streams import MoverStream, mover_stream
from tiercache.store.l1 import L1Cache

DEV = torch.device("cuda")
L, H, D, BS, NB, N = 4, 4, 64, 16, 32, 256
LAYOUT = PagedLayout(LayoutKind.VLLM_LEGACY, L, H, D, BS, "bfloat16")
SLEEP_CYCLES = 400_000_000  # about 0.2 s on the device: far longer than a move of this 1 MiB


def kv_caches(value: float) -> list[torch.Tensor]:
    kv = [torch.full(LAYOUT.layer_shape(NB), value, dtype=torch.bfloat16, device=DEV) for _ in range(L)]
    torch.cuda.synchronize()  # filled before any other stream looks
    return kv


def slots() -> torch.Tensor:
    table = torch.randperm(NB - 1, generator=torch.Generator().manual_seed(0))[: N // BS] + 1
    pos = torch.arange(N)
    return table[pos // BS] * BS + pos % BS


def pinned_object() -> torch.Tensor:
    spec = object_spec(LAYOUT, N)
    l1 = L1Cache(2 * spec.nbytes, spec.nbytes, pinned=True)
    obj = l1.reserve_write("k", spec)
    assert obj is not None
    return obj.tensor()


def on_mover_thread(mover: MoverStream, work: Callable[[], None]) -> None:
    """Run ``work`` on another thread whose current stream is the mover's, as the connector's loop thread."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            mover.use_on_this_thread()
            work()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]


@pytest.fixture(scope="module", autouse=True)
def warm() -> None:
    """One gather first, so that no test's move waits for a compile or a first allocation."""
    obj = pinned_object()
    dispatch.gather(kv_caches(0.0), Move.gather(LAYOUT, slots(), [(0, N)], [obj]))
    torch.cuda.synchronize()


def saved_after_forward(fence: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A forward on a model stream writes 1.0 into KV that held 0.0 (late, behind a sleep), then a save is
    issued on the mover's thread, waiting for the fence taken after the forward or not; (the saved object,
    the KV the forward wrote)."""
    kv = kv_caches(0.0)
    model = torch.cuda.Stream()
    mover = MoverStream(DEV)
    obj = pinned_object()
    with torch.cuda.stream(model):
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in kv:
            t.fill_(1.0)
        after_forward = mover.caller_fence()
    move = Move.gather(LAYOUT, slots(), [(0, N)], [obj])

    def save() -> None:
        if fence:
            asyncio.run(after_forward.reached())
        dispatch.gather(kv, move)

    on_mover_thread(mover, save)
    torch.cuda.synchronize()
    return obj.clone(), kv


def test_a_fenced_save_reads_the_kv_the_forward_wrote() -> None:
    obj, kv = saved_after_forward(fence=True)
    want = torch.empty_like(obj)
    reference.gather(kv, Move.gather(LAYOUT, slots(), [(0, N)], [want]))
    assert torch.equal(obj, want)
    assert bool((obj == 1.0).all())


def test_without_the_fence_a_save_reads_stale_kv() -> None:
    """What the fence prevents: the save ran before the forward's write (so the test above can fail)."""
    obj, _ = saved_after_forward(fence=False)
    assert bool((obj == 0.0).all())


def read_after_load(fence: bool) -> torch.Tensor:
    """A load's last write (late, behind a sleep) of 2.0 into KV holding 0.0 on the mover's stream, then the
    model's stream reads the KV, holding the load's fence or not; what it read."""
    kv = kv_caches(0.0)
    model = torch.cuda.Stream()
    mover = MoverStream(DEV)
    written = []

    def load() -> None:
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in kv:
            t.fill_(2.0)  # as a staged scatter's kernel, still running when the load's call returned
        written.append(mover.moves_fence())

    on_mover_thread(mover, load)
    with torch.cuda.stream(model):
        if fence:
            written[0].hold()
        seen = torch.stack([t.clone() for t in kv])
    torch.cuda.synchronize()
    return seen


def test_a_forward_holding_the_loads_fence_reads_the_loaded_kv() -> None:
    assert bool((read_after_load(fence=True) == 2.0).all())


def test_without_the_fence_the_forward_reads_before_the_load() -> None:
    assert bool((read_after_load(fence=False) == 0.0).all())


def test_waiting_for_a_fence_leaves_the_event_loop_free() -> None:
    """A job waiting for the model's queued work does not stop the loop's other jobs."""
    model = torch.cuda.Stream()
    mover = MoverStream(DEV)
    with torch.cuda.stream(model):
        torch.cuda._sleep(SLEEP_CYCLES)
        fence = mover.caller_fence()
    order: list[str] = []

    async def waiter() -> None:
        await fence.reached()
        order.append("fence reached")

    async def other() -> None:
        await asyncio.sleep(0)
        order.append("other job" if not model.query() else "other job, after the model")

    async def both() -> None:
        await asyncio.gather(waiter(), other())

    asyncio.run(both())
    assert order == ["other job", "fence reached"]
    assert model.query()


def test_one_mover_per_device_on_the_threads_that_use_it() -> None:
    mover = mover_stream(DEV)
    assert mover_stream(torch.device("cuda", torch.cuda.current_device())) is mover
    seen: list[int] = []
    on_mover_thread(mover, lambda: seen.append(torch.cuda.current_stream().cuda_stream))
    assert seen == [mover.stream.cuda_stream]
    assert torch.cuda.current_stream().cuda_stream != mover.stream.cuda_stream


def test_the_legacy_default_stream_does_not_hold_the_moves_back() -> None:
    """Non-blocking: work on the legacy default stream (where a thread's work goes unless told otherwise)
    does not delay the moves' stream."""
    mover = MoverStream(DEV)
    x = torch.zeros(1, device=DEV)
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.default_stream()):
        torch.cuda._sleep(SLEEP_CYCLES)
    with torch.cuda.stream(mover.stream):
        x.fill_(3.0)
    mover.stream.synchronize()
    assert not torch.cuda.default_stream().query()  # still asleep, and the mover's fill is done
    torch.cuda.synchronize()
    assert x.item() == 3.0
