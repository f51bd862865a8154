"""Loads ``benchmarks/fuzz.py`` (the fuzz targets and their oracles) for the short fuzz runs in the tests."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

FUZZ = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz.py"


def load() -> ModuleType:
    """The fuzz module (loaded once per process)."""
    if "tiercache_fuzz" in sys.modules:
        return sys.modules["tiercache_fuzz"]
    spec = importlib.util.spec_from_file_location("tiercache_fuzz", FUZZ)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
