"""The server's logging: a real ``tiercache serve`` writes its warnings and INFO lines on stderr, one line
each with time, level, pid and logger name; ``--log-level`` and ``server.log_level`` choose the
lowest level."""

from __future__ import annotations

import io
import logging
import re
import resource
from pathlib import Path

import pytest

from tiercache.config import ConfigError, config_from_dict
from tiercache.server.logsetup import setup_server_logging
from tiercache.testing.harness.processes import ConfigServer

LINE = (
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d{4} (?P<level>[A-Z]+) tiercache\[(?P<pid>\d+)\] "
    r"(?P<name>tiercache(\.\w+)*): "
)
FD_LIMIT = 256  # below 4 x max_clients (1024): the server warns at start


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def _serve(tmp_path: Path, sock_dir: Path, table: str = "", *args: str) -> tuple[int, str]:
    """Start ``tiercache serve`` (its ready line read), stop it; (pid, its stderr)."""
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'[l1]\ncapacity = "64KiB"\n[server]\nslot_bytes = 4096\n{table}\n')
    server = ConfigServer(cfg, str(sock_dir / "log.sock"), *args, preexec=_low_fd_limit)
    code = server.stop()
    err = server.log()
    assert code == 0, err
    return server.pid, err


def test_serve_logs_warnings_and_info_lines_formatted_on_stderr(tmp_path: Path, sock_dir: Path) -> None:
    pid, err = _serve(tmp_path, sock_dir)
    warn = re.search(LINE + r"the open-file limit \(256\) is below 4 x max_clients \(1024\)", err, re.M)
    assert warn is not None, err
    assert (warn["level"], warn["pid"], warn["name"]) == ("WARNING", str(pid), "tiercache.server.main")
    info = re.search(LINE + r"tiercache server epoch \d+ on ", err, re.M)
    assert info is not None, err
    assert (info["level"], info["pid"], info["name"]) == ("INFO", str(pid), "tiercache.server.server")
    for line in err.splitlines():  # every line is a formatted record: nothing bare, no color codes
        assert re.match(LINE, line), line
        assert "\x1b[" not in line


def test_log_level_flag_wins_over_the_config_key(tmp_path: Path, sock_dir: Path) -> None:
    _, err = _serve(tmp_path, sock_dir, 'log_level = "debug"', "--log-level", "WARNING")
    assert "open-file limit" in err
    assert "tiercache server epoch" not in err  # INFO is below the flag's level
    _, err = _serve(tmp_path, sock_dir, 'log_level = "error"')
    assert "open-file limit" not in err
    assert err == ""


def test_log_level_key_is_validated() -> None:
    assert config_from_dict({}).server.log_level == "info"
    assert config_from_dict({"server": {"log_level": "Debug"}}).server.log_level == "debug"
    with pytest.raises(ConfigError, match=r"server\.log_level must be one of debug, info, .*'loud'"):
        config_from_dict({"server": {"log_level": "loud"}})
    with pytest.raises(ConfigError, match=r"server\.log_level"):
        config_from_dict({"server": {"log_level": 10}})


def test_a_record_with_a_traceback_is_one_line() -> None:
    logger = logging.getLogger("tiercache")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    stream = io.StringIO()
    try:
        setup_server_logging("info", stream)
        logging.getLogger("tiercache.store.tier").debug("hidden")
        try:
            raise RuntimeError("first\nsecond")
        except RuntimeError:
            logging.getLogger("tiercache.store.tier").exception("tier failed")
    finally:
        logger.handlers[:] = saved[0]
        logger.setLevel(saved[1])
        logger.propagate = saved[2]
    out = stream.getvalue()
    assert out.count("\n") == 1, out
    assert re.match(LINE + r"tier failed\\nTraceback .*RuntimeError: first\\nsecond$", out), out
    assert "hidden" not in out
    with pytest.raises(ValueError, match="log level must be one of"):
        setup_server_logging("loud")
