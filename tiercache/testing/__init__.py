"""Conformance kit for adapter and codec packages, and the fault-injection wrapper. Importing it does not
import pytest.

Third parties subclass ``AdapterConformance`` / ``CodecConformance`` in their own test suites;
``FaultInjectingAdapter`` injects faults around a real adapter (``InMemoryAdapter`` is the old name of
``tiercache.adapters.memory.MemoryAdapter``). ``tiercache.testing.harness`` holds the test support that the
repository's tests and benchmarks share (server launchers, the fuzz, soak and fault-matrix harnesses).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiercache.testing.adapters import AdapterConformance
    from tiercache.testing.codecs import CodecConformance
    from tiercache.testing.fakes import FaultInjectingAdapter, InMemoryAdapter

__all__ = ["AdapterConformance", "CodecConformance", "FaultInjectingAdapter", "InMemoryAdapter"]

_LAZY = {
    "AdapterConformance": "tiercache.testing.adapters",
    "CodecConformance": "tiercache.testing.codecs",
    "FaultInjectingAdapter": "tiercache.testing.fakes",
    "InMemoryAdapter": "tiercache.testing.fakes",
}


def __getattr__(name: str) -> Any:
    """Load kit classes on first use (they import pytest)."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tiercache.testing' has no attribute {name!r}")
