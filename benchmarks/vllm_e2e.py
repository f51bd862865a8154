"""vLLM on CPU: prompt tokens a decode instance computes, and its TTFT, with a tiercache hit vs cold.

A prefill instance (kv_producer) stores a long prompt; a decode instance (kv_consumer, another OS process)
then serves a prompt sharing 90 % of it (the shared prefix is chunk-aligned). The same decode prompt is also
run on a cold instance without the connector. Each instance is its own process on the tiny random-weight
Llama (tests/e2e/make_tiny.py), ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` + ``uni`` executor, block size 32.

    .venv/bin/python benchmarks/vllm_e2e.py [--out benchmarks/results/vllm_e2e_cpu.json] [--reps 2]

``--layerwise`` also runs a layerwise prefill/decode pair (``"layerwise": true``: stored layer by layer,
restored layer by layer while the forward pass runs) in each repetition and reports its TTFT against the
whole-object load of the same repetition; ``--layers N`` uses a deeper random Llama (``make_tiny.py``'s
``llamaN``: N layers, 4 KV heads of 64) so that the per-layer pipeline has something to overlap.
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

from tiercache.cli.bench.report import print_json

ROOT = Path(__file__).resolve().parent.parent
E2E = ROOT / "tests" / "e2e"


def run(work: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(E2E / "run_vllm.py"), str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_e2e_cpu.json"))
    ap.add_argument("--prompt-tokens", type=int, default=2560)
    ap.add_argument("--shared", type=float, default=0.9, help="shared-prefix fraction of the prompt")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2, help="fresh prefill/decode/cold instances per repetition")
    ap.add_argument("--layerwise", action="store_true", help="also a layerwise prefill/decode pair per rep")
    ap.add_argument("--layers", type=int, default=2, help="model depth (2: the tests' tiny Llama)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="tiercache-vllm-bench-") as tmp:
        work = Path(tmp)
        model = work / "tiny"
        kind = "llama" if args.layers == 2 else f"llama{args.layers}"
        subprocess.run(
            [sys.executable, str(E2E / "make_tiny.py"), str(model), kind], check=True, capture_output=True
        )
        n = args.prompt_tokens
        shared_n = int(n * args.shared)
        reps: list[dict[str, Any]] = []
        for rep in range(args.reps):
            rng = random.Random(rep)

            def ids(k: int, rng: random.Random = rng) -> list[int]:
                return [rng.randrange(3, 350) for _ in range(k)]

            shared = ids(shared_n)
            stored, asked = shared + ids(n - shared_n), shared + ids(n - shared_n)
            base = {
                "model": str(model),
                "max_model_len": args.prompt_tokens + 256,
                "batched": 4096,
                "max_tokens": 8,
                "warmup": ids(40),
                "ttft": True,
            }
            rec: dict[str, Any] = {}
            for mode in ("whole", "layerwise") if args.layerwise else ("whole",):
                config = work / f"tc{rep}-{mode}.toml"
                config.write_text(
                    f'chunk_size = {args.chunk_size}\nsave_unfull_chunk = true\n[l1]\ncapacity = "256MiB"\n'
                    f'[[tiers]]\nname = "disk"\nurl = "file://{work}/l2-{rep}-{mode}"\ncodecs = ["raw"]\n'
                )
                extra = {"config": str(config), "layerwise": mode == "layerwise"}
                run(
                    work,
                    f"prefill{rep}-{mode}",
                    {**base, "prompts": [stored], "connector": {"role": "kv_producer", "extra": extra}},
                )
                rec[mode] = run(
                    work,
                    f"hit{rep}-{mode}",
                    {**base, "prompts": [asked], "connector": {"role": "kv_consumer", "extra": extra}},
                )
            cold = run(work, f"cold{rep}", {**base, "prompts": [asked]})
            hit = rec["whole"]
            entry = {
                "hit_ttft_s": hit["ttft"][0]["ttft_s"],
                "cold_ttft_s": cold["ttft"][0]["ttft_s"],
                "hit_cached_tokens": hit["ttft"][0]["num_cached_tokens"],
                "cold_cached_tokens": cold["ttft"][0]["num_cached_tokens"],
                "tokens_identical": hit["results"][0]["tokens"] == cold["results"][0]["tokens"],
            }
            if "layerwise" in rec:
                lw = rec["layerwise"]
                entry |= {
                    "layerwise_ttft_s": lw["ttft"][0]["ttft_s"],
                    "layerwise_cached_tokens": lw["ttft"][0]["num_cached_tokens"],
                    "layerwise_tokens_identical": lw["results"][0]["tokens"] == cold["results"][0]["tokens"],
                }
            reps.append(entry)
    import vllm

    hit_cached = min(r["hit_cached_tokens"] for r in reps)
    hit_ttft = statistics.median(r["hit_ttft_s"] for r in reps)
    cold_ttft = statistics.median(r["cold_ttft_s"] for r in reps)
    result = {
        "benchmark": "vllm_e2e",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "vllm": vllm.__version__,
        "model": "tiny random Llama (2 layers, 2 KV heads x 32, fp32), block_size 32, CPU backend",
        "prompt_tokens": n,
        "shared_prefix_tokens": shared_n,
        "chunk_size": args.chunk_size,
        "tier": "L1 + POSIX (file://, raw codec); decode in a new process (uni executor)",
        "hit": {
            "num_cached_tokens": hit_cached,
            "computed_prompt_tokens": n - hit_cached,
            "computed_fraction": round((n - hit_cached) / n, 4),
            "ttft_s_median": round(hit_ttft, 4),
        },
        "cold": {
            "num_cached_tokens": max(r["cold_cached_tokens"] for r in reps),
            "computed_prompt_tokens": n - max(r["cold_cached_tokens"] for r in reps),
            "computed_fraction": 1.0,
            "ttft_s_median": round(cold_ttft, 4),
        },
        "ttft_ratio_hit_over_cold": round(hit_ttft / cold_ttft, 4),
        "goal_computed_fraction_max": 0.12,
        "goal_met": (n - hit_cached) / n <= 0.12,
        "greedy_tokens_identical": all(r["tokens_identical"] for r in reps),
        "repetitions": reps,
    }
    if args.layerwise:
        lw_ttft = statistics.median(r["layerwise_ttft_s"] for r in reps)
        result["model"] = f"random Llama ({args.layers} layers), block_size 32, CPU backend"
        result["layerwise"] = {
            "num_cached_tokens": min(r["layerwise_cached_tokens"] for r in reps),
            "ttft_s_median": round(lw_ttft, 4),
            "ttft_ratio_layerwise_over_whole": round(lw_ttft / hit_ttft, 4),
            "ttft_ratio_layerwise_over_cold": round(lw_ttft / cold_ttft, 4),
            "greedy_tokens_identical": all(r["layerwise_tokens_identical"] for r in reps),
        }
    print_json(result, args.out)


if __name__ == "__main__":
    main()
