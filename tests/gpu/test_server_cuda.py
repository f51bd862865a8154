"""Server mode on CUDA: a client's mapping of the shared L1 registered with cudaHostRegister is pinned memory
to torch and the kernels; a GPU gather into shared slots and a scatter back from them are bit-exact."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tiercache.gpu import LayoutKind, Move, PagedLayout, dispatch, object_spec, reference
from tiercache.server.client import SharedL1

LAYOUT = PagedLayout(
    LayoutKind.VLLM_FLASH, num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16"
)
CHUNK = 64


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "l1.sock")
    spec = object_spec(LAYOUT, CHUNK)
    cmd = [sys.executable, "-m", "tiercache.server", "--socket", path, "--slot-bytes", str(spec.nbytes)]
    proc = subprocess.Popen([*cmd, "--slots", "8"], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    assert proc.stdout is not None
    assert proc.stdout.readline(), "the server did not start"
    try:
        yield path
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_registered_shared_slots_are_pinned_and_round_trip_bit_exact(socket_path: str) -> None:
    spec = object_spec(LAYOUT, CHUNK)
    nb, bs = 16, LAYOUT.block_size
    gen = torch.Generator(device="cuda").manual_seed(5)
    kv = [
        torch.randn(LAYOUT.layer_shape(nb), generator=gen, device="cuda").to(torch.bfloat16) for _ in range(4)
    ]
    kv2 = [torch.zeros_like(t) for t in kv]
    slots = torch.randperm(nb * bs, generator=gen, device="cuda")[: 2 * CHUNK]
    spans = [(0, CHUNK), (CHUNK, 2 * CHUNK)]
    want = [torch.empty(spec.shape, dtype=torch.bfloat16) for _ in spans]  # the CPU reference's objects
    reference.gather([t.cpu() for t in kv], Move.gather(LAYOUT, slots.cpu(), spans, want))
    l1 = SharedL1(socket_path)
    objs = l1.batched_reserve_write(["a", "b"], [spec, spec])
    assert all(o is not None for o in objs)
    seg = objs[0].seg  # type: ignore[union-attr]
    assert seg.cuda_register_s is not None  # a worker's client registers its mapping when it connects
    try:
        shared = [o.tensor() for o in objs]  # type: ignore[union-attr]
        assert all(t.is_pinned() for t in shared)
        dispatch.gather(kv, Move.gather(LAYOUT, slots, spans, shared))
        torch.cuda.synchronize()
        for got, exp in zip(shared, want, strict=True):
            assert torch.equal(got.view(torch.int16), exp.view(torch.int16))
        dispatch.scatter(kv2, Move.scatter(LAYOUT, slots, spans, shared))
        back = [torch.empty(spec.shape, dtype=torch.bfloat16) for _ in spans]
        reference.gather([t.cpu() for t in kv2], Move.gather(LAYOUT, slots.cpu(), spans, back))
        for got, exp in zip(back, want, strict=True):
            assert torch.equal(got.view(torch.int16), exp.view(torch.int16))
    finally:
        l1.batched_abort_write([o for o in objs if o is not None])
        l1.close()
