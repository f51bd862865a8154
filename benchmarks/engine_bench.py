"""CacheEngine on CPU tensors: store/retrieve GB/s through the L1 path against torch memcpy; lookup time.

Workload (Llama-8B shape): 32 layers, 8 kv heads, head_dim 128, bf16, 128 KiB per token; a request of
``--tokens`` tokens (4096 = 512 MiB), chunks of 256 tokens. Layouts: ``flash`` (vLLM's standardized GPU view
``[NB, H, BS, 2D]`` over an NHD allocation, block 16, here on CPU tensors) and ``cpu_blocks`` (vLLM's CPU
backend: whole-block pages, block 32). Block tables are random permutations (no runs of consecutive blocks).

Store/retrieve go through ``CacheEngine`` over a ``StorageManager`` with L1 only (~1.2 GiB pool, faulted in
once by a warm-up round; every round deletes its objects so the next one reuses the same slots). Baselines in
the same run, interleaved round by round (best of ``--repeats``): ``dst.copy_(src)`` of the same bytes into a
warm buffer (memcpy), and a torch ``index_select`` of the request's whole block pages into a warm buffer.
``gather``/``scatter`` are the bare ``tiercache.gpu.reference`` calls into warm objects (engine overhead =
engine time - bare time). Retrieve is verified bit-exact once (plain block indexing, not timed).

Lookup: ``--lookup-tokens`` tokens (131072 = 512 chunks) over L1 + 2 POSIX tiers in temp dirs (first 100
chunks in L1, next 200 in tier 1, rest in tier 2; tiny placeholder frames), ``prefetch=False``; reported with
the hashing / L1 / per-tier split and each tier's round trip (``batched_contains`` of one key) measured alone.
Goal: ``lookup_ms <= 2 + sum(rtt_ms)``. Token ids are passed as a Python list (like vLLM's
``prompt_token_ids``); ``*_numpy_tokens`` figures pass the same ids as a numpy int64 array.

The measuring code lives in ``tiercache.cli.bench.engine`` (``tiercache bench engine`` runs it with plots);
this script is its long-form caller.

Run: ``python benchmarks/engine_bench.py [--tokens 4096] [--repeats 5] [--layout flash,cpu_blocks]`` prints
JSON (``--out PATH`` also writes it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from tiercache.cli.bench.engine import (
    CHUNK,
    HEAD_DIM,
    HEADS,
    KINDS,
    LAYERS,
    bench_layout,
    bench_lookup,
    make_layout,
)
from tiercache.cli.bench.measure import host_info
from tiercache.cli.bench.report import print_json

__all__ = ["CHUNK", "bench_layout", "bench_lookup", "main", "make_layout", "run"]


async def run(
    tokens: int = 4096,
    repeats: int = 5,
    layouts: tuple[str, ...] = ("flash", "cpu_blocks"),
    *,
    lookup_tokens: int = 131_072,
    lookup_repeats: int = 20,
    layers: int = LAYERS,
    l1_capacity: int | None = None,
) -> dict[str, Any]:
    """The whole benchmark as a JSON-ready dict."""
    out: dict[str, Any] = {
        "benchmark": "engine_bench",
        "host": {**host_info(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")},
        "workload": {
            "layers": layers,
            "kv_heads": HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "bfloat16",
            "tokens": tokens,
            "chunk_size": CHUNK,
            "bytes_per_token": 2 * layers * HEADS * HEAD_DIM * 2,
            "repeats": repeats,
        },
        "layouts": {},
    }
    for name in layouts:
        res = await bench_layout(name, tokens, repeats, layers=layers, l1_capacity=l1_capacity)
        res.pop("times_s")  # the raw samples feed `tiercache bench`'s percentiles; not kept here
        out["layouts"][name] = res
    out["lookup"] = await bench_lookup(lookup_tokens, lookup_repeats, layers=layers)
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: prints the JSON (and writes it to ``--out``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layout", default="flash,cpu_blocks")
    p.add_argument("--lookup-tokens", type=int, default=131_072)
    p.add_argument("--lookup-repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    layouts = tuple(x.strip() for x in args.layout.split(",") if x.strip())
    for name in layouts:
        if name not in KINDS:
            p.error(f"unknown layout {name!r}; choose from {sorted(KINDS)}")
    result = asyncio.run(
        run(
            args.tokens,
            args.repeats,
            layouts,
            lookup_tokens=args.lookup_tokens,
            lookup_repeats=args.lookup_repeats,
        )
    )
    print_json(result, args.out)


if __name__ == "__main__":
    main()
