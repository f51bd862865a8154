"""Trace replay of a shared L1 under several tenants: eviction policies, quotas and admission side by side.

    PYTHONHASHSEED=0 python benchmarks/trace_replay.py [--seed 7] [--out benchmarks/results]

(The frequency sketch and the ceiling estimate hash keys with Python's ``hash``: PYTHONHASHSEED fixes their
figures; the eviction runs repeat exactly whatever the seed.)

The trace: ``--tenants`` tenants (each its own ``cache_salt``), each with a system prompt its conversations
share, hold multi-turn conversations (every turn resends the whole history plus new text; ``--active`` are in
flight at once, interleaved at random); between conversation turns a batch tenant streams one-off prompts (a
scan, ``--scan-per-turn`` prompts of ``--scan-chunks`` chunks each). Keys come from the real
``TokenDatabase`` (the salt enters the first chunk); every request goes through a real ``L1Cache`` like the
engine does: a prefix lookup, a restore of each hit chunk (leased, every byte compared with what was stored
under that key, then the lease checked valid) and a store of the chunks after the hit prefix (one
``batched_reserve_write`` of the request's chunks in order, as the engine's store makes).

Two traces: ``conversations`` (the options as given) and ``long_system_prompts`` (system prompts of 32
chunks, longer replies, a 3x L1, a larger scan: the shared prefixes LRU keeps anyway weigh more). Runs per
trace (same trace, same run): ``lru`` (the baseline), ``s3fifo``, ``s3fifo_ghosts1`` (the paper's ghost
list of 1x the cache), each policy again with per-tenant quotas, and with admission after 2 sightings.
Reported per run: conversation chunk hits (the figure of merit), hit rates, the hit-rate ceiling estimate
beside the exact one, the most each tenant held against its budget, and wrong bytes (must be 0).
Prints JSON and writes ``trace_replay_cpu.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.cli.bench.report import print_json
from tiercache.keys import KeySpace, RequestIdentity, TokenDatabase
from tiercache.spec import KVSpec
from tiercache.store.l1 import L1Cache
from tiercache.store.policy import Admission, HitRateCeiling

CHUNK = 16  # tokens per chunk
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", tokens=CHUNK)  # 2 KiB a chunk
BATCH = "batch"  # the scanning tenant


@dataclass(frozen=True)
class Request:
    """One prompt of a tenant; ``conversation`` False for the scan's one-off prompts."""

    tenant: str
    tokens: list[int]
    conversation: bool


def _words(rng: random.Random, chunks: int) -> list[int]:
    return [rng.randrange(1, 50000) for _ in range(chunks * CHUNK)]


def make_trace(args: argparse.Namespace) -> list[Request]:
    """The interleaved requests: conversations of every tenant, and the batch tenant's scan between turns."""
    rng = random.Random(args.seed)
    tenants = [f"tenant{i}" for i in range(args.tenants)]
    system = {t: _words(rng, args.system_chunks) for t in tenants}
    pending = [(t, c) for t in tenants for c in range(args.conversations)]
    rng.shuffle(pending)
    active: list[tuple[str, list[int], int]] = []  # tenant, history, turns left
    out: list[Request] = []
    while pending or active:
        while pending and len(active) < args.active:
            t, _ = pending.pop()
            active.append((t, list(system[t]), args.turns))
        i = rng.randrange(len(active))
        tenant, history, left = active[i]
        prompt = history + _words(rng, args.user_chunks)
        out.append(Request(tenant, prompt, True))
        history = prompt + _words(rng, args.reply_chunks)  # the answer joins the history
        if left > 1:
            active[i] = (tenant, history, left - 1)
        else:
            active.pop(i)
        for _ in range(args.scan_per_turn):
            out.append(Request(BATCH, _words(rng, args.scan_chunks), False))
    return out


