"""Restores under stress (``tiercache.testing.harness.restore_stress``): no restored token is ever wrong.

The demo's path, prefill through L1 into a memory and a file tier, decode prefetching from the file tier into
its own L1, run round after round with delays in every adapter call and codec job, deadlines that expire
mid-load and mid-put, L1s small enough to evict while prefetches land, decodes that start before the stores
have drained, and busy threads. Hits may shrink; a restore may never hold a wrong byte, a wrong ret_mask or
a write past its end. A damaged decode (one byte flipped as a frame lands in L1) must be caught.
"""

from __future__ import annotations

import pathlib
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.asyncio


def _load() -> ModuleType:
    from tiercache.testing.harness import restore_stress

    return restore_stress


@pytest.mark.slow
async def test_no_restore_is_wrong_under_stress(tmp_path: pathlib.Path) -> None:
    result = await _load().run_stress(12, tmp_path, seed=7, busy=2)
    assert result["wrong"] == []
    # the stress reached what it is for: restores that landed, loads from L2, timeouts, delays
    assert result["restores"] >= 40
    assert result["tokens_written"] > 0
    assert result["prefetched"] > 0
    assert result["tier_errors"] > 0
    assert result["delays"] > 100


async def test_the_checks_catch_a_damaged_restore(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One byte of every frame decoded into L1 flipped: restores from L2 hold wrong KV, and the stress run
    reports them (round, request, check, first token)."""
    import tiercache.store.prefetch_controller as prefetch

    decode = prefetch.decode_into_l1

    def damaged(pipeline: Any, frame: Any, obj: Any, *args: Any) -> None:
        decode(pipeline, frame, obj, *args)
        buf = obj.buffer()
        buf[100] ^= 0x40

    monkeypatch.setattr(prefetch, "decode_into_l1", damaged)
    result = await _load().run_stress(3, tmp_path, seed=3, busy=0)
    assert result["wrong"], result
    first = result["wrong"][0]
    assert first["check"] == "bytes"
    assert {"round", "request", "token", "tier"} <= set(first)
