"""pluggy hook specifications of tiercache; plugins implement them with ``@hookimpl``.

Hooks run once, when the registry is first used (configuration time), never per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import pluggy

__all__ = ["AdapterRegistrar", "CodecRegistrar", "hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("tiercache")
hookimpl = pluggy.HookimplMarker("tiercache")


class AdapterRegistrar(Protocol):
    """Callback a plugin calls once per adapter it provides."""

    def __call__(
        self, scheme: str, target: str, *, aliases: Sequence[str] = (), extra: str | None = None
    ) -> None:
        """Register ``target`` ("module:Class") for URL ``scheme`` (and ``aliases``); ``extra`` names the
        pip extra that provides its dependencies (for the install hint)."""


class CodecRegistrar(Protocol):
    """Callback a plugin calls once per codec it provides."""

    def __call__(self, codec_id: str, target: str, *, extra: str | None = None) -> None:
        """Register ``target`` ("module:Class") as codec ``codec_id``."""


@hookspec
def tiercache_register_adapters(register: AdapterRegistrar) -> None:
    """Call ``register(scheme, "pkg.mod:Class", aliases=..., extra=...)`` for each adapter."""


@hookspec
def tiercache_register_codecs(register: CodecRegistrar) -> None:
    """Call ``register(codec_id, "pkg.mod:Class", extra=...)`` for each codec."""


@hookspec(firstresult=True)
def tiercache_resolve_scheme(url: str) -> str | None:
    """Map a URL whose scheme is not registered (e.g. an https endpoint) to a registered scheme, or None."""
