"""Package layout: ``import tiercache`` stays free of torch, and DESIGN §4's entry points resolve."""

from __future__ import annotations

import subprocess
import sys


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
