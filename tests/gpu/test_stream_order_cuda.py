# mypy: disable-error-code="no-untyped-call"
"""The moves' stream against the model's on CUDA (skipped without it): a model stream (as vLLM queues its
forward on) shares no order with the moves' thread, so a save issued right after the forward is queued reads
stale KV unless it waited for a ``caller_fence``, and the model reads a load's KV before its last write
unless it holds the load's ``moves_fence``; with the fences both see the right bytes, and waiting for a fence
leaves the event loop free. The forward's and the load's late writes wait on the device behind a ``Gate`` the
test opens, and every stale read is checked while it is still shut, so no case is a race the test may lose."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

import triton
import triton.language as tl
from tiercache_vllm._layerwise import LayerProgress

from tiercache.gpu import LayoutKind, Move, PagedLayout, dispatch, object_spec, reference
from tiercache.gpu.streams import Fence, MoverStream, mover_stream
from tiercache.store.l1 import L1Cache

DEV = torch.device("cuda")
L, H, D, BS, NB, N = 4, 4, 64, 16, 32, 256
LAYOUT = PagedLayout(LayoutKind.VLLM_LEGACY, L, H, D, BS, "bfloat16")
OPEN_AFTER_TURNS = 20  # event-loop turns between a fenced wait's start and the gate's opening
MAX_SPINS = 20_000_000  # a shut gate gives up after this many spins, so a failing test cannot hang the device


@triton.jit
def _spin_while_shut(flag_ptr, gave_up_ptr, max_spins):  # type: ignore[no-untyped-def]
    spins = 0
    while (tl.load(flag_ptr, volatile=True) == 0) & (spins < max_spins):
        spins += 1
    if spins >= max_spins:
        tl.store(gave_up_ptr, 1)


class Gate:
    """Work queued on a stream after ``shut_here()`` waits on the device until the test calls ``open()``;
    ``gave_up()``: a gate stopped spinning before it was opened (what it held back ran unheld)."""

    def __init__(self) -> None:
        self.flag = torch.zeros(1, dtype=torch.int32, device=DEV)
        self.gave_up_flag = torch.zeros(1, dtype=torch.int32, device=DEV)
        self.opener = torch.cuda.Stream()
        torch.cuda.synchronize()

    def shut_here(self) -> None:
        """Hold the current stream's later work back (one spinning program on one SM)."""
        _spin_while_shut[(1,)](self.flag, self.gave_up_flag, MAX_SPINS)

    def gave_up(self) -> bool:
        torch.cuda.synchronize()
        return bool(self.gave_up_flag.item())

    def open(self) -> None:
        with torch.cuda.stream(self.opener):
            self.flag.fill_(1)


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    try:
        yield g
    finally:
        g.open()  # a failed test leaves nothing spinning
        torch.cuda.synchronize()
    assert not g.gave_up(), "a gate gave up spinning: what it held ran before the test opened it"


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
    """One gather and one open gate first, so that no test waits for a compile or a first allocation."""
    obj = pinned_object()
    dispatch.gather(kv_caches(0.0), Move.gather(LAYOUT, slots(), [(0, N)], [obj]))
    g = Gate()
    g.open()
    g.shut_here()
    torch.cuda.synchronize()


def saved_after_forward(gate: Gate, fence: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A forward on a model stream writes 1.0 into KV that held 0.0 (behind the gate), then a save is issued
    on the mover's thread, waiting for the fence taken after the forward or not; (the saved object, the KV the
    forward wrote). With the fence, the gate opens from the same event loop some turns after the wait began,
    and the wait must end only after that; without it, the save is done, and checked, while it is shut."""
    kv = kv_caches(0.0)
    model = torch.cuda.Stream()
    mover = MoverStream(DEV)
    obj = pinned_object()
    with torch.cuda.stream(model):
        gate.shut_here()
        for t in kv:
            t.fill_(1.0)
        after_forward = mover.caller_fence()
    move = Move.gather(LAYOUT, slots(), [(0, N)], [obj])
    forward_done_at_save: list[bool] = []
    order: list[str] = []

    async def fenced() -> None:
        await after_forward.reached()
        order.append("fence reached")

    async def open_later() -> None:
        for _ in range(OPEN_AFTER_TURNS):
            await asyncio.sleep(0)
        order.append("opened" if not model.query() else "opened, the forward already done")
        gate.open()

    async def both() -> None:
        await asyncio.gather(fenced(), open_later())

    def save() -> None:
        if fence:
            asyncio.run(both())
        forward_done_at_save.append(model.query())
        dispatch.gather(kv, move)

    on_mover_thread(mover, save)
    assert forward_done_at_save == [fence]
    assert order == (["opened", "fence reached"] if fence else [])
    gate.open()
    torch.cuda.synchronize()
    return obj.clone(), kv


def test_a_fenced_save_reads_the_kv_the_forward_wrote(gate: Gate) -> None:
    obj, kv = saved_after_forward(gate, fence=True)
    want = torch.empty_like(obj)
    reference.gather(kv, Move.gather(LAYOUT, slots(), [(0, N)], [want]))
    assert torch.equal(obj, want)
    assert bool((obj == 1.0).all())


def test_without_the_fence_a_save_reads_stale_kv(gate: Gate) -> None:
    """What the fence prevents: the save ran before the forward's write (so the test above can fail)."""
    obj, _ = saved_after_forward(gate, fence=False)
    assert bool((obj == 0.0).all())


