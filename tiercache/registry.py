"""Plugin registry: pluggy hooks collect ``"module:Class"`` strings; classes import on first use.

Discovery (built-ins plus the ``tiercache`` entry-point group) runs once, at configuration time; the data path
calls resolved classes, never hooks. Two plugins claiming one scheme is an error unless the caller names the
class explicitly.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pluggy

from tiercache import hookspecs
from tiercache.errors import PluginError

if TYPE_CHECKING:
    from tiercache.adapters import Adapter
    from tiercache.serde import Codec

__all__ = [
    "BUILTIN_PLUGINS",
    "ENTRY_POINT_GROUP",
    "Registration",
    "Registry",
    "get_registry",
    "load_target",
    "missing_dependency_message",
]

ENTRY_POINT_GROUP = "tiercache"
BUILTIN_PLUGINS = ("tiercache.adapters._builtin", "tiercache.serde._builtin")
_BUILTIN_DIST = "tiercache"


@dataclass(frozen=True, slots=True)
class Registration:
    """One registered adapter scheme or codec id and where it comes from."""

    kind: str  # "adapter" or "codec"
    name: str  # scheme or codec id
    target: str  # "module:Class"
    distribution: str  # distribution that registered it ("tiercache" for built-ins)
    extra: str | None = None  # pip extra that provides its dependencies
    alias_of: str | None = None  # for adapter aliases: the primary scheme


def missing_dependency_message(
    what: str, exc: ImportError, extra: str | None = None, distribution: str = _BUILTIN_DIST
) -> str:
    """One line saying which dependency of ``what`` is missing and the pip command that installs it."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        line = f"{what} needs the Python package {exc.name.partition('.')[0]!r}, which is not installed"
    else:  # the package is there but failed to load: typically a shared library of the system is missing
        line = f"{what} could not be loaded: {exc} (a system library it needs may be missing)"
    if extra:
        return f"{line}; install it with: pip install '{distribution}[{extra}]'"
    return line


