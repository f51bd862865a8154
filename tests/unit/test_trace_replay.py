"""The trace-replay benchmark on a small trace: every restore checked (0 wrong bytes), every tenant within its
budget in the quota runs, the scan refused by admission, the ceiling estimate near the exact one."""

from __future__ import annotations

from pathlib import Path

from tiercache.testing.harness.scripts import load_by_path

ROOT = Path(__file__).resolve().parents[2]


def test_small_trace(tmp_path: Path) -> None:
    small = ["--tenants", "2", "--conversations", "3", "--active", "3", "--turns", "4", "--slots", "60"]
    trace_replay = load_by_path(ROOT / "benchmarks" / "trace_replay.py", "trace_replay")
    result = trace_replay.main([*small, "--scan-chunks", "16", "--out", str(tmp_path)])
    assert (tmp_path / "trace_replay_cpu.json").is_file()
    assert result["wrong_bytes"] == 0
    assert result["tenants_over_budget"] == {}
    for trace in result["traces"].values():
        runs = trace["runs"]
        assert all(runs[n]["restores_checked"] > 0 for n in ("s3fifo", "lru_quotas", "lru_admit2"))
        assert all(r["restores_checked"] == r["conversation_hits"] + r["scan_hits"] for r in runs.values())
        for name in ("lru_quotas", "s3fifo_quotas"):
            run = runs[name]
            assert run["budgets"]
            assert all(run["max_held_bytes"].get(t, 0) <= b for t, b in run["budgets"].items())
        assert runs["lru_admit2"]["admission_refused"] > 0
        assert runs["lru"]["admission_refused"] == 0
        assert abs(runs["lru"]["hit_rate_ceiling"] - runs["lru"]["exact_ceiling"]) < 0.05
        assert runs["lru"]["conversation_lookups"] == runs["s3fifo"]["conversation_lookups"]
