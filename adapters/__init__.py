"""L2 adapters: the Adapter ABC and the built-in backends (imported lazily through the registry)."""

from __future__ import annotations

from tiercache.adapters._base import Adapter, Buffer, Capabilities, Lease, check_key, check_lengths

__all__ = ["Adapter", "Buffer", "Capabilities", "Lease", "check_key", "check_lengths"]
