"""Registry: built-ins through the hooks, entry-point plugins, lazy import, install hints, duplicates."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiercache.errors import PluginError
from tiercache.registry import Registry, get_registry, load_target, reset_registry

PLUGINS = Path(__file__).resolve().parent.parent / "fixtures" / "plugins"


@pytest.fixture
def plugin_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Put the committed fake distributions on sys.path (entry points are read from their dist-info)."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("TIERCACHE_PLUGINS", "fakeplugin")
    yield
    for name in [m for m in sys.modules if m.startswith("tiercache_fakeplugin")]:
        del sys.modules[name]
    reset_registry()


def test_builtins_register_through_the_same_hooks() -> None:
    registry = Registry(entry_points=False)
    adapters = {r.name: r for r in registry.adapters()}
    assert adapters["memory"].target == "tiercache.adapters.memory:MemoryAdapter"
    assert adapters["file"].distribution == "tiercache"
    assert adapters["posix"].alias_of == "file"
    assert "raw" in registry.codec_ids()
    assert registry.adapter_class("posix") is registry.adapter_class("file")
    assert registry.adapter_class("FILE").scheme == "file"


def test_entry_point_plugin_is_discovered_with_its_distribution(plugin_path: None) -> None:
    registry = Registry()
    by_name = {r.name: r for r in registry.adapters()}
    assert by_name["fakemem"].distribution == "tiercache-fakeplugin"
    assert by_name["fakemem2"].alias_of == "fakemem"
    assert registry.adapter_class("fakemem").__name__ == "FakeMemAdapter"
    assert registry.codec_class("fakeraw").codec_id == "raw"
    assert registry.resolve_scheme("https://fake.example/bucket") == "fakemem"


def test_classes_import_on_first_use_only(plugin_path: None) -> None:
    registry = Registry()
    assert "tiercache_fakeplugin.adapter" not in sys.modules
    registry.adapter_class("fakemem")
    assert "tiercache_fakeplugin.adapter" in sys.modules


def test_missing_dependency_gives_the_install_hint(plugin_path: None) -> None:
    registry = Registry()
    # the extra belongs to the plugin's own distribution, so the hint names it
    with pytest.raises(PluginError, match=r"pip install 'tiercache-fakeplugin\[fakedep\]'"):
        registry.adapter_class("needsdep")


def test_two_plugins_claiming_one_scheme_is_an_error_unless_the_class_is_named(
    plugin_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERCACHE_PLUGINS", "fakeplugin,clash")
    registry = Registry()
    with pytest.raises(PluginError, match="claimed by several plugins") as err:
        registry.adapter_class("fakemem")
    assert "from tiercache-clash" in str(err.value)
    assert "from tiercache-fakeplugin" in str(err.value)
    named = registry.adapter_class("fakemem", target="tiercache_fakeplugin.adapter:OtherFakeMemAdapter")
    assert named.__name__ == "OtherFakeMemAdapter"


def test_plugin_allowlist_excludes_others(plugin_path: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCACHE_PLUGINS", "")
    assert "fakemem" not in {r.name for r in Registry().adapters()}


def test_unknown_scheme_and_codec_name_the_known_ones() -> None:
    registry = Registry(entry_points=False)
    with pytest.raises(PluginError, match=r"no adapter for URL scheme 'gopher'.*file.*memory"):
        registry.resolve_scheme("gopher://x")
    with pytest.raises(PluginError, match=r"unknown codec 'nope'.*raw"):
        registry.codec_class("nope")


@pytest.mark.parametrize("target", ["nocolon", "tiercache.keys:NoSuchThing", ":X"])
def test_bad_targets(target: str) -> None:
    with pytest.raises(PluginError):
        load_target(target)


@pytest.mark.asyncio
async def test_open_adapter_resolves_the_url_through_the_registry(plugin_path: None) -> None:
    import tiercache

    reset_registry()
    adapter = await tiercache.open_adapter("fakemem://x")
    try:
        assert type(adapter).__name__ == "FakeMemAdapter"
        assert await adapter.batched_put(["k"], [b"v"]) == [True]
    finally:
        await adapter.aclose()
    assert get_registry() is get_registry()


def test_import_tiercache_is_light() -> None:
    """`import tiercache` (and the registry, config, keys) must not pull torch, redis, boto or pytest."""
    code = (
        "import sys, tiercache, tiercache.keys, tiercache.config, tiercache.testing, tiercache.serde;"
        "from tiercache.registry import get_registry; get_registry();"
        "heavy = [m for m in ('torch', 'redis', 'boto3', 'aioboto3', 'botocore', 'pytest')"
        " if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == ""
