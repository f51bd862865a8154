"""The node server as a daemon: what an operator and a misbehaving client can do to it, with real server
processes (``python -m tiercache.server``), real clients, SIGSTOP / SIGKILL, PID namespaces (``unshare``, as
root), other uids and a tight open-file limit. Waits poll a condition in bounded loops, never a clock.
"""

from __future__ import annotations

import array
import contextlib
import gc
import json
import mmap
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tiercache.server.client import ServerConnection, ServerRefused, SharedL1
from tiercache.server.main import main as server_main
from tiercache.server.protocol import Op, decode, encode
from tiercache.spec import KVSpec
from tiercache.testing.harness.processes import NodeServer, run_as, wait_for

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens=16)  # 2048 bytes
SLOTS = 8
ROOT = os.getuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root (other uids, PID namespaces)")


class Server(NodeServer):
    """A node server of SLOTS slots of 4 KiB."""

    def __init__(self, path: str, *extra: str, **kw: Any) -> None:
        super().__init__(path, *extra, slots=SLOTS, **kw)


@pytest.fixture
def server(sock_dir: Path) -> Iterator[Server]:
    srv = Server(str(sock_dir / "l1.sock"), "--max-share", "1")
    assert srv.ready
    yield srv
    srv.stop()


def raw_hello(path: str, role: str = "worker") -> tuple[socket.socket, dict[str, Any], list[int]]:
    """A bare connection that sent HELLO (no pidfd passed): the socket, the reply body, the fds received."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(60)
    sock.connect(path)
    sock.send(encode(Op.HELLO, 0, 0, {"role": role}))
    data, anc, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(8))
    fds = [fd for _, _, raw in anc for fd in array.array("i", raw[: len(raw) - len(raw) % 4])]
    return sock, decode(data, request=False).body, fds


def raw_request(sock: socket.socket, epoch: int, op: Op, body: dict[str, Any]) -> Any:
    sock.send(encode(op, epoch, 1, body))
    return decode(sock.recv(1 << 20), request=False)


def stats(l1: SharedL1) -> dict[str, Any]:
    got = l1.server_stats()
    assert got is not None
    return got


def store(l1: SharedL1, key: str, fill: int = 1) -> None:
    obj = l1.reserve_write(key, SPEC)
    assert obj is not None
    obj.buffer()[:] = bytes([fill]) * SPEC.nbytes
    l1.finish_write(obj)


# --------------------------------------------------------------------------- lost connections
def test_a_timed_out_request_is_cache_off_at_once_and_leaves_nothing_reserved(server: Server) -> None:
    """The server hangs (SIGSTOP) during an ALLOC: the client pays one timeout, then misses without any round
    trip while the server is stopped; once it resumes the client is back by itself, the late ALLOC's
    reservation is gone and the key can be stored and found."""
    l1 = SharedL1(server.path, timeout_s=0.5, backoff_s=0.01, max_backoff_s=0.05)
    assert l1.wait_connected(60)  # a loaded machine may answer the first HELLO late: connected by a retry
    os.kill(server.pid, signal.SIGSTOP)
    try:
        assert l1.reserve_write("k", SPEC) is None  # one timeout
        assert not l1.connected()
        asked = dict(l1.requests)
        for _ in range(20):  # every later call is a miss at once: no request, no reconnect on the call
            assert l1.contains("k") is False
            assert l1.reserve_write("k2", SPEC) is None
        assert dict(l1.requests) == asked
        assert l1.lost_connections == 1
        l1.timeout_s = 60.0  # the connections after the stall: a loaded machine may answer slowly
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert l1.wait_connected(60)
    assert wait_for(lambda: stats(l1)["reserved"] == 0)
    store(l1, "k")
    assert l1.contains("k")
    after = stats(l1)
    assert (after["published"], after["orphaned"]) == (1, 0)


def test_a_lost_session_is_fenced_once_its_writes_settle(server: Server) -> None:
    """A connection lost while an object is being written: its key is free at once, its slot stays out of
    use while the write may still land, and the client's fence frees it once the write settled."""
    l1 = SharedL1(server.path, timeout_s=0.5, backoff_s=0.01, max_backoff_s=0.05)
    assert l1.wait_connected(60)  # a loaded machine may answer the first HELLO late: connected by a retry
    obj = l1.reserve_write("w", SPEC)
    assert obj is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        assert l1.contains("x") is False  # times out: the connection is lost with "w" being written
        l1.timeout_s = 60.0  # the connections after the stall: a loaded machine may answer slowly
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert l1.wait_connected(60)
    assert wait_for(lambda: stats(l1)["orphaned"] == 1)  # the server saw the old connection go
    s = stats(l1)
    assert s["reserved"] == 1  # the write may still land: the slot is kept
    other = SharedL1(server.path)
    assert other.reserve_write("w", SPEC) is not None  # but the key is not "present"
    obj.buffer()[:] = b"\x05" * SPEC.nbytes  # the late write lands in the kept slot, harming no one
    l1.finish_write(obj)  # settles it (never published): the session is fenced with the next request
    s = stats(l1)
    assert s["freed_by_fence"] == 1
    assert s["orphaned"] == 0
    assert s["lost_sessions"] == 0


