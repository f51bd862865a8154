"""A tier URL whose extra is not installed gives the pip command, for every built-in adapter with an extra.

Each case runs in a subprocess whose meta path refuses the extra's packages (as if never installed), then
opens a URL of every scheme that extra provides through ``open_adapter`` and through ``tiercache check``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from tiercache.registry import Registry

# The packages each extra installs (top-level import names) and a URL per scheme that parses cleanly.
EXTRA_MODULES = {
    "redis": ("redis",),
    "s3": ("aioboto3", "aiobotocore", "botocore", "boto3"),
    "mooncake": ("mooncake",),
}
URLS = {
    "redis": "redis://127.0.0.1:1/0",
    "rediss": "rediss://127.0.0.1:1/0",
    "valkey": "valkey://127.0.0.1:1/0",
    "valkeys": "valkeys://127.0.0.1:1/0",
    "redis+cluster": "redis+cluster://127.0.0.1:1",
    "rediss+cluster": "rediss+cluster://127.0.0.1:1",
    "valkey+cluster": "valkey+cluster://127.0.0.1:1",
    "valkeys+cluster": "valkeys+cluster://127.0.0.1:1",
    "s3": "s3://bucket/prefix",
    "s3a": "s3a://bucket/prefix",
    "mooncake": "mooncake://127.0.0.1:1",
}

_CHILD = textwrap.dedent(
    """
    import asyncio, importlib.abc, json, sys

    KIND, BLOCKED, CONFIG, ITEMS = sys.argv[1], set(sys.argv[2].split(",")), sys.argv[3], sys.argv[4:]

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
    from tiercache.errors import PluginError

    if KIND == "adapter":
        from tiercache import open_adapter
        from tiercache.cli import main

        def attempt(url):
            asyncio.run(open_adapter(url))
            return "opened"
    else:
        from tiercache.serde import build_pipeline

        def attempt(codec):
            build_pipeline(["raw", codec])
            return "built"

    out = {}
    for item in ITEMS:
        try:
            out[item] = attempt(item)
        except PluginError as exc:
            out[item] = str(exc)
        except BaseException as exc:
            out[item] = f"NOT A PluginError: {type(exc).__name__}: {exc}"
    print(json.dumps(out))
    sys.stdout.flush()
    if KIND == "adapter":
        main(["check", CONFIG, "--json"])
    """
)
"""Child process: with the packages of argv[2] blocked, open each adapter URL (then ``tiercache check``
argv[3]) or build each codec (argv[1] is ``adapter`` or ``codec``); prints what each attempt raised."""


def _run_child(
    kind: str, blocked: Sequence[str], config: str, items: Sequence[str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, kind, ",".join(blocked), config, *items],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=cwd,
    )


def _builtin_extras() -> dict[str, list[str]]:
    """Scheme names (aliases included) per extra, from the built-in registrations."""
    registry = Registry(entry_points=False)
    by_extra: dict[str, list[str]] = {}
    for reg in registry.adapters():
        if reg.extra is not None:
            by_extra.setdefault(reg.extra, []).append(reg.name)
    return by_extra


def test_every_builtin_extra_is_covered() -> None:
    """A new built-in adapter with an extra must be added here (so its hint is tested too)."""
    by_extra = _builtin_extras()
    assert set(by_extra) == set(EXTRA_MODULES)
    assert {s for schemes in by_extra.values() for s in schemes} == set(URLS)


@pytest.mark.parametrize("extra", sorted(EXTRA_MODULES))
def test_missing_extra_gives_the_install_hint(extra: str, tmp_path: Path) -> None:
    """Every scheme of ``extra``: a PluginError naming the package and ``pip install 'tiercache[extra]'``."""
    schemes = _builtin_extras()[extra]
    urls = [URLS[s] for s in schemes]
    config = tmp_path / "tiers.toml"
    config.write_text(f'[[tiers]]\nname = "t"\nurl = "{urls[0]}"\n')
    done = _run_child("adapter", EXTRA_MODULES[extra], str(config), urls, tmp_path)
    first, _, rest = done.stdout.partition("\n")
    assert first.startswith("{"), done.stdout + done.stderr
    results = json.loads(first)
    hint = f"install it with: pip install 'tiercache[{extra}]'"
    for url in urls:
        assert hint in results[url], f"{url}: {results[url]}"
        assert "which is not installed" in results[url]
        assert any(repr(m) in results[url] for m in EXTRA_MODULES[extra]), results[url]
    report = json.loads(rest)
    assert report["ok"] is False
    assert hint in report["tiers"][0]["error"]


CODEC_MODULES = {"lz4": "lz4", "zstd": "zstandard", "aesgcm": "cryptography"}


def test_missing_codec_extra_gives_the_install_hint(tmp_path: Path) -> None:
    """Every built-in codec with an extra: a PluginError naming the package and ``tiercache[codecs]``."""
    registry = Registry(entry_points=False)
    with_extra = {r.name: r.extra for r in registry.codecs() if r.extra is not None}
    assert with_extra == dict.fromkeys(CODEC_MODULES, "codecs")
    done = _run_child("codec", list(CODEC_MODULES.values()), "-", list(CODEC_MODULES), tmp_path)
    results = json.loads(done.stdout or "{}")
    assert set(results) == set(CODEC_MODULES), done.stderr
    for codec, module in CODEC_MODULES.items():
        assert f"needs the Python package {module!r}" in results[codec], results[codec]
        assert "install it with: pip install 'tiercache[codecs]'" in results[codec], results[codec]
