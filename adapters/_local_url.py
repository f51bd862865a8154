"""Parsing a local-file adapter URL (``scheme:///absolute/path?options``)."""

from __future__ import annotations

import os
from collections.abc import Collection
from urllib.parse import unquote, urlsplit

from tiercache.errors import ConfigError

__all__ = ["local_url"]


def local_url(url: str, schemes: Collection[str], label: str) -> tuple[str, str]:
    """The unquoted absolute path of ``url`` and its query string; ConfigError (one line, prefixed ``label``)
    for a scheme not in ``schemes``, a host other than ``localhost`` or a relative path."""
    form = f"{label}:///absolute/path"
    parts = urlsplit(url)
    if parts.scheme not in schemes:
        raise ConfigError(f"{label}: expected a {form} URL, got {url!r}")
    if parts.netloc not in ("", "localhost"):
        raise ConfigError(f"{label}: URL must be {form} (no host), got {url!r}")
    path = unquote(parts.path)
    if not os.path.isabs(path):
        raise ConfigError(f"{label}: URL must name an absolute path, got {url!r}")
    return path, parts.query
