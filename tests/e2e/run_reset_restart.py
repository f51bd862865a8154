"""One in-process vLLM with the connector on a tiercache config; stores prompts, or resets and looks up.

Usage: ``python run_reset_restart.py SPEC_JSON OUT_JSON``. SPEC keys: ``model``, ``config`` (tiercache TOML),
``prompts`` (``{"A": [...], "B": [...]}``), ``mode``: ``"store"`` runs every prompt and waits for its saves;
``"reset"`` runs B (``hit_b``: the external hit tokens), then ``reset_prefix_cache(reset_connector=True)``
(``answer``), then A (``hit_a``).
"""

from __future__ import annotations

from typing import Any


def main() -> None:
    from tiny_llm import child_done, child_spec, tiny_llm

    spec = child_spec()
    from tiercache_vllm.connector import drain_all, snapshot
    from vllm import SamplingParams

    llm = tiny_llm(spec["model"], {"config": spec["config"]})
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def hit_tokens() -> int:
        return sum(int(s["hit_tokens"]) for s in snapshot()["scheduler"])

    def run(name: str) -> int:
        before = hit_tokens()
        llm.generate([{"prompt_token_ids": spec["prompts"][name]}], sp, use_tqdm=False)  # type: ignore[list-item]
        drain_all()
        for _ in range(2):  # steps without requests: finished saves free their blocks
            llm.llm_engine.step()
        return hit_tokens() - before

    out: dict[str, Any] = {}
    if spec["mode"] == "store":
        for name in spec["prompts"]:
            run(name)
    else:
        out["hit_b"] = run("B")
        out["answer"] = bool(llm.reset_prefix_cache(reset_connector=True))
        out["hit_a"] = run("A")
    child_done(out)


if __name__ == "__main__":
    main()
