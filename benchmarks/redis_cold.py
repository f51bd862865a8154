"""Cold 512 MiB retrieve from Redis in fresh processes with default settings: how many complete.

    .venv/bin/python -P benchmarks/redis_cold.py [--tokens 4096] [--runs 5] [--out PATH]

One process stores a request (Llama-8B shape: 32 layers, 8 kv heads, head_dim 128, bf16, 256-token chunks;
4096 tokens = 512 MiB) through ``CacheEngine`` into a redis-server started here on a free port (write-through:
time until every chunk is stored, ``drain``). Then ``--runs`` fresh processes each open an engine from a
config with only the tier's URL (every ``[manager]`` and adapter option at its default), retrieve the
request cold (nothing in L1) and report the tokens written, the wall time and whether the KV is bit-exact.
A bare ``redis-py`` GET of every chunk, timed in each fresh process beside it, is the same-run baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tiercache.cli.bench.report import print_json
from tiercache.testing.harness.backends import start_redis_process
from tiercache.testing.harness.processes import free_port

LAYERS, HEADS, HEAD_DIM, CHUNK, BLOCK = 32, 8, 128, 256, 16


def _request(tokens_n: int, seed: int) -> tuple[Any, Any, Any, list[int]]:
    """(layout, KV layers, slot mapping, token ids) of the benchmark request; the same for the same seed."""
    import torch

    from tiercache.gpu.layouts import LayoutKind, PagedLayout

    gen = torch.Generator().manual_seed(seed)
    nb = tokens_n // BLOCK + 8
    layout = PagedLayout(LayoutKind.VLLM_FLASH, LAYERS, HEADS, HEAD_DIM, BLOCK, "bfloat16")
    kv = [
        torch.randn(nb, BLOCK, HEADS, 2 * HEAD_DIM, generator=gen).bfloat16().permute(0, 2, 1, 3)
        for _ in range(LAYERS)
    ]
    table = torch.randperm(nb - 1, generator=gen)[: tokens_n // BLOCK] + 1
    pos = torch.arange(tokens_n)
    slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
    return layout, kv, slots, [int(t) for t in torch.randint(0, 128_000, (tokens_n,), generator=gen)]


def _config(url: str) -> Any:
    from tiercache.config import config_from_dict

    return config_from_dict({"l1": {"capacity": "1GiB"}, "tiers": [{"name": "redis", "url": url}]})


async def _store(url: str, tokens_n: int) -> dict[str, float]:
    from tiercache.store.engine import CacheEngine

    layout, kv, slots, toks = _request(tokens_n, 0)
    engine = await CacheEngine.open(_config(url), layout, model="bench/llama-8b-shape")
    try:
        t0 = time.perf_counter()
        await engine.store(toks, kv, slots)
        t1 = time.perf_counter()
        await engine.drain()
        t2 = time.perf_counter()
        stored = engine.manager.metrics.value("tiercache_stores_total", tier="redis")
    finally:
        await engine.aclose()
    return {"store_s": t1 - t0, "write_through_s": t2 - t0, "chunks_stored": stored}


async def _retrieve(url: str, tokens_n: int) -> dict[str, Any]:
    import redis.asyncio as aredis
    import torch

    from tiercache.gpu import Move, reference
    from tiercache.store.engine import CacheEngine

    layout, kv, slots, toks = _request(tokens_n, 0)
    back = [torch.empty_like(t.permute(0, 2, 1, 3)).permute(0, 2, 1, 3) for t in kv]
    engine = await CacheEngine.open(_config(url), layout, model="bench/llama-8b-shape")
    try:
        t0 = time.perf_counter()
        mask = await engine.retrieve(toks, back, slots)
        dt = time.perf_counter() - t0
    finally:
        await engine.aclose()
    got = int(mask.sum())
    want = torch.empty(2, LAYERS, tokens_n, HEADS * HEAD_DIM, dtype=torch.bfloat16)
    have = torch.empty_like(want)
    reference.gather(kv, Move.gather(layout, slots, [(0, tokens_n)], [want]))
    exact = False
    if got == tokens_n:
        reference.gather(back, Move.gather(layout, slots, [(0, tokens_n)], [have]))
        exact = torch.equal(want.view(torch.int16), have.view(torch.int16))
    # baseline: redis-py GET of every stored value (with parts: every part key and head), one after another
    client = aredis.Redis.from_url(url)
    keys = [k async for k in client.scan_iter(count=1000)]
    t1 = time.perf_counter()
    nbytes = 0
    for k in keys:
        nbytes += len(await client.get(k) or b"")
    raw_s = time.perf_counter() - t1
    await client.aclose()
    return {"tokens": got, "retrieve_s": dt, "bit_exact": exact, "raw_get_s": raw_s, "raw_get_bytes": nbytes}


def _child(args: argparse.Namespace) -> None:
    res = asyncio.run(_retrieve(args.url, args.tokens))
    print(json.dumps(res))
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--child-url", dest="url", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.url:
        _child(args)
        return
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("redis-server not found")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="tc-redis-cold-")
    big = ["--maxmemory", "2gb", "--proto-max-bulk-len", "1gb"]
    proc = start_redis_process(server, port, Path(workdir), big, timeout=15)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        stored = asyncio.run(_store(url, args.tokens))
        runs = []
        for _ in range(args.runs):
            out = subprocess.run(
                [sys.executable, "-P", __file__, "--tokens", str(args.tokens), "--child-url", url],
                capture_output=True,
                text=True,
                check=False,
            )
            line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "{}"
            runs.append(json.loads(line) if line.startswith("{") else {"error": out.stderr[-2000:]})
    finally:
        proc.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    nbytes = args.tokens * LAYERS * 2 * HEADS * HEAD_DIM * 2
    complete = [r for r in runs if r.get("tokens") == args.tokens and r.get("bit_exact")]
    res: dict[str, Any] = {
        "workload": f"{args.tokens} tokens, Llama-8B shape, bf16, {CHUNK}-token chunks, {nbytes} bytes",
        "defaults": "config has only the tier URL: every [manager] and adapter option at its default",
        "store": stored,
        "write_through_GBps": nbytes / float(stored["write_through_s"]) / 1e9,
        "runs": runs,
        "complete": f"{len(complete)}/{len(runs)}",
    }
    if complete:
        med = statistics.median(float(r["retrieve_s"]) for r in complete)
        raw = statistics.median(float(r["raw_get_s"]) for r in complete)
        res["cold_retrieve_GBps"] = nbytes / med / 1e9
        res["raw_get_GBps"] = nbytes / raw / 1e9
        res["cold_retrieve_vs_raw_get"] = raw / med
    print_json(res, args.out)


if __name__ == "__main__":
    main()
