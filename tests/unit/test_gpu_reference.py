"""Torch reference gather/scatter of tiercache.gpu: bit-exact round trips between engines and layouts."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.gpu import LayoutKind, Move, PagedLayout, object_spec, plan_read
from tiercache.testing.harness.moves import (
    DTYPES,
    bits,
    poisoned,
    random_tensor,
    ref_gather,
    ref_scatter,
    sentinel_left,
)

L, H, D = 3, 2, 8


@dataclass
class Engine:
    """One engine's paged KV: per-layer tensors, its layout and a request's slot mapping."""

    layout: PagedLayout
    kv: list[torch.Tensor]
    block_table: torch.Tensor

    def slots(self, n: int) -> torch.Tensor:
        bs = self.layout.block_size
        pos = torch.arange(n)
        return self.block_table[pos // bs] * bs + pos % bs

    def token(self, layer: int, slot: int) -> list[torch.Tensor]:
        """The logical K and V (or MLA latent) [H, D] of the token at ``slot``, read plainly per layout."""
        bs, d = self.layout.block_size, self.layout.head_dim
        b, o = divmod(slot, bs)
        t = self.kv[layer]
        if self.layout.kind is LayoutKind.VLLM_LEGACY:
            return [t[0, b, o], t[1, b, o]]
        if self.layout.kind is LayoutKind.VLLM_MLA:
            return [t[b, :, o]]
        return [t[b, :, o, :d], t[b, :, o, d:]]

    def snapshot(self) -> list[torch.Tensor]:
        return [bits(t).clone() for t in self.kv]


def make_engine(
    kind: LayoutKind,
    dtype: torch.dtype,
    num_blocks: int,
    block_size: int,
    tokens: int,
    seed: int,
    *,
    strided: bool = True,
    padded: bool = False,
) -> Engine:
    """An engine with random KV and a random block table (block 0 is vLLM's null block, never used)."""
    gen = torch.Generator().manual_seed(seed)
    h = 1 if kind is LayoutKind.VLLM_MLA else H
    layout = PagedLayout(kind, L, h, D, block_size, str(dtype))
    kv = []
    for _ in range(L):
        if kind is LayoutKind.VLLM_FLASH and padded:
            # heads padded in the allocation: slots are strided rows, heads are not mergeable into them
            t = random_tensor((num_blocks, block_size, h + 1, 2 * D), dtype, gen)[:, :, :h].permute(
                0, 2, 1, 3
            )
        elif kind is LayoutKind.VLLM_FLASH and strided:
            # GPU NHD allocation [NB, BS, H, 2D], seen through vLLM's [NB, H, BS, 2D] view.
            t = random_tensor((num_blocks, block_size, h, 2 * D), dtype, gen).permute(0, 2, 1, 3)
            assert not t.is_contiguous()
        else:
            t = random_tensor(layout.layer_shape(num_blocks), dtype, gen)
        kv.append(t)
    need = -(-tokens // block_size)
    table = torch.randperm(num_blocks - 1, generator=gen)[:need] + 1
    return Engine(layout, kv, table)


KINDS = [
    pytest.param(LayoutKind.VLLM_FLASH, True, id="flash-strided"),
    pytest.param(LayoutKind.VLLM_FLASH, False, id="flash-contiguous"),
    pytest.param(LayoutKind.VLLM_LEGACY, True, id="legacy"),
    pytest.param(LayoutKind.VLLM_MLA, True, id="mla"),
]


def chunk_spans(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def alloc(layout: PagedLayout, spans: list[tuple[int, int]], dtype: torch.dtype) -> list[torch.Tensor]:
    return [poisoned(object_spec(layout, e - s).shape, dtype) for s, e in spans]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("kind", "strided"), KINDS)
def test_round_trip_between_engines(kind: LayoutKind, strided: bool, dtype: torch.dtype) -> None:
    n, chunk = 150, 64  # last chunk unfull, chunks not block-aligned (block 16)
    pre = make_engine(kind, dtype, 40, 16, n, seed=1, strided=strided)
    dec = make_engine(kind, dtype, 50, 16, n, seed=2, strided=strided)
    assert not torch.equal(pre.block_table[: len(dec.block_table)], dec.block_table)
    spans = chunk_spans(n, chunk)
    objs = alloc(pre.layout, spans, dtype)
    ref_gather(pre.kv, pre.layout, pre.slots(n), spans, objs)
    for obj in objs:
        assert not sentinel_left(obj)
    # token by token against a plain per-layout read
    slots = pre.slots(n).tolist()
    for (s, e), obj in zip(spans, objs, strict=True):
        for layer in range(L):
            for t in range(s, e, 7):
                want = pre.token(layer, slots[t])
                if kind is LayoutKind.VLLM_MLA:
                    assert torch.equal(bits(obj[layer, t - s]), bits(want[0]).flatten())
                else:
                    for p in range(2):
                        assert torch.equal(bits(obj[p, layer, t - s]), bits(want[p]).flatten())

    before = dec.snapshot()
    dec_slots = dec.slots(n)
    assert ref_scatter(objs, dec.kv, dec.layout, dec_slots, spans) == n
    again = alloc(dec.layout, spans, dtype)
    ref_gather(dec.kv, dec.layout, dec_slots, spans, again)
    for a, b in zip(objs, again, strict=True):
        assert torch.equal(bits(a), bits(b))
    # nothing outside the request's slots moved
    touched = torch.zeros(
        dec.kv[0].shape[0] if kind is not LayoutKind.VLLM_LEGACY else dec.kv[0].shape[1], 16
    )
    touched.view(-1)[dec_slots] = 1
    untouched_blocks = (touched.sum(1) == 0).nonzero().squeeze(1)
    for layer in range(L):
        cur, old = bits(dec.kv[layer]), before[layer]
        if kind is LayoutKind.VLLM_LEGACY:
            assert torch.equal(cur[:, untouched_blocks], old[:, untouched_blocks])
        else:
            assert torch.equal(cur[untouched_blocks], old[untouched_blocks])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bfloat16", "fp8"])
def test_round_trip_padded_heads_to_contiguous(dtype: torch.dtype) -> None:
    n = 77
    pre = make_engine(LayoutKind.VLLM_FLASH, dtype, 12, 16, n, seed=30, padded=True)
    dec = make_engine(LayoutKind.VLLM_FLASH, dtype, 12, 16, n, seed=31, strided=False)
    dec2 = make_engine(LayoutKind.VLLM_FLASH, dtype, 12, 16, n, seed=32, padded=True)
    spans = chunk_spans(n, 32)
    objs = alloc(pre.layout, spans, dtype)
    ref_gather(pre.kv, pre.layout, pre.slots(n), spans, objs)
    assert not any(sentinel_left(o) for o in objs)
    assert ref_scatter(objs, dec.kv, dec.layout, dec.slots(n), spans) == n
    assert ref_scatter(objs, dec2.kv, dec2.layout, dec2.slots(n), spans) == n
    ps, ds, d2s = pre.slots(n).tolist(), dec.slots(n).tolist(), dec2.slots(n).tolist()
    for layer in range(L):
        for t in range(n):
            want = pre.token(layer, ps[t])
            for eng, sl in ((dec, ds), (dec2, d2s)):
                for g, w in zip(eng.token(layer, sl[t]), want, strict=True):
                    assert torch.equal(bits(g), bits(w))


def test_round_trip_head_dim_not_innermost() -> None:
    """A legacy engine whose allocation is [2, NB, BS, D, H] (last dim strided) takes the indexing path."""
    n = 50
    pre = make_engine(LayoutKind.VLLM_LEGACY, torch.float16, 10, 16, n, seed=33)
    dec = make_engine(LayoutKind.VLLM_LEGACY, torch.float16, 10, 16, n, seed=34)
    gen = torch.Generator().manual_seed(35)
    dec.kv = [random_tensor((2, 10, 16, D, H), torch.float16, gen).transpose(3, 4) for _ in range(L)]
    assert dec.kv[0].stride(-1) != 1
    spans = chunk_spans(n, 16)
    objs = alloc(pre.layout, spans, torch.float16)
    ref_gather(pre.kv, pre.layout, pre.slots(n), spans, objs)
    assert ref_scatter(objs, dec.kv, dec.layout, dec.slots(n), spans) == n
    back = alloc(dec.layout, spans, torch.float16)
    ref_gather(dec.kv, dec.layout, dec.slots(n), spans, back)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(objs, back, strict=True))
    ps, ds = pre.slots(n).tolist(), dec.slots(n).tolist()
    for t in range(n):
        for g, w in zip(dec.token(1, ds[t]), pre.token(1, ps[t]), strict=True):
            assert torch.equal(bits(g), bits(w))


@pytest.mark.parametrize(("kind", "strided"), KINDS)
def test_layerwise_matches_full(kind: LayoutKind, strided: bool) -> None:
    n = 70
    pre = make_engine(kind, torch.bfloat16, 20, 16, n, seed=3, strided=strided)
    dec = make_engine(kind, torch.bfloat16, 20, 16, n, seed=4, strided=strided)
    spans = [(0, 32), (32, 70)]
    full = alloc(pre.layout, spans, torch.bfloat16)
    ref_gather(pre.kv, pre.layout, pre.slots(n), spans, full)
    for layer in range(L):
        per = [
            poisoned(object_spec(pre.layout, e - s).with_layers(layer, layer + 1).shape, torch.bfloat16)
            for s, e in spans
        ]
        one = range(layer, layer + 1)
        ref_gather(pre.kv, pre.layout, pre.slots(n), spans, per, layers=one)
        for f, p in zip(full, per, strict=True):
            want = f[layer : layer + 1] if kind is LayoutKind.VLLM_MLA else f[:, layer : layer + 1]
            assert torch.equal(bits(p), bits(want))
        assert ref_scatter(per, dec.kv, dec.layout, dec.slots(n), spans, skip=[0, 5], layers=one) == n - 5
    back = alloc(dec.layout, spans, torch.bfloat16)
    ref_gather(dec.kv, dec.layout, dec.slots(n), spans, back)
    assert torch.equal(bits(back[0]), bits(full[0]))
    tail = (
        (slice(None), slice(5, None))
        if kind is LayoutKind.VLLM_MLA
        else (slice(None), slice(None), slice(5, None))
    )
    assert torch.equal(bits(back[1][tail]), bits(full[1][tail]))
    with pytest.raises(ValueError, match="out of range"):
        ref_gather(pre.kv, pre.layout, pre.slots(n), spans, full, layers=range(L, L + 1))


def test_design_example_288_local_hit_512_chunk_256() -> None:
    chunk, hit, local = 256, 512, 288
    pre = make_engine(LayoutKind.VLLM_FLASH, torch.bfloat16, 64, 16, hit, seed=5)
    dec = make_engine(LayoutKind.VLLM_FLASH, torch.bfloat16, 80, 16, hit, seed=6)
    spans = chunk_spans(hit, chunk)
    objs = alloc(pre.layout, spans, torch.bfloat16)
    ref_gather(pre.kv, pre.layout, pre.slots(hit), spans, objs)

    plan = plan_read(local, hit, chunk)
    assert plan.spans == ((256, 512),)
    assert plan.skip_prefix == 32
    by_start = dict(zip([s for s, _ in spans], objs, strict=True))
    read = [by_start[s] for s, _ in plan.spans]
    before = dec.snapshot()
    written = ref_scatter(read, dec.kv, dec.layout, dec.slots(hit), plan.spans, plan.skip_prefix)
    assert written == plan.tokens_to_write == 224

    dec_slots, pre_slots = dec.slots(hit).tolist(), pre.slots(hit).tolist()
    old = Engine(dec.layout, [b.view(torch.bfloat16) for b in before], dec.block_table)
    for layer in range(L):
        for t in range(hit):
            got = dec.token(layer, dec_slots[t])
            want = pre.token(layer, pre_slots[t]) if t >= local else old.token(layer, dec_slots[t])
            for g, w in zip(got, want, strict=True):
                assert torch.equal(bits(g), bits(w)), (layer, t)


def test_skip_prefix_and_negative_slots_untouched() -> None:
    n = 96
    pre = make_engine(LayoutKind.VLLM_FLASH, torch.float16, 20, 16, n, seed=7)
    dec = make_engine(LayoutKind.VLLM_FLASH, torch.float16, 20, 16, n, seed=8)
    spans = [(0, 48), (48, 96)]
    objs = alloc(pre.layout, spans, torch.float16)
    ref_gather(pre.kv, pre.layout, pre.slots(n), spans, objs)
    slots = dec.slots(n).clone()
    slots[60:70] = -1  # e.g. tokens the decode engine does not want written
    before = dec.snapshot()
    written = ref_scatter(objs, dec.kv, dec.layout, slots, spans, skip=[20, 4])
    assert written == (48 - 20) + (48 - 4 - 10)
    orig = dec.slots(n).tolist()
    old = Engine(dec.layout, [b.view(torch.float16) for b in before], dec.block_table)
    pre_slots = pre.slots(n).tolist()
    for t in range(n):
        skipped = t < 20 or 48 <= t < 52 or 60 <= t < 70
        for layer in range(L):
            got = dec.token(layer, orig[t])
            want = old.token(layer, orig[t]) if skipped else pre.token(layer, pre_slots[t])
            for g, w in zip(got, want, strict=True):
                assert torch.equal(bits(g), bits(w)), t
    # a whole span skipped, and a span of only negative slots: nothing written
    assert ref_scatter(objs[:1], dec.kv, dec.layout, slots, spans[:1], skip=48) == 0
    neg = torch.full((n,), -1)
    assert ref_scatter(objs, dec.kv, dec.layout, neg, spans) == 0


def test_gather_rejects_negative_slots() -> None:
    pre = make_engine(LayoutKind.VLLM_FLASH, torch.bfloat16, 10, 16, 32, seed=9)
    slots = pre.slots(32).clone()
    slots[3] = -1
    with pytest.raises(ValueError, match="slots < 0"):
        ref_gather(pre.kv, pre.layout, slots, [(0, 32)], alloc(pre.layout, [(0, 32)], torch.bfloat16))


def test_layout_conversion_legacy_to_flash() -> None:
    n = 100
    legacy = make_engine(LayoutKind.VLLM_LEGACY, torch.bfloat16, 16, 16, n, seed=10)
    flash = make_engine(LayoutKind.VLLM_FLASH, torch.bfloat16, 24, 16, n, seed=11)
    assert legacy.layout.fingerprint == flash.layout.fingerprint
    spans = chunk_spans(n, 32)
    objs = alloc(legacy.layout, spans, torch.bfloat16)
    ref_gather(legacy.kv, legacy.layout, legacy.slots(n), spans, objs)
    assert ref_scatter(objs, flash.kv, flash.layout, flash.slots(n), spans) == n
    ls, fs = legacy.slots(n).tolist(), flash.slots(n).tolist()
    for layer in range(L):
        for t in range(n):
            k_l, v_l = legacy.token(layer, ls[t])
            k_f, v_f = flash.token(layer, fs[t])
            assert torch.equal(bits(k_l), bits(k_f))
            assert torch.equal(bits(v_l), bits(v_f))


def test_non_contiguous_out_and_int32_slots() -> None:
    n = 40
    pre = make_engine(LayoutKind.VLLM_FLASH, torch.bfloat16, 10, 16, n, seed=12)
    big = poisoned((2, L, 2 * n, H * D), torch.bfloat16)
    out = big[:, :, 10 : 10 + n]  # a view, not contiguous
    assert not out.is_contiguous()
    ref_gather(pre.kv, pre.layout, pre.slots(n).to(torch.int32), [(0, n)], [out])
    assert not sentinel_left(out)
    ref = alloc(pre.layout, [(0, n)], torch.bfloat16)
    ref_gather(pre.kv, pre.layout, pre.slots(n), [(0, n)], ref)
    assert torch.equal(bits(out), bits(ref[0]))
    assert sentinel_left(big[:, :, :10])


def test_argument_errors() -> None:
    n = 32
    pre = make_engine(LayoutKind.VLLM_FLASH, torch.bfloat16, 10, 16, n, seed=13)
    objs = alloc(pre.layout, [(0, n)], torch.bfloat16)
    slots = pre.slots(n)
    with pytest.raises(ValueError, match="shape"):
        ref_gather(pre.kv, pre.layout, slots, [(0, n - 1)], objs)
    with pytest.raises(ValueError, match="dtype"):
        ref_gather(pre.kv, pre.layout, slots, [(0, n)], [objs[0].half()])
    with pytest.raises(ValueError, match="outside the slot mapping"):
        ref_gather(pre.kv, pre.layout, slots, [(0, n + 1)], objs)
    with pytest.raises(ValueError, match="spans for"):
        ref_gather(pre.kv, pre.layout, slots, [(0, 16), (16, 32)], objs)
    with pytest.raises(ValueError, match="outside the paged KV"):
        ref_gather(pre.kv, pre.layout, slots + 10 * 16, [(0, n)], objs)
    with pytest.raises(ValueError, match="KV cache tensors"):
        ref_gather(pre.kv[:2], pre.layout, slots, [(0, n)], objs)
    with pytest.raises(ValueError, match="skip_prefix"):
        ref_scatter(objs, pre.kv, pre.layout, slots, [(0, n)], skip=n + 1)
    with pytest.raises(ValueError, match="skip counts"):
        ref_scatter(objs, pre.kv, pre.layout, slots, [(0, n)], skip=[0, 0])


# ----------------------------------------------------------------------------------------------- CPU_BLOCKS


def pack_cpu_page(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One (block, head) page as the CPU attention backend holds it: K as [D, BS] then V as [BS, D]."""
    bs, d = k.shape
    return torch.cat([k.t().reshape(-1), v.reshape(-1)]).view(bs, 2 * d)


def unpack_cpu_page(page: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``pack_cpu_page``: logical K [BS, D] and V [BS, D]."""
    bs, two_d = page.shape
    d = two_d // 2
    flat = page.reshape(-1)
    return flat[: bs * d].view(d, bs).t(), flat[bs * d :].view(bs, d)


def cpu_engine(num_blocks: int, block_size: int, tokens: int, seed: int) -> tuple[Engine, torch.Tensor]:
    """A CPU_BLOCKS engine whose pages hold transposed K, and its logical KV [L, NB*BS, 2, H, D]."""
    gen = torch.Generator().manual_seed(seed)
    layout = PagedLayout(LayoutKind.CPU_BLOCKS, L, H, D, block_size, "float32")
    logical = torch.randn(L, num_blocks, block_size, 2, H, D, generator=gen) + 5
    kv = []
    for layer in range(L):
        t = torch.empty(num_blocks, H, block_size, 2 * D)
        for b in range(num_blocks):
            for h in range(H):
                t[b, h] = pack_cpu_page(logical[layer, b, :, 0, h], logical[layer, b, :, 1, h])
        kv.append(t)
    table = torch.randperm(num_blocks - 1, generator=gen)[: -(-tokens // block_size)] + 1
    return Engine(layout, kv, table), logical.view(L, num_blocks * block_size, 2, H, D)


def logical_from_pages(engine: Engine) -> torch.Tensor:
    """Decode every page of an engine back into logical KV [L, NB*BS, 2, H, D]."""
    nb, _, bs, _ = engine.kv[0].shape
    out = torch.empty(L, nb, bs, 2, H, D)
    for layer in range(L):
        for b in range(nb):
            for h in range(H):
                k, v = unpack_cpu_page(engine.kv[layer][b, h])
                out[layer, b, :, 0, h], out[layer, b, :, 1, h] = k, v
    return out.view(L, nb * bs, 2, H, D)


def test_cpu_blocks_whole_page_round_trip() -> None:
    bs, n = 32, 100  # final partial block (tokens 96-99) copied whole
    pre, pre_logical = cpu_engine(12, bs, n, seed=20)
    dec, _ = cpu_engine(16, bs, n, seed=21)
    spans = [(0, 64), (64, 100)]
    objs = [poisoned(object_spec(pre.layout, e - s).shape, torch.float32) for s, e in spans]
    assert objs[1].shape[2] == 64  # 36 tokens -> 2 whole pages
    ref_gather(pre.kv, pre.layout, pre.slots(n), spans, objs)
    for obj in objs:
        assert not sentinel_left(obj)
    # the object holds the raw pages in order: layer-major, then block
    pages = objs[0].view(L, 2, H, bs, 2 * D)
    for layer in range(L):
        assert torch.equal(pages[layer], pre.kv[layer][pre.block_table[:2]])
    assert ref_scatter(objs, dec.kv, dec.layout, dec.slots(n), spans) == n
    dec_logical = logical_from_pages(dec)
    ps, ds = pre.slots(n), dec.slots(n)
    assert torch.equal(dec_logical[:, ds], pre_logical[:, ps])  # token by token, K and V
    # the final page was copied whole: the 28 slots after token 99 came along with it
    last_pre, last_dec = pre.block_table[3], dec.block_table[3]
    for layer in range(L):
        assert torch.equal(dec.kv[layer][last_dec], pre.kv[layer][last_pre])


def test_cpu_blocks_skip_is_whole_pages() -> None:
    bs, n = 32, 128
    pre, _ = cpu_engine(8, bs, n, seed=22)
    dec, _ = cpu_engine(8, bs, n, seed=23)
    spans = [(0, 128)]
    objs = [poisoned(object_spec(pre.layout, 128).shape, torch.float32)]
    ref_gather(pre.kv, pre.layout, pre.slots(n), spans, objs)
    before = dec.snapshot()
    assert ref_scatter(objs, dec.kv, dec.layout, dec.slots(n), spans, skip=64) == 64
    for layer in range(L):
        for i, blk in enumerate(dec.block_table.tolist()):
            src = pre.kv[layer][pre.block_table[i]] if i >= 2 else before[layer][blk].view(torch.float32)
            assert torch.equal(dec.kv[layer][blk], src)
    # pages whose slots are < 0 are skipped whole
    slots = dec.slots(n).clone()
    slots[96:128] = -1
    assert ref_scatter(objs, dec.kv, dec.layout, slots, spans) == 96


def test_cpu_blocks_strided_layer_and_contiguous_objects() -> None:
    bs, n = 32, 64
    pre, _ = cpu_engine(6, bs, n, seed=25)
    gen = torch.Generator().manual_seed(26)
    # inner dims not dense (padded heads): pages still move whole, block by block
    dec = Engine(
        pre.layout,
        [torch.randn(6, H + 1, bs, 2 * D, generator=gen)[:, :H] for _ in range(L)],
        pre.block_table.flip(0),
    )
    objs = [poisoned(object_spec(pre.layout, n).shape, torch.float32)]
    ref_gather(pre.kv, pre.layout, pre.slots(n), [(0, n)], objs)
    assert ref_scatter(objs, dec.kv, dec.layout, dec.slots(n), [(0, n)]) == n
    for layer in range(L):
        for i in range(2):
            assert torch.equal(dec.kv[layer][dec.block_table[i]], pre.kv[layer][pre.block_table[i]])
    back = [poisoned(object_spec(pre.layout, n).shape, torch.float32)]
    ref_gather(dec.kv, dec.layout, dec.slots(n), [(0, n)], back)
    assert torch.equal(back[0], objs[0])
    big = torch.empty(2, L, 2 * n, H * D)
    with pytest.raises(ValueError, match="contiguous"):
        ref_gather(pre.kv, pre.layout, pre.slots(n), [(0, n)], [big[:, :, :n]])


def test_cpu_blocks_alignment_errors() -> None:
    bs, n = 32, 128
    pre, _ = cpu_engine(8, bs, n, seed=24)
    slots = pre.slots(n)
    lay = pre.layout
    with pytest.raises(ValueError, match="not block-aligned"):
        ref_gather(pre.kv, lay, slots, [(0, 48)], [torch.empty(object_spec(lay, 48).shape)])
    with pytest.raises(ValueError, match="not block-aligned"):
        ref_gather(pre.kv, lay, slots, [(16, 64)], [torch.empty(object_spec(lay, 48).shape)])
    objs = [torch.randn(object_spec(lay, 128).shape)]
    with pytest.raises(ValueError, match="multiple of block_size"):
        ref_scatter(objs, pre.kv, lay, slots, [(0, 128)], skip=16)
    bad = slots.clone()
    bad[5] = bad[4]  # not a whole block in order
    with pytest.raises(ValueError, match="whole blocks"):
        ref_gather(pre.kv, lay, bad, [(0, 128)], [torch.empty(object_spec(lay, 128).shape)])
    half = slots.clone()
    half[40:50] = -1  # a page partly without KV
    with pytest.raises(ValueError, match="whole blocks"):
        ref_scatter(objs, pre.kv, lay, half, [(0, 128)])
    neg = slots.clone()
    neg[32:64] = -1
    with pytest.raises(ValueError, match="slots < 0"):
        ref_gather(pre.kv, lay, neg, [(0, 128)], [torch.empty(object_spec(lay, 128).shape)])
    # the final partial block is allowed only at the end of the slot mapping
    assert ref_scatter(objs[:1], pre.kv, lay, slots[:100], [(0, 100)]) == 100


# -------------------------------------------------------------------------------------- a real model shape


def test_llama8b_shape_round_trip_through_a_shuffled_block_table() -> None:
    """Llama-8B's KV shape (32 layers, 8 KV heads, head dim 128, blocks of 16) through a shuffled block
    table: every object holds exactly its tokens' KV, and scattering them into a fresh cache restores every
    written slot bit-exactly and leaves every other slot untouched. (Speed: ``tiercache bench engine``.)"""
    n, bs, chunk = 300, 16, 256  # a full chunk and a 44-token tail (the last block partly filled)
    layout = PagedLayout(LayoutKind.VLLM_FLASH, 32, 8, 128, bs, "bfloat16")
    gen = torch.Generator().manual_seed(8)
    nb = n // bs + 8
    kv = [random_tensor(layout.layer_shape(nb), torch.bfloat16, gen) for _ in range(32)]
    slots = (torch.randperm(nb, generator=gen)[: -(-n // bs)].repeat_interleave(bs) * bs)[:n] + torch.arange(
        n
    ) % bs
    spans = chunk_spans(n, chunk)
    assert spans == [(0, 256), (256, 300)]
    objs = alloc(layout, spans, torch.bfloat16)
    ref_gather(kv, layout, slots, spans, objs)
    for (start, end), obj in zip(spans, objs, strict=True):
        for layer in (0, 17, 31):
            # per token and head the page holds K (head dim) then V (head dim)
            page = kv[layer].permute(0, 2, 1, 3).reshape(nb * bs, 8, 256)[slots[start:end]]
            assert torch.equal(bits(obj[0, layer]), bits(page[:, :, :128].reshape(end - start, -1)))
            assert torch.equal(bits(obj[1, layer]), bits(page[:, :, 128:].reshape(end - start, -1)))
    fresh = [poisoned(t.shape, torch.bfloat16) for t in kv]
    assert ref_scatter(objs, fresh, layout, slots, spans) == n
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[slots] = True
    for src, dst in zip(kv, fresh, strict=True):
        flat_src = bits(src.permute(0, 2, 1, 3).reshape(nb * bs, -1))
        flat_dst = bits(dst.permute(0, 2, 1, 3).reshape(nb * bs, -1))
        assert torch.equal(flat_dst[written], flat_src[written])
        assert bool((flat_dst[~written] == -1).all())  # never written: still the poison


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("kind", "strided"), [*KINDS, pytest.param(LayoutKind.CPU_BLOCKS, False, id="cpu-pages")]
)
def test_cuda_round_trip_with_host_objects(kind: LayoutKind, strided: bool) -> None:
    """CUDA paged KV <-> host objects (staged copies) and CUDA objects give the same bits as the CPU path."""
    n, bs = 96, 32
    if kind is LayoutKind.CPU_BLOCKS:
        pre, _ = cpu_engine(8, bs, n, seed=40)
        dec, _ = cpu_engine(8, bs, n, seed=41)
    else:
        pre = make_engine(kind, torch.bfloat16, 8, bs, n, seed=40, strided=strided)
        dec = make_engine(kind, torch.bfloat16, 8, bs, n, seed=41, strided=strided)
    dtype = pre.kv[0].dtype
    spans = chunk_spans(n, 64)
    cpu_objs = alloc(pre.layout, spans, dtype)
    ref_gather(pre.kv, pre.layout, pre.slots(n), spans, cpu_objs)
    gpu_kv = [t.cuda() for t in pre.kv]  # .cuda() keeps strides of dense views
    assert gpu_kv[0].is_contiguous() == pre.kv[0].is_contiguous()
    host = alloc(pre.layout, spans, dtype)
    ref_gather(gpu_kv, pre.layout, pre.slots(n), spans, host)  # slot_mapping on the host, KV on the GPU
    dev = [o.cuda() for o in alloc(pre.layout, spans, dtype)]
    ref_gather(gpu_kv, pre.layout, pre.slots(n).cuda(), spans, dev)
    for a, b, c in zip(cpu_objs, host, dev, strict=True):
        assert torch.equal(bits(a), bits(b))
        assert torch.equal(bits(a), bits(c).cpu())
    dec_gpu = [t.cuda() for t in dec.kv]
    assert ref_scatter(host, dec_gpu, dec.layout, dec.slots(n).cuda(), spans, skip=32) == n - 32
    assert ref_scatter(cpu_objs, dec.kv, dec.layout, dec.slots(n), spans, skip=32) == n - 32
    for g, c in zip(dec_gpu, dec.kv, strict=True):
        assert torch.equal(bits(g).cpu(), bits(c))


@pytest.mark.parametrize("kind", [LayoutKind.VLLM_FLASH, LayoutKind.VLLM_LEGACY, LayoutKind.VLLM_MLA])
def test_fp8_reference_round_trip_on_cpu(kind: LayoutKind) -> None:
    """The fp8 L1 path on a CPU engine (the torch reference behind ``dispatch``): the payload is the fp8
    codec's, half the bytes plus scales; its scatter writes within 3 % of the original, leaves the skipped
    tokens and slots < 0 untouched and counts the tokens written."""
    from tiercache.gpu import dispatch, fp8_payload_nbytes
    from tiercache.gpu import reference as ref
    from tiercache.serde.fp8 import Fp8Codec

    gen = torch.Generator().manual_seed(41)
    h = 1 if kind is LayoutKind.VLLM_MLA else H
    layout = PagedLayout(kind, L, h, D, 16, "bfloat16")
    nb = 12
    kv = [(torch.randn(layout.layer_shape(nb), generator=gen) * 3).to(torch.bfloat16) for _ in range(L)]
    slots = torch.randperm(nb * 16, generator=gen)[:70]
    spans = [(0, 32), (32, 64), (64, 70)]
    outs = [torch.empty(fp8_payload_nbytes(layout, e - s), dtype=torch.uint8) for s, e in spans]
    dispatch.gather(kv, Move.gather_fp8(layout, slots, spans, outs))
    codec = Fp8Codec()
    for (s, e), out in zip(spans, outs, strict=True):
        spec = object_spec(layout, e - s)
        obj = torch.empty(spec.shape, dtype=torch.bfloat16)
        ref_gather(kv, layout, slots, [(s, e)], [obj])
        want = bytearray(codec.max_encoded_size(spec.nbytes, spec))
        src = memoryview(obj.view(torch.uint8).reshape(-1).numpy())
        n = codec.encode_into(src, memoryview(want), spec, None)  # type: ignore[arg-type]
        assert torch.equal(out, torch.frombuffer(want, dtype=torch.uint8)[:n])
        elements = spec.nbytes // 2
        assert out.numel() == elements + 4 * (elements // (e - s))  # e4m3 bytes + a float32 per channel
    slots2 = slots.clone()
    slots2[40] = -1
    got = [poisoned(t.shape, torch.bfloat16) for t in kv]
    written = dispatch.scatter(got, Move.scatter_fp8(layout, slots2, spans, outs, [3, 0, 0]))
    assert written == 70 - 3 - 1
    back = [poisoned(object_spec(layout, e - s).shape, torch.bfloat16) for s, e in spans]
    orig = [torch.empty_like(b) for b in back]
    ref_gather(kv, layout, slots, spans, orig)
    full = [poisoned(t.shape, torch.bfloat16) for t in kv]
    ref.scatter(full, Move.scatter_fp8(layout, slots, spans, outs))
    ref_gather(full, layout, slots, spans, back)
    for a, b in zip(back, orig, strict=True):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 0.03
    # the skipped tokens (3 of span 0) and the slot < 0 were not written
    skipped = torch.cat([slots[:3], slots[40:41]])
    one = [torch.empty(object_spec(layout, 4).shape, dtype=torch.bfloat16)]
    ref_gather(got, layout, skipped, [(0, 4)], one)
    assert not bool(torch.isfinite(one[0].float()).any())  # still the NaN poison


# ----- property: any spans and skips; whole blocks (widened index_copy_) and ragged ends match a plain loop


Case = tuple[LayoutKind, bool, torch.dtype, int, int, list[int], list[int], int]


@st.composite
def _scatter_cases(draw: st.DrawFn) -> Case:
    kind, strided = draw(
        st.sampled_from(
            [
                (LayoutKind.VLLM_FLASH, True),
                (LayoutKind.VLLM_FLASH, False),
                (LayoutKind.VLLM_LEGACY, True),
                (LayoutKind.VLLM_MLA, True),
            ]
        )
    )
    dtype = draw(st.sampled_from(DTYPES))
    bs = draw(st.sampled_from([2, 4, 16]))
    n = draw(st.integers(1, 90))
    cuts = sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=4)))) if n > 1 else []
    bounds = [0, *cuts, n]
    skips = [draw(st.integers(0, b - a)) for a, b in itertools.pairwise(bounds)]
    return kind, strided, dtype, bs, n, bounds, skips, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(_scatter_cases())
def test_scatter_any_spans_and_skips_matches_plain_loop(
    case: Case,
) -> None:
    """Spans cut anywhere (block-straddling heads and tails, single tokens) and any skip per span: every
    token past its span's skip lands bit-exactly at its slot; skipped tokens, other slots untouched."""
    kind, strided, dtype, bs, n, bounds, skips, seed = case
    nblocks = -(-n // bs) + 3
    src = make_engine(kind, dtype, nblocks, bs, n, seed, strided=strided)
    dst = make_engine(kind, dtype, nblocks, bs, n, seed + 1, strided=strided)
    dst.block_table = src.block_table  # same slots, different contents
    spans = list(itertools.pairwise(bounds))
    slots = src.slots(n)
    objs = alloc(src.layout, spans, dtype)
    ref_gather(src.kv, src.layout, slots, spans, objs)
    before = Engine(dst.layout, [t.clone() for t in dst.kv], dst.block_table)
    written = ref_scatter(objs, dst.kv, dst.layout, slots, spans, skip=skips)
    assert written == sum(b - a - s for (a, b), s in zip(spans, skips, strict=True))
    skipped = {t for (a, _), s in zip(spans, skips, strict=True) for t in range(a, a + s)}
    for layer in range(L):
        for t in range(n):
            want = before.token(layer, int(slots[t])) if t in skipped else src.token(layer, int(slots[t]))
            got = dst.token(layer, int(slots[t]))
            assert all(torch.equal(bits(g), bits(w)) for g, w in zip(got, want, strict=True)), (layer, t)
    # slots outside the request (the spare blocks) are untouched
    used = set(src.block_table.tolist())
    for b in range(nblocks):
        if b not in used:
            for layer in range(L):
                got_b = dst.token(layer, b * bs)
                want_b = before.token(layer, b * bs)
                assert all(torch.equal(bits(g), bits(w)) for g, w in zip(got_b, want_b, strict=True))
