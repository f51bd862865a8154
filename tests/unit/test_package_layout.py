"""Package layout: `import tiercache` stays free of torch, the entry points resolve, the top-level folders
are subpackages through relative symlinks, and a second checkout imports its own code."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def _probe(code: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    return proc.stdout.split()


def test_import_tiercache_and_its_layers_stay_free_of_torch() -> None:
    code = "import sys, tiercache, tiercache.store, tiercache.cli; print('torch' in sys.modules)"
    assert _probe(code) == ["False"]


def test_cache_engine_is_exported_lazily_from_the_store() -> None:
    code = (
        "import sys, tiercache; before = 'torch' in sys.modules; engine = tiercache.CacheEngine; "
        "from tiercache.store.engine import CacheEngine; "
        "print(before, engine is CacheEngine, 'CacheEngine' in tiercache.__all__)"
    )
    assert _probe(code) == ["False", "True", "True"]


def test_public_entry_points_resolve() -> None:
    code = (
        "import tiercache, tiercache.keys as k, tiercache.serde as s; "
        "print(callable(tiercache.load_config), callable(tiercache.open_adapter), "
        "callable(s.build_pipeline), callable(s.read_header), callable(k.contiguous_prefix))"
    )
    assert _probe(code) == ["True"] * 5


ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("adapters", "serde", "gpu")
"""The design's top-level folders, subpackages of ``tiercache``."""


def test_the_top_level_folders_are_subpackages_through_relative_symlinks() -> None:
    """``tiercache/<folder>`` is a symlink to ``../<folder>``: one real path per module, and a checkout's
    package always holds that checkout's folders."""
    for name in FOLDERS:
        link = ROOT / "tiercache" / name
        assert link.is_symlink(), link
        assert os.readlink(link) == f"../{name}"
        assert (link / "__init__.py").resolve() == (ROOT / name / "__init__.py").resolve()


def test_a_second_checkout_imports_its_own_folders(tmp_path: Path) -> None:
    """Python started in another checkout takes ``tiercache`` and its ``adapters``, ``serde`` and ``gpu`` from
    that checkout, not from the checkout installed (editable) in the environment."""
    other = tmp_path / "other"
    skip = shutil.ignore_patterns("__pycache__", "*.so")
    for name in ("tiercache", *FOLDERS):
        shutil.copytree(ROOT / name, other / name, symlinks=True, ignore=skip)
    (other / "adapters" / "_this_checkout.py").write_text("")
    code = (
        "import tiercache, tiercache.adapters, tiercache.serde, tiercache.gpu; "
        "import tiercache.adapters._this_checkout; "
        "print(*(m.__file__ for m in (tiercache, tiercache.adapters, tiercache.serde, tiercache.gpu)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=other, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    files = [Path(f) for f in proc.stdout.split()]
    assert len(files) == 4
    for f in files:
        assert f.resolve().is_relative_to(other.resolve()), f
