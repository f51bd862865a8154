"""Server mode on CUDA: a client's mapping of the shared L1 registered with cudaHostRegister is pinned memory
to torch and the kernels; a GPU gather into shared slots and a scatter back from them are bit-exact.

The registration runs off the request path: a worker's SharedL1 in a process that uses CUDA only does the
HELLO in its constructor, its background thread registers the segment and only then installs the connection;
calls made meanwhile are misses with no request sent. The same holds after a server restart (a new
segment). The tests count requests and read states; the timings they print are information only.
"""

from __future__ import annotations

import collections
import mmap
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tiercache.gpu import LayoutKind, Move, PagedLayout, dispatch, object_spec, reference
from tiercache.server import cuda
from tiercache.server.client import SharedL1
from tiercache.server.segment import Segment

LAYOUT = PagedLayout(
    LayoutKind.VLLM_FLASH, num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16"
)
CHUNK = 64
SPEC = object_spec(LAYOUT, CHUNK)
BIG = 8 << 30  # a multi-GiB segment: its registration takes far longer than a few calls


def _serve(path: str, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tiercache.server", "--socket", path, "--slot-bytes", str(SPEC.nbytes)]
    proc = subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, text=True, cwd=str(Path(path).parent))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("tiercache server listening"):
        proc.kill()
        proc.wait(timeout=30)
        pytest.fail(f"the server did not start: {line!r}")
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
    proc.wait(timeout=60)
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture
def socket_path(sock_dir: Path) -> Iterator[str]:
    path = str(sock_dir / "l1.sock")
    proc = _serve(path, "--slots", "8")
    try:
        yield path
    finally:
        _stop(proc)


@pytest.fixture
def big_server(sock_dir: Path) -> Iterator[str]:
    path = str(sock_dir / "big.sock")
    proc = _serve(path, "--capacity", str(BIG))
    try:
        yield path
    finally:
        _stop(proc)


class RegistrationWatch:
    """Stands in for ``cuda.register`` and calls the real one: counts registrations started and finished,
    and records the thread each ran on and the seconds each took."""

    def __init__(self) -> None:
        self._real = cuda.register
        self._cond = threading.Condition()
        self.started = 0
        self.finished = 0
        self.threads: list[threading.Thread] = []
        self.seconds: list[float | None] = []

    def __call__(self, data: mmap.mmap) -> float | None:
        with self._cond:
            self.started += 1
            self.threads.append(threading.current_thread())
            self._cond.notify_all()
        took = None
        try:
            took = self._real(data)
            return took
        finally:
            with self._cond:
                self.seconds.append(took)
                self.finished += 1
                self._cond.notify_all()

    def wait_started(self, n: int, timeout_s: float) -> bool:
        """Wait until ``n`` registrations have started; whether they have."""
        with self._cond:
            return self._cond.wait_for(lambda: self.started >= n, timeout_s)


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> RegistrationWatch:
    w = RegistrationWatch()
    monkeypatch.setattr(cuda, "register", w)
    return w


def _round_trip(l1: SharedL1, keys: tuple[str, str], *, commit: bool = False) -> Segment:
    """Gather random KV into two reserved shared slots on the GPU, check them bit-exact against the CPU
    reference, scatter them back into zeroed KV and check that too; the slots' segment."""
    nb, bs = 16, LAYOUT.block_size
    gen = torch.Generator(device="cuda").manual_seed(5)
    kv = [
        torch.randn(LAYOUT.layer_shape(nb), generator=gen, device="cuda").to(torch.bfloat16) for _ in range(4)
    ]
    kv2 = [torch.zeros_like(t) for t in kv]
    slots = torch.randperm(nb * bs, generator=gen, device="cuda")[: 2 * CHUNK]
    spans = [(0, CHUNK), (CHUNK, 2 * CHUNK)]
    want = [torch.empty(SPEC.shape, dtype=torch.bfloat16) for _ in spans]  # the CPU reference's objects
    reference.gather([t.cpu() for t in kv], Move.gather(LAYOUT, slots.cpu(), spans, want))
    objs = l1.batched_reserve_write(list(keys), [SPEC, SPEC])
    assert all(o is not None for o in objs)
    live = [o for o in objs if o is not None]
    seg = live[0].seg
    try:
        shared = [o.tensor() for o in live]
        assert all(t.is_pinned() for t in shared)  # the registered mapping is pinned memory to torch
        dispatch.gather(kv, Move.gather(LAYOUT, slots, spans, shared))
        torch.cuda.synchronize()
        for got, exp in zip(shared, want, strict=True):
            assert torch.equal(got.view(torch.int16), exp.view(torch.int16))
        dispatch.scatter(kv2, Move.scatter(LAYOUT, slots, spans, shared))
        back = [torch.empty(SPEC.shape, dtype=torch.bfloat16) for _ in spans]
        reference.gather([t.cpu() for t in kv2], Move.gather(LAYOUT, slots.cpu(), spans, back))
        for got, exp in zip(back, want, strict=True):
            assert torch.equal(got.view(torch.int16), exp.view(torch.int16))
    finally:
        if commit:
            l1.batched_finish_write(live)
        else:
            l1.batched_abort_write(live)
    return seg


