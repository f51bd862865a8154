"""The tiny model's vLLM engine as the e2e child scripts run it: CPU, fp32, eager, block size 32, 64 MiB of
KV, prefix caching on, the tiercache connector as ``kv_both`` (recompute on a failed load); and the child
scripts' spec and result."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, NoReturn


def child_spec() -> dict[str, Any]:
    """The spec of a child script run as ``SCRIPT SPEC_JSON OUT_JSON`` (read from ``SPEC_JSON``), with vLLM
    set to run offline and its engine core in this process (call it before importing vLLM)."""
    with open(sys.argv[1]) as f:
        spec: dict[str, Any] = json.load(f)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return spec


def child_done(result: Any) -> NoReturn:
    """Write ``result`` as JSON to ``OUT_JSON`` (the script's second argument), print ``DONE`` and leave at
    once (vLLM's background threads must not keep the process alive)."""
    with open(sys.argv[2], "w") as f:
        json.dump(result, f, indent=1)
    print("DONE", flush=True)
    os._exit(0)


def tiny_llm(model: str, extra_config: dict[str, Any], **overrides: Any) -> Any:
    """``vllm.LLM`` of ``model`` with the connector's ``extra_config``; ``overrides``: more (or other)
    ``LLM`` arguments."""
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": model,
        "tokenizer": model,
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 1024,
        "block_size": 32,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 1024,
        "seed": 0,
        "enable_prefix_caching": True,
        "kv_cache_memory_bytes": 64 << 20,
        "distributed_executor_backend": "uni",
        "kv_transfer_config": {
            "kv_connector": "TierCacheConnector",
            "kv_connector_module_path": "tiercache_vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra_config,
        },
    }
    return LLM(**{**kwargs, **overrides})
