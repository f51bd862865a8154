"""GPU tests of the Triton kernels, the GPU<->L1 pipeline and the fused fp8 gather (skipped without CUDA).

Random bit patterns (never zeros), poisoned outputs checked for full coverage, bit-exact against the torch
reference (which runs on the same CUDA tensors).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tiercache.testing.harness import moves as cases
from tiercache.testing.harness.moves import (
    DTYPES,
    KINDS,
    bits,
    k_gather,
    k_scatter,
    ref_gather,
    ref_scatter,
    sentinel_left,
)

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from tiercache.errors import Unsupported
from tiercache.gpu import (
    LayoutKind,
    Move,
    PagedLayout,
    dispatch,
    object_spec,
    reference,
    transfer,
)
from tiercache.gpu import triton_kernels as tk
from tiercache.serde.fp8 import Fp8Codec
from tiercache.store.l1 import L1Cache

DEV = torch.device("cuda")
make_kv = functools.partial(
    cases.make_kv, device=DEV, layers=4, heads=4, head_dim=64, bs=16, nb=64, tokens=600
)


def poisoned(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device = DEV, pin: bool = False
) -> torch.Tensor:
    return cases.poisoned(shape, dtype, device, pin)


def d_gather(kv: Any, layout: PagedLayout, slots: torch.Tensor, spans: Any, out: Any, **kw: Any) -> None:
    dispatch.gather(kv, Move.gather(layout, slots, spans, out, **kw))


def d_scatter(objs: Any, kv: Any, layout: PagedLayout, slots: torch.Tensor, spans: Any, skip: Any = 0) -> int:
    return dispatch.scatter(kv, Move.scatter(layout, slots, spans, objs, skip))


def spans_of(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


CONFIGS = [
    pytest.param(tk.DEFAULT_CONFIG, id="default"),
    pytest.param(tk.TileConfig(128, 0, 2), id="head-chunks"),
    pytest.param(tk.TileConfig(65536, 0, 8), id="big-tile"),
]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("kind", "strided"), KINDS)
def test_kernels_match_reference(
    kind: LayoutKind, strided: bool, dtype: torch.dtype, cfg: tk.TileConfig
) -> None:
    n = 600
    spans = spans_of(n, 256)  # the last chunk is unfull (88 tokens)
    layout, kv, slots = make_kv(kind, dtype, strided, seed=1, tokens=n, heads=6)
    want = [poisoned(object_spec(layout, e - s).shape, dtype) for s, e in spans]
    got = [poisoned(w.shape, dtype) for w in want]
    ref_gather(kv, layout, slots, spans, want)
    k_gather(kv, layout, slots, spans, got, cfg=cfg)
    for a, b in zip(want, got, strict=True):
        assert not sentinel_left(b)
        assert torch.equal(bits(a), bits(b))
    _, dst_ref, other = make_kv(kind, dtype, strided, seed=2, tokens=n, heads=6)
    dst_ker = [t.clone() for t in dst_ref]
    other[300] = -1
    skips = [37, 0, 5]
    assert (
        ref_scatter(got, dst_ref, layout, other, spans, skips)
        == k_scatter(got, dst_ker, layout, other, spans, skips, cfg=cfg)
        == n - 37 - 5 - 1
    )
    for a, b in zip(dst_ref, dst_ker, strict=True):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("coalesce", [False, True], ids=["per-object", "coalesced"])
@pytest.mark.parametrize(("kind", "strided"), KINDS)
def test_dispatch_through_pinned_l1(
    kind: LayoutKind, strided: bool, coalesce: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA KV <-> L1 objects (pinned pool views) through the staged pipeline, small staging (many groups)."""
    n = 1000
    spans = spans_of(n, 128)
    layout, kv, slots = make_kv(kind, torch.bfloat16, strided, seed=3, tokens=n, nb=80)
    spec = object_spec(layout, 128)
    l1 = L1Cache(len(spans) * 2 * spec.nbytes, spec.nbytes, pinned=True)
    objs = [l1.reserve_write(f"k{i}", object_spec(layout, e - s)) for i, (s, e) in enumerate(spans)]
    outs = [o.tensor() for o in objs if o is not None]
    assert len(outs) == len(spans)
    for o in outs:
        bits(o).fill_(-1)
    xfer = transfer.transfer_for(DEV)
    old, old_co = xfer.staging_bytes, xfer.coalesce
    xfer.staging_bytes = 3 * spec.nbytes  # 3 chunks per group, 3 groups, 2 buffers
    xfer.coalesce = coalesce
    monkeypatch.setattr(dispatch, "ZERO_COPY_BYTES", 0)  # these small moves would go over the bus
    monkeypatch.setattr(dispatch, "PIECED_MIN_BYTES", 1 << 62)  # ... or in layer pieces
    try:
        d_gather(kv, layout, slots, spans, outs)
        want = [poisoned(o.shape, o.dtype, torch.device("cpu")) for o in outs]
        ref_gather(kv, layout, slots, spans, want)
        for a, b in zip(want, outs, strict=True):
            assert not sentinel_left(b)
            assert torch.equal(bits(a), bits(b))
        _, dst, other = make_kv(kind, torch.bfloat16, strided, seed=4, tokens=n, nb=80)
        dst_ref = [t.clone() for t in dst]
        other[700] = -1
        assert d_scatter(outs, dst, layout, other, spans, 40) == n - 41
        assert ref_scatter(outs, dst_ref, layout, other, spans, 40) == n - 41
        for a, b in zip(dst_ref, dst, strict=True):
            assert torch.equal(bits(a), bits(b))
        # layerwise entry points
        spec1 = object_spec(layout, 128).with_layers(2, 3)
        one = poisoned(spec1.shape, torch.bfloat16, torch.device("cpu"), pin=True)
        ref1 = poisoned(spec1.shape, torch.bfloat16, torch.device("cpu"))
        d_gather(kv, layout, slots, [(128, 256)], [one], layers=range(2, 3))
        ref_gather(kv, layout, slots, [(128, 256)], [ref1], range(2, 3))
        assert torch.equal(bits(one), bits(ref1))
        # host-checked and trusted moves through the pipeline
        for kw in ({"host_slots": slots.cpu()}, {"trusted": True}):
            for o in outs:
                bits(o).fill_(-1)
            d_gather(kv, layout, slots, spans, outs, **kw)  # type: ignore[arg-type]
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(want, outs, strict=True))
        bad = slots.cpu()
        bad[5] = -1
        with pytest.raises(ValueError, match="slots < 0"):
            d_gather(kv, layout, slots, spans, outs, host_slots=bad)
    finally:
        xfer.staging_bytes, xfer.coalesce = old, old_co


