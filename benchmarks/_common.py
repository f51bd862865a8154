"""What the scripts in ``benchmarks/`` share: the repository root, the test harness's server launchers
(``tiercache.testing.harness``) and tiercache.cli.bench's measuring helpers (timing, GB/s, ratios, host info)
and its JSON printer; the random paged KV the CPU copy benchmarks copy from; the size sweeps' command line
and load fields; the model-shaped GPU workload the GPU overlap benchmarks run beside their moves.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from tiercache.cli.bench.measure import best, best_median, gbps, host_info, paired, percentiles, ratio
from tiercache.cli.bench.report import print_json
from tiercache.testing.harness.backends import start_redis_process
from tiercache.testing.harness.processes import NodeServer, ServerProcess, free_port, port_open, start_process
from tiercache.testing.harness.s3 import TEST_ENV as S3_TEST_ENV
from tiercache.testing.harness.s3 import MotoServer, aws_test_env
from tiercache.testing.harness.scripts import load_by_path

if TYPE_CHECKING:
    import torch

    from tiercache.gpu.cpu_rows import Geometry
    from tiercache.gpu.layouts import PagedLayout

ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "ROOT",
    "S3_TEST_ENV",
    "FlashKV",
    "MatmulModel",
    "MotoServer",
    "NodeServer",
    "ServerProcess",
    "aws_test_env",
    "best",
    "best_median",
    "contiguous_geometry",
    "flash_kv",
    "free_port",
    "gbps",
    "host_info",
    "load_by_path",
    "load_fields",
    "paired",
    "parse_sizes",
    "percentiles",
    "port_open",
    "print_json",
    "ratio",
    "sizes_parser",
    "start_process",
    "start_redis_process",
]


class FlashKV(NamedTuple):
    """What :func:`flash_kv` builds."""

    layout: PagedLayout
    kv: list[torch.Tensor]
    """Random bf16 pages per layer: vLLM's NHD allocation ``[NB, BS, H, 2D]`` seen as ``[NB, H, BS, 2D]``."""
    kv_back: list[torch.Tensor]
    """Zeroed pages of the same layout, to scatter into."""
    slots: torch.Tensor
    """One slot per token through a shuffled block table (no two blocks adjacent, block 0 unused)."""


def flash_kv(layers: int, heads: int, head_dim: int, block: int, tokens: int) -> FlashKV:
    """A ``VLLM_FLASH`` paged KV holding ``tokens`` tokens (8 blocks to spare), from torch's current seed."""
    import torch

    from tiercache.gpu.layouts import LayoutKind, PagedLayout

    nb = tokens // block + 8
    layout = PagedLayout(LayoutKind.VLLM_FLASH, layers, heads, head_dim, block, "bfloat16")
    raw = [torch.randn(nb, block, heads, 2 * head_dim).bfloat16() for _ in range(layers)]
    kv = [r.permute(0, 2, 1, 3) for r in raw]
    kv_back = [torch.zeros_like(r).permute(0, 2, 1, 3) for r in raw]
    table = torch.randperm(nb - 1)[: tokens // block] + 1
    pos = torch.arange(tokens)
    return FlashKV(layout, kv, kv_back, table[pos // block] * block + pos % block)


def sizes_parser(doc: str | None, rounds: int) -> argparse.ArgumentParser:
    """A size sweep's command line: ``--sizes`` (parse them with :func:`parse_sizes`), ``--repeats``,
    ``--rounds`` (default ``rounds``); described by ``doc``'s first line."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--sizes", default="1MiB,4MiB,32MiB", help="comma-separated sizes (e.g. 1MiB,4MiB)")
    parser.add_argument("--repeats", type=int, default=None, help="objects per size and round")
    parser.add_argument("--rounds", type=int, default=rounds, help="rounds per size (totals reported)")
    return parser


def parse_sizes(text: str) -> list[int]:
    """``--sizes``: comma-separated sizes (``1MiB,4MiB``) in bytes."""
    from tiercache.adapters.options import parse_size

    return [parse_size(s) for s in text.split(",") if s]


def load_fields(load_before: float) -> dict[str, Any]:
    """The host's CPU count and 1-minute load average before a run (``load_before``) and now: ratios are
    unreliable on a machine busy with other work."""
    return {
        "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }


def contiguous_geometry(kv: torch.Tensor, heads: int, head_dim: int) -> Geometry:
    """The row kernel's view of a contiguous ``[2, L, T, H*D]`` KV (LMCache's layout) as one paged block of
    ``T`` tokens: it walks the same (layer, token, head, plane) rows as for a paged KV."""
    from tiercache.gpu import cpu_rows

    e, tokens = kv.element_size(), kv.shape[2]
    return cpu_rows.Geometry(
        layers=tuple(kv[0, j].data_ptr() for j in range(kv.shape[1])),
        block_size=tokens,
        s_blk=tokens * kv.stride(2) * e,
        s_off=kv.stride(2) * e,
        s_head=head_dim * e,
        heads=heads,
        plane_offsets=(0, kv.stride(0) * e),
        row_bytes=head_dim * e,
        n_slots=tokens,
    )


class MatmulModel:
    """A model-shaped CUDA workload: one forward is ``layers`` x the four bf16 matrix products of a Llama-8B
    decoder layer (hidden 4096, q/k/v 6144, MLP 14336) on ``tokens`` tokens, captured once as a CUDA graph and
    replayed on a stream of its own (so the host's work for other streams cannot starve its launches)."""

    def __init__(self, tokens: int, layers: int) -> None:
        import torch

        dev = torch.device("cuda")
        g = torch.Generator(device=dev).manual_seed(3)

        def rand(*shape: int) -> torch.Tensor:
            return (torch.randn(shape, generator=g, device=dev) * 0.02).bfloat16()

        self.x = rand(tokens, 4096)
        self.w = [rand(4096, 6144), rand(4096, 4096), rand(4096, 28672), rand(14336, 4096)]
        self.q = torch.empty(tokens, 6144, dtype=torch.bfloat16, device=dev)
        self.o = torch.empty(tokens, 4096, dtype=torch.bfloat16, device=dev)
        self.gu = torch.empty(tokens, 28672, dtype=torch.bfloat16, device=dev)
        self.h = torch.empty(tokens, 4096, dtype=torch.bfloat16, device=dev)
        self.flops = 2 * tokens * (4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096) * layers
        self.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self.stream):
            for _ in range(3):
                self._layers(layers)
        self.stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            self._layers(layers)
        torch.cuda.synchronize()

    def _layers(self, k: int) -> None:
        import torch

        for _ in range(k):
            torch.matmul(self.x, self.w[0], out=self.q)
            torch.matmul(self.q[:, :4096], self.w[1], out=self.o)
            torch.matmul(self.o, self.w[2], out=self.gu)
            torch.matmul(self.gu[:, :14336], self.w[3], out=self.h)

    def forwards_s(self, k: int) -> float:
        """Device seconds per forward of ``k`` replays back to back on the model's stream."""
        import torch

        a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self.stream):
            a.record()
            for _ in range(k):
                self.graph.replay()
            b.record()
        b.synchronize()
        return float(a.elapsed_time(b)) / 1e3 / k
