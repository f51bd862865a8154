"""Redis Cluster failover: 3 masters + 3 replicas, a master SIGKILLed mid-run. Lookups and retrieves during
the failover are misses (counted as tier errors), after the replica's promotion they hit again, and every
token ever restored is bit-exact."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tiercache.config import config_from_dict
from tiercache.gpu.layouts import LayoutKind, PagedLayout, object_spec
from tiercache.gpu.move import Move
from tiercache.gpu.reference import gather, scatter
from tiercache.store.engine import CacheEngine
from tiercache.testing.harness.backends import start_redis_process
from tiercache.testing.harness.processes import ServerProcess, free_port, wait_until

pytestmark = pytest.mark.asyncio

LAYOUT = PagedLayout(
    LayoutKind.VLLM_FLASH, num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="bfloat16"
)
TOKENS = 1024  # 4 chunks per prompt
PROMPTS = 12


def _cli(port: int, *args: str) -> str:
    cli = shutil.which("redis-cli")
    assert cli is not None
    out = subprocess.run([cli, "-p", str(port), *args], capture_output=True, timeout=10, check=False)
    return out.stdout.decode(errors="replace")


class Node:
    def __init__(self, binary: str, directory: Path) -> None:
        self.port = free_port()
        cluster = ["--cluster-enabled", "yes", "--cluster-config-file", str(directory / "nodes.conf"),
                   "--cluster-node-timeout", "1000", "--cluster-port", str(free_port())]  # fmt: skip
        self.proc: ServerProcess = start_redis_process(binary, self.port, directory, cluster, timeout=15)

    def role(self) -> str:
        info = _cli(self.port, "INFO", "replication")
        return "master" if "role:master" in info else "slave"


@pytest.fixture
def cluster(redis_binary: str, tmp_path: Path) -> Iterator[list[Node]]:
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli not installed (Debian: apt-get install -y redis-tools)")
    nodes: list[Node] = []
    try:
        for i in range(6):
            nodes.append(Node(redis_binary, tmp_path / f"node-{i}"))
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        cli = shutil.which("redis-cli")
        assert cli is not None
        subprocess.run([cli, "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        wait_until(lambda: all("cluster_state:ok" in _cli(n.port, "CLUSTER", "INFO") for n in nodes))
        wait_until(lambda: sorted(n.role() for n in nodes) == ["master"] * 3 + ["slave"] * 3)
        yield nodes
    finally:
        for node in nodes:
            node.proc.stop()


def _prompt(i: int) -> tuple[list[int], torch.Tensor, list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(i)
    kv = torch.randn(object_spec(LAYOUT, TOKENS).shape, generator=gen).to(torch.bfloat16)
    cache = [torch.zeros(LAYOUT.layer_shape(TOKENS // 16), dtype=torch.bfloat16) for _ in range(2)]
    slots = torch.arange(TOKENS)
    scatter(cache, Move.scatter(LAYOUT, slots, [(0, TOKENS)], [kv]))
    return [i * 100_000 + t for t in range(TOKENS)], kv, cache, slots


async def _restore(
    engine: CacheEngine, prompt: tuple[list[int], torch.Tensor, list[torch.Tensor], torch.Tensor]
) -> int:
    """Retrieve a prompt into a fresh paged cache; the number of tokens restored (AssertionError if any
    restored token differs from the stored KV)."""
    tokens, kv, _, slots = prompt
    target = [
        torch.full(LAYOUT.layer_shape(TOKENS // 16), float("nan"), dtype=torch.bfloat16) for _ in range(2)
    ]
    mask = await engine.retrieve(tokens, target, slots)
    restored = int(mask.sum())
    out = torch.empty(object_spec(LAYOUT, TOKENS).shape, dtype=torch.bfloat16)
    gather(target, Move.gather(LAYOUT, slots, [(0, TOKENS)], [out]))
    assert torch.equal(out[:, :, :restored].view(torch.int16), kv[:, :, :restored].view(torch.int16))
    assert bool(mask[:restored].all())
    return restored


async def test_master_killed_mid_run_misses_then_hits_nothing_wrong(cluster: list[Node]) -> None:
    masters = [n for n in cluster if n.role() == "master"]
    seeds = ",".join(f"127.0.0.1:{n.port}" for n in cluster)
    config = config_from_dict(
        {
            "chunk_size": 256,
            "l1": {"capacity": "64MiB", "pinned": False},
            "manager": {"circuit_failures": 1000, "l2_deadline_s": 2.0, "lookup_deadline_s": 1.0},
            "tiers": [{"name": "cluster", "url": f"redis+cluster://{seeds}"}],
        }
    )
    prompts = [_prompt(i) for i in range(PROMPTS)]
    prefill = await CacheEngine.open(config, LAYOUT, model="t/failover")
    try:
        for tokens, _, cache, slots in prompts:
            assert await prefill.store(tokens, cache, slots) == TOKENS
        await prefill.drain()
        assert prefill.manager.metrics.value("tiercache_stores_total", tier="cluster") == PROMPTS * 4
    finally:
        await prefill.aclose()
    # every replica has caught up with its master before the kill
    wait_until(lambda: sum(int(_cli(n.port, "DBSIZE").strip() or 0) for n in cluster) == 2 * PROMPTS * 4)

    decode = await CacheEngine.open(config, LAYOUT, model="t/failover")
    metrics = decode.manager.metrics
    try:
        assert await _restore(decode, prompts[0]) == TOKENS  # warm: the cluster serves
        victim = masters[0]
        victim.proc.kill()
        # During the failover: the dead master's slots are misses (tier errors), the rest hit, nothing wrong.
        during = [await _restore(decode, p) for p in prompts[1:]]
        errors_during = metrics.value(
            "tiercache_tier_errors_total", tier="cluster", op="contains"
        ) + metrics.value("tiercache_tier_errors_total", tier="cluster", op="get")
        assert errors_during >= 1
        assert min(during) < TOKENS
        # A replica takes over the dead master's slots.
        alive = [n for n in cluster if n is not victim]
        wait_until(lambda: all("cluster_state:ok" in _cli(n.port, "CLUSTER", "INFO") for n in alive))
        wait_until(lambda: sum(n.role() == "master" for n in alive) == 3)
        missing_chunks = sum((TOKENS - d) // 256 for d in during)
        loaded_before = metrics.value("tiercache_prefetched_total", tier="cluster")
        # After: every prompt is restored whole again (from L1 or the promoted replica), bit-exact.
        for _round in range(50):
            restored = [await _restore(decode, p) for p in prompts]
            if min(restored) == TOKENS:
                break
            await asyncio.sleep(0.2)  # the client refreshes its slot map after a MOVED/connection error
        assert restored == [TOKENS] * PROMPTS
        # the chunks missed during the failover came from the promoted replica (the rest from L1)
        assert metrics.value("tiercache_prefetched_total", tier="cluster") - loaded_before == missing_chunks
        assert metrics.value("tiercache_frames_rejected_total", tier="cluster") == 0
    finally:
        await decode.aclose()
