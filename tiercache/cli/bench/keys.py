"""The keys suite: chunk-key hashing (``TokenDatabase``) against bare ``hashlib.sha256`` over the same bytes.

Three callables run interleaved (the machine's noise hits all alike): ``raw`` hashes each chunk's token
bytes with ``hashlib.sha256`` (no chaining, no key objects: the floor), ``chain`` is
``TokenDatabase.prefix_hashes`` and ``spans`` is ``process_tokens`` (hashes + ``ChunkSpan`` keys). Rates are
chunks per second of the best run; ``benchmarks/keys_bench.py`` prints ``hashing()``'s JSON.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from tiercache.cli.bench.measure import Row, percentiles, spread, times
from tiercache.keys import KeySpace, TokenDatabase, contiguous_prefix

if TYPE_CHECKING:
    from tiercache.cli.bench.runner import SuiteContext

__all__ = ["hashing", "hashing_samples", "keys_suite"]

GOAL_RATIO = 0.8
"""The goal: ``process_tokens`` at >= 80 % of raw sha256 over the same bytes."""


def hashing_samples(
    num_tokens: int, chunk_size: int, repeats: int, *, save_unfull_chunk: bool = True
) -> dict[str, list[float]]:
    """Seconds per call of ``raw``, ``chain`` and ``spans`` over one prompt, interleaved ``repeats`` times."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128_256, num_tokens, dtype=np.int64)
    token_bytes = memoryview(tokens.astype("<u4").tobytes())
    step = chunk_size * 4
    num_chunks = num_tokens // chunk_size
    db = TokenDatabase(
        KeySpace("bench/model", "bfloat16", 32, 8, 128),
        chunk_size=chunk_size,
        save_unfull_chunk=save_unfull_chunk,
    )

    def raw() -> None:
        sha256 = hashlib.sha256
        for offset in range(0, num_chunks * step, step):
            sha256(token_bytes[offset : offset + step]).digest()

    def chain() -> None:
        db.prefix_hashes(tokens)

    def spans() -> None:
        db.process_tokens(tokens)

    calls: dict[str, Callable[[], None]] = {"raw": raw, "chain": chain, "spans": spans}
    for fn in calls.values():  # warm-up
        fn()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            samples[name] += times(fn, 1)
    return samples


def hashing(num_tokens: int, chunk_size: int, repeats: int) -> dict[str, Any]:
    """Chunks hashed per second: ``prefix_hashes``/``process_tokens`` vs a bare sha256 loop (JSON-ready)."""
    num_chunks = num_tokens // chunk_size
    samples = hashing_samples(num_tokens, chunk_size, repeats)
    rates = {name: num_chunks / min(t) for name, t in samples.items()}
    return {
        "tokens": num_tokens,
        "chunk_size": chunk_size,
        "chunks": num_chunks,
        "raw_sha256_chunks_per_s": round(rates["raw"]),
        "hash_chain_chunks_per_s": round(rates["chain"]),
        "hash_chain_ratio": round(rates["chain"] / rates["raw"], 3),
        "process_tokens_chunks_per_s": round(rates["spans"]),
        "process_tokens_ratio": round(rates["spans"] / rates["raw"], 3),
        "goal_ratio": GOAL_RATIO,
        "process_tokens_prompt_ms": round(num_chunks / rates["spans"] * 1000, 3),
    }


async def keys_suite(ctx: SuiteContext) -> list[Row]:
    """Tokens per second turned into chunk keys vs raw sha256 of the same bytes; prefix scans."""
    chunk = ctx.config.chunk_size
    sizes = ctx.token_sizes(quick=(4096, 32768), full=(4096, 32768, 131072))
    ctx.plan(len(sizes))
    rows: list[Row] = []
    for n in sizes:
        t = hashing_samples(n, chunk, ctx.repeat, save_unfull_chunk=ctx.config.save_unfull_chunk)
        for case, name in (("process_tokens", "spans"), ("prefix_hashes", "chain")):
            rows.append(
                Row(
                    case=case,
                    size=n,
                    size_unit="tokens",
                    value=n / min(t[name]) / 1e6,
                    unit="Mtok/s",
                    raw=n / min(t["raw"]) / 1e6,
                    baseline="hashlib.sha256 per chunk of token bytes",
                    latency_s=percentiles(t[name]),
                    spread=spread(t[name], t["raw"]),
                    extra={"chunk_size": chunk, "chunks": n // chunk},
                )
            )
        chunks = max(1, n // chunk)
        hits = [True] * (chunks // 2) + [False] + [True] * (chunks - chunks // 2 - 1)
        t_prefix = times(lambda: contiguous_prefix(hits), ctx.repeat)
        rows.append(
            Row(
                case="contiguous_prefix",
                size=n,
                size_unit="tokens",
                value=len(hits) / min(t_prefix) / 1e6,
                unit="Mchunks/s",
                latency_s=percentiles(t_prefix),
                spread=spread(t_prefix),
                extra={"chunks": len(hits)},
            )
        )
        ctx.advance(f"keys {n} tokens")
    return rows
