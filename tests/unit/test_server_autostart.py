"""``tiercache.server.autostart``: one private ``tiercache serve`` per instance, shared by every process of
the instance (flock), run by a keeper that removes the instance's directory once the process that started it
has exited, however it exited (clean exit, SIGTERM, SIGKILL), once the server died by itself, and after a
failed start, whose record stays until then so that every process of the live instance falls back the same
way. Real processes; waits are on pidfds and pipes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tiercache.server.autostart import (
    FAILED_NAME,
    INFO_NAME,
    AutostartError,
    ensure_private_server,
    private_dir,
    socket_answers,
)
from tiercache.server.client import ServerConnection, SharedL1
from tiercache.spec import KVSpec
from tiercache.testing.harness.processes import exits_within

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens=16)  # 2048 bytes

STARTER = r"""
import json, sys
from tiercache.server.autostart import AutostartError, ensure_private_server
config = sys.argv[4] if len(sys.argv) > 4 else None
try:
    path = ensure_private_server(
        sys.argv[1], slot_bytes=int(sys.argv[3]), base=sys.argv[2], config_path=config, timeout_s=60
    )
except AutostartError as exc:
    print(json.dumps({"error": str(exc)}), flush=True)
else:
    print(json.dumps({"socket": path}), flush=True)
