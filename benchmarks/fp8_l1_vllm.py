"""vLLM on CPU with an fp8 L1: how often a decode restored through ``[l1] codec = "fp8"`` produces the greedy
tokens of a cold run, over many prompts (fp8 KV is lossy: measured, never asserted).

A prefill instance (kv_producer) stores every prompt through its L1 into a POSIX tier; a decode instance
(kv_consumer, another OS process) serves the same prompts, restoring their cached prefix; a cold instance
without the connector serves them too. Done twice, in the same run: with the fp8 L1 (tier chain ``["fp8"]``)
and, as the control, with the raw L1 (tier chain ``["raw"]``, bit-exact: every prompt must agree). Each
instance is its own process on the tiny random-weight Llama (tests/e2e/make_tiny.py), uni executor, fp32
KV, block size 32, chunk 64.

    .venv/bin/python benchmarks/fp8_l1_vllm.py [--prompts 50] [--out benchmarks/results/fp8_l1_vllm_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_e2e import E2E, ROOT, run

from tiercache.cli.bench.report import print_json


def agreement(got: list[int], want: list[int]) -> int:
    """Leading tokens of ``got`` equal to ``want`` (greedy: the first divergence decides the rest)."""
    n = 0
    for a, b in zip(got, want, strict=False):
        if a != b:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fp8_l1_vllm_cpu.json"))
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()

    rng = random.Random(14)
    prompts = [[rng.randrange(3, 350) for _ in range(rng.randrange(160, 400))] for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory(prefix="tiercache-fp8-vllm-") as tmp:
        work = Path(tmp)
        model = work / "tiny"
        subprocess.run(
            [sys.executable, str(E2E / "make_tiny.py"), str(model)], check=True, capture_output=True
        )
        base = {"model": str(model), "prompts": prompts, "max_tokens": args.max_tokens, "batched": 4096}
        cold = run(work, "cold", base)
        want = [r["tokens"] for r in cold["results"]]
        arms: dict[str, Any] = {}
        for codec in ("fp8", "raw"):
            config = work / f"{codec}.toml"
            config.write_text(
                f'chunk_size = 64\nsave_unfull_chunk = true\n[l1]\ncapacity = "256MiB"\ncodec = "{codec}"\n'
                f'[[tiers]]\nname = "disk"\nurl = "file://{work}/l2-{codec}"\ncodecs = ["{codec}"]\n'
            )
            extra = {"config": str(config)}
            run(work, f"prefill-{codec}", {**base, "connector": {"role": "kv_producer", "extra": extra}})
            hit = run(work, f"decode-{codec}", {**base, "connector": {"role": "kv_consumer", "extra": extra}})
            got = [r["tokens"] for r in hit["results"]]
            cached = [r["num_cached_tokens"] for r in hit["results"]]
            lead = [agreement(g, w) for g, w in zip(got, want, strict=True)]
            same_pos = [
                sum(a == b for a, b in zip(g, w, strict=True)) / len(w)
                for g, w in zip(got, want, strict=True)
            ]
            arms[codec] = {
                "prompts_restored": sum(c > 0 for c in cached),
                "restored_tokens_fraction": round(sum(cached) / sum(len(p) for p in prompts), 4),
                "prompts_all_tokens_identical": sum(g == w for g, w in zip(got, want, strict=True)),
                "prompts_first_token_identical": sum(g[:1] == w[:1] for g, w in zip(got, want, strict=True)),
                "fraction_identical": round(
                    sum(g == w for g, w in zip(got, want, strict=True)) / len(want), 4
                ),
                "mean_leading_tokens_agreeing": round(statistics.mean(lead), 3),
                "mean_positionwise_agreement": round(statistics.mean(same_pos), 4),
            }
            print(codec, json.dumps(arms[codec]), file=sys.stderr)
    import vllm

    result = {
        "benchmark": "fp8_l1_vllm",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "vllm": vllm.__version__,
        "model": "tiny random Llama (2 layers, 2 KV heads x 32, fp32 KV), block_size 32, CPU backend",
        "prompts": args.prompts,
        "prompt_tokens": [min(len(p) for p in prompts), max(len(p) for p in prompts)],
        "max_tokens": args.max_tokens,
        "chunk_size": 64,
        "tier": "L1 + POSIX (file://); decode in a new process (uni executor); greedy (temperature 0)",
        "fp8": arms["fp8"],
        "raw_control": arms["raw"],
        "note": (
            "greedy tokens of the decode (KV restored through the L1 of each codec) against a cold run; a "
            "random-weight model's logits are close together, so this is a harsh test of fp8's 2.6 % KV error"
        ),
    }
    print_json(result, args.out)


if __name__ == "__main__":
    main()
