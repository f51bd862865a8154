"""The engine suite: CacheEngine store/retrieve on CPU (or CUDA) tensors against memcpy; lookup over tiers.

Workload (Llama-8B shape by default): 32 layers, 8 kv heads, head_dim 128, bf16, 128 KiB per token, chunks of
256 tokens. Layouts: ``flash`` (vLLM's standardized view ``[NB, H, BS, 2D]`` over an NHD allocation, block 16)
and ``cpu_blocks`` (vLLM's CPU backend: whole-block pages, block 32). Block tables are random permutations.
Store/retrieve go through ``CacheEngine`` over a ``StorageManager`` with L1 only; baselines in the same run,
interleaved round by round: ``dst.copy_(src)`` of the same bytes (memcpy) and ``index_select`` of the
request's block pages. Lookup: L1 + 2 POSIX tiers in temp dirs, with the hashing / L1 / per-tier split.
``benchmarks/engine_bench.py`` is the long-form caller of these functions.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tiercache.adapters.posix import PosixAdapter
from tiercache.cli.bench.measure import Row, atimes, best_median, gbps, percentiles, spread
from tiercache.config import ManagerConfig, config_from_dict
from tiercache.gpu.layouts import LayoutKind, PagedLayout, object_spec
from tiercache.gpu.move import Move
from tiercache.gpu.reference import gather, scatter
from tiercache.keys import KeySpace
from tiercache.metrics import L1
from tiercache.serde import build_pipeline
from tiercache.store.engine import CacheEngine
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager

if TYPE_CHECKING:
    from tiercache.cli.bench.runner import SuiteContext

__all__ = [
    "bench_keyspace",
    "bench_layout",
    "bench_lookup",
    "engine_suite",
    "make_layout",
    "paged_kv",
    "slot_mapping",
    "traffic",
]

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


def bench_keyspace(layout: PagedLayout) -> KeySpace:
    """The keyspace ``CacheEngine.open`` would give an engine of ``layout`` (no salt)."""
    return CacheEngine.keyspace_for(config_from_dict({}), layout, model="bench/llama-8b-shape")


def paged_kv(
    layout: PagedLayout, num_blocks: int, gen: torch.Generator | None, device: str = "cpu"
) -> list[torch.Tensor]:
    """Per-layer paged KV on ``device``, faulted in (random bits when ``gen`` is given, else zeros)."""
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
        if device != "cpu":
            base = base.to(device)
            t = base.permute(0, 2, 1, 3) if layout.kind is LayoutKind.VLLM_FLASH else base
        out.append(t)
    return out


def slot_mapping(table: torch.Tensor, block_size: int, tokens: int) -> torch.Tensor:
    pos = torch.arange(tokens)
    return table[pos // block_size] * block_size + pos % block_size


async def bench_layout(
    name: str, tokens: int, repeats: int, *, layers: int = LAYERS, l1_capacity: int | None = None
) -> dict[str, Any]:
    """Store/retrieve through the engine vs memcpy and index_select baselines, interleaved; best of N."""
    layout = make_layout(name, layers=layers)
    gen = torch.Generator().manual_seed(1234)
    bs = layout.block_size
    nblk = -(-tokens // bs)
    num_blocks = 2 * nblk + 1  # block 0 is vLLM's null block
    src_kv = paged_kv(layout, num_blocks, gen)
    dst_kv = paged_kv(layout, num_blocks, None)
    src_table = torch.randperm(num_blocks - 1, generator=gen)[:nblk] + 1
    dst_table = torch.randperm(num_blocks - 1, generator=gen)[:nblk] + 1
    src_slots = slot_mapping(src_table, bs, tokens)
    dst_slots = slot_mapping(dst_table, bs, tokens)
    token_ids = torch.randint(0, 128_000, (tokens,), generator=gen).tolist()

    slot_bytes = CacheEngine.slot_bytes(layout, CHUNK)
    chunks = -(-tokens // CHUNK)
    nbytes = object_spec(layout, tokens).nbytes
    capacity = l1_capacity if l1_capacity is not None else max(int(1.2 * 2**30), (chunks + 2) * slot_bytes)
    l1 = L1Cache(capacity, slot_bytes)
    manager = StorageManager(l1, tiers=[], policy=ManagerConfig())
    engine = CacheEngine(manager, layout, bench_keyspace(layout), chunk_size=CHUNK)
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
    bare_store = Move.gather(layout, src_slots, spans, bare_objs)
    bare_load = Move.scatter(layout, dst_slots, spans, bare_objs)

    def bare_gather() -> None:
        gather(src_kv, bare_store)

    def bare_scatter() -> None:
        scatter(dst_kv, bare_load)

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

    best = {k: best_median(v) for k, v in times.items()}
    mem = best["memcpy"][0]
    res: dict[str, Any] = {
        "layout": layout.kind.name,
        "block_size": bs,
        "bytes": nbytes,
        "chunks": chunks,
        "verified": verified,
        "memcpy_GBps": _gb(nbytes, mem),
        "index_select_GBps": _gb(nbytes, best["index_select"][0]),
        "store_GBps": _gb(nbytes, best["store"][0]),
        "retrieve_GBps": _gb(nbytes, best["retrieve"][0]),
        "gather_GBps": _gb(nbytes, best["gather"][0]),
        "scatter_GBps": _gb(nbytes, best["scatter"][0]),
        "store_ratio": round(mem / best["store"][0], 3),
        "retrieve_ratio": round(mem / best["retrieve"][0], 3),
        "gather_ratio": round(mem / best["gather"][0], 3),
        "scatter_ratio": round(mem / best["scatter"][0], 3),
        "index_select_ratio": round(mem / best["index_select"][0], 3),
        "goal_ratio": GOAL_RATIO,
        "median_ms": {k: round(v[1] * 1e3, 2) for k, v in best.items()},
        "best_ms": {k: round(v[0] * 1e3, 2) for k, v in best.items()},
        "times_s": times,
        "engine_overhead_ms": {
            "store_minus_gather": round((best["store"][0] - best["gather"][0]) * 1e3, 2),
            "retrieve_minus_scatter": round((best["retrieve"][0] - best["scatter"][0]) * 1e3, 2),
            "process_tokens": round(min(t_hash) * 1e3, 3),
        },
    }
    res["store_meets_goal"] = res["store_ratio"] >= GOAL_RATIO
    res["retrieve_meets_goal"] = res["retrieve_ratio"] >= GOAL_RATIO
    return res


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
        engine = CacheEngine(manager, layout, bench_keyspace(layout), chunk_size=CHUNK)
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
            t_lookup += await atimes(lookup, 1)
            t_lookup_arr += await atimes(lookup_array, 1)
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
        seen = traffic(manager)
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
        "traffic": seen,
    }


def traffic(manager: StorageManager) -> dict[str, float]:
    """What ``manager``'s lookups saw: chunks looked up, the share found in any tier (``hit_rate``) and
    the share an unbounded cache would have found (``hit_rate_ceiling``, from its distinct-chunk sketch)."""
    m = manager.metrics
    levels = [L1, *(t.name for t in manager.tiers)]
    hits = sum(m.value("tiercache_hits_total", tier=name) for name in levels)
    chunks = hits + m.value("tiercache_misses_total", tier=levels[-1])  # a miss is counted at every level
    return {
        "chunks_looked_up": int(chunks),
        "hit_rate": round(hits / chunks, 4) if chunks else 0.0,
        "hit_rate_ceiling": round(manager.ceiling.ceiling(), 4),
    }


def _gb(nbytes: int, seconds: float) -> float:
    return round(gbps(nbytes, seconds), 3)


async def engine_suite(ctx: SuiteContext) -> list[Row]:
    """Store and retrieve per request size through the engine (L1 path) vs memcpy; lookup vs its split."""
    layers = 8 if ctx.quick else LAYERS
    sizes = ctx.token_sizes(quick=(512, 2048), full=(1024, 4096, 16384))
    rows: list[Row] = []
    ctx.plan(len(sizes) + 1)
    for tokens in sizes:
        res = await bench_layout("flash", tokens, ctx.repeat, layers=layers)
        t = res["times_s"]
        nbytes = int(res["bytes"])
        mem = gbps(nbytes, min(t["memcpy"]))
        for case in ("store", "retrieve", "gather", "scatter"):
            rows.append(
                Row(
                    case=case,
                    size=nbytes,
                    value=gbps(nbytes, min(t[case])),
                    raw=mem,
                    baseline="memcpy",
                    latency_s=percentiles(t[case]),
                    spread=spread(t[case], t["memcpy"]),
                    extra={"tokens": tokens, "layers": layers, "verified": res["verified"]},
                )
            )
        ctx.advance(f"engine {tokens} tokens")
    lookup_tokens = 16_384 if ctx.quick else 131_072
    look = await bench_lookup(lookup_tokens, max(ctx.repeat, 3), layers=layers)
    med = look["lookup_ms"]["median"] / 1e3
    hash_med = look["split_ms"]["process_tokens"]["median"] / 1e3
    rows.append(
        Row(
            case="lookup",
            size=lookup_tokens,
            size_unit="tokens",
            value=lookup_tokens / med / 1e6,
            unit="Mtok/s",
            raw=lookup_tokens / hash_med / 1e6,
            baseline="hashing alone (process_tokens)",
            latency_s={"p50": med},
            extra={
                "correct": look["correct"],
                "goal_ms": look["goal_ms"],
                "rtt_ms": look["rtt_ms"],
                **look["traffic"],
            },
        )
    )
    ctx.advance("engine lookup")
    return rows
