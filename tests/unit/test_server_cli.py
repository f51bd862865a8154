"""``tiercache serve`` and the ``[server]`` config table: a real server process started by the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tiercache.config import ConfigError, ServerConfig, config_from_dict
from tiercache.server.client import SharedL1
from tiercache.spec import KVSpec

TIERCACHE = str(Path(sys.executable).with_name("tiercache"))


def test_server_table_parses_and_validates() -> None:
    cfg = config_from_dict(
        {
            "server": {
                "socket": "/run/tc.sock",
                "slot_bytes": "1MiB",
                "mode": "0660",
                "group": "kv",
                "allowed_uids": [1000, 1001],
                "metrics_port": 9400,
            }
        }
    )
    assert cfg.server == ServerConfig("/run/tc.sock", 1 << 20, 0o660, "kv", (1000, 1001), 9400, "127.0.0.1")
    assert config_from_dict({}).server == ServerConfig()
    for bad, fragment in [
        ({"mode": "rw"}, "octal"),
        ({"mode": 0o1777}, "not a file mode"),
        ({"allowed_uids": [-1]}, "allowed_uids"),
        ({"metrics_port": 70000}, r"server.metrics_port must be in \[0, 65535\]"),
        ({"max_share_per_client": 0}, "server.max_share_per_client"),
        ({"max_leases_per_client": 0}, "server.max_leases_per_client"),
        ({"max_clients": 0}, "server.max_clients"),
        ({"orphan_grace_s": -1}, "server.orphan_grace_s"),
        ({"region_bytes": 10}, "server.region_bytes"),
        ({"admin_group": 1.5}, "server.admin_group must be int or str"),
        ({"sockets": "/x"}, "unknown config key 'server.sockets'"),
        ({"slot_bytes": "lots"}, "server.slot_bytes"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            config_from_dict({"server": bad})


def _serve(tmp_path: Path, server_table: str, *args: str) -> subprocess.Popen[str]:
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'[l1]\ncapacity = "64KiB"\n[server]\n{server_table}\n')
    return subprocess.Popen(
        [TIERCACHE, "serve", "--config", str(cfg), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )


def test_serve_from_config_with_metrics(tmp_path: Path, sock_dir: Path) -> None:
    sock = str(sock_dir / "ignored.sock")
    real = str(sock_dir / "cli.sock")
    proc = _serve(tmp_path, f'socket = "{sock}"\nslot_bytes = 4096\nmetrics_port = 0', "--socket", real)
    try:
        assert proc.stdout is not None
        metrics_line = proc.stdout.readline()
        ready = proc.stdout.readline()
        assert ready.startswith(f"tiercache server listening on {real} ")  # --socket wins
        assert not os.path.exists(sock)
        assert os.stat(real).st_mode & 0o777 == 0o600
        l1 = SharedL1(real)
        stats = l1.server_stats()
        assert stats is not None
        assert stats["num_slots"] == 16  # 64 KiB / 4096
        spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", tokens=16)
        obj = l1.reserve_write("k", spec)
        assert obj is not None
        l1.finish_write(obj)
        url = metrics_line.split()[-1]
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url, timeout=60) as resp:
            text = resp.read().decode()
        assert 'tiercache_server_slots{state="published"} 1.0' in text
        assert 'tiercache_server_slots{state="free"} 15.0' in text
        assert "tiercache_server_clients 1.0" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert not os.path.exists(real)


def test_serve_config_errors_are_clear(tmp_path: Path, sock_dir: Path) -> None:
    no_socket = _serve(tmp_path, "slot_bytes = 4096")
    _, err = no_socket.communicate(timeout=60)
    assert no_socket.returncode == 2
    assert "pass --socket or set server.socket" in err
    too_big = _serve(tmp_path, "slot_bytes = 65537", "--socket", str(sock_dir / "s.sock"))
    _, err = too_big.communicate(timeout=60)
    assert too_big.returncode == 2
    assert "an object of 65537 bytes does not fit a region of 65536 bytes" in err
    bad_group = _serve(tmp_path, 'admin_group = "no-such-group-here"', "--socket", str(sock_dir / "s.sock"))
    _, err = bad_group.communicate(timeout=60)
    assert bad_group.returncode == 2
    assert "no group named 'no-such-group-here'" in err


def test_serve_without_slot_bytes_serves_every_object_size(tmp_path: Path, sock_dir: Path) -> None:
    """No server.slot_bytes: size classes come from the clients, so two models (two object sizes) share
    one server, each object byte-exact in its own class."""
    cfg = tmp_path / "serve.toml"
    cfg.write_text('[l1]\ncapacity = "1MiB"\n[server]\nregion_bytes = "64KiB"\n')
    proc = subprocess.Popen(
        [TIERCACHE, "serve", "--config", str(cfg), "--socket", str(sock_dir / "s.sock")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("tiercache server listening")
        small = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", tokens=16)  # 512 B
        large = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32", tokens=16)  # 32 KiB
        model_a = SharedL1(str(sock_dir / "s.sock"), slot_bytes=[small.nbytes])
        model_b = SharedL1(str(sock_dir / "s.sock"), slot_bytes=[large.nbytes])
        for l1, spec, fill in ((model_a, small, 1), (model_b, large, 2), (model_a, small, 3)):
            for i in range(3):
                obj = l1.reserve_write(f"{fill}-{i}", spec)
                assert obj is not None
                obj.buffer()[:] = bytes([fill + i]) * spec.nbytes
                l1.finish_write(obj)
        for l1, spec, fill in ((model_a, small, 1), (model_b, large, 2), (model_a, small, 3)):
            for i in range(3):
                lease = l1.acquire(f"{fill}-{i}")
                assert lease is not None
                assert bytes(lease.obj.buffer()) == bytes([fill + i]) * spec.nbytes
                assert lease.valid()
                lease.release()
        stats = model_a.server_stats()
        assert stats is not None
        assert stats["classes"] == 2
        assert stats["max_object"] == 64 * 1024
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
