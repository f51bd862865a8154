"""tiercache demo: prefill and decode processes share KV via L2, restore it bit-exact, survive corruption."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=180,
        check=False,
    )


def check_rows(rows: list[dict[str, Any]]) -> None:
    """What holds for every request whatever the tiers are: restored KV verified, hits add up."""
    for r in rows:
        assert r["verified"], r
        assert r["l1_hit"] + r["l2_hit"] == r["hit"] <= r["tokens"]
        assert r["written"] <= r["read"]


# The default demo, worked out by hand (chunks of 256, a shared 1000-token system prompt = 3 whole chunks):
# name: (tokens, local, hit, l1_hit, l2_hit, read, written, skip, compute)
DEFAULT_DEMO = {
    "chat-a": (1400, 0, 1400, 0, 1400, 1400, 1400, 0, 0),  # first decode: everything from L2
    "chat-b": (1600, 0, 1600, 768, 832, 1600, 1600, 0, 0),  # system chunks now in L1, its own from L2
    # holds 288 locally: chunk 0 not read, chunk 1 (256..511) read whole, its first 32 tokens skipped
    "chat-c+local": (1300, 288, 1300, 768, 532, 1300 - 256, 1300 - 288, 32, 0),
    "chat-a-again": (1400, 0, 1400, 1400, 0, 1400, 1400, 0, 0),  # all in L1 now
    "solo": (700, 0, 700, 0, 700, 700, 700, 0, 0),
    "chat-d-new": (1500, 0, 768, 768, 0, 768, 768, 0, 1500 - 768),  # never prefilled: the shared prefix hits
}


def test_demo_default_restores_every_request_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = run("tiercache", "demo", "--json", str(out), env={"TMPDIR": str(scratch)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    rows = result["requests"]
    assert result["ok"] is True
    check_rows(rows)
    fields = ("tokens", "local", "hit", "l1_hit", "l2_hit", "read", "written", "skip", "compute")
    assert {r["name"]: tuple(r[f] for f in fields) for r in rows} == DEFAULT_DEMO
    assert result["prefill"]["pid"] != result["decode"]["pid"] != os.getpid()
    # the prefill stores what no earlier request stored (a repeat: nothing); chat-d-new was never prefilled
    stored = {
        "chat-a": 1400,
        "chat-b": 1600 - 768,
        "chat-c+local": 1300 - 768,
        "chat-a-again": 0,
        "solo": 700,
    }
    assert {r["name"]: r["stored"] for r in rows} == {**stored, "chat-d-new": 0}
    totals = {k: sum(r[k] for r in rows) for k in ("read", "written", "skip", "local", "hit")}
    assert totals["read"] - totals["written"] == totals["skip"]
    # The table: header, one line per request, totals and the verdict.
    for title in ("request", "local hit", "L1 hit", "L2 hit", "read", "written", "verified"):
        assert title in proc.stdout
    for r in rows:
        assert r["name"] in proc.stdout
    total_line = next(line for line in proc.stdout.splitlines() if line.startswith("total"))
    assert str(totals["written"]) in total_line.split()
    assert "OK" in proc.stdout
    assert "Traceback" not in proc.stderr
    assert "tiercache_hits_total" in result["metrics"]
    assert not list(scratch.iterdir())  # the temp dir (and its POSIX tier) is gone


def test_demo_metrics_and_config_with_a_process_local_tier_first(tmp_path: Path) -> None:
    config = tmp_path / "mixed.toml"
    config.write_text(
        "chunk_size = 256\n[l1]\ncapacity = '256MiB'\n"
        "[[tiers]]\nname = 'mem'\nurl = 'memory://demo'\ncapacity = '1GiB'\n"
        f"[[tiers]]\nname = 'shared'\nurl = 'file://{tmp_path}/l2'\ncapacity = '1GiB'\n"
    )
    out = tmp_path / "out.json"
    proc = run("tiercache", "demo", "--config", str(config), "--metrics", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["requests"]
    check_rows(rows)
    assert 'tiercache_hits_total{tier="shared"}' in proc.stdout  # decode's L2 hits came from the shared tier
    assert "# TYPE tiercache_frames_rejected_total counter" in proc.stdout
    assert list((tmp_path / "l2").rglob("tc1.*"))  # the configured tier, not a temp dir, held the objects


def test_demo_refuses_a_config_without_a_shared_tier(tmp_path: Path) -> None:
    config = tmp_path / "memory.toml"
    config.write_text("chunk_size = 256\n[[tiers]]\nname = 'mem'\nurl = 'memory://x'\ncapacity = '1GiB'\n")
    proc = run("tiercache", "demo", "--config", str(config))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "shared" in lines[0]
    assert "mem" in lines[0]
    assert "Traceback" not in proc.stderr


def test_demo_with_a_bad_config_is_one_line_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "typo.toml"
    config.write_text("chunk_sise = 256\n")
    proc = run("tiercache", "demo", "--config", str(config))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "chunk_sise" in proc.stderr


def test_a_corrupted_l2_object_is_a_miss_never_wrong_kv(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    pre = run(
        "tiercache.cli.demo", "prefill", "--workdir", str(work), "--out", str(tmp_path / "prefill.json")
    )
    assert pre.returncode == 0, pre.stderr
    objects = sorted(p for p in (work / "l2").rglob("tc1.*") if p.is_file())
    assert objects
    victim = objects[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01  # one bit of the payload
    victim.write_bytes(bytes(data))
    dec = run("tiercache.cli.demo", "decode", "--workdir", str(work), "--out", str(tmp_path / "decode.json"))
    assert dec.returncode == 0, dec.stderr
    result = json.loads((tmp_path / "decode.json").read_text())
    rows = result["requests"]
    check_rows(rows)  # every request verified: the bad chunk and what follows it are recomputed
    assert result["frames_rejected"] >= 1
    assert 'tiercache_frames_rejected_total{tier="disk"}' in result["metrics"]
    assert sum(r["fallback"] for r in rows) > 0  # looked up as a hit, served as a miss


def test_expected_kv_is_deterministic_prefix_dependent_and_never_zero() -> None:
    torch = pytest.importorskip("torch")
    from tiercache.cli.demo import demo_layout, demo_requests, expected_kv

    layout = demo_layout()
    tokens = demo_requests()[0].tokens[:300]
    kv = expected_kv(tokens, layout)
    assert kv.shape == (2, layout.num_layers, 300, layout.num_kv_heads * layout.head_dim)
    assert kv.dtype == torch.bfloat16
    assert torch.equal(kv, expected_kv(tokens, layout))
    assert bool((kv != 0).any(dim=-1).all())
    other = expected_kv((tokens[0] + 1, *tokens[1:]), layout)
    assert not torch.equal(kv[:, :, 1:], other[:, :, 1:])  # a different first token changes every later KV


def test_cli_import_stays_light() -> None:
    proc = run("tiercache", "--help")
    assert proc.returncode == 0
    assert "demo" in proc.stdout
    probe = subprocess.run(
        [
            sys.executable,
            "-P",
            "-c",
            "import sys, tiercache.cli; print('torch' in sys.modules, 'tiercache.cli.demo' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.split() == ["False", "False"]


@pytest.mark.slow
def test_demo_through_an_encrypted_compressed_tier(tmp_path: Path) -> None:
    """Both processes open the tier with the same key; frames on disk are sealed, KV still bit-exact."""
    out = tmp_path / "out.json"
    env = {"TIERCACHE_KEY": "ab" * 32, "TIERCACHE_DIR": str(tmp_path)}
    proc = run("tiercache", "demo", "--config", str(EXAMPLES / "encrypted.toml"), "--json", str(out), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    check_rows(result["requests"])
    assert any(r["l2_hit"] > 0 for r in result["requests"])
    frames = list((tmp_path / "l2").rglob("tc1.*"))
    assert frames
    from tiercache.serde import read_header

    header = read_header(frames[0].read_bytes())
    assert header.chain == ("raw", "shuffle", "zstd", "aesgcm")
    # A decode process with another key finds the objects but cannot open them: misses, never wrong KV.
    work = tmp_path / "work"
    work.mkdir()
    config = ["--config", str(EXAMPLES / "encrypted.toml")]
    step_env = {**env, "TIERCACHE_DIR": str(tmp_path / "second")}
    pre = run(
        "tiercache.cli.demo",
        "prefill",
        "--workdir",
        str(work),
        *config,
        "--out",
        str(tmp_path / "p.json"),
        env=step_env,
    )
    assert pre.returncode == 0, pre.stderr
    dec = run(
        "tiercache.cli.demo",
        "decode",
        "--workdir",
        str(work),
        *config,
        "--out",
        str(tmp_path / "d.json"),
        env={**step_env, "TIERCACHE_KEY": "cd" * 32},
    )
    assert dec.returncode == 0, dec.stderr
    decoded = json.loads((tmp_path / "d.json").read_text())
    check_rows(decoded["requests"])  # verified: nothing wrong was served
    assert all(r["l2_hit"] == 0 or r["fallback"] for r in decoded["requests"])
    assert decoded["frames_rejected"] >= 1
