"""The native CPU row kernel (gpu/_rowcopy.c via cpu_rows) against the torch path, bit for bit, every layout.

Each case runs the same gather / scatter twice on identical inputs: once through the kernel, once with
``TIERCACHE_CPU_KERNELS=0`` (the torch path, itself checked against a per-token loop in test_gpu_reference),
and asserts equal objects, equal KV and equal token counts, and that the kernel was the path taken.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import shutil
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_gpu_reference import L, make_engine
from tiercache.gpu import LayoutKind, Move, PagedLayout, cpu_rows, dispatch, object_spec
from tiercache.testing.harness.moves import DTYPES, bits, poisoned, random_tensor

# The moves of these cases, spelled as the cases read (one layer: ``layers=range(layer, layer + 1)``).


def _layers(layer: int | None) -> range | None:
    return None if layer is None else range(layer, layer + 1)


def gather(
    kv: object,
    layout: PagedLayout,
    slots: torch.Tensor,
    spans: object,
    out: list[torch.Tensor],
    layer: int | None = None,
) -> None:
    move = Move.gather(layout, slots, spans, out, layers=_layers(layer))  # type: ignore[arg-type]
    dispatch.gather(kv, move)  # type: ignore[arg-type]


def scatter(
    objs: list[torch.Tensor],
    kv: object,
    layout: PagedLayout,
    slots: torch.Tensor,
    spans: object,
    skip_prefix: object = 0,
    layer: int | None = None,
) -> int:
    move = Move.scatter(layout, slots, spans, objs, skip_prefix, layers=_layers(layer))  # type: ignore[arg-type]
    return dispatch.scatter(kv, move)  # type: ignore[arg-type]


@contextmanager
def cpu_kernels(value: str) -> Iterator[None]:
    """Run the body with ``TIERCACHE_CPU_KERNELS`` set to ``value`` (restored after)."""
    old = os.environ.get("TIERCACHE_CPU_KERNELS")
    os.environ["TIERCACHE_CPU_KERNELS"] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ["TIERCACHE_CPU_KERNELS"]
        else:
            os.environ["TIERCACHE_CPU_KERNELS"] = old


def torch_path() -> contextlib.AbstractContextManager[None]:
    """Run the body with the native kernel switched off."""
    return cpu_kernels("0")


@contextmanager
def kernel_calls() -> Iterator[mock.MagicMock]:
    """Count the kernel calls made in the body (the real kernel still runs)."""
    with mock.patch.object(cpu_rows, "copy", wraps=cpu_rows.copy) as spy:
        yield spy


def test_kernel_is_built_where_a_compiler_is() -> None:
    """The editable / wheel install compiles the kernel with the system C compiler when there is one; the
    environment switch turns it off and on at run time (whatever it was set to for the test run)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the torch path is the only one")
    with cpu_kernels("1"):
        assert cpu_rows.native() is not None
        with torch_path():
            assert cpu_rows.native() is None
        assert cpu_rows.native() is not None


VARIANTS = ["flash-strided", "flash-contiguous", "flash-padded", "legacy", "mla"]
KIND = {
    "flash-strided": LayoutKind.VLLM_FLASH,
    "flash-contiguous": LayoutKind.VLLM_FLASH,
    "flash-padded": LayoutKind.VLLM_FLASH,
    "legacy": LayoutKind.VLLM_LEGACY,
    "mla": LayoutKind.VLLM_MLA,
}

TokenCase = tuple[
    str, torch.dtype, int, int, list[int], list[int], str, list[int], int | None, int, torch.dtype
]


