"""Layout descriptors, detection, object specs, fingerprints and the read-plan arithmetic of tiercache.gpu."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tiercache.gpu import (
    LayoutKind,
    PagedLayout,
    ReadPlan,
    detect_layout,
    object_spec,
    plan_read,
    skip_prefix_for,
)
from tiercache.keys import KeySpace
from tiercache.spec import KVFormat

NB, H, BS, D, L = 6, 4, 16, 8, 3


def flash_strided(nb: int = NB, h: int = H, bs: int = BS, d: int = D) -> torch.Tensor:
    """vLLM's [NB, H, BS, 2D] view of an NHD ([NB, BS, H, 2D]) allocation, as on the GPU."""
    return torch.randn(nb, bs, h, 2 * d).permute(0, 2, 1, 3)


def test_import_does_not_load_torch() -> None:
    code = "import sys, tiercache.gpu as g; g.plan_read(1, 2, 3); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_detect_strided_flash() -> None:
    kv = [flash_strided() for _ in range(L)]
    assert not kv[0].is_contiguous()
    layout = detect_layout(kv, BS)
    assert layout == PagedLayout(LayoutKind.VLLM_FLASH, L, H, D, BS, "float32")


def test_detect_dict_keeps_order_and_dtype() -> None:
    kv = {f"model.layers.{i}.self_attn.attn": flash_strided().to(torch.bfloat16) for i in range(L)}
    layout = detect_layout(kv, BS)
    assert (layout.kind, layout.num_layers, layout.dtype) == (LayoutKind.VLLM_FLASH, L, "bfloat16")


def test_detect_contiguous_cpu_is_ambiguous() -> None:
    kv = [torch.randn(NB, H, BS, 2 * D) for _ in range(L)]
    with pytest.raises(ValueError, match=r"\(6, 4, 16, 16\)") as err:
        detect_layout(kv, BS)
    assert "CPU_BLOCKS" in str(err.value)
    assert "VLLM_FLASH" in str(err.value)
    assert detect_layout(kv, BS, kind=LayoutKind.CPU_BLOCKS).kind is LayoutKind.CPU_BLOCKS
    assert detect_layout(kv, BS, kind=LayoutKind.VLLM_FLASH).kind is LayoutKind.VLLM_FLASH


def test_detect_non_cpu_device_is_flash() -> None:
    kv = [torch.empty(NB, H, BS, 2 * D, device="meta") for _ in range(L)]
    assert detect_layout(kv, BS).kind is LayoutKind.VLLM_FLASH


def test_cpu_blocks_rejects_strided() -> None:
    with pytest.raises(ValueError, match="does not fit layout CPU_BLOCKS"):
        detect_layout([flash_strided()], BS, kind=LayoutKind.CPU_BLOCKS)


def test_detect_legacy() -> None:
    kv = [torch.randn(2, NB, BS, H, D, dtype=torch.float16) for _ in range(L)]
    assert detect_layout(kv, BS) == PagedLayout(LayoutKind.VLLM_LEGACY, L, H, D, BS, "float16")


def test_detect_mla_needs_a_hint() -> None:
    kv = [torch.randn(NB, 1, BS, 576).permute(0, 1, 2, 3) for _ in range(L)]
    with pytest.raises(ValueError, match="VLLM_MLA"):
        detect_layout(kv, BS)
    assert detect_layout(kv, BS, use_mla=True) == PagedLayout(LayoutKind.VLLM_MLA, L, 1, 576, BS, "float32")
    assert detect_layout(kv, BS, head_dim=576).kind is LayoutKind.VLLM_MLA
    flash = detect_layout(kv, BS, use_mla=False, kind=LayoutKind.VLLM_FLASH)
    assert (flash.num_kv_heads, flash.head_dim) == (1, 288)


def test_detect_errors() -> None:
    with pytest.raises(ValueError, match="no KV cache"):
        detect_layout([], BS)
    with pytest.raises(ValueError, match="different shapes"):
        detect_layout([flash_strided(), flash_strided(nb=NB + 1)], BS)
    with pytest.raises(ValueError, match="no known layout fits"):
        detect_layout([flash_strided()], BS * 2)
    with pytest.raises(ValueError, match="no known layout fits"):
        detect_layout([torch.randn(NB, BS, D)], BS)  # old MLA shape: not supported
    with pytest.raises(ValueError, match="no known layout fits"):
        detect_layout([flash_strided()], BS, num_kv_heads=H + 1)
    with pytest.raises(ValueError, match="dtype or device"):
        detect_layout([flash_strided(), flash_strided().half()], BS)


def test_layout_validation() -> None:
    with pytest.raises(ValueError, match="one latent head"):
        PagedLayout(LayoutKind.VLLM_MLA, L, 2, D, BS, "bfloat16")
    with pytest.raises(ValueError, match="positive"):
        PagedLayout(LayoutKind.VLLM_FLASH, L, H, D, 0, "bfloat16")
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        PagedLayout(LayoutKind.VLLM_FLASH, L, H, D, BS, "int4")
    assert PagedLayout(LayoutKind.VLLM_FLASH, L, H, D, BS, "bf16").dtype == "bfloat16"


def test_layer_shape_and_num_blocks() -> None:
    flash = PagedLayout(LayoutKind.VLLM_FLASH, L, H, D, BS, "float32")
    legacy = PagedLayout(LayoutKind.VLLM_LEGACY, L, H, D, BS, "float32")
    mla = PagedLayout(LayoutKind.VLLM_MLA, L, 1, D, BS, "float32")
    assert flash.layer_shape(NB) == (NB, H, BS, 2 * D)
    assert legacy.layer_shape(NB) == (2, NB, BS, H, D)
    assert mla.layer_shape(NB) == (NB, 1, BS, D)
    assert legacy.num_blocks_of(torch.empty(2, NB, BS, H, D)) == NB
    with pytest.raises(ValueError, match="does not match"):
        flash.num_blocks_of(torch.empty(2, NB, BS, H, D))
    with pytest.raises(ValueError, match="dtype"):
        flash.num_blocks_of(torch.empty(NB, H, BS, 2 * D, dtype=torch.float16))


