"""Soak: a store/lookup/retrieve loop through L1 + a Redis tier + a POSIX tier, with faults injected.

A "prefill" engine stores prompts (from a paged KV cache) and a "decode" engine with its own L1 restores
them into its own paged cache; every restored token is compared bit for bit with the prompt's KV (a wrong
token is counted and fails the verdict). Prompts share prefixes and the working set is larger than either
L1 or the POSIX tier's capacity, so L1 eviction, L2 stores, L2 hits and evictions all run continuously.
The loop runs as fast as it can (time compressed by rate): ops/s is in the JSON.

Faults, one every ``--fault-every`` seconds in turn: Redis killed (SIGKILL) and restarted on its port after
``--fault-len`` seconds (empty: no persistence), Redis paused (SIGSTOP) then resumed, POSIX objects corrupted
(a byte flipped or the file truncated) while Redis is down (so reads reach them), then a quiet period.

Sampled every ``--sample-every`` seconds: process RSS, open file descriptors, threads, L1 used bytes and
live leases of both engines, store-queue depths, and the counters (ops, hits by tier, errors, rejected
frames, dropped stores). Verdict: after the warm-up, the median of the last quarter of RSS, fds and L1
occupancy is within +-5 % of the median of the first quarter (the "first" quarter starts after warm-up),
zero leases when the run has drained, zero wrong tokens, every fault kind seen in the metrics.

Run: ``python benchmarks/soak.py --duration 1800 --out benchmarks/results/soak_cpu.json
--plot benchmarks/results/soak_cpu.png`` (``make soak``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from tiercache.cli.bench.measure import host_info
from tiercache.config import config_from_dict
from tiercache.gpu.layouts import LayoutKind, PagedLayout, object_spec
from tiercache.gpu.move import Move
from tiercache.gpu.reference import gather, scatter
from tiercache.store.engine import CacheEngine
from tiercache.testing.harness.backends import start_redis_process
from tiercache.testing.harness.processes import ServerProcess, free_port

__all__ = ["SoakConfig", "main", "run_soak", "verdict"]

LAYOUT = PagedLayout(
    LayoutKind.VLLM_FLASH, num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype="bfloat16"
)
CHUNK = 256
FAULTS = ("redis_kill", "redis_pause", "posix_corrupt", "quiet")
FLAT_TOLERANCE = 0.05


@dataclass
class SoakConfig:
    """One soak run's knobs (the defaults are the committed 30-minute run's)."""

    duration_s: float = 1800.0
    warmup_frac: float = 0.2
    sample_every_s: float = 5.0
    fault_every_s: float = 15.0
    fault_len_s: float = 3.0
    prompts: int = 48
    groups: int = 6
    seed: int = 0


@dataclass
class Prompt:
    tokens: list[int]
    kv: torch.Tensor  # [2, L, T, H, D] bf16: the KV every engine must restore bit-exact
    cache: list[torch.Tensor]  # the prefill's paged cache holding ``kv`` at slots 0..T-1
    slots: torch.Tensor


def _chunk_kv(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(object_spec(LAYOUT, CHUNK).shape, generator=gen).to(torch.bfloat16)


def make_prompts(cfg: SoakConfig) -> list[Prompt]:
    """Prompts of one shared chunk per group + 1..3 own chunks; a chunk's KV depends on its tokens only."""
    rng = random.Random(cfg.seed)
    prompts = []
    for i in range(cfg.prompts):
        group = i % cfg.groups
        chunk_ids = [1_000_000 + group] + [i * 10 + j for j in range(rng.randint(1, 3))]
        tokens = [c * CHUNK + t for c in chunk_ids for t in range(CHUNK)]
        kv = torch.cat([_chunk_kv(c) for c in chunk_ids], dim=2)
        n = len(tokens)
        cache = [torch.zeros(LAYOUT.layer_shape(n // LAYOUT.block_size), dtype=torch.bfloat16)
                 for _ in range(LAYOUT.num_layers)]  # fmt: skip
        slots = torch.arange(n)
        scatter(cache, Move.scatter(LAYOUT, slots, [(0, n)], [kv]))
        prompts.append(Prompt(tokens, kv, cache, slots))
    return prompts


class Redis:
    """A redis-server this script starts, kills, restarts (same port) and pauses, by PID."""

    def __init__(self, binary: str, directory: Path) -> None:
        self.binary, self.directory = binary, directory
        self.port = free_port()
        self.proc: ServerProcess = self._start()

    def _start(self) -> ServerProcess:
        lru = ["--maxmemory", "48mb", "--maxmemory-policy", "allkeys-lru"]
        return start_redis_process(self.binary, self.port, self.directory, lru)

    def restart(self) -> None:
        self.proc.stop()
        self.proc = self._start()


def corrupt_files(root: Path, rng: random.Random, count: int) -> int:
    """Flip one byte in, or truncate, up to ``count`` stored objects under ``root``; returns how many."""
    files = [p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".tmp")]
    done = 0
    for path in rng.sample(files, min(count, len(files))):
        try:
            size = path.stat().st_size
            if size == 0:
                continue
            with path.open("r+b") as f:
                if rng.random() < 0.5:
                    f.seek(rng.randrange(size))
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
                else:
                    f.truncate(rng.randrange(size))
            done += 1
        except OSError:  # evicted meanwhile
            continue
    return done


@dataclass
class State:
    ops: int = 0
    wrong_tokens: int = 0
    restored_tokens: int = 0
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0))
    corrupted: int = 0
    samples: list[dict[str, Any]] = field(default_factory=list)


