"""tiercache-fsspec: the conformance kit through the entry point, errors, atomic puts and cancellation."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from tiercache_fsspec.adapter import FsspecAdapter

from tiercache import open_adapter
from tiercache.errors import AdapterTimeout, AdapterUnavailable, ConfigError
from tiercache.registry import get_registry
from tiercache.testing import AdapterConformance
from tiercache.testing.adapters import AdapterFactory

TIERCACHE = str(Path(sys.executable).with_name("tiercache"))


# ----- the kit, three ways: memory (blocking, direct commit), local files (rename commit), an async fs -----
class TestFsspecMemory(AdapterConformance):
    """``fsspec+memory://`` opened through ``open_adapter`` (so through the registry and the entry point)."""

    @pytest.fixture
    def adapter_factory(self) -> AdapterFactory:
        url = f"fsspec+memory://kit-{uuid.uuid4().hex[:8]}/prefix"
        return lambda: open_adapter(url)


class TestFsspecFile(AdapterConformance):
    """``fsspec+file:///dir``: temporary file + rename."""

    @pytest.fixture
    def adapter_factory(self, tmp_path: Path) -> AdapterFactory:
        return lambda: open_adapter(f"fsspec+file://{tmp_path}/kv")


class TestFsspecAsync(AdapterConformance):
    """An async filesystem (a memory fs in fsspec's async wrapper): the ``_pipe_file``/``_cat_file`` path."""

    @pytest.fixture
    def adapter_factory(self) -> AdapterFactory:
        root = f"/async-{uuid.uuid4().hex[:8]}"

        async def factory() -> FsspecAdapter:
            fs = AsyncFileSystemWrapper(MemoryFileSystem(), asynchronous=True)
            assert fs.async_impl
            return FsspecAdapter(fs, root)

        return factory


# ----- fault injection: a filesystem whose calls fail or block on demand ---------------------------------
class FaultyLocalFS(LocalFileSystem):  # type: ignore[misc]
    """A local filesystem that raises ``fail`` from every call, or blocks renames until ``release``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail: BaseException | None = None
        self.rename_started = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def _maybe_fail(self) -> None:
        if self.fail is not None:
            raise self.fail

    def info(self, path: str, **kwargs: Any) -> Any:
        self._maybe_fail()
        return super().info(path, **kwargs)

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self._maybe_fail()
        return super().cat_file(path, *args, **kwargs)

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
        self._maybe_fail()
        return super().pipe_file(path, value, *args, **kwargs)

    def mv(self, path1: str, path2: str, *args: Any, **kwargs: Any) -> Any:
        self.rename_started.set()
        self.release.wait(30)
        self._maybe_fail()
        return super().mv(path1, path2, *args, **kwargs)

    async def put_held_in_rename(self, adapter: FsspecAdapter, value: bytes) -> asyncio.Future[list[bool]]:
        """Start ``adapter``'s put of "k" and return it once its rename is held (until ``release`` is set)."""
        self.release.clear()
        self.rename_started.clear()
        put = asyncio.ensure_future(adapter.batched_put(["k"], [value]))
        await asyncio.to_thread(self.rename_started.wait, 30)
        return put


@pytest.fixture
def faulty(tmp_path: Path) -> tuple[FaultyLocalFS, Path]:
    root = tmp_path / "kv"
    root.mkdir()
    return FaultyLocalFS(skip_instance_cache=True), root


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (ConnectionResetError("peer reset"), AdapterUnavailable),
        (PermissionError("denied"), AdapterUnavailable),
        (RuntimeError("server said 500"), AdapterUnavailable),
        (TimeoutError("read timed out"), AdapterTimeout),
    ],
)
async def test_transport_errors_raise_adapter_errors(
    faulty: tuple[FaultyLocalFS, Path], error: BaseException, expected: type[Exception]
) -> None:
    """Filesystem failures raise AdapterUnavailable/AdapterTimeout in every call; a missing file misses."""
    fs, root = faulty
    adapter = FsspecAdapter(fs, str(root), commit="rename")
    try:
        assert await adapter.batched_contains(["absent"]) == [False]
        assert await adapter.batched_get(["absent"]) == [None]
        assert await adapter.batched_delete(["absent"]) == [False]
        fs.fail = error
        with pytest.raises(expected, match=str(error)):
            await adapter.batched_contains(["k"])
        with pytest.raises(expected):
            await adapter.batched_get(["k"])
        with pytest.raises(expected):
            await adapter.batched_put(["k"], [b"v"])
        with pytest.raises(expected):
            await adapter.batched_delete(["k"])
        assert sorted(p.name for p in root.iterdir()) == []  # the failed put left no temporary file
    finally:
        await adapter.aclose()


@pytest.mark.asyncio
async def test_failed_rename_removes_the_temporary_file(faulty: tuple[FaultyLocalFS, Path]) -> None:
    """A put whose rename fails reports the error, leaves the old value and no temporary file."""
    fs, root = faulty
    adapter = FsspecAdapter(fs, str(root), commit="rename")
    try:
        assert await adapter.batched_put(["k"], [b"old"]) == [True]
        put = await fs.put_held_in_rename(adapter, b"new value")
        assert sorted(p.name for p in root.iterdir() if p.name != "k")[0].startswith(".tmp.k.")
        fs.fail = OSError("disk went away")
        fs.release.set()
        with pytest.raises(AdapterUnavailable, match="disk went away"):
            await put
        fs.fail = None
        assert sorted(p.name for p in root.iterdir()) == ["k"]
        assert await adapter.batched_get(["k"]) == [b"old"]
    finally:
        await adapter.aclose()