def test_gather_errors_and_fallback() -> None:
    layout, kv, slots = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=5, tokens=256)
    out = [poisoned(object_spec(layout, 256).shape, torch.bfloat16)]
    bad = slots.clone()
    bad[10] = -1
    with pytest.raises(ValueError, match="slots < 0"):
        d_gather(kv, layout, bad, [(0, 256)], out)
    bad[10] = 10**6
    with pytest.raises(ValueError, match="outside the paged KV"):
        d_gather(kv, layout, bad, [(0, 256)], out)
    kv[1] = kv[1].contiguous()  # strides differ between layers: the reference runs instead
    with pytest.raises(Unsupported):
        k_gather(kv, layout, slots, [(0, 256)], out)
    want = [poisoned(out[0].shape, torch.bfloat16)]
    d_gather(kv, layout, slots, [(0, 256)], out)
    ref_gather(kv, layout, slots, [(0, 256)], want)
    assert torch.equal(bits(out[0]), bits(want[0]))


@pytest.mark.parametrize("block_t", [0, 32], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("soft", [False, True], ids=["hw-cvt", "soft-cvt"])
@pytest.mark.parametrize("kind", [LayoutKind.VLLM_FLASH, LayoutKind.VLLM_LEGACY, LayoutKind.VLLM_MLA])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fused_fp8_gather_is_the_codec_payload(
    kind: LayoutKind, dtype: torch.dtype, soft: bool, block_t: int
) -> None:
    n = 600
    spans = spans_of(n, 256)
    layout, kv, slots = make_kv(kind, torch.bfloat16, True, seed=6, tokens=n)
    layout = PagedLayout(kind, layout.num_layers, layout.num_kv_heads, layout.head_dim, 16, str(dtype))
    gen = torch.Generator(device=DEV).manual_seed(7)
    kv = [torch.randn(t.shape, generator=gen, device=DEV).mul_(3).to(dtype) for t in kv]
    objs = [torch.empty(object_spec(layout, e - s).shape, dtype=dtype, device=DEV) for s, e in spans]
    ref_gather(kv, layout, slots, spans, objs)
    outs = [
        torch.full((tk.fp8_payload_nbytes(layout, e - s),), 255, dtype=torch.uint8, device=DEV)
        for s, e in spans
    ]
    tk.gather_fp8(kv, Move.gather_fp8(layout, slots, spans, outs), soft_convert=soft, block_t=block_t)
    codec = Fp8Codec()
    for (s, e), obj, out in zip(spans, objs, outs, strict=True):
        spec = object_spec(layout, e - s)
        want = bytearray(codec.max_encoded_size(spec.nbytes, spec))
        host = obj.cpu()
        codec.encode_into(memoryview(host.view(torch.uint8).numpy()).cast("B"), memoryview(want), spec, None)  # type: ignore[arg-type]
        got = out.cpu()
        mismatch = int((torch.frombuffer(want, dtype=torch.uint8) != got).sum())
        assert mismatch == 0, f"{mismatch} of {got.numel()} bytes differ from the codec"


def test_cpu_slot_mapping_and_repeated_calls() -> None:
    """A host slot_mapping is checked on the host; repeated calls (cached plans) stay bit-exact."""
    n = 512
    spans = spans_of(n, 256)
    layout, kv, slots = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=9, tokens=n)
    want = [poisoned(object_spec(layout, e - s).shape, torch.bfloat16) for s, e in spans]
    ref_gather(kv, layout, slots, spans, want)
    for sl in (slots, slots.cpu(), slots.to(torch.int32), slots):
        got = [poisoned(w.shape, torch.bfloat16) for w in want]
        k_gather(kv, layout, sl, spans, got)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(want, got, strict=True))
    bad = slots.cpu()
    bad[300] = -1
    with pytest.raises(ValueError, match="slots < 0"):
        k_gather(kv, layout, bad, spans, want)


