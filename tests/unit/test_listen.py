"""``listen_at``: a socket path appears only once it accepts; a failed start removes only what it made."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest

from tiercache.server import listen
from tiercache.server.listen import MAX_SOCKET_PATH, listen_at, socket_path_fits


def _path_of_bytes(directory: Path, size: int) -> str:
    """A path in ``directory`` of exactly ``size`` bytes."""
    base = f"{directory}/"
    return base + "s" * (size - len(base))


def test_the_path_is_linked_only_after_the_socket_listens(
    sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the link, the staging socket already accepts; the path has its mode and the staging name goes."""
    path = str(sock_dir / "l.sock")
    seen: list[str] = []
    real_link = os.link

    def link_after_a_connect(src: str, dst: str) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            probe.connect(src)  # ECONNREFUSED had it been linked before listen
        seen.append(dst)
        real_link(src, dst)

    monkeypatch.setattr(os, "link", link_after_a_connect)
    with listen_at(path, mode=0o640) as sock:
        assert seen == [path]
        assert os.stat(path).st_mode & 0o777 == 0o640
        assert not os.path.exists(path + ".new")
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
            client.connect(path)
            conn, _ = sock.accept()  # the probe's connection, queued first
            conn.close()


def test_a_path_taken_meanwhile_is_left_alone(sock_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another file appears at the path between bind and link: it stays, and the staging name goes."""
    path = str(sock_dir / "l.sock")
    real_link = os.link

    def someone_first(src: str, dst: str) -> None:
        Path(dst).write_text("theirs")
        real_link(src, dst)

    monkeypatch.setattr(os, "link", someone_first)
    with pytest.raises(FileExistsError):
        listen_at(path)
    assert Path(path).read_text() == "theirs"
    assert not os.path.exists(path + ".new")


@pytest.mark.parametrize("size", [MAX_SOCKET_PATH - 3, MAX_SOCKET_PATH])
def test_a_path_too_long_for_staging_is_bound_in_place(sock_dir: Path, size: int) -> None:
    """A path whose ``.new`` name would not fit a socket address is bound as it is."""
    path = _path_of_bytes(sock_dir, size)
    assert socket_path_fits(path)
    assert not socket_path_fits(path + ".new")
    with listen_at(path, socket.SOCK_STREAM) as sock:
        assert os.stat(path).st_mode & 0o777 == 0o600
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(path)
            sock.accept()[0].close()
    os.unlink(path)


def test_a_failed_bind_in_place_leaves_the_socket_that_holds_the_path(sock_dir: Path) -> None:
    """Bound in place, a path held by a live socket refuses the bind, and that socket keeps its path."""
    path = _path_of_bytes(sock_dir, MAX_SOCKET_PATH)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as holder:
        holder.bind(path)
        holder.listen(1)
        with pytest.raises(OSError, match="in use") as err:
            listen_at(path, socket.SOCK_STREAM)
        assert err.value.errno == errno.EADDRINUSE
        assert os.path.exists(path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(path)  # still the holder's
            holder.accept()[0].close()


def test_a_failed_staging_bind_leaves_what_holds_the_staging_name(
    sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staging name taken between the stale-socket check and the bind is not removed by the failure."""
    path = str(sock_dir / "l.sock")
    monkeypatch.setattr(listen, "_clear_stale_socket", lambda _path: None)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as other:
        other.bind(path + ".new")
        with pytest.raises(OSError, match="in use") as err:
            listen_at(path)
        assert err.value.errno == errno.EADDRINUSE
        assert os.path.exists(path + ".new")
        assert not os.path.exists(path)


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "in_place"])
def test_a_failure_after_the_bind_leaves_no_name(
    sock_dir: Path, monkeypatch: pytest.MonkeyPatch, staged: bool
) -> None:
    """The group cannot be set: the bound name goes, and the path never appears."""
    path = str(sock_dir / "l.sock") if staged else _path_of_bytes(sock_dir, MAX_SOCKET_PATH)

    def refused(*_args: object, **_kwargs: object) -> None:
        raise PermissionError(errno.EPERM, "not allowed")

    monkeypatch.setattr(os, "chown", refused)
    with pytest.raises(PermissionError):
        listen_at(path, group=os.getgid())
    assert not os.path.exists(path)
    assert not os.path.exists(path + ".new")


def test_a_failure_after_the_link_removes_the_path_too(
    sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staging name cannot be removed once linked: the linked path goes as well (no socket nobody
    listens on is left at the path)."""
    path = str(sock_dir / "l.sock")
    real_unlink = os.unlink
    failed: list[str] = []

    def first_unlink_fails(name: str) -> None:
        if not failed:
            failed.append(name)
            raise PermissionError(errno.EPERM, "not allowed")
        real_unlink(name)

    monkeypatch.setattr(os, "unlink", first_unlink_fails)
    with pytest.raises(PermissionError):
        listen_at(path)
    assert failed == [path + ".new"]
    assert not os.path.exists(path)
    assert not os.path.exists(path + ".new")