def _calls_miss(l1: SharedL1) -> list[float]:
    """Every request-making call of the L1 surface, three times, each a miss or a skipped store; their
    seconds (8 keys missed and 3 stores skipped per round)."""
    calls: list[Callable[[], bool]] = [
        lambda: l1.contains("a") is False,
        lambda: l1.batched_contains(["a", "b"]) == [False, False],
        lambda: l1.reserve_write("a", SPEC) is None,
        lambda: l1.batched_reserve_write(["a", "b"], [SPEC, SPEC]) == [None, None],
        lambda: l1.acquire("a") is None,
        lambda: l1.batched_acquire(["a", "b"]) == [None, None],
        lambda: l1.batched_locate(["a", "b"], prefetch=True) == [None, None],
        lambda: l1.server_stats() is None,
    ]
    took: list[float] = []
    for _ in range(3):
        for call in calls:
            start = time.perf_counter()
            missed = call()
            took.append(time.perf_counter() - start)
            assert missed
    return took


def _us(seconds: list[float]) -> str:
    return f"max {max(seconds) * 1e6:.1f} us, median {sorted(seconds)[len(seconds) // 2] * 1e6:.1f} us"


def test_registered_shared_slots_are_pinned_and_round_trip_bit_exact(socket_path: str) -> None:
    l1 = SharedL1(socket_path)
    try:
        assert l1.wait_connected(60)  # the segment is registered in the background, then installed
        seg = _round_trip(l1, ("a", "b"))
        assert seg.cuda_register_s is not None  # a worker's client registered its mapping
    finally:
        l1.close()


def test_registration_runs_off_the_request_path(big_server: str, watch: RegistrationWatch) -> None:
    """An 8 GiB segment: the constructor returns after the HELLO, the watcher thread registers the mapping,
    and every call made meanwhile is a miss with no request sent; once installed the slots are pinned and
    GPU moves through them are bit-exact."""
    torch.zeros(1, device="cuda")  # CUDA is initialised in this process, as in a vLLM worker
    made = time.perf_counter()
    l1 = SharedL1(big_server, slot_bytes=[SPEC.nbytes])
    ctor_s = time.perf_counter() - made
    try:
        assert l1.requests == collections.Counter()  # the constructor made the HELLO alone
        assert watch.wait_started(1, 60)
        assert watch.threads[0] is not threading.current_thread()  # registered by the background thread
        took = _calls_miss(l1)
        assert watch.finished == 0, "the registration ended before the calls: they cannot show anything"
        assert not l1.connected()
        assert l1.requests == collections.Counter()  # no call sent a request, none waited for one
        assert (l1.offline_misses, l1.skipped_stores) == (3 * 8, 3 * 3)
        assert l1.wait_connected(120)
        assert l1.requests == collections.Counter()
        seg = _round_trip(l1, ("a", "b"))
        assert seg.data_bytes > BIG // 2
        assert seg.cuda_register_s is not None
        assert seg.cuda_register_s == watch.seconds[0]
        assert watch.started == 1
        print(
            f"8 GiB segment: constructor {ctor_s * 1e3:.1f} ms, registration {seg.cuda_register_s:.2f} s, "
            f"{len(took)} calls meanwhile: {_us(took)}"
        )
    finally:
        l1.close()


def test_a_restarted_server_is_registered_again_in_the_background(
    sock_dir: Path, watch: RegistrationWatch
) -> None:
    """The server restarts with a new 8 GiB segment: the client reconnects by itself, registers the new
    segment in the background, misses meanwhile (no requests, no waits), then serves bit-exact GPU moves
    through the new pinned slots."""
    path = str(sock_dir / "l1.sock")
    torch.zeros(1, device="cuda")
    first = _serve(path, "--capacity", str(BIG))
    second: subprocess.Popen[str] | None = None
    l1 = SharedL1(path, slot_bytes=[SPEC.nbytes], backoff_s=0.01, max_backoff_s=0.05)
    try:
        assert l1.wait_connected(120)
        old = _round_trip(l1, ("a", "b"), commit=True)
        lease = l1.acquire("a")
        assert lease is not None
        assert lease.valid()
        _stop(first)
        second = _serve(path, "--capacity", str(BIG))
        assert watch.wait_started(2, 120)  # reconnected (HELLO) and registering the new segment
        asked = collections.Counter(l1.requests)
        took = _calls_miss(l1)
        assert watch.finished == 1, "the registration ended before the calls: they cannot show anything"
        assert not l1.connected()
        assert l1.requests == asked
        assert not lease.valid()
        lease.release()  # the lost connection already dropped it: nothing is sent
        assert l1.wait_connected(120, reconnects=1)
        assert l1.contains("a") is False  # the new server knows nothing of the old one's objects
        new = _round_trip(l1, ("c", "d"))
        assert new is not old
        assert new.cuda_register_s is not None
        assert new.cuda_register_s == watch.seconds[1]
        assert watch.threads[1] is not threading.current_thread()
        print(
            f"restart: re-registration {new.cuda_register_s:.2f} s (first {old.cuda_register_s:.2f} s), "
            f"{len(took)} calls meanwhile: {_us(took)}"
        )
    finally:
        l1.close()
        _stop(first)
        if second is not None:
            _stop(second)
