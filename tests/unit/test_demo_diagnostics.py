"""tiercache demo's verdict names the check that failed and the first token where it fails.

The demo's prefill and decode steps run here in one process (each with its own engine and L1, so decode
reads the file tier), with the decode's restores damaged on purpose: a wrong token inside one request's
restored KV (``bytes``), a token written past another's restored end (``blocks past the restored end``), a
wrong ret_mask entry (``ret_mask``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercache.cli import demo
from tiercache.gpu import Move, reference
from tiercache.gpu.layouts import object_spec
from tiercache.store.engine import PreparedRetrieve, RetrieveResult

BAD_TOKEN = 513  # chat-a, chunk 2 (tokens 512..767), restored from L2
PAST_END = (
    1000  # chat-d-new holds 1500 tokens, 768 restored (the shared prefix): 1000 is computed, not restored
)
BAD_MASK = 5  # solo: 700 tokens restored


def _overwrite(layout: Any, kv_caches: Any, slot_mapping: torch.Tensor, token: int) -> None:
    """Write a KV token of ones at ``slot_mapping[token]`` (what a stray copy would do)."""
    ones = torch.ones(object_spec(layout, 1).shape, dtype=torch.bfloat16)
    reference.scatter(kv_caches, Move.scatter(layout, slot_mapping[token : token + 1], [(0, 1)], [ones]))


def test_a_failed_restore_names_its_check_and_first_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = demo.demo_config(tmp_path)
    asyncio.run(demo.prefill(config))

    scatter, finish = PreparedRetrieve.scatter, PreparedRetrieve.finish
    damaged: list[int] = []

    def damaged_scatter(self: PreparedRetrieve, kv_caches: Any, slot_mapping: torch.Tensor) -> None:
        scatter(self, kv_caches, slot_mapping)
        if self.num_tokens == 1400 and not damaged:  # the first chat-a only
            damaged.append(BAD_TOKEN)
            _overwrite(self.engine.layout, kv_caches, slot_mapping, BAD_TOKEN)
        if self.num_tokens == 1500:
            _overwrite(self.engine.layout, kv_caches, slot_mapping, PAST_END)

    def damaged_finish(self: PreparedRetrieve) -> RetrieveResult:
        result = finish(self)
        if self.num_tokens == 700:
            result.ret_mask[BAD_MASK] = False
        return result

    monkeypatch.setattr(PreparedRetrieve, "scatter", damaged_scatter)
    monkeypatch.setattr(PreparedRetrieve, "finish", damaged_finish)
    rows = {r["name"]: r for r in asyncio.run(demo.decode(config))["requests"]}

    assert {name for name, r in rows.items() if not r["verified"]} == {"chat-a", "chat-d-new", "solo"}
    assert rows["chat-a-again"]["verified"]  # the same chunks from L1: only the paged copy was damaged
    bad = rows["chat-a"]["failed_checks"]
    assert list(bad) == [demo.CHECK_BYTES]
    assert bad[demo.CHECK_BYTES].startswith(f"bytes: token {BAD_TOKEN} differs from the prefill's (")
    assert "chunk 2 served by disk" in bad[demo.CHECK_BYTES]
    assert "1 of 1400 tokens differ" in bad[demo.CHECK_BYTES]
    past = rows["chat-d-new"]["failed_checks"]
    assert list(past) == [demo.CHECK_PAST_END]
    assert f"token {PAST_END} was written though the restore ended at 768" in past[demo.CHECK_PAST_END]
    mask = rows["solo"]["failed_checks"]
    assert list(mask) == [demo.CHECK_MASK]
    assert (
        f"ret_mask: token {BAD_MASK} is False, expected True exactly for tokens 0..699"
        in mask[demo.CHECK_MASK]
    )

    lines = demo.verdict_lines(list(rows.values()))
    assert lines[0] == (
        "FAILED (blocks past the restored end, bytes, ret_mask): restored KV differs from the prefill's"
    )
    assert f"  chat-a: {bad[demo.CHECK_BYTES]}" in lines
    assert len(lines) == 4
    # counts are those of a passing run: only the checks tell
    assert (rows["chat-a"]["hit"], rows["chat-a"]["read"], rows["chat-a"]["written"]) == (1400, 1400, 1400)


def test_a_passing_run_is_one_ok_line() -> None:
    assert demo.verdict_lines([{"name": "x", "verified": True, "failed_checks": {}}]) == [
        "OK: every restored token is bit-exact"
    ]
