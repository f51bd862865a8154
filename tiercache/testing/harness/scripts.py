"""``load_by_path``: a Python file outside any package (a script, a test module's helpers) as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_by_path"]


def load_by_path(path: str | Path, name: str) -> ModuleType:
    """The Python file at ``path`` as module ``name`` (loaded once, then taken from ``sys.modules``).

    For files outside any package (a benchmark script, a test file's helpers): it is registered in
    ``sys.modules`` before it runs, as dataclasses and pickling look their module up by name.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
