"""One in-process vLLM with the connector on a node server, writing its keyspace file; cache control by prompt
runs through the ``tiercache cache`` CLI in its own process (keys computed there from the keyspace file and
the prompt's token ids). Writes JSON with each phase's answers and each request's hit tokens per source.

Usage: ``python run_prompt_control.py SPEC_JSON OUT_JSON``. SPEC keys: ``model``, ``config`` (tiercache TOML),
``server`` (the node server's socket), ``keyspace_file``, ``prompts`` (name -> token ids).

Phases: store A and D; ``pin_a`` (the CLI pins A by prompt); a burst of B, C, E; ``a_after_burst`` and
``d_after_burst`` (A's and D's identical requests: their hit sources); a second burst of F and G;
``prefetch_b`` (the CLI prefetches B by prompt); ``b_after_prefetch``; ``delete_a`` (the CLI deletes A by
prompt: unpinned and gone from L1 and L2) and ``a_after_delete``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def main() -> None:
    from tiny_llm import child_done, child_spec, tiny_llm

    spec = child_spec()
    from loaded import ROOMY, drain_server
    from tiercache_vllm.connector import TierCacheConnector, drain_all
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sources: list[dict[str, int]] = []
    original = TierCacheConnector.get_external_cache_hit_sources

    def recording(self: Any, request: Any, num_external_tokens: int) -> Any:
        split = original(self, request, num_external_tokens)
        sources.append({str(k.value): int(v) for k, v in split.items()})
        return split

    TierCacheConnector.get_external_cache_hit_sources = recording
    llm = tiny_llm(
        spec["model"],
        {
            "config": spec["config"],
            "server": f"unix://{spec['server']}",
            "keyspace_file": spec["keyspace_file"],
            **ROOMY,
        },
        disable_log_stats=False,  # vLLM asks the connector for hit sources only while it keeps stats
    )
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    workdir = Path(sys.argv[2]).parent
    tiercache = str(Path(sys.executable).with_name("tiercache"))
    phases: dict[str, Any] = {"keyspace": json.loads(Path(spec["keyspace_file"]).read_text())}

    def settle() -> None:
        drain_all()
        for _ in range(2):  # steps without requests: finished saves complete
            llm.llm_engine.step()
        drain_server(spec["server"])  # the write-behind reached the file tier before a later burst evicts

    def request(name: str) -> dict[str, int]:
        llm.reset_prefix_cache()  # vLLM's own prefix cache: a repeated prompt must come from tiercache
        seen = len(sources)
        prompt: TokensPrompt = {"prompt_token_ids": spec["prompts"][name]}
        llm.generate([prompt], sp, use_tqdm=False)
        settle()
        total: dict[str, int] = {}
        for split in sources[seen:]:
            for source, tokens in split.items():
                total[source] = total.get(source, 0) + tokens
        return total

    def cache(action: str, name: str) -> dict[str, Any]:
        prompt = workdir / f"{name}.tokens.json"
        prompt.write_text(json.dumps(spec["prompts"][name]))
        argv = [tiercache, "cache", action, "--socket", spec["server"], "--json"]
        argv += ["--prompt", str(prompt), "--keyspace", spec["keyspace_file"]]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{argv}: {proc.stderr}")
        answer: dict[str, Any] = json.loads(proc.stdout)
        return answer

    for name in ("A", "D"):
        request(name)
    phases["pin_a"] = cache("pin", "A")
    for name in ("B", "C", "E"):
        request(name)
    phases["a_after_burst"] = request("A")
    phases["d_after_burst"] = request("D")
    for name in ("F", "G"):
        request(name)
    phases["prefetch_b"] = cache("prefetch", "B")
    phases["b_after_prefetch"] = request("B")
    phases["delete_a"] = cache("delete", "A")
    phases["a_after_delete"] = request("A")
    child_done(phases)


if __name__ == "__main__":
    main()
