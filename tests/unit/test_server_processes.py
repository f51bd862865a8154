"""Server mode with real processes: a ``python -m tiercache.server`` child, clients in this process and in
child processes (killed with SIGKILL, run as another uid). No mocks; waits poll a condition in bounded loops.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercache.server.client import ServerConnection, ServerRefused, SharedL1
from tiercache.server.protocol import Op, decode, encode
from tiercache.server.server import ServerAlreadyRunning, claim_socket_path
from tiercache.spec import KVSpec
from tiercache.testing.harness.processes import NodeServer, run_as, wait_for

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens=16)  # 2048 bytes
SLOT_BYTES, SLOTS = 4096, 4


class Server(NodeServer):
    """A node server of SLOTS slots of SLOT_BYTES (one client may hold every slot)."""

    def __init__(self, path: str, *extra: str) -> None:
        super().__init__(path, "--max-share", "1", *extra, slot_bytes=SLOT_BYTES, slots=SLOTS)


CLIENT_SCRIPT = r"""
import json, os, sys
from tiercache.server.client import SharedL1
from tiercache.spec import KVSpec
spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens=16)
l1 = SharedL1(sys.argv[1])
held = []
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "reserve":  # reserve and half-write, never commit
        obj = l1.reserve_write(arg, spec)
        obj.buffer()[: spec.nbytes // 2] = b"\x07" * (spec.nbytes // 2)
        held.append(obj)
        out = {"slot": obj.slot, "gen": obj.gen}
    elif cmd == "acquire":
        lease = l1.acquire(arg)
        held.append(lease)
        out = {"ok": lease is not None and lease.valid()}
    elif cmd == "close":
        l1.close()
        out = {"closed": True}
    print(json.dumps(out), flush=True)
"""


class Client:
    """A client child process driven line by line over stdin/stdout."""

    def __init__(self, tmp: Path, path: str) -> None:
        script = tmp / "client_child.py"
        script.write_text(CLIENT_SCRIPT)
        self.proc = subprocess.Popen(
            [sys.executable, str(script), path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=tmp,
        )

    def ask(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return reply


@pytest.fixture
def server(sock_dir: Path) -> Iterator[Server]:
    srv = Server(str(sock_dir / "l1.sock"))
    assert srv.ready
    yield srv
    srv.stop()


def _fill(obj: Any, value: int) -> None:
    obj.tensor().fill_(value)


def test_store_in_one_process_read_in_another(server: Server, tmp_path: Path) -> None:
    writer = SharedL1(server.path)
    obj = writer.reserve_write("k", SPEC)
    assert obj is not None
    assert writer.reserve_write("k", SPEC) is None
    src = torch.arange(SPEC.nbytes // 2, dtype=torch.float16).view(SPEC.shape)
    obj.tensor().copy_(src)
    assert not writer.contains("k")  # reserved is invisible
    writer.finish_write(obj)
    reader = SharedL1(server.path)  # a second connection: own mapping of the same memfd
    assert reader.batched_contains(["k", "x"]) == [True, False]
    lease = reader.acquire("k")
    assert lease is not None
    assert lease.valid()
    assert lease.obj.spec == SPEC
    assert torch.equal(lease.obj.tensor(), src)
    assert reader.server_stats()["leases"] == 1  # type: ignore[index]
    lease.release()
    assert not lease.valid()
    assert reader.server_stats()["leases"] == 0
    child = Client(tmp_path, server.path)  # and from another process
    try:
        assert child.ask("acquire k") == {"ok": True}
    finally:
        child.proc.kill()
        child.proc.wait()


def test_alloc_evicts_lru_but_never_a_leased_slot(server: Server) -> None:
    l1 = SharedL1(server.path)
    for i in range(SLOTS):
        obj = l1.reserve_write(f"k{i}", SPEC)
        assert obj is not None
        l1.finish_write(obj)
    reader = SharedL1(server.path)
    leases = reader.batched_acquire([f"k{i}" for i in range(SLOTS)])
    assert all(lease is not None for lease in leases)
    assert l1.reserve_write("new", SPEC) is None  # everything leased: refused, nothing stolen
    assert all(lease is not None and lease.valid() for lease in leases)
    leases[2].release()  # type: ignore[union-attr]
    assert l1.reserve_write("new", SPEC) is not None
    assert l1.batched_contains([f"k{i}" for i in range(SLOTS)]) == [True, True, False, True]
    assert l1.stats().evictions == 1


def test_dead_client_leases_drop_and_reservations_wait_for_process_exit(
    server: Server, tmp_path: Path
) -> None:
    l1 = SharedL1(server.path)
    obj = l1.reserve_write("pub", SPEC)
    assert obj is not None
    l1.finish_write(obj)
    child = Client(tmp_path, server.path)
    assert child.ask("acquire pub") == {"ok": True}
    ref = child.ask("reserve half")
    assert l1.server_stats()["leases"] == 1
    assert l1.server_stats()["reserved"] == 1
    assert child.ask("close") == {"closed": True}  # connection gone, process alive
    assert wait_for(lambda: l1.server_stats()["leases"] == 0)  # type: ignore[index]
    assert l1.server_stats()["reserved"] == 1  # type: ignore[index]  # no late write may land in a reused slot
    assert l1.server_stats()["orphaned"] == 1  # type: ignore[index]  # but its key is no longer present
    assert l1.connected()
    assert l1.contains("half") is False
    kept = l1.reserve_write("half", SPEC)  # anyone may store the key now, in another slot
    assert kept is not None
    assert kept.slot != ref["slot"]
    l1.abort_write(kept)
    child.proc.kill()  # SIGKILL mid-store
    child.proc.wait()
    assert wait_for(lambda: l1.server_stats()["reserved"] == 0)  # type: ignore[index]
    assert l1.contains("half") is False  # nothing published
    header = l1._conn.seg.slot_state(ref["slot"])  # type: ignore[union-attr]
    assert header == (ref["gen"] + 1, 0)  # freed: generation bumped
    again = l1.reserve_write("half", SPEC)  # the key is free again
    assert again is not None


def test_sigkill_client_without_closing(server: Server, tmp_path: Path) -> None:
    child = Client(tmp_path, server.path)
    child.ask("reserve k")
    l1 = SharedL1(server.path)
    assert l1.server_stats()["reserved"] == 1  # type: ignore[index]
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait()
    assert wait_for(lambda: l1.server_stats()["reserved"] == 0)  # type: ignore[index]
    assert l1.contains("k") is False


def test_dead_server_is_cache_off_then_reconnect_with_new_epoch(sock_dir: Path) -> None:
    path = str(sock_dir / "l1.sock")
    first = Server(path)
    assert first.ready
    l1 = SharedL1(path, backoff_s=0.01, max_backoff_s=0.05)
    obj = l1.reserve_write("k", SPEC)
    assert obj is not None
    _fill(obj, 3)
    l1.finish_write(obj)
    lease = l1.acquire("k")
    pending = l1.reserve_write("w", SPEC)
    assert lease is not None
    assert pending is not None
    first.kill()  # SIGKILL: the socket file stays behind, stale
    assert l1.contains("k") is False  # cache-off: a miss, no exception
    assert torch.all(lease.obj.tensor() == 3)  # bytes already mapped stay readable
    assert not lease.valid()  # but are no longer vouched for
    assert l1.reserve_write("x", SPEC) is None
    assert l1.skipped_stores == 1
    l1.finish_write(pending)  # a store of the dead epoch is dropped silently
    lease.release()
    second = Server(path)  # the stale socket file is replaced
    try:
        assert second.ready
        assert second.epoch != first.epoch
        assert l1.wait_connected(60)  # the client reconnects by itself, in the background
        assert l1.contains("k") is False
        assert l1.reconnects == 1
        assert l1._conn is not None
        assert l1._conn.epoch == second.epoch
        # A stale (slot, generation, epoch) from the first server is rejected by the second.
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        raw.connect(path)
        raw.send(encode(Op.HELLO, 0, 0, {"role": "worker"}))
        raw.recvmsg(65536, socket.CMSG_SPACE(8))
        raw.send(encode(Op.COMMIT, first.epoch, 1, {"slots": [[pending.slot, pending.gen]]}))
        reply = decode(raw.recv(65536), request=False)
        raw.close()
        assert reply.op is Op.ERR
        assert reply.body["code"] == "stale_epoch"
        assert l1.server_stats()["published"] == 0  # type: ignore[index]
    finally:
        second.stop()


def test_second_server_on_live_socket_is_refused(server: Server) -> None:
    again = Server(server.path)
    assert not again.ready
    assert again.proc.wait(timeout=60) == 2
    assert again.stop() == 2
    assert "already listening on" in again.log()
    with pytest.raises(ServerAlreadyRunning, match="already listening"):
        claim_socket_path(server.path)
    assert SharedL1(server.path).connected()  # the first one still serves


def test_claim_refuses_a_regular_file(tmp_path: Path) -> None:
    f = tmp_path / "not-a-socket"
    f.write_text("x")
    with pytest.raises(ServerAlreadyRunning, match="not a socket"):
        claim_socket_path(str(f))
    assert f.read_text() == "x"


def test_socket_mode_and_clean_sigterm(sock_dir: Path) -> None:
    srv = Server(str(sock_dir / "l1.sock"))
    assert srv.ready
    assert os.stat(srv.path).st_mode & 0o777 == 0o600
    assert os.path.exists(srv.path + ".lock")  # held while serving
    assert srv.stop() == 0
    assert not os.path.exists(srv.path)
    assert not os.path.exists(srv.path + ".lock")


def test_the_socket_path_appears_once_the_server_accepts(sock_dir: Path) -> None:
    """The socket is bound as ``PATH.new`` and linked into place after it listens: a client that connects
    the moment the path exists is accepted, and a crashed server's ``PATH.new`` is replaced, not kept."""
    path = str(sock_dir / "l1.sock")
    for _ in range(5):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as leftover:
            leftover.bind(path + ".new")
        srv = NodeServer(path, read_ready=False)
        try:
            assert wait_for(lambda p=srv.proc: os.path.exists(path) or p.poll() is not None, attempts=10**7)
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as first:
                first.connect(path)  # ECONNREFUSED if the path had appeared before listen
            assert srv.read_ready()
            assert os.stat(path).st_mode & 0o777 == 0o600
            assert not os.path.exists(path + ".new")
        finally:
            assert srv.stop() == 0
        assert not os.path.exists(path)


def test_a_server_refuses_a_file_in_the_way_of_its_socket(sock_dir: Path) -> None:
    """Something other than a socket at ``PATH.new`` is not replaced: the server refuses to start."""
    path = str(sock_dir / "l1.sock")
    Path(path + ".new").write_text("x")
    srv = NodeServer(path)
    assert not srv.ready
    assert srv.stop() == 2
    assert "l1.sock.new exists and is not a socket" in srv.log()
    assert Path(path + ".new").read_text() == "x"
    assert not os.path.exists(path)


def test_sigterm_stops_a_server_whose_stdout_reader_went_away(sock_dir: Path) -> None:
    """The stop line cannot be printed (closed pipe): the server still stops cleanly."""
    srv = Server(str(sock_dir / "l1.sock"))
    assert srv.ready
    assert srv.proc.stdout is not None
    srv.proc.stdout.close()  # the starter is gone: the next print hits a broken pipe
    assert srv.stop() == 0
    assert not os.path.exists(srv.path)


def test_malformed_message_drops_only_that_connection(server: Server) -> None:
    good = SharedL1(server.path)
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    raw.settimeout(60)
    raw.connect(server.path)
    raw.send(b"\xc1garbage")
    reply = decode(raw.recv(65536), request=False)
    assert reply.op is Op.ERR
    assert reply.body["code"] == "protocol"
    assert raw.recv(65536) == b""  # dropped
    raw.close()
    stats = good.server_stats()
    assert stats is not None
    assert stats["protocol_errors"] == 1
    assert stats["clients"] == 1


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another uid")
def test_client_of_disallowed_uid_is_refused(sock_dir: Path) -> None:
    srv = Server(str(sock_dir / "l1.sock"), "--mode", "666")  # reachable by anyone: SO_PEERCRED decides
    assert srv.ready
    try:

        def connect() -> str:
            try:
                ServerConnection(srv.path, timeout_s=30)
            except ServerRefused as exc:
                return f"refused {exc.code}"
            return "connected"

        assert run_as(65534, connect) == "refused forbidden"
        own = SharedL1(srv.path)  # the server's own uid is allowed
        stats = own.server_stats()
        assert stats is not None
        assert stats["refused_peers"] == 1
    finally:
        srv.stop()


def test_random_garbage_never_takes_the_server_down(server: Server) -> None:
    import random

    from tiercache.server.protocol import PROTOCOL_VERSION

    rng = random.Random(13)
    import msgpack

    payloads = [rng.randbytes(rng.randrange(1, 200)) for _ in range(30)]
    payloads += [
        msgpack.packb([PROTOCOL_VERSION, 0, op, 1, {"keys": [rng.random()], "slots": [[-1, 2**64 - 1]]}])
        for op in [*range(7), 11, 64, 65]  # each one invalid: no valid STATS/END/CLEAR/DRAIN slips in
    ]
    for data in payloads:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        raw.settimeout(60)
        raw.connect(server.path)
        raw.send(data)
        reply = raw.recv(65536)
        raw.close()
        assert decode(reply, request=False).op is Op.ERR
    stats = SharedL1(server.path).server_stats()
    assert stats is not None
    assert stats["protocol_errors"] == len(payloads)
    assert server.proc.poll() is None


def test_lookups_of_many_keys_are_batched(server: Server) -> None:

    l1 = SharedL1(server.path)
    obj = l1.reserve_write("k0", SPEC)
    assert obj is not None
    l1.finish_write(obj)
    keys = [f"k{i}" + "x" * 500 for i in range(1, 400)]
    keys.insert(300, "k0")  # in the third batch of 128
    found = l1.batched_contains(keys)
    assert found == [k == "k0" for k in keys]
    leases = l1.batched_acquire(keys)
    assert [lease is not None for lease in leases] == found
    assert l1.server_stats()["leases"] == 1  # type: ignore[index]
    assert l1.batched_contains([]) == []
