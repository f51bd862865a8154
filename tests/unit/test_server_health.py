"""``tiercache health`` against real servers: a ``python -m tiercache.server`` child (live, SIGSTOPped, gone),
the probe run as the ``tiercache`` command in a child process. No mocks; no sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tiercache.server.health import check_health
from tiercache.testing.harness.processes import ConfigServer, NodeServer, run_as

TIERCACHE = str(Path(sys.executable).with_name("tiercache"))


class Server(NodeServer):
    """A running node server (asserted ready) of 4 slots of 4 KiB."""

    def __init__(self, path: str, *extra: str) -> None:
        super().__init__(path, *extra)
        assert self.ready

    def stop(self) -> int:
        code = super().stop()
        assert code == 0
        return code


@pytest.fixture
def server(sock_dir: Path) -> Iterator[Server]:
    srv = Server(str(sock_dir / "h.sock"), "--mode", "666")
    yield srv
    srv.stop()


def health(*args: str) -> tuple[int, str, str, float]:
    """Run ``tiercache health ARGS``: (exit status, stdout, stderr, seconds)."""
    start = time.monotonic()
    out = subprocess.run(
        [TIERCACHE, "health", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    return out.returncode, out.stdout, out.stderr, time.monotonic() - start


def test_healthy_server(server: Server, tmp_path: Path) -> None:
    rc, out, err, _ = health(server.path)
    assert (rc, err) == (0, "")
    assert out.startswith(f"tiercache health: ok: server at {server.path} answered in ")
    assert f"epoch {server.epoch}, pid {server.proc.pid}" in out
    assert out.count("\n") == 1  # one line

    rc, out, err, _ = health(server.path, "--json", "--timeout", "30")
    assert rc == 0
    report = json.loads(out)
    assert report["ok"] is True
    assert report["socket"] == server.path
    assert report["epoch"] == server.epoch
    assert report["pid"] == server.proc.pid
    assert report["timeout_s"] == 30
    assert 0 < report["seconds"] < 30
    assert report["stats"]["epoch"] == server.epoch  # the server's STATS reply, whole

    # the socket from the config's [server] table; a SOCKET argument wins over it
    good = tmp_path / "good.toml"
    good.write_text(f'[server]\nsocket = "{server.path}"\n')
    assert health("--config", str(good))[0] == 0
    other = tmp_path / "other.toml"
    other.write_text(f'[server]\nsocket = "{tmp_path / "absent.sock"}"\n')
    assert health(server.path, "--config", str(other))[0] == 0
    rc, _, err, _ = health("--config", str(other))
    assert rc == 1
    assert "absent.sock" in err

    # the config's server.server_uid: the probe checks the server's uid as a client does
    owner = tmp_path / "owner.toml"
    owner.write_text(f'[server]\nsocket = "{server.path}"\nserver_uid = {os.getuid()}\n')
    assert health("--config", str(owner))[0] == 0
    stranger = tmp_path / "stranger.toml"
    stranger.write_text(f'[server]\nsocket = "{server.path}"\nserver_uid = {os.getuid() + 4242}\n')
    rc, _, err, _ = health("--config", str(stranger))
    assert rc == 1
    assert err.startswith("tiercache health: FAIL: ")
    assert (
        f"untrusted_server: the server on {server.path} runs as uid {os.getuid()}, not {os.getuid() + 4242}"
        in err
    )

    direct = check_health(server.path, timeout_s=30)  # the library call the command makes
    assert direct.ok
    assert (direct.epoch, direct.pid) == (server.epoch, server.proc.pid)


def test_the_probe_asks_for_stats_only(sock_dir: Path, tmp_path: Path) -> None:
    """The server's own per-op counts (``/metrics`` of ``tiercache serve``): one probe is one HELLO and one
    STATS, nothing else."""
    sock = str(sock_dir / "m.sock")
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'[l1]\ncapacity = "64KiB"\n[server]\nsocket = "{sock}"\nmetrics_port = 0\n')
    with ConfigServer(cfg) as server:
        assert server.address == sock

        def counts() -> dict[str, float]:
            with urllib.request.urlopen(server.metrics_url, timeout=60) as resp:
                text = resp.read().decode()
            return {
                s.labels["op"]: s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "tiercache_server_op_seconds_count"
            }

        before = counts()
        assert health("--config", str(cfg))[0] == 0
        after = counts()
        assert {op: n - before.get(op, 0.0) for op, n in after.items() if n != before.get(op, 0.0)} == {
            "HELLO": 1,
            "STATS": 1,
        }
        assert server.stop() == 0


def test_stopped_server_fails_within_the_timeout(server: Server) -> None:
    os.kill(server.proc.pid, signal.SIGSTOP)  # alive, socket in place, connects still queue: answers nothing
    try:
        rc, out, err, seconds = health(server.path, "--timeout", "1.5")
        assert rc == 1
        assert out == ""
        assert (
            err
            == f"tiercache health: FAIL: no answer to HELLO from the server at {server.path} within 1.5 s\n"
        )
        assert seconds >= 1.5  # it waited for the answer (its bound: the JSON run's own seconds, below)

        direct = check_health(server.path, timeout_s=2.0)  # the whole probe is bounded, not each call
        assert not direct.ok
        # the deadline answered, not a socket timeout (each socket call may take timeout + 1 s) ...
        assert direct.reason.startswith("no answer to HELLO from the server"), direct.reason
        # ... within the timeout plus a loaded machine's scheduling delays, well under the 4 s that two
        # calls each given the whole timeout would take
        assert 2.0 <= direct.seconds < 3.5

        rc, out, _, _ = health(server.path, "--timeout", "1", "--json")
        assert rc == 1
        report = json.loads(out)
        assert report["ok"] is False
        assert "no answer to HELLO" in report["reason"]
        # the command's own wait, without its start-up (which a loaded machine stretches by seconds)
        assert 1.0 <= report["seconds"] < 2.5
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert health(server.path, "--timeout", "30")[0] == 0  # running again: healthy again


def test_no_server(sock_dir: Path) -> None:
    missing = str(sock_dir / "missing.sock")
    rc, out, err, _ = health(missing, "--timeout", "30")
    assert rc == 1
    assert out == ""
    assert err.startswith("tiercache health: FAIL: cannot reach the tiercache server at " + missing)
    assert err.count("\n") == 1

    stale = str(sock_dir / "stale.sock")  # a socket file no process listens on (its server died)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(stale)
    s.close()
    rc, _, err, seconds = health(stale, "--timeout", "30")
    assert rc == 1
    assert "Connection refused" in err
    assert seconds < 30

    rc, out, _, _ = health(missing, "--json")
    assert rc == 1
    assert json.loads(out)["ok"] is False


def test_server_gone_after_start(sock_dir: Path) -> None:
    srv = Server(str(sock_dir / "gone.sock"))
    assert health(srv.path)[0] == 0
    srv.kill()
    rc, _, err, _ = health(srv.path, "--timeout", "30")
    assert rc == 1
    assert "cannot reach" in err


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run the probe as another uid")
def test_probe_of_a_disallowed_uid_fails(server: Server) -> None:
    line = run_as(65534, lambda: check_health(server.path, timeout_s=30).line())
    assert line.startswith(f"tiercache health: FAIL: server at {server.path} refused the probe: forbidden")
    assert health(server.path, "--timeout", "30")[0] == 0  # its own uid is allowed


def test_usage_and_config_errors(tmp_path: Path, sock_dir: Path) -> None:
    sock = str(sock_dir / "never.sock")
    for args, fragment in [
        ((), "no socket: pass SOCKET or --config with server.socket"),
        ((sock, "--timeout", "0"), "--timeout must be > 0 seconds, got 0"),
        ((sock, "--timeout", "-1"), "--timeout must be > 0"),
        ((sock, "--timeout", "nan"), "--timeout must be > 0"),
        ((sock, "--timeout", "soon"), "invalid float value: 'soon'"),
        ((sock, "--bogus"), "unrecognized arguments: --bogus"),
        (("--config", str(tmp_path / "nope.toml")), "nope.toml"),
    ]:
        rc, out, err, _ = health(*args)
        assert rc == 2, args
        assert out == "", args
        assert fragment in err, (args, err)
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\nsockets = "/x"\n')
    rc, _, err, _ = health("--config", str(bad))
    assert rc == 2
    assert "unknown config key 'server.sockets'" in err
    unknown_user = tmp_path / "user.toml"
    unknown_user.write_text(f'[server]\nsocket = "{sock}"\nserver_uid = "no-such-user-tc"\n')
    rc, _, err, _ = health("--config", str(unknown_user))
    assert rc == 2
    assert "server.server_uid: no user named 'no-such-user-tc'" in err
    no_socket = tmp_path / "nosock.toml"
    no_socket.write_text('[l1]\ncapacity = "1GiB"\n')
    rc, out, _, _ = health("--config", str(no_socket), "--json")
    assert rc == 2
    assert json.loads(out)["reason"] == "no socket: pass SOCKET or --config with server.socket"
    with pytest.raises(ValueError, match="timeout"):
        check_health(sock, timeout_s=0)