def test_device_checks_refuse_and_count() -> None:
    """The device check kernel: slots < 0 refused by a gather, skipped and not counted by a scatter, slots
    past the KV refused by both; nothing is written for a bad slot."""
    n = 600
    spans = spans_of(n, 256)
    layout, kv, slots = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=11, tokens=n)
    objs = [poisoned(object_spec(layout, e - s).shape, torch.bfloat16) for s, e in spans]
    k_gather(kv, layout, slots, spans, objs)
    bad = slots.clone()
    bad[3] = -1
    bad[520] = -7
    dst = [t.clone() for t in kv]
    dst_ref = [t.clone() for t in kv]
    assert k_scatter(objs, dst, layout, bad, spans, [5, 0, 0]) == n - 5 - 1
    ref_scatter(objs, dst_ref, layout, bad, spans, [5, 0, 0])
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(dst_ref, dst, strict=True))
    with pytest.raises(ValueError, match=r"span \(0, 256\) has slots < 0"):
        k_gather(kv, layout, bad, spans, objs)
    bad[520] = 64 * 16 + 3
    with pytest.raises(ValueError, match=f"slot {64 * 16 + 3} outside"):
        k_scatter(objs, dst, layout, bad, spans, [5, 0, 0])


@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_fused_fp8_refuses_non_finite_input(poison: float) -> None:
    n = 600
    spans = spans_of(n, 256)
    layout, kv, slots = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=12, tokens=n)
    gen = torch.Generator(device=DEV).manual_seed(3)
    kv = [torch.randn(t.shape, generator=gen, device=DEV).to(torch.bfloat16) for t in kv]
    outs = [
        torch.empty(tk.fp8_payload_nbytes(layout, e - s), dtype=torch.uint8, device=DEV) for s, e in spans
    ]
    tk.gather_fp8(kv, Move.gather_fp8(layout, slots, spans, outs))
    clean = [o.clone() for o in outs]
    for fast in (True, False):
        again = [torch.full_like(o, 255) for o in outs]
        tk.plan_fp8(
            kv, Move.gather_fp8(layout, slots, spans, again, trusted=True), channels_fast=fast
        ).launch()
        assert all(torch.equal(a, b) for a, b in zip(clean, again, strict=True))
    blk, off = divmod(int(slots[300]), 16)
    kv[2][blk, 3, off, 70] = poison
    with pytest.raises(ValueError, match="finite"):
        tk.gather_fp8(kv, Move.gather_fp8(layout, slots, spans, outs))
    tk.gather_fp8(
        kv, Move.gather_fp8(layout, slots, spans, outs), check=False
    )  # asked not to check: no error


