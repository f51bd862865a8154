"""tiercache: a tiered KV-cache store for disaggregated LLM inference.

Importing this package is light (no torch, redis or boto); heavy parts load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tiercache.errors import (
    AdapterError,
    AdapterTimeout,
    AdapterUnavailable,
    ConfigError,
    FrameError,
    PluginError,
    TiercacheError,
)

if TYPE_CHECKING:
    from tiercache._open import open_adapter
    from tiercache.config import Config, load_config
    from tiercache.store.engine import CacheEngine

__version__ = "0.1.0"

__all__ = [
    "AdapterError",
    "AdapterTimeout",
    "AdapterUnavailable",
    "CacheEngine",
    "Config",
    "ConfigError",
    "FrameError",
    "PluginError",
    "TiercacheError",
    "__version__",
    "load_config",
    "open_adapter",
]

_LAZY = {
    "open_adapter": ("tiercache._open", "open_adapter"),
    "load_config": ("tiercache.config", "load_config"),
    "Config": ("tiercache.config", "Config"),
    "CacheEngine": ("tiercache.store.engine", "CacheEngine"),
}


def __getattr__(name: str) -> Any:
    """Import public entry points on first access so ``import tiercache`` stays light."""
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tiercache' has no attribute {name!r}")
