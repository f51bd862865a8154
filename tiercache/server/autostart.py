"""A private ``tiercache serve`` child for one client instance (the vLLM connector's ``"server": "auto"``).

:func:`ensure_private_server` gives every process of one instance (same ``instance`` string) the same server:
the first caller, holding an ``flock`` in the instance's private directory (``0700``, under
``$TMPDIR/tiercache-<uid>/``), spawns ``python -m tiercache.server.autostart``, which serves
``tiercache serve`` on ``<dir>/l1.sock`` and exits when the spawning process has exited (it watches a pipe
whose write end only that process holds; EOF means it is gone), removing the directory. Later callers find
the socket answering and use it. A failed start is recorded in the directory, so every process of the
instance makes the same choice (in-process) instead of diverging.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "DEFAULT_SOCKET",
    "AutostartError",
    "ensure_private_server",
    "main",
    "private_dir",
    "socket_answers",
]

DEFAULT_SOCKET = "/run/tiercache/tiercache.sock"
"""Where ``"auto"`` looks for a node's daemon when the config sets no ``server.socket``."""

SOCKET_NAME = "l1.sock"
INFO_NAME = "server.json"
"""``{"pid", "socket"}`` of the private server, written once it answers (operators, tests)."""
FAILED_NAME = "failed"
"""Present when the instance's server could not start: every process of the instance runs in-process."""
_LOCK_NAME = "lock"
_LOG_NAME = "server.log"
_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


class AutostartError(RuntimeError):
    """The private server could not be started (the message says why; the log tail is included)."""


def socket_answers(path: str, timeout_s: float = 1.0) -> bool:
    """Whether a tiercache server completes a HELLO on ``path`` now (the connection is closed again)."""
    from tiercache.server.client import ServerConnection, ServerUnavailable

    try:
        conn = ServerConnection(path, role="admin", timeout_s=timeout_s)
    except ServerUnavailable:
        return False
    conn.close()
    return True


def private_dir(instance: str, base: str | None = None) -> Path:
    """``<base>/tiercache-<uid>/<instance>``, created ``0700``; ``AutostartError`` if the per-user directory
    is not a real directory owned by this uid with mode ``0700`` (someone else's, or a symlink)."""
    if not instance or not all(c.isalnum() or c in "-_." for c in instance) or instance.startswith("."):
        raise AutostartError(f"instance id {instance!r} must be letters, digits, '-', '_' or '.'")
    root = Path(base or tempfile.gettempdir()) / f"tiercache-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
        raise AutostartError(f"{root} must be a directory owned by uid {os.getuid()} with mode 0700")
    path = root / instance
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    return path


def ensure_private_server(
    instance: str,
    *,
    slot_bytes: int,
    config_path: str | None = None,
    timeout_s: float = 60.0,
    base: str | None = None,
    python: str = sys.executable,
) -> str:
    """The socket path of ``instance``'s private server, started now by this process if none answers.

    Exactly one process of the instance starts it (``flock``); the child exits once that process has exited.
    ``AutostartError`` when it cannot start (then, and for every later caller of the instance, at once).
    """
    where = private_dir(instance, base)
    sock_path = str(where / SOCKET_NAME)
    if len(sock_path) > _MAX_SOCKET_PATH:
        raise AutostartError(f"socket path {sock_path} is longer than {_MAX_SOCKET_PATH} bytes; set TMPDIR")
    lock_fd = os.open(where / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        failed = where / FAILED_NAME
        if failed.exists():
            raise AutostartError(
                f"the private server of {instance} did not start before: {failed.read_text()}"
            )
        if socket_answers(sock_path):
            return sock_path
        try:
            pid = _spawn(where, sock_path, slot_bytes, config_path, timeout_s, python)
        except AutostartError as exc:
            failed.write_text(str(exc))
            raise
        (where / INFO_NAME).write_text(json.dumps({"pid": pid, "socket": sock_path}))
        return sock_path
    finally:
        os.close(lock_fd)


def _spawn(
    where: Path, sock_path: str, slot_bytes: int, config_path: str | None, timeout_s: float, python: str
) -> int:
    """Start the child and wait until its socket answers (bounded by ``timeout_s``); its pid."""
    read_end, write_end = os.pipe()  # we keep write_end (never inherited by exec'd children): EOF = we exited
    argv = [python, "-m", "tiercache.server.autostart", str(read_end), str(where), "--"]
    argv += ["serve", "--socket", sock_path, "--slot-bytes", str(slot_bytes)]
    if config_path:
        argv += ["--config", config_path]
    log_path = where / _LOG_NAME
    try:
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(read_end,),
                cwd=where,  # not the caller's cwd: a source checkout there would shadow the installed package
                start_new_session=True,  # no signal to the instance's process group: the pipe decides
            )
    except OSError as exc:
        os.close(write_end)
        raise AutostartError(f"cannot start {argv[0]}: {exc}") from exc
    finally:
        os.close(read_end)
    _KEEP.append(write_end)
    threading.Thread(target=proc.wait, name="tiercache-autostart-reaper", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while not socket_answers(sock_path):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
            try:
                tail = log_path.read_text(errors="replace")[-2000:].strip()
            except FileNotFoundError:
                tail = "(its directory is gone)"
            raise AutostartError(
                f"private tiercache server (exit {proc.returncode}) did not start on {sock_path}: {tail}"
            )
        time.sleep(delay)  # the child is importing and mapping its segment; nothing to wait on but the socket
        delay = min(delay * 2, 0.2)
    return proc.pid


_KEEP: list[int] = []
"""Write ends of the pipes the private servers watch, held until this process exits."""


# ----- the child -----------------------------------------------------------------------------------------
def _watch_parent(fd: int, on_exit: Callable[[], None]) -> None:
    """Block until the parent's end of the pipe is closed (it exited), then call ``on_exit``."""
    with contextlib.suppress(OSError):
        while os.read(fd, 1):
            pass
    on_exit()


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tiercache.server.autostart FD DIR -- serve ...``: run the CLI until SIGTERM or until the
    process holding the other end of pipe ``FD`` exits, then remove ``DIR`` (kept, with the log, when the
    server failed)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[2] != "--":
        print("usage: python -m tiercache.server.autostart FD DIR -- serve ARGS", file=sys.stderr)
        return 2
    fd, where = int(args[0]), Path(args[1])
    with contextlib.suppress(OSError):  # not the starter's pinned cores (vLLM's CPU workers pin theirs)
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    signal.signal(signal.SIGTERM, _exit_on_term)  # until the server's loop installs its own handler
    threading.Thread(
        target=_watch_parent,
        args=(fd, lambda: os.kill(os.getpid(), signal.SIGTERM)),
        name="tiercache-parent-watch",
        daemon=True,
    ).start()
    from tiercache.cli.main import main as cli_main

    rc = 0
    try:
        rc = cli_main(args[3:])
    finally:
        if rc == 0:  # a failed start keeps its log for the starter (and the operator)
            _remove(where)
    return rc


def _remove(where: Path) -> None:
    """Remove the private directory and the files this module puts there."""
    for name in (SOCKET_NAME, INFO_NAME, _LOCK_NAME, _LOG_NAME, FAILED_NAME):
        with contextlib.suppress(FileNotFoundError):
            (where / name).unlink()
    with contextlib.suppress(OSError):
        where.rmdir()


if __name__ == "__main__":
    sys.exit(main())
