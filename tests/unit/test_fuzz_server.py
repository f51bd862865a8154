"""A real ``python -m tiercache.server`` fuzzed by a hostile client process while two legitimate client
processes store and read back (``benchmarks/fuzz.py``'s live run, short), and what that fuzz found."""

from __future__ import annotations

import array
import os
import socket
import time
from pathlib import Path

from tiercache.server.client import ServerConnection
from tiercache.server.protocol import Op, decode, encode
from tiercache.server.segment import MIN_SLOT, Geometry, Segment
from tiercache.server.slots import Caps, SlotTable
from tiercache.testing.harness import fuzz
from tiercache.testing.harness.processes import NodeServer


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _fds_settle_at(pid: int, want: int, timeout_s: float = 30.0) -> int:
    """The server's open fds once they are ``want`` (a loaded server may close a connection's descriptors
    a moment after answering), or what they are after ``timeout_s`` (a leak never settles)."""
    deadline = time.monotonic() + timeout_s
    while (now := _open_fds(pid)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def test_fds_passed_beside_the_pidfd_of_a_hello_are_closed(sock_dir: Path) -> None:
    """A HELLO may carry descriptors besides the client's pidfd (or none that is one): the server keeps at
    most that pidfd and closes the rest, so a client passing junk cannot run the server out of descriptors."""
    path = str(sock_dir / "s.sock")
    server = NodeServer(path)
    try:
        assert server.ready
        probe = ServerConnection(path, role="probe", timeout_s=60)
        probe.request(Op.STATS, {})
        before = _open_fds(server.pid)
        for i in range(20):
            r, w = os.pipe()
            junk = [r, w] + ([os.pidfd_open(os.getpid())] if i % 2 else [])
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(60)
            sock.connect(path)
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", junk).tobytes())]
            sock.sendmsg([encode(Op.HELLO, 0, 0, {"role": "worker"})], anc)
            data, anc_in, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(8))
            assert decode(data, request=False).op is Op.OK
            for fd in junk + [fd for _, _, raw in anc_in for fd in array.array("i", raw)]:
                os.close(fd)
            sock.close()
        assert probe.request(Op.STATS, {})["clients"] == 1  # every HELLO connection was closed
        assert _fds_settle_at(server.pid, before) == before
        probe.close()
    finally:
        server.stop()


def test_legitimate_clients_store_beside_a_fuzzer() -> None:
    """Two client processes store byte-patterned objects and read every byte back, alone for 3 s, then for
    3 s beside a fuzzer process (garbage, oversized messages, reservations never committed on connections
    dropped or held open, pins, wrong epochs, random fences). The server runs as a node would run it for
    several client processes (each may hold a quarter of the segment): each client keeps at least 0.8 of the
    stores it made alone, no byte read is wrong, the server lives and logs a few lines, and once the fuzzer
    exits everything it held comes back."""
    run = fuzz.run_live(3.0, 0.25, capacity=64 << 20, region_bytes=4 << 20, tokens=16, warmup_s=1.0, seed=3)
    during, after = run["server_during_fuzz"], run["server_after_fuzzer_exit"]
    summary = {k: run[k] for k in ("min_ratio", "wrong_bytes", "server_alive", "log_lines", "log_tail")}
    assert run["server_alive"], summary
    assert run["server_exit"] == 0, summary
    assert run["wrong_bytes"] == 0, summary
    assert during["stats"]["protocol_errors"] > 100, during  # the fuzzer did reach the server
    assert during["stats"]["orphaned"] > 0, during  # ... and held reservations of dropped connections
    for client in run["clients"]:
        assert client["alone"]["stores"] > 0, client
        assert client["fuzzed"]["stores"] > 0, client
        assert client["ratio"] >= 0.8, {k: v for k, v in client.items() if k != "alone"}
    assert run["log_lines"] <= 12, summary
    assert run["log_bytes"] <= 4096, summary
    assert after["stats"]["reserved"] == 0, after
    assert after["stats"]["lost_sessions"] == 0, after
    assert after["fds"] <= run["server_before_fuzz"]["fds"] + 4, after


def test_lost_writes_spread_over_regions_hold_no_more_than_their_share() -> None:
    """A process's dropped connections each left one unfinished write in a size class of its own. A region
    holding a reservation cannot go to another class, so those writes count each region they lie in whole:
    with a share of one half, half the regions stay for the other clients (counted by slot bytes, 15 of the
    16 regions were held), and once the process exits its whole share is back."""
    region = 16 * MIN_SLOT
    seg, data_fd, header_fd = Segment.create(Geometry(region, 16), epoch=7)
    os.close(data_fd)
    os.close(header_fd)
    table = SlotTable(seg, Caps(max_share=0.5))
    lost = []
    for i in range(16):  # ascending sizes: each one a new class, which takes a region of its own
        conn = 100 + i
        table.set_holder(conn, -7)
        if isinstance(table.alloc(conn, [f"p{i}"], [MIN_SLOT * (i + 1)], [b""])[0], list):
            lost.append(conn)
        table.orphan(conn)
    assert table.stats()["orphaned"] == len(lost) == 8
    table.set_holder(200, -9)  # another process, objects of one region each
    other = table.alloc(200, [f"q{i}" for i in range(8)], [region] * 8, [b""] * 8)
    assert all(isinstance(ref, list) for ref in other), other
    assert table.abort(200, [(ref[0], ref[1]) for ref in other if isinstance(ref, list)]) == [True] * 8
    for conn in lost:  # the process exited
        table.free_reservations(conn)
    table.set_holder(300, -7)
    again = table.alloc(300, [f"r{i}" for i in range(8)], [region] * 8, [b""] * 8)
    assert all(isinstance(ref, list) for ref in again), again
