"""The codecs suite: each codec chain (the config's tiers' and the usual ones) on a KV-like sample vs memcpy.

The sample is bf16 KV drawn from a standard normal (values like real keys and values, no structure a real
model would add, so compression figures are a floor). Encode and decode run interleaved with a ``memcpy``
of the same bytes (the raw baseline); the frame-to-raw size ratio and lossiness go in ``extra``. Chains that
need a key from the environment are skipped (listed in the suite's notes) when it is unset.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tiercache.cli.bench.measure import Row, best, gbps, paired, percentiles, spread, times
from tiercache.serde import CodecContext, build_pipeline
from tiercache.spec import KVFormat, KVSpec

if TYPE_CHECKING:
    from tiercache.cli.bench.runner import SuiteContext
    from tiercache.serde._codec import Codec

__all__ = ["DEFAULT_CHAINS", "as_bytes", "chain_result", "codecs_suite", "kv_sample", "stage_vs_library"]

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


def _gb(nbytes: int, seconds: float) -> float:
    return round(gbps(nbytes, seconds), 3)


def as_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes (a copy)."""
    return bytes(t.contiguous().view(torch.uint8).reshape(-1).numpy())


def stage_vs_library(
    name: str, codec: Codec, lib_enc: Callable[[bytes], bytes], lib_dec: Callable[[bytes], object],
    data: bytes, spec: KVSpec, repeat: int,
) -> dict[str, object]:  # fmt: skip
    """One bytes-to-bytes codec against its library's own call on the same bytes."""
    ctx = CodecContext("bench", b"static-header", 1)
    src = memoryview(data)
    out = memoryview(bytearray(codec.max_encoded_size(len(data), spec)))
    n = codec.encode_into(src, out, spec, ctx)
    back = memoryview(bytearray(len(data)))
    lib_out = lib_enc(data)
    t_codec_e, t_lib_e = paired(lambda: codec.encode_into(src, out, spec, ctx), lambda: lib_enc(data), repeat)
    enc = bytes(out[:n])
    t_codec_d, t_lib_d = paired(
        lambda: codec.decode_into(memoryview(enc), back, spec, ctx), lambda: lib_dec(lib_out), repeat
    )
    assert bytes(back) == data
    return {
        "codec": name,
        "bytes": len(data),
        "encoded_bytes": n,
        "stored_raw": enc[0] == 0 if name in ("lz4", "zstd") else None,
        "ratio": round(len(data) / n, 4),
        "library_ratio": round(len(data) / len(lib_out), 4),
        "encode_gbps": _gb(len(data), t_codec_e),
        "library_encode_gbps": _gb(len(data), t_lib_e),
        "encode_vs_library": round(t_lib_e / t_codec_e, 3),
        "decode_gbps": _gb(len(data), t_codec_d),
        "library_decode_gbps": _gb(len(data), t_lib_d),
        "decode_vs_library": round(t_lib_d / t_codec_d, 3),
    }


def chain_result(chain: list[object], x: torch.Tensor, spec: KVSpec, repeat: int) -> dict[str, object]:
    """One whole chain: frame size ratio, encode/decode GB/s (best of ``repeat``), fp8 errors."""
    pipe = build_pipeline(chain)  # type: ignore[arg-type]
    frame = pipe.encode(x, spec, "bench")
    dst = torch.empty_like(x)
    t_e = best(lambda: pipe.encode(x, spec, "bench"), repeat)
    t_d = best(lambda: pipe.decode_into(frame, "bench", dst), repeat)
    xf, yf = x.float(), dst.float()
    result: dict[str, object] = {
        "chain": pipe.get_config(),
        "raw_bytes": spec.nbytes,
        "frame_bytes": len(frame),
        "ratio_vs_raw": round(spec.nbytes / len(frame), 4),
        "encode_gbps": _gb(spec.nbytes, t_e),
        "decode_gbps": _gb(spec.nbytes, t_d),
    }
    if not pipe.lossless:
        result["relative_error"] = round(float((yf - xf).norm() / xf.norm()), 5)
        result["max_error_over_absmax"] = round(float((yf - xf).abs().max() / xf.abs().max()), 5)
    else:
        assert torch.equal(dst.view(torch.uint8), x.view(torch.uint8))
    return result


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

    sizes = ctx.byte_sizes(quick=(256 << 10, 4 << 20), full=(256 << 10, 4 << 20, 32 << 20))
    chains = _chains(ctx)
    ctx.plan(len(sizes) * len(chains))
    rows: list[Row] = []
    for size in sizes:
        x, spec = kv_sample(size)
        src = x.view(torch.uint8).reshape(-1)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the destination in
        nbytes = spec.nbytes
        t_mem: list[float] = []  # one baseline per size, sampled between every chain's runs
        measured: list[tuple[str, list[float], list[float], dict[str, Any]]] = []
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
            for _ in range(ctx.repeat):  # interleaved with the baseline
                t_enc += times(lambda: pipe.encode(x, spec, "bench"), 1)
                t_mem += times(lambda: dst.copy_(src), 1)
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
            measured.append((label, t_enc, t_dec, extra))
            ctx.advance(f"codec {label} {size} B")
        mem = gbps(nbytes, min(t_mem)) if t_mem else None
        for label, t_enc, t_dec, extra in measured:
            for op, t in (("encode", t_enc), ("decode", t_dec)):
                rows.append(
                    Row(
                        case=f"{label} {op}",
                        size=nbytes,
                        value=gbps(nbytes, min(t)),
                        raw=mem,
                        baseline="memcpy (one baseline per size, sampled between all chains' runs)",
                        latency_s=percentiles(t),
                        spread=spread(t, t_mem),
                        extra=extra,
                    )
                )
    return rows