def _metric_sum(engine: CacheEngine, name: str, **labels: str) -> float:
    total = 0.0
    for family in engine.manager.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def sample(start: float, state: State, prefill: CacheEngine, decode: CacheEngine) -> dict[str, Any]:
    proc = psutil.Process()
    l1p, l1d = prefill.manager.l1.stats(), decode.manager.l1.stats()
    engines = (prefill, decode)
    return {
        "t_s": round(time.monotonic() - start, 2),
        "rss_bytes": proc.memory_info().rss,
        "fds": proc.num_fds(),
        "threads": proc.num_threads(),
        "l1_used_bytes": l1p.used_bytes + l1d.used_bytes,
        "leases": l1p.leased + l1d.leased,
        "queue_depth": sum(t.queue.qsize() for e in engines for t in e.manager.tiers),
        "ops": state.ops,
        "wrong_tokens": state.wrong_tokens,
        "loaded_redis": _metric_sum(decode, "tiercache_prefetched_total", tier="redis"),
        "loaded_disk": _metric_sum(decode, "tiercache_prefetched_total", tier="disk"),
        "tier_errors": sum(_metric_sum(e, "tiercache_tier_errors_total") for e in engines),
        "frames_rejected": sum(_metric_sum(e, "tiercache_frames_rejected_total") for e in engines),
        "stores_dropped": _metric_sum(prefill, "tiercache_stores_dropped_total"),
        "stores_redis": _metric_sum(prefill, "tiercache_stores_total", tier="redis"),
        "circuit_open_redis": _metric_sum(decode, "tiercache_circuit_open", tier="redis"),
    }