@pytest.mark.asyncio
async def test_cancelled_put_completes_and_aclose_waits(faulty: tuple[FaultyLocalFS, Path]) -> None:
    """Cancelling a put mid-rename: the write finishes whole in the background; aclose waits for it."""
    fs, root = faulty
    adapter = FsspecAdapter(fs, str(root), commit="rename")
    put = await fs.put_held_in_rename(adapter, b"x" * 100_000)
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    assert not (root / "k").exists()  # still blocked in the rename
    closing = asyncio.ensure_future(adapter.aclose())
    await asyncio.sleep(0)
    assert not closing.done()  # aclose waits for the started write
    fs.release.set()
    await closing
    assert sorted(p.name for p in root.iterdir()) == ["k"]
    assert (root / "k").read_bytes() == b"x" * 100_000


# ----- URLs, options, registry -----------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_url_forms_and_layout(tmp_path: Path) -> None:
    """``fsspec+file:///dir`` stores each key as ``dir/key``; memory URLs share the process's memory fs."""
    adapter = await open_adapter(f"fsspec+file://{tmp_path}/a/b")
    try:
        assert isinstance(adapter, FsspecAdapter)
        assert await adapter.batched_put(["key1"], [b"hello"]) == [True]
        assert (tmp_path / "a" / "b" / "key1").read_bytes() == b"hello"
    finally:
        await adapter.aclose()
    bucket = f"bucket-{uuid.uuid4().hex[:8]}"
    writer = await open_adapter(f"fsspec+memory://{bucket}/p")
    assert isinstance(writer, FsspecAdapter)
    assert (writer.capabilities.shared, writer.capabilities.persistent) == (False, True)  # one per process
    assert (adapter.capabilities.shared, adapter.capabilities.persistent) == (True, True)
    reader = await open_adapter(f"fsspec+memory://{bucket}/p")
    try:
        assert await writer.batched_put(["k"], [b"shared"]) == [True]
        assert await reader.batched_get(["k"]) == [b"shared"]
        assert MemoryFileSystem().cat_file(f"/{bucket}/p/k") == b"shared"
    finally:
        await writer.aclose()
        await reader.aclose()


@pytest.mark.asyncio
async def test_options_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unknown options, bad values, unknown protocols and unset ``*_env`` variables are ConfigErrors."""
    with pytest.raises(ConfigError, match=r"unknown option.*'colour'"):
        await open_adapter("fsspec+memory://b/p", colour="red")
    with pytest.raises(ConfigError, match="commit"):
        await open_adapter("fsspec+memory://b/p?commit=sometimes")
    with pytest.raises(ConfigError, match="max_concurrency"):
        await open_adapter("fsspec+memory://b/p", max_concurrency=0)
    with pytest.raises(ConfigError, match="unknown protocol 'nosuchfs'"):
        await open_adapter("fsspec+nosuchfs://b/p")
    with pytest.raises(ConfigError, match="names no directory"):
        await open_adapter("fsspec+memory://")
    monkeypatch.delenv("TIERCACHE_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError, match="'TIERCACHE_TEST_UNSET', which is not set"):
        await open_adapter("fsspec+memory://b/p", storage_options={"token_env": "TIERCACHE_TEST_UNSET"})


@pytest.mark.asyncio
async def test_missing_implementation_says_what_to_install() -> None:
    """A protocol whose implementation package is absent names the package (fsspec's own hint)."""
    from fsspec.registry import known_implementations

    if "gcsfs" in sys.modules or _importable("gcsfs"):
        pytest.skip("gcsfs is installed here")
    with pytest.raises(ConfigError, match=r"(?i)gcsfs.*pip install 'tiercache-fsspec\[gcs\]'"):
        await open_adapter("fsspec+gcs://bucket/prefix")
    assert "gcs" in known_implementations


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_registered_through_the_entry_point() -> None:
    """The registry finds the adapter from the tiercache-fsspec distribution; fsspec+* URLs resolve to it."""
    registry = get_registry()
    (reg,) = [r for r in registry.adapters() if r.name == "fsspec"]
    assert reg.distribution == "tiercache-fsspec"
    assert reg.target == "tiercache_fsspec.adapter:FsspecAdapter"
    assert registry.resolve_scheme("fsspec+gcs://bucket/p") == "fsspec"
    assert registry.adapter_class("fsspec") is FsspecAdapter


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [TIERCACHE, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600, check=False
    )


def test_cli_plugins_and_check(tmp_path: Path) -> None:
    """``tiercache plugins`` lists it from its distribution; ``tiercache check`` round-trips a probe."""
    plugins = json.loads(_run("plugins", "--json", cwd=tmp_path).stdout)
    assert {"name": "fsspec", "distribution": "tiercache-fsspec"}.items() <= next(
        p for p in plugins if p["name"] == "fsspec"
    ).items()
    config = tmp_path / "tiercache.toml"
    config.write_text(
        "[[tiers]]\n"
        f'name = "files"\nurl = "fsspec+file://{tmp_path}/tier"\ncodecs = ["raw", "lz4"]\n'
        "[[tiers]]\n"
        'name = "mem"\nurl = "fsspec+memory://check/p"\n'
    )
    done = _run("check", str(config), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert [t["ok"] for t in report["tiers"]] == [True, True]
    assert [t["adapter"] for t in report["tiers"]] == [
        "tiercache_fsspec.adapter:FsspecAdapter",
        "tiercache_fsspec.adapter:InProcessFsspecAdapter",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["memory", "file"])
def test_cli_conformance(tmp_path: Path, where: str) -> None:
    """``tiercache conformance fsspec+memory://x`` and ``fsspec+file://DIR`` pass the whole kit."""
    url = "fsspec+memory://x" if where == "memory" else f"fsspec+file://{tmp_path}/kit"
    done = _run("conformance", url, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
    assert "failed" not in done.stdout
