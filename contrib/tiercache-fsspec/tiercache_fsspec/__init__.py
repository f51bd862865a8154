"""tiercache-fsspec: any fsspec filesystem as a tiercache L2 tier (``fsspec+PROTOCOL://...`` URLs)."""

from __future__ import annotations

__all__ = ["SCHEME", "URL_PREFIX"]

SCHEME = "fsspec"
"""The scheme the adapter is registered under; URLs name the filesystem after it: ``fsspec+memory://x``."""
URL_PREFIX = f"{SCHEME}+"