@pytest.mark.parametrize("pinned", [False, True], ids=["device-payloads", "pinned-host-payloads"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(("kind", "strided"), KINDS)
def test_fp8_gather_and_dequant_scatter_match_the_reference(
    kind: LayoutKind, strided: bool, dtype: torch.dtype, pinned: bool
) -> None:
    """An fp8 L1 round trip: the fused gather writes the codec's payload (into pinned host memory in place
    too), the fused dequantize-scatter writes exactly what the reference (codec decode + scatter) writes,
    skips and slots < 0 untouched, within 3 % of the original KV."""
    n = 600
    spans = spans_of(n, 256)
    layout, kv, slots = make_kv(kind, dtype, strided, seed=21, tokens=n)
    gen = torch.Generator(device=DEV).manual_seed(22)
    for t in kv:
        t.copy_(torch.randn(t.shape, generator=gen, device=DEV).mul_(3))
    host = torch.device("cpu") if pinned else DEV
    outs = [poisoned((tk.fp8_payload_nbytes(layout, e - s),), torch.uint8, host, pinned) for s, e in spans]
    dispatch.gather(kv, Move.gather_fp8(layout, slots, spans, outs))
    want = [torch.empty_like(o, device="cpu") for o in outs]
    reference.gather(kv, Move.gather_fp8(layout, slots, spans, want))
    assert all(torch.equal(a.cpu(), b) for a, b in zip(outs, want, strict=True))
    slots2 = slots.clone()
    slots2[300] = -1
    skips = [5, 0, 3]
    got = [poisoned(t.shape, dtype).as_strided(t.shape, t.stride()) for t in kv]
    ref = [t.clone() for t in got]
    written = dispatch.scatter(got, Move.scatter_fp8(layout, slots2, spans, outs, skips))
    assert written == reference.scatter(ref, Move.scatter_fp8(layout, slots2, spans, want, skips))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, ref, strict=True))
    back = [torch.empty(object_spec(layout, e - s).shape, dtype=dtype, device=DEV) for s, e in spans]
    orig = [torch.empty_like(b) for b in back]
    ref_gather(kv, layout, slots, spans, orig)
    full = [t.clone() for t in got]
    dispatch.scatter(full, Move.scatter_fp8(layout, slots, spans, outs))
    ref_gather(full, layout, slots, spans, back)
    for a, b in zip(back, orig, strict=True):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 0.03


@pytest.mark.parametrize("where", ["device", "pinned"])
def test_a_move_run_again_reads_the_slots_of_each_run(where: str) -> None:
    """A Move kept and run again (the pre-bound launch, or the prepared pipeline) moves the slot values of
    each run, refuses a slot made bad in place, counts exactly a scatter slot made < 0, and works again."""
    n = 600
    spans = spans_of(n, 256)
    layout, kv, slots = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=21, tokens=n)
    if where == "device":
        outs = [poisoned(object_spec(layout, e - s).shape, torch.bfloat16) for s, e in spans]
    else:
        outs = [
            poisoned(object_spec(layout, e - s).shape, torch.bfloat16, torch.device("cpu"), pin=True)
            for s, e in spans
        ]
    gather, trusted = (
        Move.gather(layout, slots, spans, outs),
        Move.gather(layout, slots, spans, outs, trusted=True),
    )
    original = slots.clone()
    for shift in (0, 3, 0):
        slots.copy_(original.roll(shift))  # the same tensor, new values
        for move in (gather, trusted):
            for o in outs:
                bits(o).fill_(-1)
            dispatch.gather(kv, move)
            want = [poisoned(o.shape, torch.bfloat16) for o in outs]
            ref_gather(kv, layout, slots, spans, want)
            assert all(torch.equal(bits(a), bits(b.to(a.device))) for a, b in zip(want, outs, strict=True))
    assert gather.prepared  # prepared on the first run, reused after
    assert trusted.prepared
    slots[300] = -1
    with pytest.raises(ValueError, match="slots < 0"):
        dispatch.gather(kv, gather)
    slots[300] = 10**6
    with pytest.raises(ValueError, match="outside the paged KV"):
        dispatch.gather(kv, gather)
    slots.copy_(original)
    dispatch.gather(kv, gather)  # good again: no error left behind
    _, dst, other = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=22, tokens=n)
    dst_ref = [t.clone() for t in dst]
    scatter = Move.scatter(layout, other, spans, outs, [7, 0, 0])
    assert dispatch.scatter(dst, scatter) == n - 7
    assert ref_scatter(outs, dst_ref, layout, other, spans, [7, 0, 0]) == n - 7
    other[100] = -1  # in place: the same move now skips that token
    bits(dst[0]).neg_()  # the second run must rewrite every layer but that token's slot
    bits(dst_ref[0]).neg_()
    assert dispatch.scatter(dst, scatter) == n - 7 - 1
    assert ref_scatter(outs, dst_ref, layout, other, spans, [7, 0, 0]) == n - 7 - 1
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(dst_ref, dst, strict=True))
    assert dispatch.scatter(dst, Move.scatter(layout, other, spans, outs, [7, 0, 0], trusted=True)) == n - 7
    # the same move on other KV caches: prepared for those, bit-exact
    _, kv2, _ = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=23, tokens=n)
    dispatch.gather(kv2, gather)
    want = [poisoned(o.shape, torch.bfloat16) for o in outs]
    ref_gather(kv2, layout, slots, spans, want)
    assert all(torch.equal(bits(a), bits(b.to(a.device))) for a, b in zip(want, outs, strict=True))


