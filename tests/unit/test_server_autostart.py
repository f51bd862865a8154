"""``tiercache.server.autostart``: one private ``tiercache serve`` child per instance, shared by every process
of the instance (flock), gone once the process that started it exited; a failed start is recorded so that
every process of the instance falls back the same way. Real processes; waits are on pidfds and pipes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from servers import exits_within

from tiercache.server.autostart import (
    FAILED_NAME,
    INFO_NAME,
    AutostartError,
    ensure_private_server,
    private_dir,
    socket_answers,
)
from tiercache.server.client import SharedL1
from tiercache.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens=16)  # 2048 bytes

STARTER = r"""
import json, sys
from tiercache.server.autostart import ensure_private_server
path = ensure_private_server(sys.argv[1], slot_bytes=int(sys.argv[3]), base=sys.argv[2], timeout_s=60)
print(json.dumps({"socket": path}), flush=True)
sys.stdin.read()  # hold the server until the test closes our stdin
"""


class Starter:
    """A process that calls ``ensure_private_server`` and then waits for its stdin to close."""

    def __init__(self, instance: str, base: Path, slot_bytes: int = 4096) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", STARTER, instance, str(base), str(slot_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.socket: str | None = json.loads(line)["socket"] if line else None

    def exit(self) -> str:
        """Close stdin (the process exits normally); its stderr."""
        _, err = self.proc.communicate(timeout=60)
        return err


def test_one_server_per_instance_shared_and_gone_with_its_starter(tmp_path: Path) -> None:
    first = Starter("inst-a", tmp_path)
    assert first.socket is not None
    assert socket_answers(first.socket)
    where = Path(first.socket).parent
    assert where == tmp_path / f"tiercache-{os.getuid()}" / "inst-a"
    assert oct(where.stat().st_mode & 0o777) == oct(0o700)
    info = json.loads((where / INFO_NAME).read_text())
    assert info["socket"] == first.socket

    second = Starter("inst-a", tmp_path)  # another process of the instance: same server, none started
    assert second.socket == first.socket
    assert json.loads((where / INFO_NAME).read_text())["pid"] == info["pid"]
    other = Starter("inst-b", tmp_path)  # another instance: its own server
    assert other.socket is not None
    assert other.socket != first.socket

    l1 = SharedL1(first.socket)  # the private server is a real server: store and find an object
    obj = l1.reserve_write("k", SPEC)
    assert obj is not None
    l1.finish_write(obj)
    assert l1.contains("k")
    l1.close()

    second.exit()  # not the starter: the server stays
    assert socket_answers(first.socket)
    first.exit()
    assert exits_within(int(info["pid"]), 60.0)
    assert not where.exists()  # socket, info, lock and log removed with the directory
    assert socket_answers(other.socket)
    other.exit()


def test_a_failed_start_is_recorded_and_every_later_call_fails_at_once(tmp_path: Path) -> None:
    with pytest.raises(AutostartError, match="slot_bytes"):  # the child's own error, from its log
        ensure_private_server("bad", slot_bytes=-1, base=str(tmp_path), timeout_s=60)
    where = tmp_path / f"tiercache-{os.getuid()}" / "bad"
    assert (where / FAILED_NAME).exists()
    with pytest.raises(AutostartError, match="did not start before"):
        ensure_private_server("bad", slot_bytes=4096, base=str(tmp_path), timeout_s=60)


def test_private_dir_refuses_a_shared_or_foreign_root(tmp_path: Path) -> None:
    root = tmp_path / f"tiercache-{os.getuid()}"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    with pytest.raises(AutostartError, match="mode 0700"):
        private_dir("x", str(tmp_path))
    root.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    root.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(AutostartError, match="must be a directory"):
        private_dir("x", str(tmp_path))
    for bad in ("", "../up", ".hidden", "a/b"):
        with pytest.raises(AutostartError, match="instance id"):
            private_dir(bad, str(tmp_path / "fresh"))


def test_socket_answers_only_for_a_live_server(tmp_path: Path) -> None:
    assert not socket_answers(str(tmp_path / "missing.sock"))
    (tmp_path / "plain").write_text("")
    assert not socket_answers(str(tmp_path / "plain"))
