"""The codecs suite: each codec chain (the config's tiers' and the usual ones) on a KV-like sample vs memcpy.

The sample is bf16 KV drawn from a standard normal (values like real keys and values, no structure a real
model would add, so compression figures are a floor). Encode and decode run interleaved with a ``memcpy``
of the same bytes (the raw baseline); the frame-to-raw size ratio and lossiness go in ``extra``. Chains that
need a key from the environment are skipped (listed in the suite's notes) when it is unset.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tiercache.bench.measure import Row, gbps, percentiles, times
from tiercache.spec import KVFormat, KVSpec

if TYPE_CHECKING:
    from tiercache.bench.runner import SuiteContext

__all__ = ["DEFAULT_CHAINS", "codecs_suite", "kv_sample"]

DEFAULT_CHAINS: tuple[tuple[Any, ...], ...] = (
    ("raw",),
    ("raw", "lz4"),
    ("raw", "zstd"),
    ("raw", "shuffle", "zstd"),
    ("fp8",),
    ("fp8", "shuffle", "zstd"),
)


def kv_sample(nbytes: int, seed: int = 0) -> tuple[torch.Tensor, KVSpec]:
    """A bf16 ``KV_2LTD`` tensor of about ``nbytes`` (8 layers, 8 heads of 128) from a standard normal."""
    layers, heads, head_dim = 8, 8, 128
    tokens = max(1, nbytes // (2 * layers * heads * head_dim * 2))
    spec = KVSpec(layers, heads, head_dim, "bfloat16", KVFormat.KV_2LTD, tokens)
    values = np.random.default_rng(seed).standard_normal(spec.shape, dtype=np.float32)
    return torch.from_numpy(values).to(torch.bfloat16), spec


def _chains(ctx: SuiteContext) -> list[list[Any]]:
    seen: dict[str, list[Any]] = {}
    for chain in [*(list(t.codecs) for t in ctx.config.tiers), *(list(c) for c in DEFAULT_CHAINS)]:
        seen.setdefault(json.dumps(chain, sort_keys=True, default=str), chain)
    return list(seen.values())


def _label(chain: list[Any]) -> str:
    return "+".join(c if isinstance(c, str) else str(dict(c).get("id")) for c in chain)


async def codecs_suite(ctx: SuiteContext) -> list[Row]:
    """Encode and decode GB/s of every chain per sample size, against memcpy of the same bytes."""
    from tiercache.errors import ConfigError
    from tiercache.serde import build_pipeline

    sizes = ctx.byte_sizes(quick=(256 << 10, 4 << 20), full=(256 << 10, 4 << 20, 32 << 20))
    chains = _chains(ctx)
    ctx.plan(len(sizes) * len(chains))
    rows: list[Row] = []
    for size in sizes:
        x, spec = kv_sample(size)
        src = x.view(torch.uint8).reshape(-1)
        dst = torch.empty_like(src)
        nbytes = spec.nbytes
        for chain in chains:
            label = _label(chain)
            try:
                pipe = build_pipeline(chain)
            except ConfigError as exc:
                ctx.note(f"chain {label} skipped: {exc}")
                ctx.advance(f"codec {label}")
                continue
            frame = pipe.encode(x, spec, "bench")
            back = torch.empty_like(x)
            t_enc: list[float] = []
            t_dec: list[float] = []
            t_mem: list[float] = []
            for _ in range(ctx.repeat):  # interleaved with the baseline
                t_enc += times(lambda: pipe.encode(x, spec, "bench"), 1)
                t_dec += times(lambda: pipe.decode_into(frame, "bench", back), 1)
                t_mem += times(lambda: dst.copy_(src), 1)
            xf, yf = x.float(), back.float()
            extra: dict[str, Any] = {
                "chain": label,
                "frame_bytes": len(frame),
                "size_ratio": nbytes / len(frame),
                "lossless": pipe.lossless,
            }
            if pipe.lossless:
                extra["verified"] = bool(torch.equal(back.view(torch.uint8), x.view(torch.uint8)))
            else:
                extra["relative_error"] = float((yf - xf).norm() / xf.norm())
            mem = gbps(nbytes, min(t_mem))
            for op, t in (("encode", t_enc), ("decode", t_dec)):
                rows.append(
                    Row(
                        case=f"{label} {op}",
                        size=nbytes,
                        value=gbps(nbytes, min(t)),
                        raw=mem,
                        baseline="memcpy",
                        latency_s=percentiles(t),
                        extra=extra,
                    )
                )
            ctx.advance(f"codec {label} {size} B")
    return rows
