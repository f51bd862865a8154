"""GPU tests of the fp8 L1: the staged fp8 pipeline (quantize into device staging, copies to host, and back)
and the engine with ``l1.codec = "fp8"`` on CUDA, bit-exact against the torch reference (skipped without
CUDA)."""

from __future__ import annotations

import asyncio

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from tiercache.config import Config, L1Config
from tiercache.gpu import LayoutKind, Move, PagedLayout, fp8_transfer, object_spec, reference, transfer
from tiercache.gpu import triton_kernels as tk
from tiercache.store.engine import CacheEngine

DEV = torch.device("cuda")
LAYOUT = PagedLayout(
    LayoutKind.VLLM_FLASH, num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16"
)


def make_kv(seed: int, blocks: int = 64) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    kv = [torch.randn(LAYOUT.layer_shape(blocks), generator=gen, device=DEV).mul_(3).to(torch.bfloat16)]
    kv += [torch.randn_like(kv[0], dtype=torch.float32).mul_(2).to(torch.bfloat16) for _ in range(3)]
    perm = torch.randperm(blocks, device=DEV, generator=gen)
    pos = torch.arange(blocks * 16, device=DEV)
    return kv, perm[pos // 16] * 16 + pos % 16


@pytest.fixture
def small_staging(monkeypatch: pytest.MonkeyPatch) -> transfer.Transfer:
    """A Transfer whose staging holds about two payloads: many groups, both buffers reused."""
    t = transfer.Transfer(DEV, staging_bytes=2 * tk.fp8_payload_nbytes(LAYOUT, 96) + 1024)
    monkeypatch.setattr(transfer, "transfer_for", lambda device: t)
    return t


@pytest.mark.parametrize("pooled", [True, False], ids=["back-to-back", "separate"])
@pytest.mark.parametrize("coalesce", [True, False])
def test_staged_fp8_store_and_load_match_the_reference(
    small_staging: transfer.Transfer, pooled: bool, coalesce: bool
) -> None:
    """Payloads back to back in one pinned pool (as L1 slots handed out in order: coalesced runs) or apart."""
    kv, slots = make_kv(1)
    spans = [(0, 96), (96, 192), (192, 288), (288, 384), (384, 480), (480, 500)]
    sizes = [tk.fp8_payload_nbytes(LAYOUT, e - s) for s, e in spans]
    pool = torch.full((sum(sizes) + 4096,), 255, dtype=torch.uint8, pin_memory=True)
    starts = [sum(sizes[:i]) + (0 if pooled else 512 * i) for i in range(len(sizes))]
    outs = [pool[a : a + n] for a, n in zip(starts, sizes, strict=True)]
    fp8_transfer.store_fp8_to_host(kv, Move.gather_fp8(LAYOUT, slots, spans, outs), coalesce=coalesce)
    assert len(transfer._groups([o.numel() for o in outs], small_staging.staging_bytes)) >= 4
    want = [torch.empty_like(o) for o in outs]
    reference.gather(kv, Move.gather_fp8(LAYOUT, slots, spans, want))
    assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))
    _, slots2 = make_kv(2)
    slots2 = slots2.clone()
    slots2[200] = -1  # skipped, never written
    skips = [0, 7, 0, 0, 3, 0]
    got = [torch.full_like(t, float("nan")) for t in kv]
    ref = [t.clone() for t in got]
    move = Move.scatter_fp8(LAYOUT, slots2, spans, outs, skips)
    n = fp8_transfer.load_fp8_from_host(got, move, coalesce=coalesce)
    assert n == reference.scatter(ref, Move.scatter_fp8(LAYOUT, slots2, spans, want, skips))
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, ref, strict=True))


def test_staged_fp8_store_refuses_bad_slots_and_non_finite_input(small_staging: transfer.Transfer) -> None:
    kv, slots = make_kv(3)
    spans = [(0, 96), (96, 192), (192, 288)]
    outs = [
        torch.empty(tk.fp8_payload_nbytes(LAYOUT, e - s), dtype=torch.uint8, pin_memory=True)
        for s, e in spans
    ]
    bad = slots.clone()
    bad[150] = 10**7
    with pytest.raises(ValueError, match="outside the paged KV"):
        fp8_transfer.store_fp8_to_host(kv, Move.gather_fp8(LAYOUT, bad, spans, outs))
    nan = torch.full(object_spec(LAYOUT, 1).shape, float("nan"), dtype=torch.bfloat16, device=DEV)
    reference.scatter(kv, Move.scatter(LAYOUT, slots, [(250, 251)], [nan]))  # one token of the third span
    with pytest.raises(ValueError, match="finite"):
        fp8_transfer.store_fp8_to_host(kv, Move.gather_fp8(LAYOUT, slots, spans, outs))


def test_engine_with_an_fp8_l1_on_cuda_equals_the_cpu_engine() -> None:
    """Store on CUDA (staged quantize) and on the CPU (the torch reference): the same L1 payloads; retrieve on
    CUDA writes exactly what the CPU engine writes, within 3 % of the source."""
    kv, slots = make_kv(4)
    n = 300
    tokens = list(range(7, 7 + n))

    async def run() -> None:
        slot = CacheEngine.slot_bytes(LAYOUT, 128, codec="fp8")
        cfg = Config(chunk_size=128, l1=L1Config(capacity=8 * slot, codec="fp8"))
        gpu = await CacheEngine.open(cfg, LAYOUT, model="m")
        cpu = await CacheEngine.open(cfg, LAYOUT, model="m")
        try:
            assert await gpu.store(tokens, kv, slots[:n]) == n
            assert await cpu.store(tokens, [t.cpu() for t in kv], slots[:n].cpu()) == n
            keys = [
                gpu.token_db.key_prefix + s.key.chunk_hash.hex() for s in gpu.token_db.process_tokens(tokens)
            ]
            for key in keys:
                a, b = gpu.manager.l1.acquire(key), cpu.manager.l1.acquire(key)
                assert a is not None
                assert b is not None
                assert torch.equal(a.obj.payload(), b.obj.payload())
                a.release()
                b.release()
            _, slots2 = make_kv(5)
            got = [torch.full_like(t, float("nan")) for t in kv]
            want = [t.cpu() for t in got]
            r = await gpu.retrieve_result(tokens, got, slots2[:n])
            assert r.tokens_written == n
            await cpu.retrieve_result(tokens, want, slots2[:n].cpu())
            assert all(
                torch.equal(a.cpu().view(torch.int16), b.view(torch.int16))
                for a, b in zip(got, want, strict=True)
            )
            x = torch.empty(object_spec(LAYOUT, n).shape, dtype=torch.bfloat16, device=DEV)
            y = torch.empty_like(x)
            reference.gather(got, Move.gather(LAYOUT, slots2[:n], [(0, n)], [x]))
            reference.gather(kv, Move.gather(LAYOUT, slots[:n], [(0, n)], [y]))
            assert float((x.float() - y.float()).norm() / y.float().norm()) < 0.03
        finally:
            await gpu.aclose()
            await cpu.aclose()

    asyncio.run(run())