def test_a_dropped_connection_frees_its_keys_and_a_fence_its_slots(server: Server) -> None:
    """A protocol error drops a connection of a live process that holds a reservation: the key is free at
    once; the slot comes back when the session is fenced with its token."""
    sock, hello, fds = raw_hello(server.path)
    for fd in fds:
        os.close(fd)
    epoch = hello["epoch"]
    reply = raw_request(sock, epoch, Op.ALLOC, {"keys": ["k"], "nbytes": [SPEC.nbytes], "meta": [b""]})
    assert isinstance(reply.body["slots"][0], list)
    sock.send(b"\xc1 not msgpack")
    assert decode(sock.recv(65536), request=False).body["code"] == "protocol"
    sock.close()
    l1 = SharedL1(server.path)
    assert wait_for(lambda: stats(l1)["orphaned"] == 1)
    store(l1, "k")  # the key was never published and is free for anyone
    assert l1.contains("k")
    fence, _, more = raw_hello(server.path)
    for fd in more:
        os.close(fd)
    assert raw_request(fence, epoch, Op.FENCE, {"sessions": [hello["session"]]}).body == {"freed": 1}
    fence.close()
    s = stats(l1)
    assert (s["reserved"], s["orphaned"], s["published"]) == (0, 0, 1)


def test_an_alloc_answered_to_a_closed_connection_is_undone(server: Server) -> None:
    """The client gave up before the server answered its ALLOC: the answer cannot be delivered and nothing
    can be written there, so the reservation is freed at once (no pidfd wait)."""
    sock, hello, fds = raw_hello(server.path)
    for fd in fds:
        os.close(fd)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        body = {"keys": ["late"], "nbytes": [SPEC.nbytes], "meta": [b""]}
        sock.send(encode(Op.ALLOC, hello["epoch"], 1, body))
        sock.close()  # gone before the server ran the ALLOC
    finally:
        os.kill(server.pid, signal.SIGCONT)
    l1 = SharedL1(server.path)
    assert wait_for(lambda: stats(l1)["freed_unsent"] == 1)
    assert stats(l1)["reserved"] == 0
    assert stats(l1)["orphaned"] == 0
    store(l1, "late")


# --------------------------------------------------------------------------- PID namespaces
def _unshare_works() -> bool:
    if not ROOT or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


CLIENT_SCRIPT = r"""
import sys
from tiercache.server.client import SharedL1
from tiercache.spec import KVSpec
spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens=16)
l1 = SharedL1(sys.argv[1])
obj = l1.reserve_write(sys.argv[2], spec)
print("reserved" if obj is not None else "refused", flush=True)
sys.stdin.read()  # hold the reservation until killed
"""


