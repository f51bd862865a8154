"""A 20-second soak (faults every 3 s; ``tiercache.testing.harness.soak``): nothing wrong, nothing left."""

from __future__ import annotations

import pathlib
import statistics
from types import ModuleType

import pytest

FD_SLACK = 2

pytestmark = pytest.mark.asyncio


def _load() -> ModuleType:
    from tiercache.testing.harness import soak

    return soak


@pytest.mark.slow
async def test_short_soak_serves_nothing_wrong_and_leaks_nothing(
    redis_binary: str, tmp_path: pathlib.Path
) -> None:
    soak = _load()
    cfg = soak.SoakConfig(duration_s=20.0, warmup_frac=0.25, sample_every_s=0.5, fault_every_s=3.0,
                          fault_len_s=1.0, prompts=24)  # fmt: skip
    result = await soak.run_soak(cfg, tmp_path)
    end = result["end"]
    assert result["verdict"]["wrong_tokens"] == 0
    assert end["leases"] == 0
    assert end["queue_depth"] == 0
    # every fault kind ran and the Redis faults show in the metrics
    assert min(result["faults"].values()) >= 1
    assert end["tier_errors"] >= 1
    # restored from Redis and from the POSIX tier despite the faults
    assert end["loaded_redis"] >= 1
    assert end["loaded_disk"] >= 1
    # fds do not grow: a fault window moves the count by a few fds either way (Redis reconnects) and a
    # connection pool may add a connection or two to meet the load (bounded), so the last quarter's median and
    # the drained end are held to the first quarter's peak (after warm-up) plus FD_SLACK; a fd leaked per
    # fault (5 faults here) or per operation (hundreds) lifts them above it
    after = [s["fds"] for s in result["samples"] if s["t_s"] >= cfg.warmup_frac * cfg.duration_s]
    quarter = max(1, len(after) // 4)
    bound = max(after[:quarter]) + FD_SLACK
    assert statistics.median(after[-quarter:]) <= bound, after
    assert end["fds"] <= bound, (end["fds"], after)
