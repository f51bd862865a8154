"""open_adapter: URL -> registered adapter class -> opened adapter."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiercache.errors import PluginError
from tiercache.registry import get_registry, missing_dependency_message

if TYPE_CHECKING:
    from tiercache.adapters import Adapter

__all__ = ["open_adapter"]


async def open_adapter(url: str, *, adapter: str | None = None, **options: object) -> Adapter:
    """Open the L2 store at ``url``: its scheme picks the adapter (``adapter="module:Class"`` overrides).

    A URL carrying a credential (a password in its user info, a secret-named query parameter) is refused
    with a ``ConfigError`` that names the ``*_env`` option to use instead and does not echo the secret."""
    from tiercache._secrets import check_url_secrets

    check_url_secrets(url, "open_adapter")
    registry = get_registry()
    if adapter is not None:
        cls = registry.adapter_class("", target=adapter)
        extra, dist = None, "tiercache"
    else:
        reg = registry.adapter_registration(registry.resolve_scheme(url))
        cls = registry.adapter_class(reg.name)
        extra, dist = reg.extra, reg.distribution
    try:
        return await cls.open(url, **options)
    except ModuleNotFoundError as exc:  # an adapter importing its client library lazily, in open()
        what = f"the {cls.scheme!r} adapter"
        raise PluginError(missing_dependency_message(what, exc, extra, dist)) from exc
