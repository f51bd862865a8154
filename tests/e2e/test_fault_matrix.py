"""The short fault matrix on the real vLLM path (``make faults`` runs every backend x fault): a prefill
(``kv_producer``) and a decode (``kv_consumer``) vLLM process on one Redis tier; Redis down when they start,
killed while they run, objects corrupted -- 0 failed requests, decode's greedy tokens identical to the cold
run, the fault in the metrics, the tier used again after recovery; and the same pair on one ``tiercache
serve`` that owns the Redis tier, Redis killed and the server itself killed."""

from __future__ import annotations

import pathlib
import shutil
from types import ModuleType
from typing import Any

import pytest

E2E = pathlib.Path(__file__).resolve().parent


def _load() -> ModuleType:
    from tiercache.testing.harness import fault_matrix

    return fault_matrix


def _passed(result: dict[str, Any], faults: list[str]) -> dict[str, dict[str, Any]]:
    """The row's cells by fault, one per fault run; each passed with no failed request, and the tier (or the
    server in front of it) served loads again after recovery."""
    cells = {c["fault"]: c for c in result["cells"]}
    assert sorted(cells) == sorted(faults)
    for fault, cell in cells.items():
        assert cell["outcome"] == "pass", (fault, cell)
        assert cell["failed_requests"] == 0
        assert cell["loaded_after_recovery"] >= 1
    return cells


@pytest.mark.slow
def test_redis_down_at_start_kill_corrupt(tiny_model: pathlib.Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    matrix = _load()
    faults = ["down_at_start", "kill", "corrupt"]
    (result,) = matrix.run_matrix(["redis"], faults, tiny_model, timeout_s=600, e2e=E2E)
    assert result["processes"] == "kv_producer + kv_consumer"
    cells = _passed(result, faults)
    assert cells["down_at_start"]["tier_down_gauge"] == 1.0
    assert cells["kill"]["fault_metrics"]["tiercache_tier_errors_total"] >= 1
    assert cells["corrupt"]["fault_metrics"]["tiercache_frames_rejected_total"] >= 1
    assert cells["kill"]["faulted_s"] <= cells["kill"]["bound_s"]


def test_redis_behind_tiercache_serve_kill_and_server_kill(tiny_model: pathlib.Path) -> None:
    """Server mode: prefill and decode both on one ``tiercache serve`` that owns the Redis tier. Redis
    killed: the server's tier metrics show it; the server SIGKILLed: cache-off (cold-identical tokens, the
    clients' offline counters move), and after a restart on the same socket decode loads from Redis again."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    matrix = _load()
    faults = ["kill", "server_kill"]
    (result,) = matrix.run_matrix(["redis+server"], faults, tiny_model, timeout_s=900, e2e=E2E)
    assert result["processes"] == "kv_producer + kv_consumer, both on one tiercache serve"
    cells = _passed(result, faults)
    assert cells["kill"]["fault_metrics"]["tiercache_tier_errors_total"] >= 1  # the server's /metrics
    assert cells["server_kill"]["fault_metrics"]["server_offline_misses"] >= 1  # decode ran cache-off


def test_update_replaces_only_the_cells_it_ran() -> None:
    """``--update`` with some faults keeps the row's other cells (in FAULTS order) and unrun rows."""
    matrix = _load()
    old = {"backend": "redis", "vllm_start_s": 9.0, "cells": [{"fault": "kill", "outcome": "pass"}]}
    old["cells"].append({"fault": "slow", "outcome": "n/a"})
    new = {"backend": "redis", "vllm_start_s": 8.0, "cells": [{"fault": "slow", "outcome": "pass"}]}
    merged = matrix._merge_row(old, new)
    assert merged["cells"] == [{"fault": "kill", "outcome": "pass"}, {"fault": "slow", "outcome": "pass"}]
    assert merged["vllm_start_s"] == 8.0
    assert matrix._merge_row(old, None) is old


def test_every_backend_has_an_action_or_a_reason_per_fault() -> None:
    """The (backend, fault) table covers the whole matrix; a cell without an action says why in words."""
    matrix = _load()
    for backend in matrix.BACKENDS:
        row = matrix.ACTIONS[backend]
        assert tuple(row) == matrix.FAULTS, backend
        for fault, action in row.items():
            assert callable(action) or len(action) > 20, (backend, fault, action)
