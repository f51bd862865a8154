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

Run: ``python benchmarks/engine_bench.py [--tokens 4096] [--repeats 5] [--layout flash,cpu_blocks]`` prints
JSON (``--out PATH`` also writes it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch

from tiercache.adapters.posix import PosixAdapter
from tiercache.config import ManagerConfig
from tiercache.engine import CacheEngine
from tiercache.gpu.layouts import LayoutKind, PagedLayout, object_spec
from tiercache.gpu.reference import gather, scatter
from tiercache.keys import KeySpace
from tiercache.l1 import L1Cache
from tiercache.manager import StorageManager
from tiercache.serde import build_pipeline

__all__ = ["bench_layout", "bench_lookup", "main", "make_layout", "run"]

LAYERS, HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
CHUNK = 256
GOAL_RATIO = 0.8
BLOCK_SIZES = {"flash": 16, "cpu_blocks": 32}
KINDS = {"flash": LayoutKind.VLLM_FLASH, "cpu_blocks": LayoutKind.CPU_BLOCKS}


def make_layout(
    name: str, *, layers: int = LAYERS, heads: int = HEADS, head_dim: int = HEAD_DIM
) -> PagedLayout:
    """The PagedLayout of ``name`` ("flash" or "cpu_blocks") for the model shape."""
    return PagedLayout(KINDS[name], layers, heads, head_dim, BLOCK_SIZES[name], "bfloat16")


def _keyspace(layout: PagedLayout) -> KeySpace:
    return KeySpace(
        model="bench/llama-8b-shape",
        kv_dtype=layout.dtype,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        kv_format=layout.object_format,
        layout_tag=layout.fingerprint if layout.block_aligned else "",
    )


def _paged_kv(layout: PagedLayout, num_blocks: int, gen: torch.Generator | None) -> list[torch.Tensor]:
    """Per-layer paged KV, faulted in (random bits when ``gen`` is given, else zeros)."""
    h, bs, d = layout.num_kv_heads, layout.block_size, layout.head_dim
    out = []
    for _ in range(layout.num_layers):
        if layout.kind is LayoutKind.VLLM_FLASH:
            # vLLM's GPU allocation is NHD [NB, BS, H, 2D]; the layer is its [NB, H, BS, 2D] view
            base = torch.empty((num_blocks, bs, h, 2 * d), dtype=DTYPE)
            t = base.permute(0, 2, 1, 3)
        else:
            base = t = torch.empty(layout.layer_shape(num_blocks), dtype=DTYPE)
        bits = base.view(torch.int16)
        if gen is None:
            bits.zero_()
        else:
            bits.random_(generator=gen)
        out.append(t)
    return out


def _slot_mapping(table: torch.Tensor, block_size: int, tokens: int) -> torch.Tensor:
    pos = torch.arange(tokens)
    return table[pos // block_size] * block_size + pos % block_size


def _best_median(times: list[float]) -> tuple[float, float]:
    return min(times), statistics.median(times)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


async def bench_layout(
    name: str, tokens: int, repeats: int, *, layers: int = LAYERS, l1_capacity: int | None = None
) -> dict[str, Any]:
    """Store/retrieve through the engine vs memcpy and index_select baselines, interleaved; best of N."""
    layout = make_layout(name, layers=layers)
    gen = torch.Generator().manual_seed(1234)
    bs = layout.block_size
    nblk = -(-tokens // bs)
    num_blocks = 2 * nblk + 1  # block 0 is vLLM's null block
    src_kv = _paged_kv(layout, num_blocks, gen)
    dst_kv = _paged_kv(layout, num_blocks, None)
    src_table = torch.randperm(num_blocks - 1, generator=gen)[:nblk] + 1
    dst_table = torch.randperm(num_blocks - 1, generator=gen)[:nblk] + 1
    src_slots = _slot_mapping(src_table, bs, tokens)
    dst_slots = _slot_mapping(dst_table, bs, tokens)
    token_ids = torch.randint(0, 128_000, (tokens,), generator=gen).tolist()

    slot_bytes = CacheEngine.slot_bytes(layout, CHUNK)
    chunks = -(-tokens // CHUNK)
    nbytes = object_spec(layout, tokens).nbytes
    capacity = l1_capacity if l1_capacity is not None else max(int(1.2 * 2**30), (chunks + 2) * slot_bytes)
    l1 = L1Cache(capacity, slot_bytes)
    manager = StorageManager(l1, tiers=[], policy=ManagerConfig())
    engine = CacheEngine(manager, layout, _keyspace(layout), chunk_size=CHUNK)
    keys = [str(s.key) for s in engine.token_db.process_tokens(token_ids)]
    spans = [(s.start, s.end) for s in engine.token_db.process_tokens(token_ids)]

    # baselines: warm buffers of the same bytes
    mem_src = torch.ones(nbytes, dtype=torch.uint8)
    mem_dst = torch.zeros(nbytes, dtype=torch.uint8)
    page = layout.page_elems
    pages_out = torch.zeros((layout.num_layers, nblk, page), dtype=torch.int16)

    def src_pages(layer: torch.Tensor) -> torch.Tensor:
        base = layer.permute(0, 2, 1, 3) if layout.kind is LayoutKind.VLLM_FLASH else layer
        return base.view(torch.int16).reshape(num_blocks, page)  # a view: the allocation is contiguous

    pages_src = [src_pages(t) for t in src_kv]

    def memcpy() -> None:
        mem_dst.copy_(mem_src)

    def index_select_pages() -> None:
        for j, p in enumerate(pages_src):
            torch.index_select(p, 0, src_table, out=pages_out[j])

    # bare gather/scatter into warm objects (no engine)
    bare_objs = [torch.zeros(object_spec(layout, e - s).shape, dtype=DTYPE) for s, e in spans]

    def bare_gather() -> None:
        gather(src_kv, layout, src_slots, spans, bare_objs)

    def bare_scatter() -> None:
        scatter(bare_objs, dst_kv, layout, dst_slots, spans)

    def drop() -> None:
        for k in keys:
            if not l1.delete(k):
                raise RuntimeError(f"could not delete {k} from L1")

    async def store() -> None:
        stored = await engine.store(token_ids, src_kv, src_slots)
        if stored != tokens:
            raise RuntimeError(f"stored {stored} of {tokens} tokens")

    async def retrieve() -> None:
        res = await engine.retrieve_result(token_ids, dst_kv, dst_slots)
        if res.tokens_written != tokens:
            raise RuntimeError(f"retrieved {res.tokens_written} of {tokens} tokens")

    # warm-up: faults in the L1 slots, the objects and the destination KV; then verify once (untimed)
    await store()
    await retrieve()
    verified = all(
        torch.equal(s.view(torch.int16)[src_table], d.view(torch.int16)[dst_table])
        if layout.kind is LayoutKind.CPU_BLOCKS
        else torch.equal(
            s.permute(0, 2, 1, 3).view(torch.int16)[src_table],
            d.permute(0, 2, 1, 3).view(torch.int16)[dst_table],
        )
        for s, d in zip(src_kv, dst_kv, strict=True)
    )
    drop()
    bare_gather()
    bare_scatter()
    memcpy()
    index_select_pages()

    t_hash: list[float] = []
    times: dict[str, list[float]] = {k: [] for k in ("memcpy", "index_select", "gather", "scatter")}
    times.update(store=[], retrieve=[])

    def timed(key: str, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        fn()
        times[key].append(time.perf_counter() - t0)

    async def atimed(key: str, fn: Callable[[], Awaitable[None]]) -> None:
        t0 = time.perf_counter()
        await fn()
        times[key].append(time.perf_counter() - t0)

    for _ in range(repeats):
        timed("memcpy", memcpy)
        await atimed("store", store)
        timed("gather", bare_gather)
        timed("index_select", index_select_pages)
        await atimed("retrieve", retrieve)
        timed("scatter", bare_scatter)
        drop()
        t0 = time.perf_counter()
        engine.token_db.process_tokens(token_ids)
        t_hash.append(time.perf_counter() - t0)
    await manager.aclose()

    best = {k: _best_median(v) for k, v in times.items()}
    mem = best["memcpy"][0]
    res: dict[str, Any] = {
        "layout": layout.kind.name,
        "block_size": bs,
        "bytes": nbytes,
        "chunks": chunks,
        "verified": verified,
        "memcpy_GBps": _gbps(nbytes, mem),
        "index_select_GBps": _gbps(nbytes, best["index_select"][0]),
        "store_GBps": _gbps(nbytes, best["store"][0]),
        "retrieve_GBps": _gbps(nbytes, best["retrieve"][0]),
        "gather_GBps": _gbps(nbytes, best["gather"][0]),
        "scatter_GBps": _gbps(nbytes, best["scatter"][0]),
        "store_ratio": round(mem / best["store"][0], 3),
        "retrieve_ratio": round(mem / best["retrieve"][0], 3),
        "gather_ratio": round(mem / best["gather"][0], 3),
        "scatter_ratio": round(mem / best["scatter"][0], 3),
        "index_select_ratio": round(mem / best["index_select"][0], 3),
        "goal_ratio": GOAL_RATIO,
        "median_ms": {k: round(v[1] * 1e3, 2) for k, v in best.items()},
        "best_ms": {k: round(v[0] * 1e3, 2) for k, v in best.items()},
        "engine_overhead_ms": {
            "store_minus_gather": round((best["store"][0] - best["gather"][0]) * 1e3, 2),
            "retrieve_minus_scatter": round((best["retrieve"][0] - best["scatter"][0]) * 1e3, 2),
            "process_tokens": round(min(t_hash) * 1e3, 3),
        },
    }
    res["store_meets_goal"] = res["store_ratio"] >= GOAL_RATIO
    res["retrieve_meets_goal"] = res["retrieve_ratio"] >= GOAL_RATIO
    return res


async def _timed_async(fn: Callable[[], Awaitable[object]], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


async def bench_lookup(
    tokens: int = 131_072, repeats: int = 20, *, split: tuple[int, int] = (100, 200), layers: int = LAYERS
) -> dict[str, Any]:
    """Lookup of a ``tokens`` prompt over L1 + 2 POSIX tiers: median/best ms, split, per-tier round trips."""
    layout = make_layout("flash", layers=layers)
    gen = torch.Generator().manual_seed(99)
    token_ids = torch.randint(0, 128_000, (tokens,), generator=gen).tolist()
    n_chunks = tokens // CHUNK
    n_l1, n_t1 = split
    if n_l1 + n_t1 >= n_chunks:  # small prompts (smoke runs): same proportions
        n_l1, n_t1 = n_chunks * n_l1 // 512, n_chunks * n_t1 // 512
    dirs = [tempfile.mkdtemp(prefix=f"tiercache-bench-t{i}-") for i in (1, 2)]
    try:
        adapters = [await PosixAdapter.open(f"file://{d}") for d in dirs]
        placeholder = object_spec(layout, 1)  # lookups only test presence; tiny L1 objects
        l1 = L1Cache(max(n_l1, 1) * placeholder.nbytes + placeholder.nbytes, placeholder.nbytes)
        manager = StorageManager(
            l1,
            tiers=[(f"tier{i + 1}", a, build_pipeline(["raw"])) for i, a in enumerate(adapters)],
            policy=ManagerConfig(),
        )
        engine = CacheEngine(manager, layout, _keyspace(layout), chunk_size=CHUNK)
        keys = [str(s.key) for s in engine.token_db.process_tokens(token_ids)]
        n = len(keys)
        assert n == n_chunks, (n, n_chunks)
        for k in keys[:n_l1]:
            obj = l1.reserve_write(k, placeholder)
            assert obj is not None
            l1.finish_write(obj)
        await adapters[0].batched_put(keys[n_l1 : n_l1 + n_t1], [b"x"] * len(keys[n_l1 : n_l1 + n_t1]))
        await adapters[1].batched_put(keys[n_l1 + n_t1 :], [b"x"] * len(keys[n_l1 + n_t1 :]))

        token_array = np.asarray(token_ids, dtype=np.int64)

        async def lookup() -> object:
            return await engine.lookup_hit(token_ids, prefetch=False)

        async def lookup_array() -> object:
            return await engine.lookup_hit(token_array, prefetch=False)

        hit = await engine.lookup_hit(token_ids, prefetch=False)  # warm (dentries, executor threads)
        expected = (n_l1, min(n_t1, n - n_l1), max(0, n - n_l1 - n_t1))
        correct = (
            hit.chunks == n
            and (
                hit.chunks_in("L1"),
                hit.chunks_in("tier1"),
                hit.chunks_in("tier2"),
            )
            == expected
        )

        t_lookup, t_lookup_arr, t_hash, t_hash_arr, t_l1 = [], [], [], [], []
        t_tier: list[list[float]] = [[], []]
        rtt: list[list[float]] = [[], []]
        rest1 = keys[n_l1:]
        rest2 = keys[n_l1 + n_t1 :]
        for _ in range(repeats):  # interleaved
            t_lookup += await _timed_async(lookup, 1)
            t_lookup_arr += await _timed_async(lookup_array, 1)
            t0 = time.perf_counter()
            engine.token_db.process_tokens(token_ids)
            t_hash.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            engine.token_db.process_tokens(token_array)
            t_hash_arr.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            l1.batched_contains(keys)
            t_l1.append(time.perf_counter() - t0)
            for i, (adapter, rest) in enumerate(zip(adapters, (rest1, rest2), strict=True)):
                t0 = time.perf_counter()
                await adapter.batched_contains(rest)
                t_tier[i].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await adapter.batched_contains(keys[:1])
                rtt[i].append(time.perf_counter() - t0)
        await manager.aclose()
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)

    def ms(v: list[float]) -> dict[str, float]:
        return {"median": round(statistics.median(v) * 1e3, 3), "best": round(min(v) * 1e3, 3)}

    rtt_med = [statistics.median(r) * 1e3 for r in rtt]
    goal = 2.0 + sum(rtt_med)
    lookup_med = statistics.median(t_lookup) * 1e3
    return {
        "tokens": tokens,
        "chunks": n,
        "split_chunks": {"L1": n_l1, "tier1": expected[1], "tier2": expected[2]},
        "tiers": "L1 + 2 x posix (file://, temp dirs)",
        "correct": correct,
        "lookup_ms": ms(t_lookup),
        "lookup_ms_numpy_tokens": ms(t_lookup_arr),
        "split_ms": {
            "process_tokens": ms(t_hash),
            "process_tokens_numpy_tokens": ms(t_hash_arr),
            "l1_batched_contains": ms(t_l1),
            "tier1_batched_contains": ms(t_tier[0]),
            "tier2_batched_contains": ms(t_tier[1]),
        },
        "rtt_ms": {"tier1": round(rtt_med[0], 3), "tier2": round(rtt_med[1], 3)},
        "goal_ms": round(goal, 3),
        "meets_goal": lookup_med <= goal,
        "meets_goal_numpy_tokens": statistics.median(t_lookup_arr) * 1e3 <= goal,
    }


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
        "host": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        },
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
        out["layouts"][name] = await bench_layout(
            name, tokens, repeats, layers=layers, l1_capacity=l1_capacity
        )
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
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