async def _workload(cfg: SoakConfig, prompts: list[Prompt], prefill: CacheEngine, decode: CacheEngine,
                    state: State, stop: asyncio.Event) -> None:  # fmt: skip
    rng = random.Random(cfg.seed + 1)
    max_tokens = max(len(p.tokens) for p in prompts)
    target = [torch.zeros(LAYOUT.layer_shape(max_tokens // LAYOUT.block_size), dtype=torch.bfloat16)
              for _ in range(LAYOUT.num_layers)]  # fmt: skip
    while not stop.is_set():
        p = rng.choice(prompts)
        n = len(p.tokens)
        if rng.random() < 0.5:
            await prefill.store(p.tokens, p.cache, p.slots)
        result = await decode.retrieve_result(p.tokens, target, p.slots)
        got = int(result.ret_mask.sum())
        if got:
            out = torch.empty(object_spec(LAYOUT, n).shape, dtype=torch.bfloat16)
            gather(target, Move.gather(LAYOUT, p.slots, [(0, n)], [out]))
            mask = result.ret_mask[:n]
            equal = out.view(torch.int16) == p.kv.view(torch.int16)  # token axis is dim 2 (KV_2LTD)
            same = equal.movedim(2, 0).reshape(n, -1).all(dim=1)
            state.wrong_tokens += int((mask & ~same).sum())
            state.restored_tokens += got
        state.ops += 1
        if state.ops % 8 == 0:
            await asyncio.sleep(0)


async def _faults(cfg: SoakConfig, redis: Redis, disk: Path, state: State, stop: asyncio.Event) -> None:
    rng = random.Random(cfg.seed + 2)
    i = 0
    while not stop.is_set():
        with _suppress_timeout():
            await asyncio.wait_for(stop.wait(), cfg.fault_every_s)
        if stop.is_set():
            return
        kind = FAULTS[i % len(FAULTS)]
        i += 1
        state.faults[kind] += 1
        if kind == "redis_kill":
            redis.proc.kill()
            await asyncio.sleep(cfg.fault_len_s)
            await asyncio.to_thread(redis.restart)
        elif kind == "redis_pause":
            redis.proc.pause()
            await asyncio.sleep(cfg.fault_len_s)
            redis.proc.resume()
        elif kind == "posix_corrupt":  # and Redis down meanwhile, so that reads reach the POSIX tier
            state.corrupted += await asyncio.to_thread(corrupt_files, disk, rng, 32)
            redis.proc.kill()
            await asyncio.sleep(cfg.fault_len_s)
            await asyncio.to_thread(redis.restart)


class _suppress_timeout:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        return exc_type is TimeoutError


async def _sampler(cfg: SoakConfig, start: float, state: State, prefill: CacheEngine, decode: CacheEngine,
                   stop: asyncio.Event) -> None:  # fmt: skip
    while not stop.is_set():
        state.samples.append(sample(start, state, prefill, decode))
        with _suppress_timeout():
            await asyncio.wait_for(stop.wait(), cfg.sample_every_s)


def _flat(values: list[float]) -> dict[str, Any]:
    """Median of the first and last quarter of ``values`` and whether they agree within FLAT_TOLERANCE."""
    q = max(1, len(values) // 4)
    first, last = statistics.median(values[:q]), statistics.median(values[-q:])
    change = (last - first) / first if first else 0.0
    return {"first": first, "last": last, "change": round(change, 4), "flat": abs(change) <= FLAT_TOLERANCE}


def verdict(
    cfg: SoakConfig, samples: list[dict[str, Any]], end: dict[str, Any], state: State
) -> dict[str, Any]:
    """Flatness of RSS, fds and L1 occupancy after warm-up; leases and wrong tokens at the end."""
    after = [s for s in samples if s["t_s"] >= cfg.warmup_frac * cfg.duration_s]
    flat = {k: _flat([float(s[k]) for s in after]) for k in ("rss_bytes", "fds", "l1_used_bytes")}
    faults_seen = {
        "redis_kill_or_pause": end["tier_errors"] > 0 and state.faults["redis_kill"] > 0,
        "posix_corrupt": end["frames_rejected"] > 0,
    }
    ok = (
        all(v["flat"] for v in flat.values())
        and end["leases"] == 0
        and state.wrong_tokens == 0
        and end["queue_depth"] == 0
    )
    return {
        "flat": flat,
        "leases_at_end": end["leases"],
        "queue_depth_at_end": end["queue_depth"],
        "wrong_tokens": state.wrong_tokens,
        "faults_seen_in_metrics": faults_seen,
        "ok": ok,
    }


async def run_soak(cfg: SoakConfig, workdir: Path) -> dict[str, Any]:
    """Run the soak in ``workdir``; returns the JSON-ready result (samples, counts, verdict)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not installed (Debian: apt-get install -y redis-server)")
    redis = Redis(binary, workdir / "redis")
    disk = workdir / "l2"
    config = config_from_dict(
        {
            "chunk_size": CHUNK,
            "l1": {"capacity": "6MiB", "pinned": False},
            "manager": {
                "l2_deadline_s": 0.5,
                "lookup_deadline_s": 0.25,
                "circuit_cooldown_s": 1.0,
                "store_queue_size": 64,
            },
            "tiers": [
                {"name": "redis", "url": f"redis://127.0.0.1:{redis.port}/0"},
                {"name": "disk", "url": f"file://{disk}", "capacity": "10MiB"},
            ],
        }
    )
    prompts = make_prompts(cfg)
    state = State()
    fds_before_open = psutil.Process().num_fds()
    prefill = await CacheEngine.open(config, LAYOUT, model="soak/model")
    decode = await CacheEngine.open(config, LAYOUT, model="soak/model")
    stop = asyncio.Event()
    start = time.monotonic()
    try:
        tasks = [
            asyncio.create_task(_workload(cfg, prompts, prefill, decode, state, stop)),
            asyncio.create_task(_faults(cfg, redis, disk, state, stop)),
            asyncio.create_task(_sampler(cfg, start, state, prefill, decode, stop)),
        ]
        await asyncio.sleep(cfg.duration_s)
        stop.set()
        await asyncio.gather(*tasks)
        redis.proc.resume()
        await prefill.drain()
        await decode.drain()
        end = sample(start, state, prefill, decode)
    finally:
        await prefill.aclose()
        await decode.aclose()
        fds_after_close = psutil.Process().num_fds()
        redis.proc.stop()
    elapsed = time.monotonic() - start
    return {
        "benchmark": "soak",
        "host": host_info(),
        "config": cfg.__dict__,
        "elapsed_s": round(elapsed, 1),
        "ops": state.ops,
        "ops_per_s": round(state.ops / elapsed, 1),
        "restored_tokens": state.restored_tokens,
        "faults": state.faults,
        "objects_corrupted": state.corrupted,
        "end": end,
        "fds_around": {"before_open": fds_before_open, "after_close": fds_after_close},
        "verdict": verdict(cfg, state.samples, end, state),
        "samples": state.samples,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """RSS, fds, L1 occupancy, leases and queue depth over time (one panel each) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [s["t_s"] / 60 for s in samples]
    panels = [("rss_bytes", "RSS (MiB)", 1 / (1 << 20)), ("fds", "open fds", 1),
              ("l1_used_bytes", "L1 used (MiB)", 1 / (1 << 20)), ("leases", "live leases", 1),
              ("queue_depth", "store queue depth", 1), ("ops", "ops (cumulative)", 1)]  # fmt: skip
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2 * len(panels)), sharex=True)
    warm = result["config"]["warmup_frac"] * result["config"]["duration_s"] / 60
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        ax.plot(t, [s[key] * scale for s in samples], lw=1)
        ax.axvline(warm, color="grey", ls=":", lw=1)
        ax.set_ylabel(label, fontsize=8)
    axes[-1].set_xlabel(
        "minutes (faults every {:.0f} s; dotted: end of warm-up)".format(result["config"]["fault_every_s"])
    )
    fig.suptitle(
        f"tiercache soak: {result['ops']} ops, verdict {'OK' if result['verdict']['ok'] else 'FAIL'}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=SoakConfig.duration_s)
    parser.add_argument("--sample-every", type=float, default=SoakConfig.sample_every_s)
    parser.add_argument("--fault-every", type=float, default=SoakConfig.fault_every_s)
    parser.add_argument("--fault-len", type=float, default=SoakConfig.fault_len_s)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    cfg = SoakConfig(args.duration, sample_every_s=args.sample_every, fault_every_s=args.fault_every,
                     fault_len_s=args.fault_len)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tiercache-soak-") as tmp:
        result = asyncio.run(run_soak(cfg, Path(tmp)))
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    if args.plot:
        plot(result, args.plot)
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    return 0 if result["verdict"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
