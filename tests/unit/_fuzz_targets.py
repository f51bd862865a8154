"""Loads ``benchmarks/fuzz.py`` (the fuzz targets and their oracles) for the short fuzz runs in the tests."""

from __future__ import annotations

import pathlib
from types import ModuleType

from tiercache.testing.harness.scripts import load_by_path

FUZZ = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz.py"


def load() -> ModuleType:
    """The fuzz module (loaded once per process)."""
    return load_by_path(FUZZ, "tiercache_fuzz")
