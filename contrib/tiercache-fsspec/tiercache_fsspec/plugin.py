"""The plugin module named by the ``tiercache`` entry point: registers the adapter through tiercache's hooks.

Registration is by ``"module:Class"`` string, so importing this module (at discovery) does not import fsspec;
the adapter module is imported the first time an ``fsspec+...`` URL is opened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiercache.hookspecs import hookimpl
from tiercache_fsspec import SCHEME, URL_PREFIX

if TYPE_CHECKING:
    from tiercache.hookspecs import AdapterRegistrar

__all__ = ["tiercache_register_adapters", "tiercache_resolve_scheme"]


@hookimpl
def tiercache_register_adapters(register: AdapterRegistrar) -> None:
    """Register ``fsspec`` (the ``fsspec+PROTOCOL`` URL family resolves to it)."""
    register(SCHEME, "tiercache_fsspec.adapter:FsspecAdapter")


@hookimpl
def tiercache_resolve_scheme(url: str) -> str | None:
    """``fsspec+PROTOCOL://...`` -> ``fsspec``; any other URL is not ours."""
    return SCHEME if url.lower().startswith(URL_PREFIX) else None