@st.composite
def _token_cases(draw: st.DrawFn) -> TokenCase:
    variant = draw(st.sampled_from(VARIANTS))
    dtype = draw(st.sampled_from(DTYPES))
    bs = draw(st.sampled_from([2, 3, 4, 16]))
    n = draw(st.integers(1, 80))
    cuts = sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=4)))) if n > 1 else []
    bounds = [0, *cuts, n]
    skips = [draw(st.integers(0, b - a)) for a, b in itertools.pairwise(bounds)]
    # blocks: a shuffled block table; runs: consecutive blocks from an offset inside a block (the torch
    # path merges them into one copy); tokens: every token anywhere (no whole block at all)
    slot_style = draw(st.sampled_from(["blocks", "runs", "tokens"]))
    negative = draw(st.lists(st.integers(0, n - 1), max_size=3))
    layer = draw(st.none() | st.integers(0, L - 1))
    slot_dtype = draw(st.sampled_from([torch.int64, torch.int32]))  # the kernel reads int64 slots only
    seed = draw(st.integers(0, 2**16))
    return variant, dtype, bs, n, bounds, skips, slot_style, negative, layer, seed, slot_dtype


def _engine_kv(variant: str, dtype: torch.dtype, nblocks: int, bs: int, n: int, seed: int) -> tuple:
    eng = make_engine(
        KIND[variant],
        dtype,
        nblocks,
        bs,
        n,
        seed,
        strided=variant != "flash-contiguous",
        padded=variant == "flash-padded",
    )
    return eng.layout, eng.kv, eng.slots(n)


