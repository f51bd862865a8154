"""One in-process vLLM with the connector and vLLM's ZMQ KV event publisher on, plus a subscriber thread that
decodes the stream with vLLM's own msgspec decoder; runs the phases of the KV events test and writes JSON.

Usage: ``python run_kv_events.py SPEC_JSON OUT_JSON``. SPEC keys: ``model``, ``config`` (tiercache TOML),
``endpoint`` (``tcp://127.0.0.1:PORT``), ``prompts`` (``{"A": [...], "B": [...]}``), ``server`` (optional: a
node server's socket; the connector runs on it and the subscriber connects to the server's ``endpoint``
instead of binding the one vLLM publishes to).

Phases (each records the connector's scheduler hit tokens before and after, and the events received):
``store_a``, ``store_b`` (L1 holds one prompt: A's chunks are evicted), ``gpu_reset_a`` (vLLM's own prefix
cache reset; A comes back from the file tier), ``connector_reset`` (``reset_prefix_cache(reset_connector=
True)``'s answer), ``after_reset_a`` (A again: nothing external may hit).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any


def subscriber(
    endpoint: str, bind: bool, out: list[dict[str, Any]], stop: threading.Event, ready: threading.Event
) -> None:
    """Decode every batch on ``endpoint`` into ``out`` ({"type", "medium", "hashes", "parent", "tokens"})."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    if bind:  # vLLM's publisher connects to a host:port endpoint (it binds only wildcards)
        sock.bind(endpoint)
    else:  # a node server binds its endpoint
        sock.connect(endpoint)
    ready.set()
    while not stop.is_set():
        if not sock.poll(100):
            continue
        _topic, _seq, payload = sock.recv_multipart()
        batch = decoder.decode(payload)
        for event in batch.events:
            if isinstance(event, BlockStored):
                out.append(
                    {
                        "type": "stored",
                        "medium": event.medium,
                        "hashes": [str(h) for h in event.block_hashes],
                        "parent": None if event.parent_block_hash is None else str(event.parent_block_hash),
                        "tokens": list(event.token_ids),
                    }
                )
            elif isinstance(event, BlockRemoved):
                out.append(
                    {
                        "type": "removed",
                        "medium": event.medium,
                        "hashes": [str(h) for h in event.block_hashes],
                    }
                )
            elif isinstance(event, AllBlocksCleared):
                out.append({"type": "cleared"})
    sock.close(linger=0)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from tiercache_vllm.connector import drain_all, snapshot
    from vllm import LLM, SamplingParams

    events: list[dict[str, Any]] = []
    stop, ready = threading.Event(), threading.Event()
    server = spec.get("server")
    bind = server is None
    thread = threading.Thread(
        target=subscriber, args=(spec["endpoint"], bind, events, stop, ready), daemon=True
    )
    thread.start()
    ready.wait(10)
    # with a node server the stream is the server's (vLLM's own GPU events are not needed then)
    publish: dict[str, Any] = (
        {
            "kv_events_config": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": spec["endpoint"],
            }
        }
        if bind
        else {}
    )
    llm = LLM(
        model=spec["model"],
        tokenizer=spec["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        block_size=32,
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        seed=0,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=64 << 20,
        distributed_executor_backend="uni",
        kv_transfer_config={
            "kv_connector": "TierCacheConnector",
            "kv_connector_module_path": "tiercache_vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "config": spec["config"],
                **({"server": f"unix://{server}"} if server else {}),
            },
        },
        **publish,
    )
    time.sleep(0.5)  # the publisher's connection is up before the first batch

    def hit_tokens() -> int:
        return sum(int(s["hit_tokens"]) for s in snapshot()["scheduler"])

    def settle() -> None:
        drain_all()
        for _ in range(2):  # steps without requests: finished saves free their blocks, queued events go out
            llm.llm_engine.step()
        time.sleep(0.8)

    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    phases: dict[str, Any] = {}

    def run(name: str, prompt: str) -> None:
        before, seen = hit_tokens(), len(events)
        llm.generate([{"prompt_token_ids": spec["prompts"][prompt]}], sp, use_tqdm=False)  # type: ignore[list-item]
        settle()
        # a step publishes what the previous one queued after its forward: one more short request flushes
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], sp, use_tqdm=False)  # type: ignore[list-item]
        settle()
        phases[name] = {"hit_tokens": hit_tokens() - before, "events": events[seen:]}

    run("store_a", "A")
    run("store_b", "B")
    llm.reset_prefix_cache()  # vLLM's GPU prefix cache only
    run("gpu_reset_a", "A")
    seen = len(events)
    phases["connector_reset"] = {"answer": bool(llm.reset_prefix_cache(reset_connector=True))}
    run("after_reset_a", "A")
    phases["connector_reset"]["events"] = events[seen:]
    stop.set()
    thread.join(5)
    with open(sys.argv[2], "w") as f:
        json.dump(phases, f, indent=1)
    print("DONE")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
