"""Cache engine: store/lookup/retrieve through L1 and a POSIX tier, skips, layouts, layerwise, masks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache.adapters.posix import PosixAdapter
from tiercache.config import Config, L1Config, ManagerConfig, config_from_dict
from tiercache.gpu.layouts import LayoutKind, PagedLayout, object_spec
from tiercache.gpu.move import Move
from tiercache.gpu.reference import gather, scatter
from tiercache.keys import InputSpan, KeySpace, RequestIdentity
from tiercache.serde import build_pipeline
from tiercache.store.engine import CacheEngine
from tiercache.store.l1 import L1Cache
from tiercache.store.manager import StorageManager

pytestmark = pytest.mark.asyncio

CHUNK = 256
POLICY = ManagerConfig(l2_deadline_s=5.0, lookup_deadline_s=2.0)


def layout_of(kind: LayoutKind = LayoutKind.VLLM_FLASH, block: int = 16) -> PagedLayout:
    return PagedLayout(kind, num_layers=3, num_kv_heads=2, head_dim=8, block_size=block, dtype="bfloat16")


def keyspace_of(layout: PagedLayout) -> KeySpace:
    return CacheEngine.keyspace_for(config_from_dict({}), layout, model="test/model")


class Engine:
    """One engine's paged KV (poisoned), a random block table and its slot mapping."""

    def __init__(self, layout: PagedLayout, num_blocks: int, seed: int) -> None:
        self.layout = layout
        gen = torch.Generator().manual_seed(seed)
        shape = layout.layer_shape(num_blocks)
        self.kv = [torch.full(shape, float("nan"), dtype=torch.bfloat16) for _ in range(layout.num_layers)]
        self.blocks = torch.randperm(num_blocks, generator=gen)

    @classmethod
    def holding(cls, layout: PagedLayout, num_tokens: int, seed: int, num_blocks: int = 64) -> Engine:
        """An engine whose first ``num_tokens`` tokens hold ``expected_kv`` (a prefill that computed them)."""
        engine = cls(layout, num_blocks, seed)
        engine.write(expected_kv(layout, num_tokens), 0, num_tokens)
        return engine

    def slots(self, num_tokens: int) -> torch.Tensor:
        bs = self.layout.block_size
        positions = torch.arange(num_tokens)
        return self.blocks[positions // bs] * bs + positions % bs

    def write(self, kv_2ltd: torch.Tensor, start: int, end: int) -> None:
        """Put the expected KV of tokens [start, end) into the paged cache (like a forward pass would)."""
        obj = kv_2ltd[:, :, start:end].contiguous()
        scatter(self.kv, Move.scatter(self.layout, self.slots(end), [(start, end)], [obj]))

    def read(self, start: int, end: int) -> torch.Tensor:
        out = torch.empty(object_spec(self.layout, end - start).shape, dtype=torch.bfloat16)
        gather(self.kv, Move.gather(self.layout, self.slots(end), [(start, end)], [out]))
        return out


def expected_kv(layout: PagedLayout, num_tokens: int, seed: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    spec = object_spec(layout, num_tokens)
    return torch.randn(spec.shape, generator=gen).to(torch.bfloat16) + 1.0


async def open_engine(
    layout: PagedLayout, l2_dir: Path | None, *, layerwise: bool = False, slots: int = 64
) -> CacheEngine:
    slot_bytes = CacheEngine.slot_bytes(layout, CHUNK, layerwise)
    tiers = []
    if l2_dir is not None:
        tiers.append(("disk", await PosixAdapter.open(f"file://{l2_dir}"), build_pipeline(["raw"])))
    manager = StorageManager(L1Cache(slot_bytes * slots, slot_bytes), tiers, POLICY)
    return CacheEngine(manager, layout, keyspace_of(layout), chunk_size=CHUNK, layerwise=layerwise)


async def prefill_seed_example(
    layout: PagedLayout, l2_dir: Path, layerwise: bool
) -> tuple[list[int], torch.Tensor]:
    """Seed §5's prefill: 600 tokens (chunks 0, 1 and a tail of 88) whose first 512 are stored to L2."""
    tokens = list(range(1000, 1600))
    _, kv, stored = await prefill_to_disk(layout, l2_dir, tokens, 512, seed=1, layerwise=layerwise)
    assert stored == 512
    return tokens, kv


async def prefill_to_disk(
    layout: PagedLayout, l2_dir: Path, tokens: list[int], stored: int, *, seed: int, layerwise: bool = False
) -> tuple[Engine, torch.Tensor, int]:
    """A prefill engine (``seed``) holding ``tokens``' expected KV stores the first ``stored`` tokens to the
    file tier at ``l2_dir`` through an engine it then closes: the prefill, the KV and what store returned."""
    kv = expected_kv(layout, len(tokens))
    prefill = Engine(layout, num_blocks=64, seed=seed)
    prefill.write(kv, 0, len(tokens))
    engine = await open_engine(layout, l2_dir, layerwise=layerwise)
    try:
        count = await engine.store(tokens[:stored], prefill.kv, prefill.slots(stored))
        await engine.drain()
    finally:
        await engine.aclose()
    return prefill, kv, count


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("layerwise", [False, True])
async def test_seed_example_local_288_hit_512(tmp_path: Path, layerwise: bool) -> None:
    """Decode holds 288 tokens; the hit ends at 512: chunk 0 skipped, chunk 1 read whole, 224 written."""
    layout = layout_of()
    tokens, kv = await prefill_seed_example(layout, tmp_path, layerwise)

    decode = Engine(layout, num_blocks=64, seed=2)
    decode.write(kv, 0, 288)  # the local prefix cache hit
    engine = await open_engine(layout, tmp_path, layerwise=layerwise)
    try:
        hit = await engine.lookup_hit(tokens)
        assert hit.tokens == 512
        assert hit.chunks == 2
        result = await engine.retrieve_result(tokens, decode.kv, decode.slots(len(tokens)), skip_tokens=288)
        assert result.tokens_read == 256
        assert result.tokens_written == 224
        assert result.skip_prefix == 32
        assert result.ret_mask[288:512].all()
        assert not result.ret_mask[:288].any()
        assert not result.ret_mask[512:].any()
        assert same_bits(decode.read(0, 512), kv[:, :, :512])
        assert decode.read(512, 600).isnan().all()  # nothing beyond the hit was written
        assert engine.manager.metrics.value("tiercache_hits_total", tier="disk") >= 2
    finally:
        await engine.aclose()


async def test_round_trip_legacy_layout_to_flash_layout_through_posix(tmp_path: Path) -> None:
    legacy, flash = layout_of(LayoutKind.VLLM_LEGACY), layout_of(LayoutKind.VLLM_FLASH)
    assert keyspace_of(legacy).digest == keyspace_of(flash).digest  # same objects, so the same keys
    tokens = list(range(700))
    _, kv, _ = await prefill_to_disk(legacy, tmp_path, tokens, 700, seed=3)

    dst = Engine(flash, 64, seed=4)
    engine = await open_engine(flash, tmp_path)
    try:
        ret = await engine.retrieve(tokens, dst.kv, dst.slots(700))
        assert ret.all()
        assert same_bits(dst.read(0, 700), kv)
    finally:
        await engine.aclose()


async def test_cpu_blocks_layout_has_its_own_keyspace_and_round_trips(tmp_path: Path) -> None:
    cpu = layout_of(LayoutKind.CPU_BLOCKS, block=32)
    assert keyspace_of(cpu).digest != keyspace_of(layout_of(block=32)).digest
    tokens = list(range(5, 517))
    src, _, _ = await prefill_to_disk(cpu, tmp_path, tokens, 512, seed=5)
    dst = Engine(cpu, 64, seed=6)
    dst.write(src.read(0, 64), 0, 64)  # the local hit: the same two pages the prefill computed
    engine = await open_engine(cpu, tmp_path)
    try:
        result = await engine.retrieve_result(tokens, dst.kv, dst.slots(512), skip_tokens=64)
        assert result.tokens_written == 448
        assert same_bits(dst.read(0, 512), src.read(0, 512))  # page bytes equal, whatever is inside
        with pytest.raises(ValueError, match="block_size"):
            await engine.retrieve_result(tokens, dst.kv, dst.slots(512), skip_tokens=70)
    finally:
        await engine.aclose()


async def test_layerwise_chunk_counts_only_when_every_layer_is_present(tmp_path: Path) -> None:
    layout = layout_of()
    tokens = list(range(768))
    src = Engine.holding(layout, 768, seed=8)
    engine = await open_engine(layout, None, layerwise=True)
    try:
        await engine.store(tokens, src.kv, src.slots(768))
        assert await engine.lookup(tokens) == 768
        spans = engine.token_db.process_tokens(tokens)
        assert engine.manager.l1.delete(str(spans[1].key.with_layer(2)))  # one layer of chunk 1 is gone
        hit = await engine.lookup_hit(tokens)
        assert hit.tokens == 256
        assert hit.chunks == 1
    finally:
        await engine.aclose()


async def test_layerwise_generators_store_one_layer_per_step() -> None:
    layout = layout_of()
    tokens = list(range(300))
    src = Engine(layout, 64, seed=9)
    kv = expected_kv(layout, 300)
    src.write(kv, 0, 300)
    engine = await open_engine(layout, None, layerwise=True)
    try:
        seen = []
        async for layer in engine.store_layers(tokens, src.kv, src.slots(300)):
            seen.append(layer)
            assert await engine.lookup(tokens) == 0 if layer < 2 else 300
        assert seen == [0, 1, 2]
        dst = Engine(layout, 64, seed=10)
        assert (await engine.retrieve(tokens, dst.kv, dst.slots(300))).all()
        assert same_bits(dst.read(0, 300), kv)
    finally:
        await engine.aclose()


async def test_store_skips_cached_chunks_and_respects_the_mask() -> None:
    layout = layout_of()
    tokens = list(range(800))
    src = Engine.holding(layout, 800, seed=11)
    engine = await open_engine(layout, None)
    try:
        mask = torch.tensor([False] * 256 + [True] * 544)
        assert await engine.store(tokens, src.kv, src.slots(800), mask) == 544
        assert await engine.lookup(tokens) == 0  # chunk 0 was masked out: no prefix
        assert await engine.store(tokens, src.kv, src.slots(800)) == 256  # only chunk 0 is new
        assert await engine.lookup(tokens) == 800
        with pytest.raises(ValueError, match="multiple of the chunk size"):
            await engine.store(tokens, src.kv, src.slots(800), torch.tensor([False] * 10 + [True] * 790))
    finally:
        await engine.aclose()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_tokens=st.integers(1, 900), local=st.integers(0, 900), stored_chunks=st.integers(0, 4))
async def test_retrieve_arithmetic(num_tokens: int, local: int, stored_chunks: int) -> None:
    """Property: written = hit_end - local (or 0); the ret_mask covers exactly [local, hit_end)."""
    layout = layout_of()
    local = min(local, num_tokens)
    tokens = list(range(num_tokens))
    kv = expected_kv(layout, num_tokens)
    src = Engine(layout, 64, seed=12)
    src.write(kv, 0, num_tokens)
    engine = await open_engine(layout, None)
    try:
        stored_end = min(num_tokens, stored_chunks * CHUNK)
        if stored_end:
            await engine.store(tokens[:stored_end], src.kv, src.slots(stored_end))
        hit_end = stored_end if stored_end == num_tokens or stored_end % CHUNK == 0 else 0
        dst = Engine(layout, 64, seed=13)
        if local:
            dst.write(kv, 0, local)
        result = await engine.retrieve_result(tokens, dst.kv, dst.slots(num_tokens), skip_tokens=local)
        assert result.tokens_written == max(0, hit_end - local)
        assert int(result.ret_mask.sum()) == max(0, hit_end - local)
        if hit_end > local:
            assert result.ret_mask[local:hit_end].all()
            assert same_bits(dst.read(0, hit_end), kv[:, :, :hit_end])
    finally:
        await engine.aclose()


async def test_expired_lease_during_retrieve_is_not_served(tmp_path: Path) -> None:
    """If a lease lapses (slot possibly reused) the tokens it covered are reported as not retrieved."""
    layout = layout_of()
    tokens = list(range(512))
    src = Engine.holding(layout, 512, seed=14)
    engine = await open_engine(layout, None)
    try:
        await engine.store(tokens, src.kv, src.slots(512))
        original = engine.manager.l1.batched_acquire

        def short_leases(keys, lease_s=None):  # type: ignore[no-untyped-def]
            leases = original(keys, lease_s)
            for lease in leases:
                if lease is not None:
                    lease.release()  # behaves like a lease that expired mid-copy
            return leases

        engine.manager.l1.batched_acquire = short_leases  # type: ignore[method-assign]
        dst = Engine(layout, 64, seed=15)
        result = await engine.retrieve_result(tokens, dst.kv, dst.slots(512))
        assert not result.ret_mask.any()
        assert result.tokens_written == 0
    finally:
        await engine.aclose()


@pytest.mark.parametrize("layerwise", [False, True])
async def test_layer_by_layer_retrieve_writes_one_layer_per_step(layerwise: bool) -> None:
    layout = layout_of()
    tokens = list(range(600))
    kv = expected_kv(layout, 600)
    src = Engine(layout, 64, seed=16)
    src.write(kv, 0, 600)
    engine = await open_engine(layout, None, layerwise=layerwise)
    try:
        await engine.store(tokens, src.kv, src.slots(600))
        dst = Engine(layout, 64, seed=17)
        dst.write(kv, 0, 100)
        prepared = await engine.prepare_retrieve(tokens, skip_tokens=100)
        assert prepared.tokens_to_write == 500
        assert engine.manager.l1.stats().leased > 0
        for layer in range(layout.num_layers):
            prepared.scatter_layer(layer, dst.kv, dst.slots(600))
            got = dst.read(0, 600)
            assert same_bits(got[:, : layer + 1], kv[:, : layer + 1])  # layers so far: restored
            assert got[:, layer + 1 :, 100:].isnan().all()  # later layers: untouched yet
        result = prepared.finish()
        assert prepared.finish() is result  # idempotent
        assert result.tokens_written == 500
        assert result.ret_mask[100:].all()
        assert not result.ret_mask[:100].any()
        assert engine.manager.l1.stats().leased == 0  # every lease released
    finally:
        await engine.aclose()


async def test_prepare_retrieve_with_nothing_cached_is_empty() -> None:
    layout = layout_of()
    engine = await open_engine(layout, None)
    try:
        prepared = await engine.prepare_retrieve(list(range(300)))
        dst = Engine(layout, 64, seed=18)
        prepared.scatter(dst.kv, dst.slots(300))
        result = prepared.finish()
        assert result.tokens_written == 0
        assert not result.ret_mask.any()
        assert dst.read(0, 300).isnan().all()
    finally:
        await engine.aclose()


# ----- request identity (salt, LoRA, input spans) -----------------------------------------------------
TENANT_A = RequestIdentity(cache_salt="tenant-a")
OTHERS = [
    None,
    RequestIdentity(cache_salt="tenant-b"),
    RequestIdentity(cache_salt="tenant-a", lora_name="adapter-b", lora_path="/a/b"),
    RequestIdentity(cache_salt="tenant-a", inputs=(InputSpan("mm", "image-2", 300, 400),)),
]


@pytest.mark.parametrize("layerwise", [False, True])
async def test_a_prompt_stored_for_one_identity_serves_only_that_identity(
    tmp_path: Path, layerwise: bool
) -> None:
    layout = layout_of()
    tokens = list(range(2000, 2600))
    kv = expected_kv(layout, len(tokens))
    prefill = Engine(layout, num_blocks=64, seed=1)
    prefill.write(kv, 0, len(tokens))
    engine = await open_engine(layout, tmp_path, layerwise=layerwise)
    try:
        assert await engine.store(tokens, prefill.kv, prefill.slots(600), identity=TENANT_A) == 600
        assert await engine.lookup(tokens, identity=TENANT_A) == 600
        assert await engine.lookup(tokens, identity=RequestIdentity(cache_salt="tenant-a")) == 600
        # the image covers tokens 300..400 (chunk 1): chunk 0 is shared, nothing from chunk 1 on
        expected = [0, 0, 0, CHUNK]
        assert [await engine.lookup(tokens, identity=other) for other in OTHERS] == expected
        decode = Engine(layout, num_blocks=64, seed=2)
        result = await engine.retrieve_result(tokens, decode.kv, decode.slots(600), identity=OTHERS[1])
        assert result.tokens_written == 0
        assert decode.read(0, 600).isnan().all()
        result = await engine.retrieve_result(tokens, decode.kv, decode.slots(600), identity=TENANT_A)
        assert result.tokens_written == 600
        assert same_bits(decode.read(0, 600), kv)
    finally:
        await engine.aclose()


async def test_masked_store_under_an_identity_extends_the_same_chain(tmp_path: Path) -> None:
    layout = layout_of()
    tokens = list(range(3000, 3512))
    kv = expected_kv(layout, 512)
    src = Engine(layout, num_blocks=64, seed=3)
    src.write(kv, 0, 512)
    lora = RequestIdentity(lora_name="sql", lora_path="/adapters/sql")
    engine = await open_engine(layout, tmp_path)
    try:
        await engine.store(tokens[:256], src.kv, src.slots(256), identity=lora)
        mask = [False] * 256 + [True] * 256
        assert await engine.store(tokens, src.kv, src.slots(512), mask, identity=lora) == 256
        assert await engine.lookup(tokens, identity=lora) == 512
        assert await engine.lookup(tokens) == 0
    finally:
        await engine.aclose()


async def test_process_salt_from_the_environment_still_isolates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = layout_of()
    config = Config(l1=L1Config(capacity=1 << 24, pinned=False), cache_salt_env="TC_TEST_SALT")
    monkeypatch.setenv("TC_TEST_SALT", "process-1")
    one = await CacheEngine.open(config, layout, model="m")
    monkeypatch.setenv("TC_TEST_SALT", "process-2")
    two = await CacheEngine.open(config, layout, model="m")
    try:
        tokens = list(range(CHUNK))
        ident = RequestIdentity(cache_salt="tenant-a")
        assert one.token_db.keys(tokens, identity=ident) != two.token_db.keys(tokens, identity=ident)
        assert one.keyspace.cache_salt == "process-1"
    finally:
        await one.aclose()
        await two.aclose()


@pytest.mark.parametrize("layerwise", [False, True])
async def test_retrieve_reuses_its_lookup_no_second_hash_no_second_l2_query(
    tmp_path: Path, layerwise: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seed example through ``prepare_retrieve(lookup=...)``: same bytes, no hashing, one L2 lookup."""
    layout = layout_of()
    tokens, kv = await prefill_seed_example(layout, tmp_path, layerwise)
    decode = Engine(layout, num_blocks=64, seed=2)
    decode.write(kv, 0, 288)
    engine = await open_engine(layout, tmp_path, layerwise=layerwise)
    try:
        hit = await engine.lookup_hit(tokens, prefetch=False)
        assert (hit.tokens, hit.tiers) == (512, ("disk", "disk"))
        adapter = engine.manager.tiers[0].adapter
        contains_calls = 0
        real_contains = adapter.batched_contains

        async def counting_contains(keys: list[str]) -> list[bool]:
            nonlocal contains_calls
            contains_calls += 1
            return await real_contains(keys)

        def no_hashing(*args: object, **kwargs: object) -> None:
            raise AssertionError("the tokens were hashed again")

        monkeypatch.setattr(adapter, "batched_contains", counting_contains)
        monkeypatch.setattr(engine.token_db, "process_tokens", no_hashing)
        monkeypatch.setattr(engine.token_db, "prefix_hashes", no_hashing)
        prepared = await engine.prepare_retrieve(tokens, skip_tokens=288, lookup=hit)
        assert contains_calls == 0
        assert prepared.tokens_to_write == 224
        prepared.scatter(decode.kv, decode.slots(600))
        result = prepared.finish()
        assert (result.tokens_read, result.tokens_written, result.skip_prefix) == (256, 224, 32)
        assert same_bits(decode.read(0, 512), kv[:, :, :512])
        assert decode.read(512, 600).isnan().all()
        with pytest.raises(ValueError, match="lookup was of 600 tokens"):
            await engine.prepare_retrieve(tokens[:300], lookup=hit)  # not at a chunk boundary
        with pytest.raises(ValueError, match="lookup was of 600 tokens"):
            await engine.prepare_retrieve([*tokens, 1], lookup=hit)  # longer than the lookup
        # a retrieve of a prefix ending at a chunk boundary (the connector's load) reuses the first keys
        shorter = await engine.prepare_retrieve(tokens[:256], lookup=hit)
        assert (shorter.tokens_to_write, contains_calls) == (256, 0)
        assert shorter.finish().tokens_read == 256
    finally:
        await engine.aclose()
