"""The keys suite: chunk-key hashing (``TokenDatabase.process_tokens``) against a bare hashlib chain."""

from __future__ import annotations

import hashlib
import random
from typing import TYPE_CHECKING

from tiercache.bench.measure import Row, percentiles, times
from tiercache.keys import KeySpace, TokenDatabase, contiguous_prefix

if TYPE_CHECKING:
    from tiercache.bench.runner import SuiteContext

__all__ = ["keys_suite", "sha256_chain"]


def sha256_chain(data: bytes, chunk_bytes: int) -> bytes:
    """The raw baseline: SHA-256 chained over ``data`` in ``chunk_bytes`` pieces (what a chunk key costs)."""
    h = b""
    for start in range(0, len(data), chunk_bytes):
        h = hashlib.sha256(h + data[start : start + chunk_bytes]).digest()
    return h


async def keys_suite(ctx: SuiteContext) -> list[Row]:
    """Tokens per second turned into chunk keys, vs hashlib over the same token bytes; prefix scans."""
    chunk = ctx.config.chunk_size
    db = TokenDatabase(
        KeySpace(model="bench/model", kv_dtype="bfloat16", num_layers=32, num_kv_heads=8, head_dim=128),
        chunk_size=chunk,
        save_unfull_chunk=ctx.config.save_unfull_chunk,
    )
    sizes = ctx.token_sizes(quick=(4096, 32768), full=(4096, 32768, 131072))
    ctx.plan(len(sizes))
    rows: list[Row] = []
    rng = random.Random(7)
    for n in sizes:
        ids = [rng.randrange(128_000) for _ in range(n)]
        data = b"".join(i.to_bytes(4, "little") for i in ids)
        t_db: list[float] = []
        t_raw: list[float] = []
        for _ in range(ctx.repeat):  # interleaved
            t_db += times(lambda: db.process_tokens(ids), 1)
            t_raw += times(lambda: sha256_chain(data, chunk * 4), 1)
        spans = db.process_tokens(ids)
        hits = [True] * (len(spans) // 2) + [False] + [True] * (len(spans) - len(spans) // 2 - 1)
        t_prefix = times(lambda: contiguous_prefix(hits), ctx.repeat)
        rows.append(
            Row(
                case="process_tokens",
                size=n,
                size_unit="tokens",
                value=n / min(t_db) / 1e6,
                unit="Mtok/s",
                raw=n / min(t_raw) / 1e6,
                baseline="hashlib.sha256 chain over the token bytes",
                latency_s=percentiles(t_db),
                extra={"chunks": len(spans), "chunk_size": chunk},
            )
        )
        rows.append(
            Row(
                case="contiguous_prefix",
                size=n,
                size_unit="tokens",
                value=len(hits) / min(t_prefix) / 1e6,
                unit="Mchunks/s",
                latency_s=percentiles(t_prefix),
                extra={"chunks": len(hits)},
            )
        )
        ctx.advance(f"keys {n} tokens")
    return rows
