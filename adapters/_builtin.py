"""Built-in adapters, registered through the same pluggy hook third-party packages use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiercache.hookspecs import hookimpl

if TYPE_CHECKING:
    from tiercache.hookspecs import AdapterRegistrar

__all__ = ["tiercache_register_adapters"]


@hookimpl
def tiercache_register_adapters(register: AdapterRegistrar) -> None:
    """Register the memory and file (POSIX directory) adapters."""
    register("memory", "tiercache.adapters.memory:MemoryAdapter")
    register("file", "tiercache.adapters.posix:PosixAdapter", aliases=("posix",))