@settings(max_examples=80, deadline=None)
@given(_token_cases())
def test_token_layouts_kernel_equals_torch_path(case: TokenCase) -> None:
    """Any spans, skips, shuffled or scattered slots (int64 or int32), slots < 0 in a scatter, one layer or
    all: the kernel writes exactly the bytes the torch path writes, and counts the same tokens."""
    variant, dtype, bs, n, bounds, skips, slot_style, negative, layer, seed, slot_dtype = case
    nblocks = -(-n // bs) + 3
    layout, src_kv, slots = _engine_kv(variant, dtype, nblocks, bs, n, seed)
    if slot_style == "tokens":
        gen = torch.Generator().manual_seed(seed)
        slots = torch.randperm(nblocks * bs, generator=gen)[:n]
    elif slot_style == "runs":
        slots = torch.arange(n) + (seed % (2 * bs + 1))  # fits: nblocks * bs >= n + 3 * bs
    slots = slots.to(slot_dtype)
    spans = list(itertools.pairwise(bounds))

    def objects() -> list[torch.Tensor]:
        shapes = [object_spec(layout, b - a) for a, b in spans]
        if layer is None:
            return [poisoned(s.shape, dtype) for s in shapes]
        return [poisoned(s.with_layers(layer, layer + 1).shape, dtype) for s in shapes]

    def run_gather(out: list[torch.Tensor]) -> None:
        gather(src_kv, layout, slots, spans, out, layer=layer)

    fast, slow = objects(), objects()
    with kernel_calls() as spy:
        run_gather(fast)
    assert spy.call_count == (1 if cpu_rows.native() is not None else 0)
    with torch_path():
        run_gather(slow)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(bits(a), bits(b))

    # scatter: full objects (their layer view for one layer, as the engine passes it) into a fresh KV
    full = [poisoned(object_spec(layout, b - a).shape, dtype) for a, b in spans]
    gather(src_kv, layout, slots, spans, full)
    if layer is None:
        sources = full
    elif layout.planes == 1:
        sources = [t[layer : layer + 1] for t in full]
    else:
        sources = [t[:, layer : layer + 1] for t in full]
    sslots = slots.clone()
    sslots[negative] = -1
    _, dst_fast, _ = _engine_kv(variant, dtype, nblocks, bs, n, seed + 1)  # same seed: same KV and strides
    _, dst_slow, _ = _engine_kv(variant, dtype, nblocks, bs, n, seed + 1)

    def run_scatter(kv: list[torch.Tensor]) -> int:
        return scatter(sources, kv, layout, sslots, spans, skip_prefix=skips, layer=layer)

    with kernel_calls() as spy:
        written_fast = run_scatter(dst_fast)
    with torch_path():
        written_slow = run_scatter(dst_slow)
    assert written_fast == written_slow
    kept = sum(int((sslots[a + s : b] >= 0).sum()) for (a, b), s in zip(spans, skips, strict=True))
    assert written_fast == kept
    moved = any(s < b - a for (a, b), s in zip(spans, skips, strict=True))
    assert spy.call_count == (1 if cpu_rows.native() is not None and moved else 0)
    for a, b in zip(dst_fast, dst_slow, strict=True):
        assert torch.equal(bits(a), bits(b))


BlockCase = tuple[torch.dtype, int, int, list[int], list[int], list[int], int]


@st.composite
def _block_cases(draw: st.DrawFn) -> BlockCase:
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn]))
    bs = draw(st.sampled_from([1, 2, 8]))
    pages = draw(st.integers(1, 9))
    n = (pages - 1) * bs + draw(st.integers(1, bs))  # last page partial or whole
    cuts = sorted(set(draw(st.lists(st.integers(1, pages - 1), max_size=3)))) if pages > 1 else []
    bounds = [0, *(c * bs for c in cuts), n]
    # whole pages, or the whole span (a partial last page is then skipped too)
    skips = [min(draw(st.integers(0, -(-(b - a) // bs))) * bs, b - a) for a, b in itertools.pairwise(bounds)]
    negative_pages = draw(st.lists(st.integers(0, pages - 1), max_size=2))
    return dtype, bs, n, bounds, skips, negative_pages, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(_block_cases())
def test_cpu_blocks_kernel_equals_torch_path(case: BlockCase) -> None:
    """CPU_BLOCKS: whole pages from a shuffled block table, a partial last page, whole-page skips and
    pages < 0 in a scatter: the kernel's objects and KV equal the torch path's, token counts too."""
    dtype, bs, n, bounds, skips, negative_pages, seed = case
    gen = torch.Generator().manual_seed(seed)
    h, d = 2, 4
    pages = -(-n // bs)
    nblocks = pages + 3
    layout = PagedLayout(LayoutKind.CPU_BLOCKS, L, h, d, bs, str(dtype))
    src_kv = [random_tensor(layout.layer_shape(nblocks), dtype, gen) for _ in range(L)]
    table = torch.randperm(nblocks - 1, generator=gen)[:pages] + 1
    pos = torch.arange(n)
    slots = table[pos // bs] * bs + pos % bs
    spans = list(itertools.pairwise(bounds))
    fast = [poisoned(object_spec(layout, b - a).shape, dtype) for a, b in spans]
    slow = [poisoned(object_spec(layout, b - a).shape, dtype) for a, b in spans]
    with kernel_calls() as spy:
        gather(src_kv, layout, slots, spans, fast)
    assert spy.call_count == (1 if cpu_rows.native() is not None else 0)
    with torch_path():
        gather(src_kv, layout, slots, spans, slow)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(bits(a), bits(b))
    sslots = slots.clone()
    for p in negative_pages:
        sslots[p * bs : (p + 1) * bs] = -1
    dst_kv = [random_tensor(layout.layer_shape(nblocks), dtype, gen) for _ in range(L)]
    dst_fast, dst_slow = [t.clone() for t in dst_kv], [t.clone() for t in dst_kv]
    written_fast = scatter(fast, dst_fast, layout, sslots, spans, skip_prefix=skips)
    with torch_path():
        written_slow = scatter(fast, dst_slow, layout, sslots, spans, skip_prefix=skips)
    assert written_fast == written_slow
    for a, b in zip(dst_fast, dst_slow, strict=True):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_bad_slots_leave_every_object_untouched(kernel: str) -> None:
    """A bad slot in a later span is rejected before anything is copied, on the kernel path and on the torch
    path alike: no half-filled objects after a gather, no half-written KV after a scatter."""
    with cpu_kernels(kernel):
        if kernel == "1" and cpu_rows.native() is None:
            pytest.skip("no native kernel built")
        layout, kv, slots = _engine_kv("flash-strided", torch.bfloat16, 12, 4, 32, seed=5)
        spans = [(0, 16), (16, 32)]
        for bad in (-1, 12 * 4):
            s = slots.clone()
            s[20] = bad
            out = [poisoned(object_spec(layout, 16).shape, torch.bfloat16) for _ in spans]
            with pytest.raises(ValueError, match="slot"):
                gather(kv, layout, s, spans, out)
            assert all(bool((bits(o) == -1).all()) for o in out)
        gen = torch.Generator().manual_seed(4)
        objs = [random_tensor(object_spec(layout, 16).shape, torch.bfloat16, gen) for _ in spans]
        before = [t.clone() for t in kv]
        s = slots.clone()
        s[20] = 12 * 4  # past the paged KV (a scatter skips slots < 0)
        with pytest.raises(ValueError, match="outside the paged KV"):
            scatter(objs, kv, layout, s, spans)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(kv, before, strict=True))


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_bad_pages_leave_every_object_untouched(kernel: str) -> None:
    """CPU_BLOCKS: a later span whose slots are not whole blocks, lie past the KV or (gather) are < 0
    writes nothing, kernel path or torch path."""
    with cpu_kernels(kernel):
        if kernel == "1" and cpu_rows.native() is None:
            pytest.skip("no native kernel built")
        bs, h, d, nblocks = 4, 2, 8, 12
        layout = PagedLayout(LayoutKind.CPU_BLOCKS, L, h, d, bs, "bfloat16")
        gen = torch.Generator().manual_seed(3)
        kv = [random_tensor(layout.layer_shape(nblocks), torch.bfloat16, gen) for _ in range(L)]
        table = torch.randperm(nblocks - 1, generator=gen)[:8] + 1
        pos = torch.arange(32)
        slots = table[pos // bs] * bs + pos % bs
        spans = [(0, 16), (16, 32)]
        shuffled, past, negative = slots.clone(), slots.clone(), slots.clone()
        shuffled[[20, 21]] = shuffled[[21, 20]]
        past[20:24] = torch.arange(nblocks * bs, nblocks * bs + 4)
        negative[20:24] = -1
        for bad, what in ((shuffled, "whole blocks"), (past, "outside the paged KV"), (negative, "< 0")):
            out = [poisoned(object_spec(layout, 16).shape, torch.bfloat16) for _ in spans]
            with pytest.raises(ValueError, match=what):
                gather(kv, layout, bad, spans, out)
            assert all(bool((bits(o) == -1).all()) for o in out)
        objs = [random_tensor(object_spec(layout, 16).shape, torch.bfloat16, gen) for _ in spans]
        before = [t.clone() for t in kv]
        for bad, what in ((shuffled, "whole blocks"), (past, "outside the paged KV")):
            with pytest.raises(ValueError, match=what):
                scatter(objs, kv, layout, bad, spans)
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(kv, before, strict=True))


@pytest.mark.parametrize("threads", [2, 3, 64])
def test_threads_split_spans_and_layers(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """Several threads taking (span, layer) tasks in turn write what one thread (and the torch path)
    writes, gather and scatter, with more threads than tasks too."""
    if cpu_rows.native() is None:
        pytest.skip("no native kernel built")
    layout, kv, slots = _engine_kv("flash-strided", torch.bfloat16, 30, 4, 100, seed=9)
    spans = [(0, 30), (30, 64), (64, 100)]
    with torch_path():
        want = [poisoned(object_spec(layout, b - a).shape, torch.bfloat16) for a, b in spans]
        gather(kv, layout, slots, spans, want)
    monkeypatch.setattr(cpu_rows, "threads", lambda nbytes: threads)
    got = [poisoned(object_spec(layout, b - a).shape, torch.bfloat16) for a, b in spans]
    gather(kv, layout, slots, spans, got)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want, strict=True))
    _, dst, _ = _engine_kv("flash-strided", torch.bfloat16, 30, 4, 100, seed=10)
    _, dst_ref, _ = _engine_kv("flash-strided", torch.bfloat16, 30, 4, 100, seed=10)
    sslots = slots.clone()
    sslots[50] = -1
    assert scatter(got, dst, layout, sslots, spans, skip_prefix=[3, 0, 5]) == 100 - 8 - 1
    with torch_path():
        scatter(want, dst_ref, layout, sslots, spans, skip_prefix=[3, 0, 5])
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(dst, dst_ref, strict=True))


def test_thread_count_follows_torch_and_size() -> None:
    """Small copies, a one-chunk Llama-8B copy (32 MiB) included, stay on the caller's thread; large ones use
    up to torch's intra-op thread count."""
    assert cpu_rows.threads(1 << 20) == 1
    assert cpu_rows.threads(32 << 20) == 1
    assert cpu_rows.threads(1 << 40) == torch.get_num_threads()


def _gather_case(seed: int) -> tuple[PagedLayout, list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """A paged KV, its slots and the torch path's objects of three spans (env switch: the caller's thread)."""
    layout, kv, slots = _engine_kv("flash-strided", torch.bfloat16, 30, 4, 100, seed=seed)
    with torch_path():
        want = [poisoned(object_spec(layout, b - a).shape, torch.bfloat16) for a, b in _SPANS]
        gather(kv, layout, slots, _SPANS, want)
    return layout, kv, slots, want


_SPANS = [(0, 30), (30, 64), (64, 100)]


def _kernel_gathers_match(
    case: tuple[PagedLayout, list[torch.Tensor], torch.Tensor, list[torch.Tensor]], rounds: int
) -> bool:
    """``rounds`` kernel gathers of ``case`` equal its torch objects, bit for bit."""
    layout, kv, slots, want = case
    for _ in range(rounds):
        got = [poisoned(object_spec(layout, b - a).shape, torch.bfloat16) for a, b in _SPANS]
        gather(kv, layout, slots, _SPANS, got)
        if not all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want, strict=True)):
            return False
    return True


def test_concurrent_callers_copy_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python threads in kernel calls at once (ctypes drops the GIL), each call on its own OpenMP team:
    every object is still exact."""
    if cpu_rows.native() is None:
        pytest.skip("no native kernel built")
    cases = [_gather_case(seed) for seed in range(20, 28)]
    monkeypatch.setattr(cpu_rows, "threads", lambda nbytes: 3)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda case: _kernel_gathers_match(case, 20), cases))
    assert results == [True] * 8


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_forked_child_copies_on_its_own_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child forked after threaded copies (its parent's OpenMP workers exist, the child has none, and
    libgomp would wait for them) copies exactly, on its caller's thread, and does not hang; the parent's
    threaded copies still work after the fork."""
    if cpu_rows.native() is None:
        pytest.skip("no native kernel built")
    case = _gather_case(30)
    monkeypatch.setattr(cpu_rows, "threads", lambda nbytes: 2)
    assert _kernel_gathers_match(case, 2)
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no exceptions out of here
        code = 1
        try:
            code = 0 if _kernel_gathers_match(case, 3) else 2
        finally:
            os._exit(code)
    exited = _wait_exit(pid, 120)
    if not exited:  # hung: kill it, and fail
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert exited, "the forked child hung"
    assert os.waitstatus_to_exitcode(status) == 0
    assert _kernel_gathers_match(case, 2)


def _wait_exit(pid: int, limit_s: float) -> bool:
    """Wait for child ``pid`` to exit (its pidfd turns readable), at most ``limit_s``: False if it did not.
    Without pidfds, wait for it unbounded (the suite's timeout ends a hang)."""
    if not hasattr(os, "pidfd_open"):
        return True
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], limit_s)
    finally:
        os.close(fd)
    return bool(ready)


def _at_offset(
    shape: tuple[int, ...], dtype: torch.dtype, offset: int, fill: torch.Tensor | None
) -> torch.Tensor:
    """A dense tensor of ``shape`` starting ``offset`` elements into a fresh buffer (misaligned rows),
    holding ``fill`` or the all-ones sentinel."""
    n = 1
    for s in shape:
        n *= s
    base = poisoned((n + offset,), dtype)
    t = base[offset:].view(shape)
    if fill is not None:
        t.copy_(fill)
    return t


def _kernel_round_trip_equals_torch_path(
    layout: PagedLayout,
    kv: list[torch.Tensor],
    slots: torch.Tensor,
    spans: list[tuple[int, int]],
    stores: int,
    obj_offset: int,
    kv_offset: int,
) -> None:
    """With store kind ``stores``, the kernel's gather into objects placed ``obj_offset`` bytes into their
    buffers, and its scatter of them into fresh poisoned KV placed ``kv_offset`` bytes in, write exactly the
    torch path's bytes (one kernel call each, every token counted)."""
    dtype, shape = kv[0].dtype, tuple(kv[0].shape)
    obj_shape = [object_spec(layout, b - a).shape for a, b in spans]
    want = [poisoned(s, dtype) for s in obj_shape]
    with torch_path():
        gather(kv, layout, slots, spans, want)
    with mock.patch.object(cpu_rows, "STORES", stores), kernel_calls() as spy:
        got = [_at_offset(s, dtype, obj_offset, None) for s in obj_shape]
        gather(kv, layout, slots, spans, got)
        back = [_at_offset(shape, dtype, kv_offset, poisoned(shape, dtype)) for _ in range(L)]
        assert scatter(got, back, layout, slots, spans) == slots.numel()
    assert spy.call_count == 2
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want, strict=True))
    ref = [poisoned(shape, dtype) for _ in range(L)]
    with torch_path():
        scatter(want, ref, layout, slots, spans)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(back, ref, strict=True))


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([0, 1, 2]),
    st.sampled_from([torch.bfloat16, torch.float32, torch.float8_e4m3fn]),
    st.sampled_from([8, 32, 40, 64]),
    st.sampled_from([0, 8, 32]),
    st.sampled_from([0, 16]),
    st.integers(1, 40),
    st.integers(0, 2**16),
)
def test_every_store_kind_equals_torch_path(
    stores: int, dtype: torch.dtype, d: int, obj_offset: int, kv_offset: int, n: int, seed: int
) -> None:
    """Cached, 16-byte streaming and widest streaming stores (64-byte with AVX-512F), rows of 8-256 bytes,
    objects and KV aligned or not to 16 / 64 bytes: gather and scatter write the torch path's bytes."""
    if cpu_rows.native() is None:
        pytest.skip("no native kernel built")
    gen = torch.Generator().manual_seed(seed)
    bs, h = 4, 2
    nblocks = -(-n // bs) + 3
    layout = PagedLayout(LayoutKind.VLLM_FLASH, L, h, d, bs, str(dtype).removeprefix("torch."))
    shape = layout.layer_shape(nblocks)
    kv = [_at_offset(shape, dtype, kv_offset, random_tensor(shape, dtype, gen)) for _ in range(L)]
    slots = torch.randperm(nblocks * bs, generator=gen)[:n]
    spans = [(0, n // 2), (n // 2, n)] if n > 1 else [(0, n)]
    _kernel_round_trip_equals_torch_path(layout, kv, slots, spans, stores, obj_offset, kv_offset)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([0, 1, 2]),
    st.sampled_from([(1, 16, 64, torch.bfloat16), (2, 8, 72, torch.float32), (1, 16, 66, torch.bfloat16)]),
    st.sampled_from([0, 16, 64]),
    st.sampled_from([0, 16]),
    st.integers(1, 5),
    st.integers(0, 2**16),
)
def test_long_pages_copy_exactly_in_interleaved_parts(
    stores: int,
    page: tuple[int, int, int, torch.dtype],
    obj_offset: int,
    kv_offset: int,
    blocks: int,
    seed: int,
) -> None:
    """CPU_BLOCKS pages of 4 KiB and more (4096 and 9216 bytes: copied as interleaved parts; 4224: not a
    multiple of the parts, copied whole) under every store kind, objects and KV aligned to 64 or 16 bytes:
    gather and scatter write exactly the torch path's bytes, shuffled blocks and a partial last page
    included."""
    if cpu_rows.native() is None:
        pytest.skip("no native kernel built")
    h, bs, d, dtype = page
    gen = torch.Generator().manual_seed(seed)
    layout = PagedLayout(LayoutKind.CPU_BLOCKS, L, h, d, bs, str(dtype).removeprefix("torch."))
    nblocks = blocks + 3
    shape = layout.layer_shape(nblocks)
    kv = [_at_offset(shape, dtype, kv_offset, random_tensor(shape, dtype, gen)) for _ in range(L)]
    n = blocks * bs - (seed % bs)  # the last page partial unless seed % bs == 0
    table = torch.randperm(nblocks, generator=gen)[:blocks]
    pos = torch.arange(n)
    slots = table[pos // bs] * bs + pos % bs
    spans = [(0, (blocks // 2) * bs), ((blocks // 2) * bs, n)] if blocks > 1 else [(0, n)]
    _kernel_round_trip_equals_torch_path(layout, kv, slots, spans, stores, obj_offset, kv_offset)


@settings(max_examples=50, deadline=None)
@given(
    st.sampled_from([LayoutKind.VLLM_FLASH, LayoutKind.VLLM_LEGACY, LayoutKind.VLLM_MLA]),
    # (heads, head dim, dtype): tokens of 32 B (prefetched 256 tokens ahead) to 32 KiB (not prefetched),
    # 16 KiB (the largest prefetched) and Llama-8B's 4 KiB between
    st.sampled_from(
        [
            (1, 8, torch.bfloat16),
            (2, 40, torch.float32),
            (3, 24, torch.bfloat16),
            (8, 128, torch.bfloat16),
            (4, 1024, torch.bfloat16),
            (8, 512, torch.float32),
        ]
    ),
    st.sampled_from([1, 3, 16]),
    st.integers(1, 300),
    st.lists(st.integers(1, 299), max_size=4),
    st.sampled_from([0, 8, 48]),
    st.integers(0, 2**16),
)
def test_gather_prefetch_ahead_equals_torch_path(
    kind: LayoutKind,
    shape: tuple[int, int, torch.dtype],
    bs: int,
    n: int,
    cuts: list[int],
    obj_offset: int,
    seed: int,
) -> None:
    """Gathers prefetch the paged rows of a token ahead of the one they copy: any token size (prefetched
    many tokens ahead, one ahead, or not at all), a shuffled block table entered mid-block (odd run
    lengths), spans shorter and longer than the distance, objects off 16 / 64-byte alignment: gather and
    scatter write exactly the torch path's bytes."""
    if cpu_rows.native() is None:
        pytest.skip("no native kernel built")
    h, d, dtype = shape
    if kind is LayoutKind.VLLM_MLA:
        h = 1
    gen = torch.Generator().manual_seed(seed)
    layout = PagedLayout(kind, L, h, d, bs, str(dtype).removeprefix("torch."))
    first = seed % bs  # the first token's offset in its block
    nblocks = -(-(n + first) // bs) + 2
    kv_shape = layout.layer_shape(nblocks)
    kv = [random_tensor(kv_shape, dtype, gen) for _ in range(L)]
    table = torch.randperm(nblocks, generator=gen)
    pos = torch.arange(n) + first
    slots = table[pos // bs] * bs + pos % bs
    bounds = [0, *sorted({c for c in cuts if c < n}), n]
    spans = list(itertools.pairwise(bounds))
    _kernel_round_trip_equals_torch_path(layout, kv, slots, spans, cpu_rows.STORES, obj_offset, 0)


@pytest.mark.parametrize("kind", [LayoutKind.VLLM_FLASH, LayoutKind.VLLM_LEGACY])
def test_whole_block_then_a_run_across_a_block_boundary(kind: LayoutKind) -> None:
    """Slots 12, 13 (block 6, whole) then 41, 42 (consecutive, but across blocks 20 and 21, block size 2):
    the torch path moves 41 and 42 row by row (it once took them for block 20 and wrote slots 40 and 41),
    and writes the kernel's bytes, gather and scatter."""
    if cpu_rows.native() is None:
        pytest.skip("no native kernel built")
    gen = torch.Generator().manual_seed(5)
    layout = PagedLayout(kind, L, 2, 16, 2, "bfloat16")
    shape = layout.layer_shape(26)
    kv = [random_tensor(shape, torch.bfloat16, gen) for _ in range(L)]
    slots = torch.tensor([12, 13, 41, 42])
    _kernel_round_trip_equals_torch_path(layout, kv, slots, [(0, 4)], cpu_rows.STORES, 0, 0)