sys.stdin.read()  # hold the server (or the failed record) until the test closes our stdin
"""


class Starter:
    """A process that calls ``ensure_private_server`` and then waits for its stdin to close."""

    def __init__(
        self,
        instance: str,
        base: Path,
        slot_bytes: int = 4096,
        config: str | None = None,
        cwd: Path | None = None,
    ) -> None:
        argv = [sys.executable, "-c", STARTER, instance, str(base), str(slot_bytes)]
        self.proc = subprocess.Popen(
            argv + ([config] if config else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        answer = json.loads(line) if line else {}
        self.socket: str | None = answer.get("socket")
        self.error: str | None = answer.get("error")

    def exit(self) -> str:
        """Close stdin (the process exits normally); its stderr."""
        _, err = self.proc.communicate(timeout=60)
        return err

    def signal(self, sig: int) -> None:
        """Send ``sig`` and reap the process."""
        self.proc.send_signal(sig)
        self.proc.communicate(timeout=60)


def _info(socket_path: str) -> dict[str, int]:
    info: dict[str, int] = json.loads((Path(socket_path).parent / INFO_NAME).read_text())
    return info


def _server_pid(info: dict[str, int]) -> int:
    """The server's pid (``pid`` is its keeper's, which exits after it)."""
    return info.get("server_pid", info["pid"])


def _keeper_pid(where: Path) -> int | None:
    """The pid of the keeper owning ``where`` (None: no keeper file)."""
    keeper = where / "keeper"
    return int(keeper.read_text().split()[0]) if keeper.exists() else None


def test_one_server_per_instance_shared_and_gone_with_its_starter(tmp_path: Path) -> None:
    first = Starter("inst-a", tmp_path)
    assert first.socket is not None
    assert socket_answers(first.socket)
    where = Path(first.socket).parent
    assert where == tmp_path / f"tiercache-{os.getuid()}" / "inst-a"
    assert oct(where.stat().st_mode & 0o777) == oct(0o700)
    info = _info(first.socket)
    assert info["socket"] == first.socket

    second = Starter("inst-a", tmp_path)  # another process of the instance: same server, none started
    assert second.socket == first.socket
    assert _info(first.socket) == info
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
    assert exits_within(info["pid"], 60.0)  # the keeper exits last: after the server and the cleanup
    assert not where.exists()  # everything in it removed (the server's socket lock file too)
    assert exits_within(_server_pid(info), 1.0)
    assert socket_answers(other.socket)
    other.exit()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_directory_goes_when_the_starter_is_killed(tmp_path: Path, sig: int) -> None:
    starter = Starter("killed", tmp_path)
    assert starter.socket is not None
    info = _info(starter.socket)
    starter.signal(sig)
    assert exits_within(info["pid"], 60.0)
    assert not Path(starter.socket).parent.exists()
    assert exits_within(_server_pid(info), 1.0)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (by parent links, as psutil's ``children(recursive=True)`` finds them)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def test_the_directory_goes_when_the_starters_whole_process_tree_is_killed(tmp_path: Path) -> None:
    """vLLM's forced shutdown (``kill_process_tree``) SIGKILLs every descendant of a process that did not
    stop in time: the private server is none of them (the keeper left the starter's tree), so it still
    cleans up once the starter is gone."""
    starter = Starter("tree", tmp_path)
    assert starter.socket is not None
    info = _info(starter.socket)
    for pid in [starter.proc.pid, *_descendants(starter.proc.pid)]:
        os.kill(pid, signal.SIGKILL)
    starter.proc.communicate(timeout=60)
    assert exits_within(info["pid"], 60.0)
    assert not Path(starter.socket).parent.exists()
    assert exits_within(_server_pid(info), 1.0)


def test_a_server_that_dies_by_itself_is_cleaned_up_and_the_next_caller_starts_a_new_one(
    tmp_path: Path,
) -> None:
    starter = Starter("crash", tmp_path)
    assert starter.socket is not None
    where = Path(starter.socket).parent
    info = _info(starter.socket)
    os.kill(_server_pid(info), signal.SIGKILL)  # a crash: its socket file stays behind
    assert exits_within(info["pid"], 60.0)  # the keeper removed the directory and left
    assert not where.exists()

    again = Starter("crash", tmp_path)  # the same instance asks again: a fresh server
    assert again.socket == starter.socket
    assert socket_answers(again.socket)
    assert _server_pid(_info(again.socket)) != _server_pid(info)
    starter.exit()  # the first starter's exit leaves the new server alone
    assert socket_answers(again.socket)
    fresh = _info(again.socket)
    again.exit()
    assert exits_within(fresh["pid"], 60.0)
    assert not where.exists()


def test_a_keeper_killed_takes_its_server_and_directory_with_it(tmp_path: Path) -> None:
    starter = Starter("keeper", tmp_path)
    assert starter.socket is not None
    info = _info(starter.socket)
    os.kill(info["pid"], signal.SIGKILL)
    assert exits_within(_server_pid(info), 60.0)  # stopped on its keeper's death, after its cleanup
    assert not Path(starter.socket).parent.exists()
    starter.exit()


def test_a_failed_start_is_recorded_while_the_starter_lives_then_removed(tmp_path: Path) -> None:
    first = Starter("bad", tmp_path, slot_bytes=-1)
    assert first.socket is None
    assert first.error is not None
    assert "slot bytes must be positive" in first.error  # the server's own error, from its log
    assert "\n" not in first.error
    where = tmp_path / f"tiercache-{os.getuid()}" / "bad"
    assert (where / FAILED_NAME).exists()
    keeper = _keeper_pid(where)  # it keeps the record and removes it with the directory

    second = Starter("bad", tmp_path)  # another process of the live instance: the same choice, at once
    assert second.error is not None
    assert "did not start before" in second.error
    with pytest.raises(AutostartError, match="did not start before"):
        ensure_private_server("bad", slot_bytes=4096, base=str(tmp_path), timeout_s=60)
    second.exit()
    assert (where / FAILED_NAME).exists()  # only the starter's exit ends the record

    first.exit()
    assert keeper is None or exits_within(keeper, 60.0)
    assert not where.exists()


def test_a_failed_record_whose_keeper_and_starter_were_killed_is_stale(tmp_path: Path) -> None:
    """A failed record outlives its instance only when its keeper was killed too: the next instance of the
    same id (a fixed engine_id) then starts afresh instead of falling back for ever."""
    first = Starter("stale", tmp_path, slot_bytes=-1)
    assert first.error is not None
    where = tmp_path / f"tiercache-{os.getuid()}" / "stale"
    keeper = _keeper_pid(where)
    assert keeper is not None
    os.kill(keeper, signal.SIGKILL)
    first.signal(signal.SIGKILL)
    assert exits_within(keeper, 60.0)
    assert (where / FAILED_NAME).exists()  # nobody was left to remove it

    again = Starter("stale", tmp_path)
    assert again.error is None
    assert again.socket is not None
    assert socket_answers(again.socket)
    info = _info(again.socket)
    again.exit()
    assert exits_within(info["pid"], 60.0)
    assert not where.exists()


def test_a_relative_config_is_the_servers_config(tmp_path: Path) -> None:
    """The server runs in the private directory; a config path relative to the starter's working directory
    reaches it absolute (the config's L2 tier is the server's)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "tiercache.toml").write_text(
        f'[l1]\ncapacity = "4MiB"\n\n[[tiers]]\nname = "reltier"\nurl = "file://{tmp_path / "l2"}"\n'
    )
    (tmp_path / "rt").mkdir()
    starter = Starter("relcfg", tmp_path / "rt", config="tiercache.toml", cwd=work)
    assert starter.error is None
    assert starter.socket is not None
    conn = ServerConnection(starter.socket, role="probe")
    assert conn.tiers == ["reltier"]
    conn.close()
    info = _info(starter.socket)
    starter.exit()
    assert exits_within(info["pid"], 60.0)


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
