"""open_adapter: URL -> registered adapter class -> opened adapter."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiercache.registry import get_registry

if TYPE_CHECKING:
    from tiercache.adapters import Adapter

__all__ = ["open_adapter"]


async def open_adapter(url: str, *, adapter: str | None = None, **options: object) -> Adapter:
    """Open the L2 store at ``url``: its scheme picks the adapter (``adapter="module:Class"`` overrides)."""
    registry = get_registry()
    if adapter is not None:
        cls = registry.adapter_class("", target=adapter)
    else:
        cls = registry.adapter_class(registry.resolve_scheme(url))
    return await cls.open(url, **options)
