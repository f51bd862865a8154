"""Storage servers on 127.0.0.1 for tests and benchmarks, started on free ports and stopped by PID: a
redis-server (or valkey-server) without persistence, the flags and the joining of a Redis cluster's masters,
and Mooncake's ``mooncake_master`` (with its HTTP
metadata server) and a store client lending a segment.

The binaries come with the ``mooncake`` extra (the CPU wheel; Debian's libibverbs1 too). A missing binary
raises ``MissingServer`` (test fixtures skip on it, or fail under CI).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tiercache.testing.harness.processes import ServerProcess, free_port, port_open, start_process, wait_until

__all__ = [
    "MissingServer",
    "MooncakeCluster",
    "cluster_node_args",
    "join_cluster",
    "mooncake_bin",
    "mooncake_env",
    "redis_answers",
    "redis_argv",
    "start_mooncake",
    "start_mooncake_master",
    "start_redis_process",
]


class MissingServer(RuntimeError):
    """A server binary is not installed here (the message says which, and how to install it)."""


def redis_argv(binary: str, port: int, directory: Path, extra: Sequence[str] = ()) -> list[str]:
    """The command line of ``binary`` (redis-server or valkey-server) on 127.0.0.1:``port``, saving nothing,
    its working files in ``directory``; ``extra`` flags after ours."""
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(directory), "--protected-mode", "no", *extra]  # fmt: skip


def redis_answers(port: int) -> bool:
    """Whether the server on 127.0.0.1:``port`` answers PING (or asks for a password first)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.3) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def start_redis_process(
    binary: str, port: int, directory: Path, extra: Sequence[str] = (), timeout: float = 30.0
) -> ServerProcess:
    """Start :func:`redis_argv` (``directory`` made) and wait until it answers PING."""
    directory.mkdir(parents=True, exist_ok=True)
    return start_process(redis_argv(binary, port, directory, extra), lambda: redis_answers(port), timeout)


def cluster_node_args(directory: Path, bus_port: int) -> list[str]:
    """The flags of a cluster-enabled master: its node file in ``directory``, its cluster bus on ``bus_port``
    (else its port + 10000, which may be taken), a 2 s node timeout."""
    return ["--cluster-enabled", "yes", "--cluster-config-file", str(directory / "nodes.conf"),
            "--cluster-node-timeout", "2000", "--cluster-port", str(bus_port)]  # fmt: skip


def join_cluster(ports: Sequence[int], timeout_s: float = 30.0) -> None:
    """Join the cluster-enabled masters on 127.0.0.1:``ports`` (``redis-cli --cluster create``, no replicas)
    and wait until each reports ``cluster_state:ok``. ``MissingServer`` without redis-cli."""
    cli = shutil.which("redis-cli")
    if cli is None:
        raise MissingServer("redis-cli not installed (Debian: apt-get install -y redis-tools)")
    addresses = [f"127.0.0.1:{p}" for p in ports]
    subprocess.run(
        [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    wait_until(lambda: all(_cluster_ok(cli, p) for p in ports), timeout_s=timeout_s, every_s=0.05)


def _cluster_ok(cli: str, port: int) -> bool:
    out = subprocess.run(
        [cli, "-p", str(port), "CLUSTER", "INFO"], capture_output=True, timeout=10, check=False
    )
    return b"cluster_state:ok" in out.stdout


def mooncake_bin(name: str) -> str | None:
    """The path of Mooncake's ``name`` binary (beside this Python first, then on PATH), or None."""
    found = Path(sys.executable).with_name(name)
    return str(found) if found.exists() else shutil.which(name)


def mooncake_env() -> dict[str, str]:
    """The environment for Mooncake processes: this one, bound to 127.0.0.1."""
    return {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}


def _port_open(port: int) -> bool:
    return port_open("127.0.0.1", port)


def _required(name: str) -> str:
    found = mooncake_bin(name)
    if found is None:
        raise MissingServer(f"{name} not found (pip install -e '.[mooncake]')")
    return found


@dataclass
class MooncakeCluster:
    """A ``mooncake_master`` (with its HTTP metadata server) plus one store client lending a segment."""

    rpc_port: int
    http_port: int
    master: ServerProcess
    store: ServerProcess

    @property
    def url(self) -> str:
        """The adapter URL (master RPC address, metadata URL, tcp)."""
        return (
            f"mooncake://127.0.0.1:{self.rpc_port}"
            f"?metadata=http://127.0.0.1:{self.http_port}/metadata&protocol=tcp"
        )

    def restart_master(self) -> None:
        """Start the master again with the same arguments (same ports) after ``kill``/``stop``."""
        self.master.stop()
        self.master = start_process(
            self.master.argv, ready=lambda: _port_open(self.rpc_port), timeout=15, env=mooncake_env()
        )

    def stop(self) -> None:
        self.store.stop()
        self.master.stop()


def start_mooncake_master() -> tuple[ServerProcess, int, int]:
    """Start a master alone on 127.0.0.1 (RPC, HTTP metadata, metrics on free ports): (process, rpc, http)."""
    master_bin = _required("mooncake_master")
    rpc, http, metrics = free_port(), free_port(), free_port()
    master_argv = [
        master_bin,
        "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
        "--metrics_host=127.0.0.1", f"--metrics_port={metrics}",
        "--rpc_thread_num=2", "--logtostderr",
    ]  # fmt: skip
    master = start_process(
        master_argv, ready=lambda: _port_open(rpc) and _port_open(http), env=mooncake_env()
    )
    return master, rpc, http


def start_mooncake(segment: str = "1GB") -> MooncakeCluster:
    """Start a master (``start_mooncake_master``) and a store client lending a ``segment`` of memory."""
    client_bin = _required("mooncake_client")
    master, rpc, http = start_mooncake_master()
    client_port = free_port()
    client_argv = [
        client_bin,
        "--host=127.0.0.1", f"--port={client_port}",
        f"--master_server_address=127.0.0.1:{rpc}",
        f"--metadata_server=http://127.0.0.1:{http}/metadata",
        f"--global_segment_size={segment}", "--protocol=tcp", "--logtostderr",
    ]  # fmt: skip
    try:
        store = start_process(client_argv, ready=lambda: _port_open(client_port), env=mooncake_env())
    except BaseException:
        master.stop()
        raise
    return MooncakeCluster(rpc, http, master, store)
