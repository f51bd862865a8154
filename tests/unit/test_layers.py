"""The layers hold: the import-linter contracts of pyproject.toml are kept by the source, and each kind of
crossing they forbid, added on purpose to a copy of the source, breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
PACKAGES = {"tiercache": ROOT / "tiercache", "tiercache_vllm": ROOT / "contrib/tiercache-vllm/tiercache_vllm"}

pytestmark = pytest.mark.skipif(
    not LINT_IMPORTS.exists() and not os.environ.get("CI"), reason="needs import-linter (the dev extra)"
)  # under CI a missing import-linter fails the tests instead


def _copy_source(dest: Path) -> Path:
    """The packages as Python imports them, copied as plain files under ``dest`` (symlinks followed)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.c")
    for name, src in PACKAGES.items():
        shutil.copytree(src, dest / name, symlinks=False, ignore=ignore)
    return dest


def _lint(src: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the repository's contracts over the packages under ``src`` (and nothing else)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _add_import(path: Path, line: str) -> None:
    """Append a module-level import to ``path`` (after everything else: still a real import at load time)."""
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")


def test_the_source_keeps_every_contract(tmp_path: Path) -> None:
    proc = _lint(_copy_source(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize(
    ("module", "imported"),
    [
        ("tiercache/gpu/reference.py", "tiercache.serde.fp8"),
        ("tiercache/serde/frame.py", "tiercache.adapters.memory"),
        ("tiercache/server/autostart.py", "tiercache.cli.main"),
        ("tiercache/config.py", "tiercache.store.l1"),
        ("tiercache/adapters/s3.py", "tiercache.config"),
        ("tiercache/store/engine.py", "tiercache.server.client"),
        ("tiercache/keys.py", "tiercache.gpu.layouts"),
        ("tiercache_vllm/worker.py", "tiercache._open"),
    ],
)
def test_a_crossing_breaks_the_contracts(tmp_path: Path, module: str, imported: str) -> None:
    src = _copy_source(tmp_path)
    _add_import(src / module, f"import {imported}")
    proc = _lint(src)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "BROKEN" in proc.stdout
    importer = module.removesuffix(".py").replace("/", ".")
    assert f"{importer} -> {imported}" in proc.stdout, proc.stdout


def test_an_import_cycle_breaks_the_contracts(tmp_path: Path) -> None:
    """The connector's server-mode module reads the settings through a protocol of its own; importing the
    settings' module back would close a cycle."""
    src = _copy_source(tmp_path)
    _add_import(src / "tiercache_vllm/_server.py", "import tiercache_vllm._common")
    proc = _lint(src)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "No cycles are allowed in tiercache_vllm" in proc.stdout, proc.stdout


def test_an_undeclared_module_breaks_the_layers(tmp_path: Path) -> None:
    """A new top-level module must be given its layer in pyproject.toml before it lands."""
    src = _copy_source(tmp_path)
    (src / "tiercache/newthing.py").write_text('"""New."""\n')
    proc = _lint(src)
    assert proc.returncode != 0
    assert "tiercache.newthing" in proc.stdout + proc.stderr
