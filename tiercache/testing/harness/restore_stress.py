"""Restores under stress: every restored token bit-exact whatever the timing (hits may shrink, never err).

The demo's path (a prefill engine stores requests sharing a prefix through L1 into a ``memory://`` tier and a
``file://`` tier; a decode engine with its own L1 and a fresh memory tier looks them up, prefetches from the
file tier and restores) run round after round, in one process, with the timing pushed around: random delays
in every adapter call and codec job, deadlines short enough that lookups, reads and puts time out (loads
orphaned mid-decode, puts landing late), small L1s that evict while prefetches stream in, decode rounds that
start before the prefill's stores have drained, and busy threads competing for the GIL and the cores. Each
restore is checked like the demo checks it: the restored tokens' KV equals the prefill's byte for byte, the
ret_mask is True exactly for them, and nothing past the restored end was written.

Usage: ``python benchmarks/restore_stress.py [--rounds 200] [--seed 1] [--busy 2] > out.json``; exit status
1 when any restore was wrong (the JSON lists each one: round, request, check, first token).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHUNK = 64
POISON = 0x5A5A
VOCAB = 32000


class Jitter:
    """Random delays (seeded): ``pause()`` on the event loop, ``block()`` on a thread."""

    def __init__(self, seed: int, chance: float, max_s: float) -> None:
        self.rng = random.Random(seed)
        self.chance = chance
        self.max_s = max_s
        self.lock = threading.Lock()
        self.delays = 0

    def _draw(self) -> float:
        with self.lock:
            if self.rng.random() >= self.chance:
                return 0.0
            self.delays += 1
            return self.rng.random() * self.max_s

    async def pause(self) -> None:
        delay = self._draw()
        if delay:
            await asyncio.sleep(delay)

    def block(self) -> None:
        delay = self._draw()
        if delay:
            time.sleep(delay)


def jittered(adapter: Any, jitter: Jitter) -> Any:
    """``adapter`` with a random delay before and after each batched call (the object itself, patched)."""
    for name in ("batched_get", "batched_put", "batched_contains"):
        call = getattr(adapter, name)

        async def wrapped(*args: Any, _call: Any = call) -> Any:
            await jitter.pause()
            result = await _call(*args)
            await jitter.pause()
            return result

        setattr(adapter, name, wrapped)
    return adapter


def _manager_class(jitter: Jitter) -> Any:
    from tiercache.store.manager import StorageManager

    class JitteredManager(StorageManager):
        """Codec jobs (encode from L1, decode into L1) delayed at random on their thread."""

        async def _run(self, fn: Any) -> Any:
            def slow() -> Any:
                jitter.block()
                result = fn()
                jitter.block()
                return result

            return await super()._run(slow)

    return JitteredManager


class Paged:
    """One engine's paged KV (poisoned) with a shuffled free-block list."""

    def __init__(self, layout: Any, blocks: int, seed: int) -> None:
        import torch

        self.layout = layout
        self.caches = [torch.empty(layout.layer_shape(blocks), dtype=torch.bfloat16) for _ in range(2)]
        self.bits = [c.view(torch.int16).numpy() for c in self.caches]  # numpy: no torch thread pool
        for b in self.bits:
            b.fill(POISON)
        self.free = list(range(blocks))
        random.Random(seed).shuffle(self.free)

    def allocate(self, n: int) -> Any:
        import torch

        bs = self.layout.block_size
        need = -(-n // bs)
        blocks = torch.tensor([self.free.pop() for _ in range(need)], dtype=torch.int64)
        return (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[:n]

    def release(self, slots: Any) -> None:
        """Give the blocks back, poisoned again."""
        blocks = sorted({int(s) // self.layout.block_size for s in slots.tolist()})
        for b in self.bits:
            b[blocks] = POISON
        self.free.extend(blocks)

    def write(self, kv: Any, slots: Any) -> None:
        from tiercache.gpu import Move, reference

        t = int(kv.shape[2])
        reference.scatter(self.caches, Move.scatter(self.layout, slots[:t], [(0, t)], [kv]))

    def read(self, slots: Any) -> Any:
        import torch

        from tiercache.gpu import Move, reference
        from tiercache.gpu.layouts import object_spec

        t = int(slots.shape[0])
        out = torch.empty(object_spec(self.layout, t).shape, dtype=torch.bfloat16)
        if t:
            reference.gather(self.caches, Move.gather(self.layout, slots, [(0, t)], [out]))
        return out


def expected_kv(tokens: Sequence[int], layout: Any) -> Any:
    """A request's KV ``[2, L, T, H*D]`` bf16: a cheap deterministic function of each token, its position and
    the whole prefix before it (a chunk restored into the wrong place or from another prefix differs)."""
    import numpy as np
    import torch

    width = layout.num_kv_heads * layout.head_dim
    ids = np.asarray(tokens, dtype=np.int64)
    prefix = np.cumsum(ids) % 65521
    mix = (ids * 2654435761 + prefix * 40503 + np.arange(ids.size) * 97) % 65536
    cols = np.arange(width, dtype=np.int64)
    vals = ((mix[:, None] * (cols * 2 + 1) + cols * 131) % 65521).astype(np.float32) / 4096.0 + 1.0
    kv = np.stack([vals * (1 + a + 2 * b) for a in range(2) for b in range(layout.num_layers)])
    bits = kv.reshape(2, layout.num_layers, ids.size, width).astype(np.float32).view(np.uint32)
    bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even, in numpy
    return torch.from_numpy(bf16.view(np.int16)).view(torch.bfloat16)


def check_restore(
    paged: Paged, slots: Any, expected: Any, ret_mask: Any, local: int, written: int
) -> dict[str, Any] | None:
    """The demo's three checks of one restore; None when it is right, else the first failing check."""
    import numpy as np
    import torch

    end = local + written
    got = paged.read(slots[:end]).view(torch.int16).numpy()
    want_kv = expected[:, :, :end].view(torch.int16).numpy()
    bad = (got != want_kv).any(axis=(0, 1, 3))
    if bad[local:].any():
        return {
            "check": "bytes",
            "token": local + int(np.flatnonzero(bad[local:])[0]),
            "tokens": int(bad.sum()),
        }
    mask = ret_mask.numpy().astype(bool)
    want = np.zeros(mask.size, dtype=bool)
    want[local:end] = True
    if (mask != want).any():
        return {"check": "ret_mask", "token": int(np.flatnonzero(mask != want)[0])}
    past = (paged.read(slots[end:]).view(torch.int16).numpy() != POISON).any(axis=(0, 1, 3))
    if past.any():
        return {"check": "blocks past the restored end", "token": end + int(np.flatnonzero(past)[0])}
    return None


def requests_for(rng: random.Random, system: Sequence[int], vocab: int) -> list[tuple[list[int], int]]:
    """A round's requests: (tokens, tokens the decode holds locally): the shared prefix plus turns, some
    repeated, some unrelated, a few with a local prefix (whole blocks)."""
    out: list[tuple[list[int], int]] = []
    for _ in range(rng.randint(4, 8)):
        kind = rng.random()
        if kind < 0.2 and out:
            tokens = list(rng.choice(out)[0])
        elif kind < 0.35:
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(40, 500))]
        else:
            tokens = list(system) + [rng.randrange(vocab) for _ in range(rng.randint(1, 400))]
        local = rng.choice([0, 0, 0, 16 * rng.randint(1, max(1, len(tokens) // 16 - 1))])
        out.append((tokens, min(local, len(tokens) - 1)))
    return out


async def run_stress(
    rounds: int, workdir: Path, *, seed: int = 1, busy: int = 2, log: Any = None
) -> dict[str, Any]:
    """``rounds`` rounds of prefill then decode under stress; what went wrong (nothing, expectedly) and what
    the stress did (timeouts, evictions, late puts, delays), to show it reached those paths."""
    import torch

    from tiercache.adapters.memory import MemoryAdapter
    from tiercache.adapters.posix import PosixAdapter
    from tiercache.config import ManagerConfig
    from tiercache.gpu.layouts import LayoutKind, PagedLayout, object_spec
    from tiercache.keys import KeySpace
    from tiercache.metrics import Metrics
    from tiercache.serde import build_pipeline
    from tiercache.store.engine import CacheEngine
    from tiercache.store.l1 import L1Cache

    layout = PagedLayout(LayoutKind.VLLM_FLASH, 2, 2, 32, 16, "bfloat16")
    keyspace = KeySpace("stress/toy", "bfloat16", 2, 2, 32)
    slot = object_spec(layout, CHUNK).nbytes
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(3 * CHUNK + 20)]
    jitter = Jitter(seed, chance=0.3, max_s=0.004)
    manager_cls = _manager_class(jitter)
    stop = threading.Event()

    def spin() -> None:  # holds the GIL in slices and a core
        while not stop.is_set():
            sum(range(20000))

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
    for t in spinners:
        t.start()
    wrong: list[dict[str, Any]] = []
    totals = {"restores": 0, "tokens_written": 0, "short_restores": 0}
    phases = {"drain": 0.0, "close": 0.0}
    metrics_p, metrics_d = Metrics(), Metrics()
    disk = f"file://{workdir}/l2"
    try:
        for r in range(rounds):
            policy = ManagerConfig(
                l2_deadline_s=rng.choice([0.02, 0.2, 1.0, 1.0]),
                lookup_deadline_s=rng.choice([0.02, 0.5, 0.5]),
                l2_read_floor_s=rng.choice([0.01, 0.05, 0.5, 0.5]),
                l2_read_mib_per_s=1000.0,
                l2_read_parallel=rng.choice([1, 2, 4]),
                store_parallel=rng.choice([1, 2, 4]),
                circuit_failures=1000,
            )

            async def tiers(capacity: int) -> list[tuple[str, Any, Any]]:
                mem = jittered(MemoryAdapter(name="hot", capacity=capacity), jitter)
                posix = jittered(await PosixAdapter.open(disk, capacity="64MiB"), jitter)
                return [("mem", mem, build_pipeline(["raw"])), ("disk", posix, build_pipeline(["raw"]))]

            l1_slots = rng.choice([6, 12, 64])
            prefill = CacheEngine(
                manager_cls(L1Cache(l1_slots * slot, slot), await tiers(8 * slot), policy, metrics=metrics_p),
                layout,
                keyspace,
                chunk_size=CHUNK,
            )
            decode = CacheEngine(
                manager_cls(L1Cache(rng.choice([4, 8, 64]) * slot, slot), await tiers(8 * slot), policy,
                            metrics=metrics_d),
                layout,
                keyspace,
                chunk_size=CHUNK,
            )  # fmt: skip
            reqs = requests_for(rng, system, VOCAB)
            p_kv, d_kv = Paged(layout, 400, seed + r), Paged(layout, 400, seed + r + 1)
            try:
                for tokens, _ in reqs:
                    slots = p_kv.allocate(len(tokens))
                    p_kv.write(expected_kv(tokens, layout), slots)
                    await prefill.store(tokens, p_kv.caches, slots)
                    p_kv.release(slots)
                t_store = time.perf_counter()
                if rng.random() < 0.7:  # else the decode starts while stores are still landing
                    with contextlib.suppress(TimeoutError):
                        await prefill.drain()
                phases["drain"] += time.perf_counter() - t_store
                for i, (tokens, local) in enumerate(rng.sample(reqs, len(reqs))):
                    slots = d_kv.allocate(len(tokens))
                    expected = expected_kv(tokens, layout)
                    if local:
                        d_kv.write(expected[:, :, :local], slots)
                    hit = await decode.lookup_hit(tokens, prefetch=rng.random() < 0.8)
                    if rng.random() < 0.3:
                        await asyncio.sleep(rng.random() * 0.01)  # loads in flight meanwhile
                    res = await decode.retrieve_result(
                        tokens,
                        d_kv.caches,
                        slots,
                        skip_tokens=local,
                        lookup=hit if rng.random() < 0.5 else None,
                    )
                    totals["restores"] += 1
                    totals["tokens_written"] += res.tokens_written
                    totals["short_restores"] += local + res.tokens_written < hit.tokens
                    bad = check_restore(d_kv, slots, expected, res.ret_mask, local, res.tokens_written)
                    if bad is not None:
                        chunk = bad["token"] // CHUNK
                        tier = hit.tiers[chunk] if chunk < len(hit.tiers) else None
                        bad.update(round=r, request=i, tokens=len(tokens), local=local, tier=tier)
                        bad["written"] = res.tokens_written
                        wrong.append(bad)
                        if log is not None:
                            print(f"WRONG {bad}", file=log, flush=True)
                    d_kv.release(slots)
            finally:
                t_close = time.perf_counter()
                await prefill.aclose()
                await decode.aclose()
                phases["close"] += time.perf_counter() - t_close
            if log is not None and (r + 1) % 10 == 0:
                print(f"round {r + 1}/{rounds}: {totals} wrong={len(wrong)}", file=log, flush=True)
    finally:
        stop.set()
        for t in spinners:
            t.join()

    def total(m: Metrics, name: str) -> float:
        return sum(s.value for fam in m.registry.collect() for s in fam.samples if s.name == name)

    return {
        "rounds": rounds,
        "seed": seed,
        "busy_threads": busy,
        "torch_threads": torch.get_num_threads(),
        "wrong": wrong,
        **totals,
        "delays": jitter.delays,
        "phase_s": phases,
        "tier_errors": sum(total(m, "tiercache_tier_errors_total") for m in (metrics_p, metrics_d)),
        "stores_dropped": total(metrics_p, "tiercache_stores_dropped_total"),
        "prefetched": total(metrics_d, "tiercache_prefetched_total"),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--busy", type=int, default=2, help="busy threads beside the engines")
    ap.add_argument(
        "--workdir", type=Path, default=None, help="where the file tier lives (default: a temp dir)"
    )
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="restore-stress-"))
    started = time.perf_counter()
    result = asyncio.run(run_stress(args.rounds, workdir, seed=args.seed, busy=args.busy, log=sys.stderr))
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result, indent=2))
    return 1 if result["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