@pytest.mark.skipif(not _unshare_works(), reason="needs root and unshare --pid")
def test_a_client_in_a_sibling_pid_namespace_frees_its_reservations_on_exit(
    sock_dir: Path, tmp_path: Path
) -> None:
    """The Kubernetes sidecar layout: the server cannot see the client's pid (SO_PEERCRED gives 0). The
    client passes its own pidfd, so its SIGKILL mid-store frees the reservation; a bare client that passes
    none gets its slots back after orphan_grace_s, its key at once."""
    srv = Server(
        str(sock_dir / "l1.sock"),
        "--max-share",
        "1",
        "--orphan-grace-s",
        "0.2",
        prefix=("unshare", "--pid", "--fork", "--mount-proc"),
    )
    assert srv.ready
    try:
        script = tmp_path / "client.py"
        script.write_text(CLIENT_SCRIPT)
        child = subprocess.Popen(
            [sys.executable, str(script), srv.path, "k"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "reserved"
        l1 = SharedL1(srv.path)
        assert stats(l1)["reserved"] == 1
        child.kill()  # SIGKILL mid-store
        child.wait()
        assert wait_for(lambda: stats(l1)["reserved"] == 0)
        assert stats(l1)["freed_on_exit"] == 1
        assert l1.reserve_write("k", SPEC) is not None
        # A bare client (no pidfd) whose pid the server cannot see: key free at once, slot after the grace.
        sock, hello, fds = raw_hello(srv.path)
        for fd in fds:
            os.close(fd)
        raw_request(sock, hello["epoch"], Op.ALLOC, {"keys": ["bare"], "nbytes": [16], "meta": [b""]})
        sock.close()
        assert wait_for(lambda: stats(l1)["freed_after_grace"] == 1, attempts=200_000)  # a server-side timer
        assert srv.proc.poll() is None
    finally:
        assert srv.stop() == 0


# --------------------------------------------------------------------------- no client can take it down
def test_clients_cannot_resize_the_segment_or_write_the_header(server: Server) -> None:
    sock, hello, fds = raw_hello(server.path)
    header_fd = fds[1]
    try:
        for fd in fds:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
        with pytest.raises(PermissionError):
            mmap.mmap(header_fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(header_fd, b"\xff" * 8, 8)
        ro = mmap.mmap(header_fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        assert int.from_bytes(ro[:8], "little") == hello["epoch"]
        ro.close()
    finally:
        for fd in fds:
            os.close(fd)
        sock.close()
    l1 = SharedL1(server.path)  # the server and every new client go on as before
    store(l1, "k", 7)
    lease = l1.acquire("k")
    assert lease is not None
    assert bytes(lease.obj.buffer()) == b"\x07" * SPEC.nbytes
    assert server.proc.poll() is None


@needs_root
def test_admin_operations_need_the_servers_uid_or_its_admin_group(sock_dir: Path) -> None:
    """A peer allowed to connect may not CLEAR by declaring itself admin; a member of admin_group may; a
    connection of the server's own uid must still say role admin."""
    nobody = 65534
    srv = Server(str(sock_dir / "a.sock"), "--mode", "666", "--allow-uid", str(nobody))
    grouped = Server(
        str(sock_dir / "g.sock"), "--mode", "666", "--allow-uid", str(nobody), "--admin-group", str(nobody)
    )
    try:
        assert srv.ready
        assert grouped.ready
        own = SharedL1(srv.path)
        store(own, "k")

        def as_admin_then_clear(path: str) -> str:
            try:
                ServerConnection(path, role="admin", timeout_s=30, server_uid=0)
                outcome = "admin"
            except ServerRefused as exc:
                outcome = f"admin {exc.code}"
            conn = ServerConnection(path, role="worker", timeout_s=30, server_uid=0)
            try:
                conn.request(Op.CLEAR, {})
                outcome += " clear ok"
            except ServerRefused as exc:
                outcome += f" clear {exc.code}"
            return outcome

        def as_nobody(path: str) -> str:
            return run_as(nobody, lambda: as_admin_then_clear(path))

        assert as_nobody(srv.path) == "admin forbidden clear forbidden"
        assert own.contains("k")  # nothing was cleared
        assert as_nobody(grouped.path) == "admin clear forbidden"  # admin by group; a worker still may not
        worker = ServerConnection(srv.path, role="worker")
        with pytest.raises(ServerRefused, match="forbidden"):
            worker.request(Op.CLEAR, {})
        admin = SharedL1(srv.path, role="admin")
        assert admin.clear() == 1
    finally:
        srv.stop()
        grouped.stop()


@needs_root
def test_a_client_refuses_a_server_run_by_another_uid(sock_dir: Path) -> None:
    """Root's client finds a server run by nobody on its socket path: no HELLO, cache-off, the reason said;
    with server_uid set to that uid it connects."""
    nobody = 65534
    os.chown(sock_dir, nobody, nobody)
    path = str(sock_dir / "l1.sock")
    pid = os.fork()
    if pid == 0:  # the server, as nobody (in this interpreter: nobody may not exec the venv's python)
        code = 1
        try:
            os.setgid(nobody)
            os.setgroups([])
            os.setuid(nobody)  # everything it runs is imported already: nobody cannot read /root
            code = server_main(["--socket", path, "--slot-bytes", "4096", "--slots", "4", "--allow-uid", "0"])
        finally:
            os._exit(code)
    try:
        assert wait_for(lambda: os.path.exists(path), attempts=10**7)  # it appears once the server listens
        l1 = SharedL1(path)
        assert not l1.connected()
        assert l1.last_error.startswith("untrusted_server: ")  # not wrapped as "cannot reach"
        assert "runs as uid 65534" in l1.last_error
        l1.close()
        trusted = SharedL1(path, server_uid=nobody)
        assert trusted.connected()
        store(trusted, "k")
        trusted.close()
    finally:
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_lease_caps_are_a_counted_refusal_and_a_too_large_answer_keeps_no_lease(sock_dir: Path) -> None:
    srv = Server(str(sock_dir / "l1.sock"), "--max-leases", "2", "--max-share", "1")
    assert srv.ready
    try:
        l1 = SharedL1(srv.path)
        for key in ("a", "b", "c"):
            store(l1, key)
        leases = l1.batched_acquire(["a", "b", "c"])
        assert [lease is not None for lease in leases] == [True, True, False]
        assert l1.refused_leases == 1
        assert stats(l1)["cap_refusals"] == 1
        l1.batched_release([lease for lease in leases if lease is not None])
        assert l1.acquire("c") is not None
    finally:
        srv.stop()
    big = Server(str(sock_dir / "big.sock"), "--max-share", "1")
    assert big.ready
    try:
        sock, hello, fds = raw_hello(big.path)
        for fd in fds:
            os.close(fd)
        epoch = hello["epoch"]
        [ref] = raw_request(
            sock, epoch, Op.ALLOC, {"keys": ["k"], "nbytes": [16], "meta": [b"m" * 256]}
        ).body["slots"]
        raw_request(sock, epoch, Op.COMMIT, {"slots": [ref[:2]]})
        reply = raw_request(sock, epoch, Op.LOOKUP, {"keys": ["k"] * 1024, "pin": True, "prefix": False})
        assert reply.body["code"] == "too_large"
        assert raw_request(sock, epoch, Op.STATS, {}).body["leases"] == 0
        sock.close()
    finally:
        big.stop()


# --------------------------------------------------------------------------- never dies quietly
def _nofile(limit: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return apply


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_running_out_of_file_descriptors_is_survived(sock_dir: Path) -> None:
    """With an open-file limit of 48 the server runs out of descriptors under 80 connections: it sheds the
    clients it cannot take (they see EOF or a broken pipe, not a hang), counts the accept errors, and serves
    new clients as soon as descriptors are free again."""
    srv = Server(str(sock_dir / "l1.sock"), "--max-share", "1", preexec=_nofile(48))
    assert srv.ready
    idle_fds = _open_fds(srv.pid)
    socks = []
    try:
        for _ in range(80):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(60)
            s.connect(srv.path)
            socks.append(s)
            with contextlib.suppress(BrokenPipeError):  # shed before its HELLO arrived
                s.send(encode(Op.HELLO, 0, 0, {"role": "probe"}))
        answered = shed = 0
        for s in socks:
            try:
                data = s.recv(65536)
            except ConnectionResetError:  # closed with its HELLO unread
                data = b""
            if data:
                answered += 1
            else:
                shed += 1
        assert shed > 0
        assert answered > 0
        for s in socks:
            s.close()
        socks.clear()
        # the server has seen every close: the next client is not shed (nor counted in shed_clients)
        assert wait_for(lambda: _open_fds(srv.pid) <= idle_fds, attempts=10**6)
        l1 = SharedL1(srv.path, backoff_s=0.01, max_backoff_s=0.05)
        assert l1.wait_connected(60)
        store(l1, "k")
        s = stats(l1)
        assert s["accept_errors"] >= 1
        assert s["shed_clients"] == shed
        assert srv.proc.poll() is None
    finally:
        for s in socks:
            s.close()
        srv.stop()


def test_two_servers_started_at_once_on_a_stale_path_never_both_run(sock_dir: Path) -> None:
    path = str(sock_dir / "l1.sock")
    for _ in range(5):
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        stale.bind(path)
        stale.close()  # a dead server's socket file
        # both started before either's ready line is read
        servers = [NodeServer(path, slots=2, read_ready=False) for _ in range(2)]
        ready = [srv.read_ready() for srv in servers]
        assert sum(ready) == 1
        loser = servers[ready.index(False)]
        assert loser.proc.wait(timeout=60) == 2
        assert loser.stop() == 2
        assert servers[ready.index(True)].stop() == 0


def _segment_maps() -> int:
    gc.collect()
    return sum(
        " /memfd:tiercache-l1 " in line + " " for line in Path("/proc/self/maps").read_text().splitlines()
    )


def test_an_idle_client_follows_a_restart_and_unmaps_the_old_segment(sock_dir: Path) -> None:
    """A server restart while the client is idle: the client notices the hangup by itself, reconnects, its
    first call after the restart is served by the new server, and the old segment is unmapped."""
    path = str(sock_dir / "l1.sock")
    first = Server(path, "--max-share", "1")
    assert first.ready
    before = _segment_maps()
    l1 = SharedL1(path, backoff_s=0.01, max_backoff_s=0.05)
    store(l1, "k")
    assert _segment_maps() == before + 1
    assert first.stop() == 0
    second = Server(path, "--max-share", "1")
    assert second.ready
    try:
        assert l1.wait_connected(60, reconnects=1)
        lost = l1.lost_connections
        store(l1, "k2")  # the first call after the restart is served
        assert l1.contains("k2")
        assert l1.lost_connections == lost
        assert _segment_maps() == before + 1  # the old server's segment is gone from this process
    finally:
        second.stop()


def test_stats_report_what_an_operator_needs(server: Server) -> None:
    l1 = SharedL1(server.path)
    store(l1, "k")
    s = stats(l1)
    for key in (
        "accept_errors",
        "busy_refusals",
        "cap_refusals",
        "orphaned",
        "lost_sessions",
        "freed_on_exit",
        "freed_by_fence",
        "freed_after_grace",
        "stores_dropped",
        "pending_stores",
        "max_object",
        "classes",
    ):
        assert key in s, key
    assert json.loads(json.dumps(s))["published"] == 1
