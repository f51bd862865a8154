"""Build a tiny random-weight Llama and a locally trained byte-level BPE tokenizer (no downloads).

Usage: ``python tests/e2e/make_tiny.py OUT_DIR``. About 386k parameters (2 layers, 2 KV heads of 32), fp32;
norm weights are 1 and the rest N(0, 0.12) so greedy output is varied (a wrong KV load changes tokens).
"""

from __future__ import annotations

import sys
from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "tiered kv cache storage for large language model inference",
    "hello world this is a tiny test model for vllm connectors",
]


def build(out: str | Path, max_position_embeddings: int = 4096) -> Path:
    """Write the tokenizer and model to ``out`` (idempotent: reuses a complete directory)."""
    out = Path(out)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0, 0.12)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else "tiny"))
