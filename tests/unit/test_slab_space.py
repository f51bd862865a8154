"""A slab never fills its filesystem: one larger than the free space is refused at open (and by ``tiercache
check``) with one line naming the capacity and the free bytes, and leaves nothing behind.

Runs on real small filesystems mounted for the test (root only): a 64 MiB tmpfs and a 64 MiB ext4 image on a
loop device (ext4 keeps the blocks of a ``posix_fallocate`` that ran out of space; tmpfs gives them back).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiercache.adapters.nvme_slab import SlabAdapter
from tiercache.cli.main import main
from tiercache.errors import ConfigError

MiB = 1 << 20
FS_BYTES = 64 * MiB


def _run(cmd: list[str]) -> bool:
    return subprocess.run(cmd, capture_output=True, check=False).returncode == 0


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A freshly mounted 64 MiB filesystem (unmounted in teardown); skipped where mounting needs root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    work = Path(tempfile.mkdtemp(prefix="tc-slabfs-"))
    mnt = work / "mnt"
    mnt.mkdir()
    if request.param == "tmpfs":
        mounted = _run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mnt)])
    else:
        image = work / "fs.img"
        with image.open("wb") as f:
            f.truncate(FS_BYTES)
        mounted = (
            shutil.which("mkfs.ext4") is not None
            and _run(["mkfs.ext4", "-q", "-F", str(image)])
            and _run(["mount", "-o", "loop", str(image), str(mnt)])
        )
    if not mounted:
        shutil.rmtree(work, ignore_errors=True)
        pytest.skip(f"cannot mount a {request.param} filesystem here")
    try:
        yield mnt
    finally:
        if _run(["umount", str(mnt)]) or _run(["umount", "-l", str(mnt)]):
            shutil.rmtree(work, ignore_errors=True)


def _free(path: Path) -> int:
    vfs = os.statvfs(path)
    return vfs.f_bavail * vfs.f_frsize


def _refused(url: str) -> ConfigError:
    """The ConfigError of opening ``url``; fails the test (closing the slab) if it opens."""

    async def attempt() -> ConfigError:
        try:
            slab = await SlabAdapter.open(url)
        except ConfigError as exc:
            return exc
        await slab.aclose()
        pytest.fail(f"opened: {slab.describe()}")

    return asyncio.run(attempt())


def _entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name != "lost+found")


def test_a_slab_larger_than_the_free_space_is_refused_and_leaves_nothing(small_fs: Path) -> None:
    free = _free(small_fs)
    url = f"nvme+slab://{small_fs}/tier.slab?capacity=1GiB"
    message = str(_refused(url))
    assert "\n" not in message
    assert "capacity 1073741824 bytes (1.0 GiB)" in message
    assert f"{_free(small_fs)} bytes" in message
    assert "are free" in message
    assert _entries(small_fs) == []  # no slab file, not even an empty one
    assert _free(small_fs) >= free - MiB  # nothing kept allocated


def test_an_existing_file_is_left_as_it_was(small_fs: Path) -> None:
    path = small_fs / "tier.slab"
    path.touch()
    assert "does not fit" in str(_refused(f"nvme+slab://{path}?capacity=512MiB"))
    assert _entries(small_fs) == ["tier.slab"]
    assert path.stat().st_size == 0
    assert path.stat().st_blocks == 0


def test_a_slab_that_fits_is_allocated_whole(small_fs: Path) -> None:
    url = f"nvme+slab://{small_fs}/tier.slab?capacity=24MiB&max_object=1MiB&extent_size=4MiB"

    async def open_put_close() -> None:
        slab = await SlabAdapter.open(url)
        try:
            assert await slab.batched_put(["k"], [b"v" * 5000]) == [True]
            assert slab.geometry is not None
            st = os.stat(small_fs / "tier.slab")
            assert st.st_blocks * 512 >= slab.geometry.used_bytes
        finally:
            await slab.aclose()

    asyncio.run(open_put_close())


def test_a_sparse_slab_opens_with_a_warning(small_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``preallocate=false`` asks for a sparse file: it opens (nothing is allocated) but says it may fill
    the filesystem."""
    url = f"nvme+slab://{small_fs}/tier.slab?capacity=1GiB&preallocate=false"

    async def open_close() -> None:
        slab = await SlabAdapter.open(url)
        await slab.aclose()

    with caplog.at_level(logging.WARNING, logger="tiercache.adapters.nvme_slab"):
        asyncio.run(open_close())
    assert any("may fill the filesystem" in r.getMessage() for r in caplog.records)
    assert (small_fs / "tier.slab").stat().st_blocks * 512 < 4 * MiB


@pytest.mark.parametrize("as_json", [False, True])
def test_check_fails_the_same_way(small_fs: Path, tmp_path: Path, as_json: bool) -> None:
    config = tmp_path / "tiers.toml"
    config.write_text(
        f'[[tiers]]\nname = "nvme"\nurl = "nvme+slab://{small_fs}/tier.slab"\ncapacity = "1GiB"\n'
    )
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["check", str(config), *(["--json"] if as_json else [])])
    assert code == 1, out.getvalue() + err.getvalue()
    if as_json:
        report = json.loads(out.getvalue())
        assert report["ok"] is False
        error = report["tiers"][0]["error"]
    else:
        (line,) = [line for line in out.getvalue().splitlines() if line.strip().startswith("nvme ")]
        assert "FAIL" in line
        error = line.split("FAIL", 1)[1].strip()
    assert error.startswith("ConfigError: nvme+slab: capacity 1073741824 bytes (1.0 GiB) does not fit")
    assert "are free" in error
    assert _entries(small_fs) == []


def test_a_capacity_past_any_disk_is_refused_before_anything_is_sized(tmp_path: Path) -> None:
    """4 EiB: refused at once (the extent table of such a layout alone would not fit in memory)."""
    message = str(_refused(f"nvme+slab://{tmp_path}/tier.slab?capacity={1 << 62}"))
    assert f"capacity {1 << 62} bytes" in message
    assert "are free" in message
    assert list(tmp_path.iterdir()) == []
