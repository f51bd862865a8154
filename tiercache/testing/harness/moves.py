"""Helpers of the kernel tests on CUDA (``tests/gpu/test_gpu_kernels.py``) and in Triton's interpreter
(``tests/unit/gpu_interp_cases.py``): random paged KV, poisoned outputs, and the move entry points called
through a ``Move`` built from each case's arguments. Tensors are made on the device of the generator or the
one named; importing this module builds no kernel (``TRITON_INTERPRET`` may still be set after it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tiercache.gpu import LayoutKind, Move, PagedLayout, reference
from tiercache.gpu import triton_kernels as tk

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
KINDS = [
    pytest.param(LayoutKind.VLLM_FLASH, True, id="flash-nhd-strided"),
    pytest.param(LayoutKind.VLLM_FLASH, False, id="flash-contiguous"),
    pytest.param(LayoutKind.VLLM_LEGACY, False, id="legacy"),
    pytest.param(LayoutKind.VLLM_MLA, False, id="mla"),
]


def ref_gather(
    kv: Any, layout: PagedLayout, slots: torch.Tensor, spans: Any, out: Any, layers: Any = None
) -> None:
    reference.gather(kv, Move.gather(layout, slots, spans, out, layers=layers))


def ref_scatter(
    objs: Any,
    kv: Any,
    layout: PagedLayout,
    slots: torch.Tensor,
    spans: Any,
    skip: Any = 0,
    layers: Any = None,
) -> int:
    return reference.scatter(kv, Move.scatter(layout, slots, spans, objs, skip, layers=layers))


def k_gather(
    kv: Any,
    layout: PagedLayout,
    slots: torch.Tensor,
    spans: Any,
    out: Any,
    layers: Any = None,
    cfg: tk.TileConfig = tk.DEFAULT_CONFIG,
    **kw: Any,
) -> None:
    tk.gather(kv, Move.gather(layout, slots, spans, out, layers=layers, **kw), cfg)


def k_scatter(
    objs: Any,
    kv: Any,
    layout: PagedLayout,
    slots: torch.Tensor,
    spans: Any,
    skip: Any = 0,
    layers: Any = None,
    cfg: tk.TileConfig = tk.DEFAULT_CONFIG,
    **kw: Any,
) -> int:
    return tk.scatter(kv, Move.scatter(layout, slots, spans, objs, skip, layers=layers, **kw), cfg)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as same-width integers (bit-exact comparisons, NaN patterns included)."""
    return t.view(BITS[t.element_size()])


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random non-zero bit patterns of ``dtype`` (finite floats for float32), on ``gen``'s device."""
    if dtype == torch.float32:
        return torch.randn(shape, generator=gen, device=gen.device) + 3.0
    ib = BITS[torch.empty((), dtype=dtype).element_size()]
    raw = torch.randint(1, torch.iinfo(ib).max, shape, generator=gen, dtype=torch.int64, device=gen.device)
    return raw.to(ib).view(dtype)


def poisoned(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu", pin: bool = False
) -> torch.Tensor:
    """A tensor whose every bit is set (a write that misses an element leaves it so)."""
    t = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
    bits(t).fill_(-1 if t.element_size() > 1 else 255)
    return t


def sentinel_left(t: torch.Tensor) -> bool:
    """True when some element of ``t`` still has every bit set."""
    return bool((bits(t) == (-1 if t.element_size() > 1 else 255)).any())


def make_kv(
    kind: LayoutKind,
    dtype: torch.dtype,
    strided: bool,
    seed: int,
    *,
    device: torch.device,
    layers: int,
    heads: int,
    head_dim: int,
    bs: int,
    nb: int,
    tokens: int,
) -> tuple[PagedLayout, list[torch.Tensor], torch.Tensor]:
    """(layout, random paged KV of ``nb`` blocks, slot mapping of ``tokens`` tokens through a shuffled block
    table that never uses block 0); VLLM_FLASH ``strided``: the NHD allocation seen through its HND view."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h = 1 if kind is LayoutKind.VLLM_MLA else heads
    layout = PagedLayout(kind, layers, h, head_dim, bs, str(dtype))
    kv = []
    for _ in range(layers):
        if kind is LayoutKind.VLLM_FLASH and strided:
            kv.append(random_tensor((nb, bs, h, 2 * head_dim), dtype, gen).permute(0, 2, 1, 3))
        else:
            kv.append(random_tensor(layout.layer_shape(nb), dtype, gen))
    need = -(-tokens // bs)
    table = torch.randperm(nb - 1, generator=gen, device=device)[:need] + 1
    pos = torch.arange(tokens, device=device)
    return layout, kv, table[pos // bs] * bs + pos % bs
