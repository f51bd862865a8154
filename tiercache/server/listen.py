"""A unix socket that appears at its path only once it accepts connections (standard library only: the
connector and autostart use the size limit without the server's dependencies)."""

from __future__ import annotations

import contextlib
import os
import socket
import stat

__all__ = ["MAX_SOCKET_PATH", "is_socket", "listen_at", "socket_path_fits"]

MAX_SOCKET_PATH = 107
"""Bytes of a unix socket path: ``sun_path`` holds 108 with the terminating NUL."""


def socket_path_fits(path: str) -> bool:
    """Whether ``path`` fits a unix socket address."""
    return len(os.fsencode(path)) <= MAX_SOCKET_PATH


def listen_at(
    path: str,
    kind: socket.SocketKind = socket.SOCK_SEQPACKET,
    *,
    mode: int = 0o600,
    group: int | None = None,
    backlog: int = 128,
) -> socket.socket:
    """A listening unix socket of ``kind`` at ``path`` with file mode ``mode`` (and ``group``), bound as
    ``PATH.new`` and linked to ``path`` once it listens, so a client that finds the path is accepted.

    ``path`` must be free (``FileExistsError`` if it exists by then); a socket left at ``PATH.new`` by a
    crashed process is replaced, anything else there refused (``FileExistsError``). Where ``PATH.new`` would
    not fit a socket address, ``path`` is bound in place (a client may then find it before it listens and be
    refused). On any failure nothing stays bound or linked, and only names this call created are removed (a
    bind refused because a socket holds the name leaves it). Callers serialise starts on one path (the
    server's ``PATH.lock``): a concurrent start could take ``PATH.new`` for a stale socket."""
    staging = path + ".new" if socket_path_fits(path + ".new") else path
    if staging != path:
        _clear_stale_socket(staging)
    sock = socket.socket(socket.AF_UNIX, kind)
    made: list[str] = []  # the names this call created, removed again if it fails
    try:
        old = os.umask(~mode & 0o777)  # created with its final mode: no window in which others may connect
        try:
            sock.bind(staging)
        finally:
            os.umask(old)
        made.append(staging)
        if group is not None:
            os.chown(staging, -1, group, follow_symlinks=False)
        sock.listen(backlog)
        if staging != path:
            os.link(staging, path)  # FileExistsError rather than replacing what appeared at the path
            made.append(path)
            os.unlink(staging)
            made.remove(staging)
    except BaseException:
        sock.close()
        for name in made:  # never a name this call did not create: a failed bind leaves what held it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
        raise
    return sock


def is_socket(path: str) -> bool:
    """Whether a socket file is at ``path`` (False: nothing is); ``FileExistsError`` for anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
    return True


def _clear_stale_socket(path: str) -> None:
    """Remove a socket file at ``path``; ``FileExistsError`` if something else is there."""
    if is_socket(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