def test_object_spec() -> None:
    flash = PagedLayout(LayoutKind.VLLM_FLASH, 32, 8, 128, 16, "bfloat16")
    spec = object_spec(flash, 256)
    assert spec.format is KVFormat.KV_2LTD
    assert spec.shape == (2, 32, 256, 1024)
    assert spec.nbytes == 2 * 32 * 256 * 1024 * 2
    mla = PagedLayout(LayoutKind.VLLM_MLA, 61, 1, 576, 64, "bfloat16")
    assert object_spec(mla, 100).shape == (61, 100, 576)
    assert object_spec(mla, 100).format is KVFormat.KV_MLA
    legacy = PagedLayout(LayoutKind.VLLM_LEGACY, 32, 8, 128, 16, "bfloat16")
    assert object_spec(legacy, 256) == spec


def test_cpu_blocks_object_spec_rounds_up_to_pages() -> None:
    cpu = PagedLayout(LayoutKind.CPU_BLOCKS, 2, 4, 64, 32, "float32")
    assert object_spec(cpu, 64).tokens == 64
    assert object_spec(cpu, 65).tokens == 96
    assert object_spec(cpu, 65).nbytes == 2 * cpu.page_elems * 4 * 3  # layers x pages
    assert cpu.block_aligned
    assert not PagedLayout(LayoutKind.VLLM_FLASH, 2, 4, 64, 32, "float32").block_aligned


def test_fingerprint() -> None:
    flash = PagedLayout(LayoutKind.VLLM_FLASH, 32, 8, 128, 16, "bfloat16")
    legacy = PagedLayout(LayoutKind.VLLM_LEGACY, 32, 8, 128, 32, "bfloat16")
    cpu = PagedLayout(LayoutKind.CPU_BLOCKS, 32, 8, 128, 32, "bfloat16")
    cpu64 = PagedLayout(LayoutKind.CPU_BLOCKS, 32, 8, 128, 64, "bfloat16")
    mla = PagedLayout(LayoutKind.VLLM_MLA, 32, 1, 576, 16, "bfloat16")
    assert flash.fingerprint == legacy.fingerprint == "KV_2LTD:L32:H8:D128:bfloat16"
    ks = KeySpace.for_spec("m", object_spec(flash, 256))
    assert ks.layout_fingerprint == flash.fingerprint
    assert KeySpace.for_spec("m", object_spec(mla, 256)).layout_fingerprint == mla.fingerprint
    assert len({flash.fingerprint, cpu.fingerprint, cpu64.fingerprint, mla.fingerprint}) == 4
    assert cpu.fingerprint.startswith("CPU_BLOCKS:BS32:")


# ----------------------------------------------------------------------------------------------- read plan


def test_design_example_288_local_512_hit() -> None:
    plan = plan_read(288, 512, 256)
    assert 0 not in plan.chunk_indices  # chunk 0 is skipped
    assert list(plan.chunk_indices) == [1]
    assert plan.spans == ((256, 512),)  # chunk 1 is read whole
    assert plan.skip_prefix == 32
    assert plan.tokens_to_write == 224
    assert plan.skips == (32,)
    assert skip_prefix_for(288, 256) == 32
    assert skip_prefix_for(288, 512) == 0


def test_plan_nothing_to_read() -> None:
    assert plan_read(512, 512, 256) == ReadPlan(512, 512, 256, (), 0, 0)
    assert plan_read(600, 512, 256).tokens_to_write == 0
    assert list(plan_read(600, 512, 256).chunk_indices) == []


def test_plan_unfull_last_chunk_and_block_alignment() -> None:
    plan = plan_read(0, 600, 256)
    assert plan.spans == ((0, 256), (256, 512), (512, 600))
    assert plan.skips == (0, 0, 0)
    assert plan_read(288, 600, 256, block_size=32).skip_prefix == 32
    with pytest.raises(ValueError, match="multiple of block_size"):
        plan_read(288, 600, 256, block_size=64)


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        plan_read(0, 10, 0)
    with pytest.raises(ValueError, match=">= 0"):
        plan_read(-1, 10, 4)


@given(
    local=st.integers(0, 5000),
    hit=st.integers(0, 5000),
    chunk=st.integers(1, 600),
)
def test_plan_properties(local: int, hit: int, chunk: int) -> None:
    plan = plan_read(local, hit, chunk)
    assert plan.tokens_to_write == max(0, hit - local)
    written = sum(e - s - k for (s, e), k in zip(plan.spans, plan.skips, strict=True))
    assert written == plan.tokens_to_write
    if not plan.spans:
        assert hit <= local
        return
    first_start = plan.spans[0][0]
    assert plan.tokens_to_write == hit - max(local, first_start)
    for i, (s, e) in zip(plan.chunk_indices, plan.spans, strict=True):
        assert s == i * chunk  # chunk-aligned reads
        assert e == min(s + chunk, hit)
        assert e > local  # no chunk read entirely below the local hit
    assert first_start <= local < first_start + chunk
    assert all(a[1] == b[0] for a, b in zip(plan.spans, plan.spans[1:], strict=False))  # contiguous
    assert plan.spans[-1][1] == hit
    assert 0 <= plan.skip_prefix < plan.spans[0][1] - plan.spans[0][0]
    assert plan.skip_prefix == skip_prefix_for(local, first_start)