@pytest.mark.parametrize("where", ["device", "pinned"])
def test_bound_moves_launch_through_the_driver_from_any_thread(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bound move launches through the native extension's ``cuLaunchKernel`` (its parameters verified with
    the driver), bit-exact, checked and trusted, also from a new thread (where the driver may refuse for want
    of a current context: the launch is made again through Triton's launcher); a trusted scatter writes every
    token past its skip; with direct launches off, Triton's launcher moves the same bytes."""
    import threading

    from tiercache.gpu import launch

    n = 600
    spans = spans_of(n, 256)
    layout, kv, slots = make_kv(LayoutKind.VLLM_FLASH, torch.bfloat16, True, seed=31, tokens=n)
    host, pin = (torch.device("cpu"), True) if where == "pinned" else (DEV, False)
    outs = [poisoned(object_spec(layout, e - s).shape, torch.bfloat16, host, pin) for s, e in spans]
    want = [poisoned(o.shape, torch.bfloat16) for o in outs]
    ref_gather(kv, layout, slots, spans, want)

    def same() -> bool:
        return all(torch.equal(bits(a), bits(b.to(a.device))) for a, b in zip(want, outs, strict=True))

    errors: list[BaseException] = []

    def run_on_thread(m: Move) -> None:
        try:
            dispatch.gather(kv, m)
            torch.cuda.synchronize()
        except BaseException as e:  # reported below
            errors.append(e)

    for trusted in (False, True):
        move = Move.gather(layout, slots, spans, outs, trusted=trusted)
        dispatch.gather(kv, move)
        torch.cuda.synchronize()
        assert same()
        path, _, bound = move.prepared[id(kv)]
        assert path == "bound"
        assert all(b.go.direct for b in getattr(bound, "bounds", [bound]))  # pinned: its layer pieces
        for o in outs:
            bits(o).fill_(-1)
        t = threading.Thread(target=run_on_thread, args=(move,))
        t.start()
        t.join()
        assert not errors
        assert same()
    dst = [poisoned(t.shape, torch.bfloat16).as_strided(t.shape, t.stride()) for t in kv]
    dst_ref = [t.clone() for t in dst]
    assert dispatch.scatter(dst, Move.scatter(layout, slots, spans, outs, [5, 0, 0], trusted=True)) == n - 5
    ref_scatter(outs, dst_ref, layout, slots, spans, [5, 0, 0])
    torch.cuda.synchronize()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(dst_ref, dst, strict=True))
    if where == "device":
        monkeypatch.setattr(launch, "DIRECT", False)
        cfg = tk.TileConfig(tile_bytes=8192, num_warps=4)  # a launch not bound before
        move = Move.gather(layout, slots, spans, outs)
        for o in outs:
            bits(o).fill_(-1)
        tk.gather(kv, move, cfg)
        torch.cuda.synchronize()
        assert same()
        bound = tk.bind(kv, move, cfg)
        assert bound is not None
        assert not bound.go.direct  # type: ignore[attr-defined]


