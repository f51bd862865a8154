"""One in-process vLLM with the connector and vLLM's ZMQ KV event publisher on, plus a subscriber thread that
decodes the stream with vLLM's own msgspec decoder; runs the phases of the KV events test and writes JSON.

Usage: ``python run_kv_events.py SPEC_JSON OUT_JSON``. SPEC keys: ``model``, ``config`` (tiercache TOML),
``endpoint`` (``tcp://127.0.0.1:PORT``), ``prompts`` (``{"A": [...], "B": [...]}``), ``server`` (optional: a
node server's socket; the connector runs on it and the subscriber connects to the server's ``endpoint``
instead of binding the one vLLM publishes to), ``tp`` (tensor-parallel size, default 1) and ``executor``
(vLLM's ``distributed_executor_backend``, default ``uni``; ``mp`` runs the workers in their own processes
while the scheduler stays in this one).

Phases (each records the connector's scheduler hit tokens before and after, and the events received):
``store_a``, ``store_b`` (L1 holds one prompt: A's chunks are evicted), ``gpu_reset_a`` (vLLM's own prefix
cache reset; A comes back from the file tier), ``connector_reset`` (``reset_prefix_cache(reset_connector=
True)``'s answer), ``after_reset_a`` (A again: nothing external may hit).
"""

from __future__ import annotations

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
    from tiny_llm import child_done, child_spec, tiny_llm

    spec = child_spec()
    from loaded import ROOMY, drain_server
    from tiercache_vllm.connector import drain_all, snapshot
    from vllm import SamplingParams

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
    llm = tiny_llm(
        spec["model"],
        {"config": spec["config"], **({"server": f"unix://{server}", **ROOMY} if server else {})},
        tensor_parallel_size=int(spec.get("tp", 1)),
        distributed_executor_backend=spec.get("executor", "uni"),
        **publish,
    )
    time.sleep(0.5)  # the publisher's connection is up before the first batch

    def hit_tokens() -> int:
        return sum(int(s["hit_tokens"]) for s in snapshot()["scheduler"])

    def settle() -> None:
        drain_all()
        for _ in range(2):  # steps without requests: finished saves free their blocks, queued events go out
            llm.llm_engine.step()
        if server:  # the server's write-behind to the file tier is done (its events published)
            drain_server(server)
        quiet()

    def quiet(gap_s: float = 0.8, most_s: float = 30.0) -> None:
        """Wait until no event arrived for ``gap_s`` (at most ``most_s`` in all): what was published has
        been received, also while a loaded machine delivers it late."""
        seen, since, end = len(events), time.monotonic(), time.monotonic() + most_s
        while time.monotonic() - since < gap_s and time.monotonic() < end:
            time.sleep(0.05)
            if len(events) != seen:
                seen, since = len(events), time.monotonic()

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
    child_done(phases)


if __name__ == "__main__":
    main()
