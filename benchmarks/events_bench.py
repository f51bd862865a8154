"""KV events' cost per chunk: ``CacheEngine.store`` and ``lookup_hit_now`` of tiny objects, events off and on.

Workload: the e2e tests' tiny model shape (2 layers, 2 KV heads of 32, float32, vLLM's CPU block layout,
block 32), chunks of 64 tokens (64 KiB objects), prompts of ``--chunks`` chunks with vLLM block hashes
(SHA-256 of random bytes, as ``key_source=auto`` passes them). Two engines over L1 only (room for four
prompts: every store from the fifth prompt on evicts a prompt's worth of chunks): one without a sink
(``events`` None), one whose ``EventSink`` is attached and emitting, its queue taken after every store as
vLLM takes a step's events. Rounds interleave the two (off, on, off, on ...): each round stores a fresh
prompt and looks up the prompt stored before it (an L1 hit, so ``lookup_hit_now`` answers in place).
Reported: median microseconds per chunk of each variant and on/off ratios, from the same run.
``--baseline-events PATH`` adds a third engine, interleaved with the two, whose sink is the ``EventSink`` of
another ``events.py`` (``git show REV:tiercache/events.py > PATH``): a change's before and after in one run.

Run: ``python benchmarks/events_bench.py [--rounds 400] [--chunks 16] [--baseline-events PATH] [--out PATH]``
prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

from tiercache.cli.bench.measure import host_info
from tiercache.cli.bench.report import print_json
from tiercache.config import Config, ManagerConfig
from tiercache.events import EventSink
from tiercache.gpu.layouts import LayoutKind, PagedLayout
from tiercache.keys import BlockHashes
from tiercache.store.engine import CacheEngine, LookupResult
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager

LAYOUT = PagedLayout(
    LayoutKind.CPU_BLOCKS, num_layers=2, num_kv_heads=2, head_dim=32, block_size=32, dtype="float32"
)
CHUNK = 64
PROMPTS_HELD = 4


def _baseline_sink(path: str) -> type[EventSink]:
    """The ``EventSink`` class of the events module at ``path``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("events_baseline", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    sink: type[EventSink] = module.EventSink
    return sink


def _engine(chunks: int, events: type[EventSink] | None) -> CacheEngine:
    """An engine over an L1 of ``PROMPTS_HELD`` prompts; with ``events``, an emitting sink of it attached."""
    slot = CacheEngine.slot_bytes(LAYOUT, CHUNK)
    l1 = L1Cache(slot * chunks * PROMPTS_HELD, slot)
    manager = StorageManager(l1, [], ManagerConfig(l2_deadline_s=5.0, lookup_deadline_s=2.0))
    keyspace = CacheEngine.keyspace_for(
        Config(chunk_size=CHUNK), LAYOUT, model="bench/events", key_source="vllm-block:sha256:bs32:seed=0"
    )
    engine = CacheEngine(manager, LAYOUT, keyspace, chunk_size=CHUNK)
    if events is not None:
        sink = events()
        sink.attach(manager)
        engine.events = sink
    return engine


def _prompt(rng: random.Random, chunks: int) -> tuple[list[int], BlockHashes]:
    tokens = [rng.randrange(1, 32_000) for _ in range(chunks * CHUNK)]
    hashes: list[bytes] = []
    parent = b""
    for _ in range(len(tokens) // LAYOUT.block_size):
        parent = hashlib.sha256(parent + rng.randbytes(8)).digest()
        hashes.append(parent)
    return tokens, BlockHashes(hashes, LAYOUT.block_size)


async def run(
    rounds: int = 400, chunks: int = 16, seed: int = 0, baseline_events: str | None = None
) -> dict[str, Any]:
    """The benchmark as a JSON-ready dict."""
    num_blocks = chunks * CHUNK // LAYOUT.block_size
    kv = [torch.randn(LAYOUT.layer_shape(num_blocks)) for _ in range(LAYOUT.num_layers)]
    slots = torch.arange(chunks * CHUNK)
    engines = {"off": _engine(chunks, None), "on": _engine(chunks, EventSink)}
    if baseline_events:
        engines["on_baseline"] = _engine(chunks, _baseline_sink(baseline_events))
    rng = random.Random(seed)
    times: dict[str, dict[str, list[float]]] = {v: {"store": [], "lookup": []} for v in engines}
    previous: dict[str, tuple[list[int], BlockHashes] | None] = dict.fromkeys(engines)
    events_seen = 0
    try:
        for r in range(rounds + PROMPTS_HELD + 1):  # the first rounds fill L1 (not timed)
            prompt = _prompt(rng, chunks)
            for variant, engine in engines.items():
                tokens, blocks = prompt
                t0 = time.perf_counter()
                stored = await engine.store(tokens, kv, slots, block_hashes=blocks)
                t1 = time.perf_counter()
                assert stored == len(tokens)
                if engine.events is not None:
                    events_seen += len(engine.events.take())
                before = previous[variant]
                looked = 0.0
                if before is not None:
                    t2 = time.perf_counter()
                    hit = engine.lookup_hit_now(before[0], block_hashes=before[1])
                    looked = time.perf_counter() - t2
                    assert isinstance(hit, LookupResult)
                    assert hit.tokens == len(before[0])
                previous[variant] = prompt
                if r > PROMPTS_HELD:
                    times[variant]["store"].append((t1 - t0) / chunks)
                    times[variant]["lookup"].append(looked / chunks)
    finally:
        for engine in engines.values():
            await engine.aclose()
    us = {v: {op: statistics.median(s) * 1e6 for op, s in ops.items()} for v, ops in times.items()}
    return {
        "benchmark": "events_bench",
        "host": {**host_info(), "load_average": os.getloadavg()},
        "workload": {
            "layout": "cpu_blocks 2 layers x 2 heads x 32, float32, block 32",
            "chunk_tokens": CHUNK,
            "object_bytes": CacheEngine.slot_bytes(LAYOUT, CHUNK),
            "chunks_per_prompt": chunks,
            "rounds": rounds,
        },
        "us_per_chunk": us,
        "events_on_over_off": {
            v: {op: us[v][op] / us["off"][op] for op in ("store", "lookup")} for v in us if v != "off"
        },
        "events_cost_us_per_chunk": {
            v: {op: us[v][op] - us["off"][op] for op in ("store", "lookup")} for v in us if v != "off"
        },
        "baseline_events": baseline_events,
        "events_taken": events_seen,
    }


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: prints the JSON (and writes it to ``--out``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--baseline-events", default=None, help="an events.py whose EventSink to time as well")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = asyncio.run(run(args.rounds, args.chunks, baseline_events=args.baseline_events))
    out["command"] = " ".join(["python", "benchmarks/events_bench.py", *(argv or sys.argv[1:])])
    print_json(out, args.out)


if __name__ == "__main__":
    main()