def load_target(target: str, extra: str | None = None, distribution: str = _BUILTIN_DIST) -> Any:
    """Import ``"module:Class"``; an ImportError becomes a PluginError with the install hint."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise PluginError(f"plugin target {target!r} is not of the form 'module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(missing_dependency_message(repr(target), exc, extra, distribution)) from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise PluginError(f"{module_name!r} has no attribute {attr!r} (from {target!r})") from exc


class Registry:
    """Adapters and codecs known to this process, resolved lazily by name."""

    def __init__(
        self, plugin_manager: pluggy.PluginManager | None = None, *, entry_points: bool = True
    ) -> None:
        self._pm = plugin_manager or pluggy.PluginManager("tiercache")
        self._pm.add_hookspecs(hookspecs)
        self._plugin_dist: dict[str, str] = {}
        self._adapters: dict[str, list[Registration]] = {}
        self._codecs: dict[str, list[Registration]] = {}
        self._classes: dict[tuple[str, str], Any] = {}
        for name in BUILTIN_PLUGINS:
            self.add_plugin(importlib.import_module(name), _BUILTIN_DIST)
        if entry_points:
            self._load_entry_points()
        self._collect()

    def _load_entry_points(self) -> None:
        allow = os.environ.get("TIERCACHE_PLUGINS")
        allowed = None if allow is None else {p.strip() for p in allow.split(",") if p.strip()}
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allowed is not None and ep.name not in allowed:
                continue
            dist = ep.dist.name if ep.dist is not None else ep.name
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin breaks only itself, loudly
                raise PluginError(f"plugin {ep.name!r} from {dist!r} failed to load: {exc}") from exc
            self.add_plugin(plugin, dist, collect=False)

    def add_plugin(self, plugin: ModuleType | object, distribution: str, *, collect: bool = True) -> None:
        """Register a plugin object (module or instance with hookimpls) as coming from ``distribution``."""
        name = self._pm.register(plugin)
        if name is None:
            return  # already registered
        self._plugin_dist[name] = distribution
        if collect:
            self._collect()

    def _collect(self) -> None:
        self._adapters.clear()
        self._codecs.clear()
        for plugin in self._pm.get_plugins():
            name = self._pm.get_name(plugin)
            dist = self._plugin_dist.get(name or "", "unknown")
            self._collect_from(plugin, dist)

    def _collect_from(self, plugin: object, dist: str) -> None:
        def register_adapter(
            scheme: str, target: str, *, aliases: Sequence[str] = (), extra: str | None = None
        ) -> None:
            for alias_of, name in [(None, scheme), *((scheme, a) for a in aliases)]:
                reg = Registration("adapter", name.lower(), target, dist, extra, alias_of)
                self._add(self._adapters, reg)

        def register_codec(codec_id: str, target: str, *, extra: str | None = None) -> None:
            self._add(self._codecs, Registration("codec", codec_id, target, dist, extra))

        caller = self._pm.subset_hook_caller
        others = [p for p in self._pm.get_plugins() if p is not plugin]
        caller("tiercache_register_adapters", remove_plugins=others)(register=register_adapter)
        caller("tiercache_register_codecs", remove_plugins=others)(register=register_codec)

    @staticmethod
    def _add(table: dict[str, list[Registration]], reg: Registration) -> None:
        entries = table.setdefault(reg.name, [])
        if all(e.target != reg.target for e in entries):
            entries.append(reg)

    # ----- queries -----------------------------------------------------------------------------------------
    def adapters(self) -> list[Registration]:
        """Every adapter registration (aliases included), sorted by scheme."""
        return sorted((r for regs in self._adapters.values() for r in regs), key=lambda r: (r.name, r.target))

    def codecs(self) -> list[Registration]:
        """Every codec registration, sorted by id."""
        return sorted((r for regs in self._codecs.values() for r in regs), key=lambda r: (r.name, r.target))

    def resolve_scheme(self, url: str) -> str:
        """The registered scheme for ``url``: its own scheme, else what ``tiercache_resolve_scheme`` says."""
        scheme = url.partition("://")[0].lower() if "://" in url else ""
        if scheme in self._adapters:
            return scheme
        resolved = self._pm.hook.tiercache_resolve_scheme(url=url)
        if isinstance(resolved, str) and resolved.lower() in self._adapters:
            return resolved.lower()
        known = ", ".join(sorted(self._adapters))
        raise PluginError(f"no adapter for URL scheme {scheme or url!r}; known schemes: {known}")

    def adapter_class(self, scheme: str, target: str | None = None) -> type[Adapter]:
        """The adapter class for ``scheme``; ``target`` ("module:Class") overrides and settles duplicates."""
        if target is not None:
            return self._load(("adapter", target), target, None)  # type: ignore[no-any-return]
        reg = self.adapter_registration(scheme)
        return self._load(("adapter", reg.target), reg.target, reg.extra, reg.distribution)  # type: ignore[no-any-return]

    def adapter_registration(self, scheme: str) -> Registration:
        """The one registration of ``scheme`` (PluginError if none or several claim it)."""
        regs = self._adapters.get(scheme.lower())
        if not regs:
            known = ", ".join(sorted(self._adapters))
            raise PluginError(f"no adapter registered for scheme {scheme!r}; known schemes: {known}")
        if len(regs) > 1:
            claims = ", ".join(sorted(f"{r.target} (from {r.distribution})" for r in regs))
            raise PluginError(
                f"scheme {scheme!r} is claimed by several plugins: {claims}; "
                f'name the class with `adapter = "module:Class"` in the tier\'s config'
            )
        return regs[0]

    def codec_class(self, codec_id: str) -> type[Codec]:
        """The codec class registered as ``codec_id``."""
        regs = self._codecs.get(codec_id)
        if not regs:
            raise PluginError(f"unknown codec {codec_id!r}; known codecs: {', '.join(sorted(self._codecs))}")
        if len(regs) > 1:
            claims = ", ".join(sorted(f"{r.target} (from {r.distribution})" for r in regs))
            raise PluginError(f"codec id {codec_id!r} is claimed by several plugins: {claims}")
        reg = regs[0]
        return self._load(("codec", reg.target), reg.target, reg.extra, reg.distribution)  # type: ignore[no-any-return]

    def codec_ids(self) -> list[str]:
        """All registered codec ids."""
        return sorted(self._codecs)

    def _load(
        self, cache_key: tuple[str, str], target: str, extra: str | None, distribution: str = _BUILTIN_DIST
    ) -> Any:
        cls = self._classes.get(cache_key)
        if cls is None:
            cls = load_target(target, extra, distribution)
            self._classes[cache_key] = cls
        return cls


_registry: Registry | None = None
_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, built (and plugins discovered) on first call."""
    global _registry
    if _registry is None:
        with _lock:
            if _registry is None:
                _registry = Registry()
    return _registry


def reset_registry(registry: Registry | None = None) -> None:
    """Replace the process-wide registry (tests; after installing plugins at run time)."""
    global _registry
    with _lock:
        _registry = registry
