"""The one error hierarchy of tiercache: every failure a caller may handle derives from TiercacheError."""

from __future__ import annotations

__all__ = [
    "AdapterError",
    "AdapterTimeout",
    "AdapterUnavailable",
    "ConfigError",
    "FrameError",
    "PluginError",
    "TiercacheError",
    "Unsupported",
]


class TiercacheError(Exception):
    """Base of every error tiercache raises on purpose."""


class ConfigError(TiercacheError, ValueError):
    """A configuration is invalid: unknown key, bad value, missing secret. The message names the key."""


class PluginError(TiercacheError):
    """A plugin could not be registered or resolved (unknown scheme, duplicate scheme, missing extra)."""


class AdapterError(TiercacheError):
    """An L2 adapter failed at the transport level. Misses are results, never AdapterError."""


class AdapterUnavailable(AdapterError):
    """The backend cannot be reached (connection refused, closed adapter, server down)."""


class AdapterTimeout(AdapterError):
    """The backend did not answer within the deadline."""


class Unsupported(AdapterError):
    """The adapter lacks the capability the caller asked for (see Capabilities); also raised inside
    ``tiercache.gpu`` when the kernels cannot do a move (the dispatch then runs the torch reference)."""


class FrameError(TiercacheError):
    """A stored frame failed a check (magic, version, length, checksum, spec, key, AEAD tag): it is a miss."""
