"""The gpu suite (CUDA only): paged GPU KV to pinned host objects and back through tiercache's kernels.

``gather`` (store path: GPU pages -> host objects) and ``scatter`` (retrieve path) go through
``tiercache.gpu.dispatch`` (Triton kernels when available, else the torch reference) against a plain
device-to-host / host-to-device copy of the same bytes between a dense device buffer and pinned memory.
Without CUDA the suite is skipped (its JSON says why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tiercache.cli.bench.engine import make_layout, paged_kv, slot_mapping
from tiercache.cli.bench.measure import Row, gbps, percentiles, spread, times
from tiercache.gpu.layouts import object_spec

if TYPE_CHECKING:
    from tiercache.cli.bench.runner import SuiteContext

__all__ = ["gpu_suite"]


async def gpu_suite(ctx: SuiteContext) -> list[Row]:
    """Gather/scatter GB/s per request size vs a same-size D2H/H2D copy (CUDA required)."""
    if not torch.cuda.is_available():
        ctx.skip("no CUDA device (torch.cuda.is_available() is False)")
        return []
    from tiercache.gpu.dispatch import gather, scatter
    from tiercache.gpu.move import Move

    layers = 8 if ctx.quick else 32
    sizes = ctx.token_sizes(quick=(1024, 4096), full=(1024, 4096, 16384))
    ctx.plan(len(sizes))
    rows: list[Row] = []
    chunk = ctx.config.chunk_size
    for tokens in sizes:
        layout = make_layout("flash", layers=layers)
        gen = torch.Generator().manual_seed(5)
        nblk = -(-tokens // layout.block_size)
        num_blocks = 2 * nblk + 1
        kv = paged_kv(layout, num_blocks, gen, device="cuda")
        table = torch.randperm(num_blocks - 1, generator=gen)[:nblk] + 1
        host_slots = slot_mapping(table, layout.block_size, tokens)
        slots = host_slots.cuda()
        spans = [(s, min(s + chunk, tokens)) for s in range(0, tokens, chunk)]
        objs = [
            torch.empty(object_spec(layout, e - s).shape, dtype=torch.bfloat16, pin_memory=True)
            for s, e in spans
        ]
        nbytes = sum(o.numel() * o.element_size() for o in objs)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

        def synced(fn: Callable[[], object]) -> Callable[[], None]:
            def run() -> None:
                fn()
                torch.cuda.synchronize()

            return run

        g_move = Move.gather(layout, slots, spans, objs, host_slots=host_slots)
        s_move = Move.scatter(layout, slots, spans, objs, host_slots=host_slots)
        do_gather = synced(lambda: gather(kv, g_move))
        do_scatter = synced(lambda: scatter(kv, s_move))
        d2h = synced(lambda: host.copy_(dev, non_blocking=True))
        h2d = synced(lambda: dev.copy_(host, non_blocking=True))
        t: dict[str, list[float]] = {"gather": [], "scatter": [], "d2h": [], "h2d": []}
        for fn in (do_gather, do_scatter, d2h, h2d):  # warm-up (kernel compilation)
            fn()
        for _ in range(ctx.repeat):
            t["gather"] += times(do_gather, 1)
            t["d2h"] += times(d2h, 1)
            t["scatter"] += times(do_scatter, 1)
            t["h2d"] += times(h2d, 1)
        for case, base, name in (("gather", "d2h", "D2H copy"), ("scatter", "h2d", "H2D copy")):
            rows.append(
                Row(
                    case=f"gpu {case}",
                    size=nbytes,
                    value=gbps(nbytes, min(t[case])),
                    raw=gbps(nbytes, min(t[base])),
                    baseline=f"{name} (pinned host)",
                    latency_s=percentiles(t[case]),
                    spread=spread(t[case], t[base]),
                    extra={"tokens": tokens, "layers": layers, "device": torch.cuda.get_device_name(0)},
                )
            )
        ctx.advance(f"gpu {tokens} tokens")
    return rows