def _payload(key: str) -> bytes:
    """What the chunk under ``key`` holds: derived from the key, so any mix-up shows."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (SPEC.nbytes // len(seed) + 1))[: SPEC.nbytes]


def replay(
    trace: list[Request],
    keys: list[list[str]],
    *,
    slots: int,
    eviction: str,
    quotas: dict[str, int] | None,
    admit_after: int,
    ghosts: float | None = None,
) -> dict[str, Any]:
    """Run the trace through one L1; counters, held-vs-budget and wrong bytes."""
    l1 = L1Cache(
        slots * SPEC.nbytes,
        SPEC.nbytes,
        pinned=False,
        eviction=eviction,
        eviction_options=None if ghosts is None else {"ghosts": ghosts},
        quotas=quotas,
    )
    admission = Admission()
    refused = 0
    ceiling = HitRateCeiling()
    conv_hits = conv_lookups = scan_hits = scan_lookups = stored = 0
    wrong_bytes = restores = 0
    max_held: dict[str, int] = {}
    t0 = time.perf_counter()
    for req, ks in zip(trace, keys, strict=True):
        ceiling.observe(ks)
        admission.seen(ks)
        hits = 0
        for k in ks:  # the prefix lookup and the restore of every hit chunk
            lease = l1.acquire(k)
            if lease is None:
                break
            with lease:
                data = bytes(lease.obj.buffer())
                ok = lease.valid()
            restores += 1
            expected = _payload(k)
            wrong_bytes += sum(a != b for a, b in zip(data, expected, strict=True)) if data != expected else 0
            if not ok:
                break
            hits += 1
        if req.conversation:
            conv_hits += hits
            conv_lookups += len(ks)
        else:
            scan_hits += hits
            scan_lookups += len(ks)
        admitted = [k for k in ks[hits:] if admission.admit(k, admit_after)]
        refused += len(ks) - hits - len(admitted)
        wanted = ks[:hits] + admitted  # like the engine: the request's chunks in order, cached ones first
        for obj in l1.batched_reserve_write(wanted, [SPEC] * len(wanted), req.tenant):  # store what missed
            if obj is None:
                continue
            obj.buffer()[:] = _payload(obj.key)
            l1.finish_write(obj)
            stored += 1
        for tenant, held in l1.tenant_stats().items():
            max_held[tenant] = max(max_held.get(tenant, 0), held.held_bytes)
    elapsed = time.perf_counter() - t0
    st = l1.stats()
    lookups = conv_lookups + scan_lookups
    over = {t: (max_held.get(t, 0), b) for t, b in (quotas or {}).items() if max_held.get(t, 0) > b}
    return {
        "eviction": eviction,
        "ghosts": ghosts,
        "quotas": bool(quotas),
        "admit_after": admit_after,
        "conversation_hits": conv_hits,
        "conversation_lookups": conv_lookups,
        "conversation_hit_rate": round(conv_hits / max(conv_lookups, 1), 4),
        "scan_hits": scan_hits,
        "hit_rate": round((conv_hits + scan_hits) / max(lookups, 1), 4),
        "hit_rate_ceiling": round(ceiling.ceiling(), 4),
        "exact_ceiling": None,
        "restores_checked": restores,
        "wrong_bytes": wrong_bytes,
        "stored_chunks": stored,
        "admission_refused": refused,
        "evictions": st.evictions,
        "quota_evictions": st.quota_evictions,
        "quota_refusals": st.quota_refusals,
        "max_held_bytes": dict(sorted(max_held.items())),
        "budgets": dict(sorted((quotas or {}).items())),
        "tenants_over_budget": over,
        "seconds": round(elapsed, 2),
    }


def _over(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {n: r["tenants_over_budget"] for n, r in runs.items() if r["tenants_over_budget"]}


def run_trace(args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration on one trace built from ``args``."""
    trace = make_trace(args)
    space = KeySpace(model="trace-replay", kv_dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8)
    db = TokenDatabase(space, chunk_size=CHUNK)
    keys = [[str(k) for k in db.keys(r.tokens, identity=RequestIdentity(cache_salt=r.tenant))] for r in trace]
    distinct = len({k for ks in keys for k in ks})
    lookups = sum(len(ks) for ks in keys)
    cap = args.slots * SPEC.nbytes
    quotas = {f"tenant{i}": int(args.tenant_share * cap) for i in range(args.tenants)}
    quotas[BATCH] = int(args.batch_share * cap)
    runs: dict[str, dict[str, Any]] = {}
    for name, eviction, q, admit, ghosts in [
        ("lru", "lru", None, 1, None),
        ("s3fifo", "s3fifo", None, 1, None),
        ("s3fifo_ghosts1", "s3fifo", None, 1, 1.0),
        ("lru_quotas", "lru", quotas, 1, None),
        ("s3fifo_quotas", "s3fifo", quotas, 1, None),
        ("lru_admit2", "lru", None, 2, None),
        ("s3fifo_admit2", "s3fifo", None, 2, None),
    ]:
        run = replay(
            trace, keys, slots=args.slots, eviction=eviction, quotas=q, admit_after=admit, ghosts=ghosts
        )
        run["exact_ceiling"] = round(1 - distinct / lookups, 4)
        runs[name] = run
    base = max(runs["lru"]["conversation_hits"], 1)
    return {
        "trace": {
            "requests": len(trace),
            "conversation_requests": sum(r.conversation for r in trace),
            "scan_requests": sum(not r.conversation for r in trace),
            "chunk_lookups": lookups,
            "distinct_chunks": distinct,
            "chunk_bytes": SPEC.nbytes,
            **{k: v for k, v in vars(args).items() if k != "out"},
        },
        **{
            f"ratio_conversation_hits_{name}_vs_lru": round(runs[name]["conversation_hits"] / base, 3)
            for name in runs
            if name != "lru"
        },
        "wrong_bytes": sum(r["wrong_bytes"] for r in runs.values()),
        "tenants_over_budget": {
            n: r["tenants_over_budget"] for n, r in runs.items() if r["tenants_over_budget"]
        },
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Build the trace, replay it under every configuration, print and write the JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--conversations", type=int, default=12, help="per tenant")
    p.add_argument("--active", type=int, default=8, help="conversations in flight at once")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-chunks", type=int, default=8)
    p.add_argument("--user-chunks", type=int, default=2)
    p.add_argument("--reply-chunks", type=int, default=2)
    p.add_argument("--scan-per-turn", type=int, default=2)
    p.add_argument("--scan-chunks", type=int, default=48)
    p.add_argument("--slots", type=int, default=400, help="L1 size in chunks")
    p.add_argument("--tenant-share", type=float, default=0.3, help="quota of each conversation tenant")
    p.add_argument("--batch-share", type=float, default=0.1, help="quota of the scanning tenant")
    p.add_argument("--out", type=Path, default=None, help="directory for trace_replay_cpu.json")
    args = p.parse_args(argv)

    traces = {
        "conversations": args,
        "long_system_prompts": argparse.Namespace(
            **{
                **vars(args),
                "system_chunks": 32,
                "reply_chunks": 6,
                "scan_chunks": 64,
                "scan_per_turn": 3,
                "slots": 3 * args.slots,
            }
        ),
    }
    results = {name: run_trace(targs) for name, targs in traces.items()}
    head = results["conversations"]
    result = {
        "benchmark": "trace_replay",
        "command": " ".join(
            [
                f"PYTHONHASHSEED={os.environ.get('PYTHONHASHSEED', '(random)')}",
                "python benchmarks/trace_replay.py",
                *(sys.argv[1:] if argv is None else argv),
            ]
        ),
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "baseline": "lru (same trace, same run)",
        "ratio_conversation_hits_s3fifo_vs_lru": head["ratio_conversation_hits_s3fifo_vs_lru"],
        "wrong_bytes": sum(r["wrong_bytes"] for r in results.values()),
        "tenants_over_budget": {
            n: r["tenants_over_budget"] for n, r in results.items() if r["tenants_over_budget"]
        },
        "traces": results,
    }
    print_json(result, None if args.out is None else args.out / "trace_replay_cpu.json")
    return result


if __name__ == "__main__":
    main()
