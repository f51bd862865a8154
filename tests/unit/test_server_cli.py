"""``tiercache serve`` and the ``[server]`` config table: a real server process started by the CLI."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest

from tiercache.config import ConfigError, ServerConfig, config_from_dict
from tiercache.server.client import SharedL1
from tiercache.spec import KVSpec
from tiercache.testing.harness.processes import ConfigServer, ServeFailed


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


def _config(tmp_path: Path, server_table: str, capacity: str = "64KiB") -> Path:
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'[l1]\ncapacity = "{capacity}"\n[server]\n{server_table}\n')
    return cfg


def test_serve_from_config_with_metrics(tmp_path: Path, sock_dir: Path) -> None:
    sock = str(sock_dir / "ignored.sock")
    real = str(sock_dir / "cli.sock")
    server = ConfigServer(_config(tmp_path, f'socket = "{sock}"\nslot_bytes = 4096\nmetrics_port = 0'), real)
    try:
        assert server.address == real  # --socket wins
        assert not os.path.exists(sock)
        assert os.stat(real).st_mode & 0o777 == 0o600
        l1 = SharedL1(real)
        stats = l1.server_stats()
        assert stats is not None
        assert stats["num_slots"] == 16  # 64 KiB / 4096
        assert stats["epoch"] == server.epoch
        spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", tokens=16)
        obj = l1.reserve_write("k", spec)
        assert obj is not None
        l1.finish_write(obj)
        assert server.metrics_url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(server.metrics_url, timeout=60) as resp:
            text = resp.read().decode()
        assert 'tiercache_server_slots{state="published"} 1.0' in text
        assert 'tiercache_server_slots{state="free"} 15.0' in text
        assert "tiercache_server_clients 1.0" in text
    finally:
        assert server.stop() == 0
    assert not os.path.exists(real)


def test_serve_config_errors_are_clear(tmp_path: Path, sock_dir: Path) -> None:
    sock = str(sock_dir / "s.sock")
    for table, socket_path, message in [
        ("slot_bytes = 4096", None, "pass --socket or set server.socket"),
        ("slot_bytes = 65537", sock, "an object of 65537 bytes does not fit a region of 65536 bytes"),
        ('admin_group = "no-such-group-here"', sock, "no group named 'no-such-group-here'"),
    ]:
        with pytest.raises(ServeFailed) as failed:
            ConfigServer(_config(tmp_path, table), socket_path).stop()
        assert failed.value.returncode == 2, failed.value.log
        assert message in failed.value.log


def test_serve_without_slot_bytes_serves_every_object_size(tmp_path: Path, sock_dir: Path) -> None:
    """No server.slot_bytes: size classes come from the clients, so two models (two object sizes) share
    one server, each object byte-exact in its own class."""
    sock = str(sock_dir / "s.sock")
    server = ConfigServer(_config(tmp_path, 'region_bytes = "64KiB"', capacity="1MiB"), sock)
    try:
        small = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", tokens=16)  # 512 B
        large = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32", tokens=16)  # 32 KiB
        model_a = SharedL1(sock, slot_bytes=[small.nbytes])
        model_b = SharedL1(sock, slot_bytes=[large.nbytes])
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
        assert server.stop() == 0