def check_pinned_gather(kv: Any, layout: PagedLayout, move: Move) -> None:
    """Run a gather ``move`` into poisoned host objects and compare them with the reference, byte for byte."""
    for o in move.objects:
        bits(o).fill_(-1)
    dispatch.gather(kv, move)
    want = [poisoned(o.shape, torch.bfloat16) for o in move.objects]
    ref_gather(kv, layout, move.slot_mapping, move.spans, want, move.layers)
    for a, b in zip(want, move.objects, strict=True):
        assert not sentinel_left(b)
        assert torch.equal(bits(a), bits(b.to(a.device)))


def check_pieced_scatter(
    kind: LayoutKind,
    strided: bool,
    outs: list[torch.Tensor],
    spans: list[tuple[int, int]],
    *,
    seed: int,
    skip: int,
    runs: int = 1,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Scatter pinned ``outs`` (the first span's first ``skip`` tokens skipped, token 450 without a slot)
    into fresh paged KV ``runs`` times in layer pieces: the exact count each time and the reference's bytes.
    Returns the KV, the reference's KV and the slots."""
    from tiercache.gpu import layer_pieces

    n = spans[-1][1]
    layout, dst, other = make_kv(kind, torch.bfloat16, strided, seed=seed, tokens=n)
    dst_ref = [x.clone() for x in dst]
    other[450] = -1
    skips = [skip] + [0] * (len(spans) - 1)
    for _ in range(runs):
        scatter = Move.scatter(layout, other, spans, outs, skips)
        assert dispatch.scatter(dst, scatter) == n - skip - 1
        assert isinstance(scatter.prepared[id(dst)][2], layer_pieces.PiecedMove)
    assert ref_scatter(outs, dst_ref, layout, other, spans, skips) == n - skip - 1
    torch.cuda.synchronize()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(dst_ref, dst, strict=True))
    return dst, dst_ref, other


@pytest.mark.parametrize(("kind", "strided"), KINDS)
def test_pinned_moves_larger_than_a_staging_buffer_alternate_two(
    kind: LayoutKind, strided: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pinned move whose pieces would not fit one staging buffer is cut into pieces of at most a buffer
    each, piece p in buffer p % 2 (each handed over by its ``free`` event): bit-exact gathers and scatters,
    run again, run after the object-group pipeline used the same buffers, a bad gather slot refused and a
    scatter's slot < 0 counted exactly."""
    from tiercache.gpu import layer_pieces

    monkeypatch.setattr(dispatch, "PIECED_MIN_BYTES", 0)
    monkeypatch.setattr(dispatch, "PIECED_MAX_BYTES", 1 << 62)
    n = 600
    spans = spans_of(n, 256)
    layout, kv, slots = make_kv(kind, torch.bfloat16, strided, seed=51, tokens=n)
    cpu = torch.device("cpu")
    outs = [poisoned(object_spec(layout, e - s).shape, torch.bfloat16, cpu, pin=True) for s, e in spans]
    layer_bytes = sum(o.numel() * o.element_size() for o in outs) // layout.num_layers
    xfer = transfer.transfer_for(DEV)
    monkeypatch.setattr(xfer, "staging_bytes", layer_bytes + 4096)  # one layer of every object a piece

    check_gather = functools.partial(check_pinned_gather, kv, layout)

    move = Move.gather(layout, slots, spans, outs)
    check_gather(move)
    pm = move.prepared[id(kv)][2]
    assert isinstance(pm, layer_pieces.PiecedMove)
    assert len(pm.bounds) == layout.num_layers  # one layer a piece
    assert len(pm.staging) == 2
    assert pm.staging[0].data_ptr() != pm.staging[1].data_ptr()
    check_gather(move)
    big = [poisoned(o.shape, torch.bfloat16, cpu, pin=True) for o in outs]
    xfer.store(kv, Move.gather(layout, slots, spans, big))  # the object-group pipeline, same buffers
    check_gather(move)
    bad = slots.clone()
    bad[100] = -1
    with pytest.raises(ValueError, match="slots < 0"):
        dispatch.gather(kv, Move.gather(layout, bad, spans, outs))
    check_pieced_scatter(kind, strided, outs, spans, seed=52, skip=3, runs=2)  # prepared, then run again


@pytest.mark.parametrize("pieces", [2, 3])
@pytest.mark.parametrize(("kind", "strided"), KINDS)
def test_small_pinned_moves_run_in_layer_pieces(
    kind: LayoutKind, strided: bool, pieces: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move of pinned objects up to ``ZERO_COPY_BYTES`` runs staged in layer pieces, every step issued to
    the driver: bit-exact gathers (several objects, an unfull one, a layerwise one) and scatters (skips, a
    slot < 0), device checks that refuse a bad gather slot and count a scatter's exactly, a kept move run
    again on new slot values, a run from a new thread, and runs between the object-group pipeline's on the
    same staging buffer; with the launch extension's copies off, the move goes over the bus instead."""
    import threading

    from tiercache.gpu import launch, layer_pieces

    monkeypatch.setattr(layer_pieces, "PIECES", pieces)
    monkeypatch.setattr(dispatch, "PIECED_MIN_BYTES", 0)  # these moves are 1-2 MiB
    n = 600
    spans = spans_of(n, 256)
    layout, kv, slots = make_kv(kind, torch.bfloat16, strided, seed=41, tokens=n)
    cpu = torch.device("cpu")
    outs = [poisoned(object_spec(layout, e - s).shape, torch.bfloat16, cpu, pin=True) for s, e in spans]

    check_gather = functools.partial(check_pinned_gather, kv, layout)

    move = Move.gather(layout, slots, spans, outs)
    check_gather(move)
    path, _, pm = move.prepared[id(kv)]
    assert path == "bound"
    assert isinstance(pm, layer_pieces.PiecedMove)
    assert len(pm.bounds) == min(pieces, layout.num_layers)
    check_gather(Move.gather(layout, slots, spans, outs, trusted=True))
    original = slots.clone()
    slots.copy_(original.roll(5))  # the same tensor, new values: the kept move reads them
    check_gather(move)
    slots[300] = -1
    with pytest.raises(ValueError, match="slots < 0"):
        dispatch.gather(kv, move)
    slots.copy_(original)
    check_gather(move)  # no error left behind
    # layerwise: an object of layers 1-3
    spec1 = object_spec(layout, 256).with_layers(1, 4)
    one = poisoned(spec1.shape, torch.bfloat16, cpu, pin=True)
    check_gather(Move.gather(layout, slots, [(256, 512)], [one], layers=range(1, 4)))
    # from a new thread (maybe without a current context)
    errors: list[BaseException] = []

    def on_thread() -> None:
        try:
            check_gather(move)
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=on_thread)
    t.start()
    t.join()
    assert not errors
    # scatters: skips, a slot < 0 counted exactly, checked and trusted
    dst, dst_ref, other = check_pieced_scatter(kind, strided, outs, spans, seed=42, skip=7)
    for x, y in zip(dst, dst_ref, strict=True):
        bits(x).neg_()
        bits(y).neg_()
    trusted = Move.scatter(layout, other, spans, outs, [7, 0, 0], trusted=True)
    assert dispatch.scatter(dst, trusted) == n - 7  # trusted: every token past the skips
    ref_scatter(outs, dst_ref, layout, other, spans, [7, 0, 0])
    torch.cuda.synchronize()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(dst_ref, dst, strict=True))
    # the object-group pipeline on the same staging, then the pieces again
    big = [poisoned(o.shape, torch.bfloat16, cpu, pin=True) for o in outs]
    pipe = Move.gather(layout, slots, spans, big)
    xfer = transfer.transfer_for(DEV)
    xfer.store(kv, pipe)
    check_gather(move)
    # a staging buffer replaced (grown by a bigger move): the kept move prepares its pieces again
    old_staging = xfer.buffers[0]
    assert old_staging is not None
    with xfer.lock:
        xfer.buffers[0] = torch.empty_like(old_staging)
    assert not pm.valid_for(kv)
    check_gather(move)
    assert move.prepared[id(kv)][2] is not pm
    want = [poisoned(o.shape, torch.bfloat16) for o in big]
    ref_gather(kv, layout, slots, spans, want)
    assert all(torch.equal(bits(a), bits(b.to(a.device))) for a, b in zip(want, big, strict=True))
    # without the extension's copies: one kernel over the bus
    monkeypatch.setattr(launch, "DIRECT", False)
    bus = Move.gather(layout, slots, spans, outs)
    check_gather(bus)
    assert isinstance(bus.prepared[id(kv)][2], tk.BoundMove)