def loaded_on_mover(gate: Gate, mover: MoverStream, kv: list[torch.Tensor], value: float) -> Fence:
    """A load's last write (behind the gate) of ``value`` into ``kv`` on the mover's stream, as a staged
    scatter's kernel still running when the load's call returned; the load's fence."""
    written: list[Fence] = []

    def load() -> None:
        gate.shut_here()
        for t in kv:
            t.fill_(value)
        written.append(mover.moves_fence())

    on_mover_thread(mover, load)
    return written[0]


def read_after_load(gate: Gate, fence: bool) -> torch.Tensor:
    """The model's stream reads KV holding 0.0 after a load of 2.0, holding the load's fence or not; what it
    read. Without the fence the read is done, and checked, while the gate is still shut."""
    kv = kv_caches(0.0)
    model = torch.cuda.Stream()
    written = loaded_on_mover(gate, MoverStream(DEV), kv, 2.0)
    with torch.cuda.stream(model):
        if fence:
            written.hold()
        seen = torch.stack([t.clone() for t in kv])
    if fence:
        assert not model.query()  # the read waits for the load
    else:
        model.synchronize()  # the read is done before the load's write
    gate.open()
    torch.cuda.synchronize()
    return seen


def test_a_forward_holding_the_loads_fence_reads_the_loaded_kv(gate: Gate) -> None:
    assert bool((read_after_load(gate, fence=True) == 2.0).all())


def test_without_the_fence_the_forward_reads_before_the_load(gate: Gate) -> None:
    assert bool((read_after_load(gate, fence=False) == 0.0).all())


def test_an_attention_layer_waits_on_the_device_for_its_layer_only(gate: Gate) -> None:
    """Layerwise loads: ``LayerProgress.wait`` makes the forward's stream hold the written layer's fence, so
    its read waits for that layer's moves and a layer written earlier is read at once."""
    kv = kv_caches(0.0)
    model = torch.cuda.Stream()
    mover = MoverStream(DEV)
    progress = LayerProgress()
    layer0 = kv_caches(0.0)[:1]

    def load_layer0() -> None:
        layer0[0].fill_(5.0)
        progress.written(mover.moves_fence())

    on_mover_thread(mover, load_layer0)
    progress.written(loaded_on_mover(gate, mover, kv, 3.0))
    with torch.cuda.stream(model):
        assert progress.wait(0, timeout=0.0)
        seen0 = layer0[0].clone()
    model.synchronize()  # layer 0's moves came before the gate
    assert not mover.stream.query()  # layer 0 was read while layer 1's moves are still held
    assert bool((seen0 == 5.0).all())
    with torch.cuda.stream(model):
        assert progress.wait(1, timeout=0.0)
        seen1 = torch.stack([t.clone() for t in kv])
    assert not model.query()
    gate.open()
    torch.cuda.synchronize()
    assert bool((seen1 == 3.0).all())
    progress.end()
    assert not progress.wait(2, timeout=0.0)


def test_waiting_for_a_fence_leaves_the_event_loop_free(gate: Gate) -> None:
    """A job waiting for the model's queued work does not stop the loop's other jobs."""
    model = torch.cuda.Stream()
    mover = MoverStream(DEV)
    with torch.cuda.stream(model):
        gate.shut_here()
        fence = mover.caller_fence()
    order: list[str] = []

    async def waiter() -> None:
        await fence.reached()
        order.append("fence reached")

    async def other() -> None:
        await asyncio.sleep(0)
        order.append("other job" if not model.query() else "other job, after the model")
        gate.open()

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


def test_the_legacy_default_stream_does_not_hold_the_moves_back(gate: Gate) -> None:
    """Non-blocking: work on the legacy default stream (where a thread's work goes unless told otherwise)
    does not delay the moves' stream."""
    mover = MoverStream(DEV)
    x = torch.zeros(1, device=DEV)
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.default_stream()):
        gate.shut_here()
    with torch.cuda.stream(mover.stream):
        x.fill_(3.0)
    mover.stream.synchronize()
    assert not torch.cuda.default_stream().query()  # still shut, and the mover's fill is done
    gate.open()
    torch.cuda.synchronize()
    assert x.item() == 3.0
