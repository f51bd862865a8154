"""A private ``tiercache serve`` for one client instance (the vLLM connector's ``"server": "auto"``).

:func:`ensure_private_server` gives every process of one instance (same ``instance`` string) the same server:
the first caller, holding an ``flock`` in the instance's private directory (``0700``, under
``$TMPDIR/tiercache-<uid>/``), spawns a keeper, ``python -m tiercache.server.autostart``, which runs
``tiercache serve`` on ``<dir>/l1.sock`` as its own child and owns the directory. Later callers find the
socket answering and use it.

The directory goes with the instance, whatever way it ends:

* The keeper watches a pipe whose write end only the starting process holds: EOF means that process exited
  (a clean exit, SIGTERM, SIGKILL, a crash alike). The keeper then stops the server (SIGTERM, its drain
  included), waits for it and removes the directory. The keeper forks once at start, leaving the starting
  process's tree: a forced shutdown that SIGKILLs the whole tree (vLLM's ``kill_process_tree``) spares it.
* A server that exits by itself (a crash, SIGKILL) is cleaned up at once; a later caller starts a new one.
* A failed start (the server exited before it answered, or did not answer within the timeout) is recorded in
  the directory as ``failed``, so every process of the instance makes the same choice (in-process) instead of
  diverging; the record stays until the starting process exits, then the directory is removed too.
* A keeper that dies (SIGKILL) takes its server with it (``PR_SET_PDEATHSIG``), which then removes the
  directory itself; a failed record whose keeper and starter are both gone is stale, and the next caller of
  the instance id clears it. Where no keeper could run at all, the starter removes the directory at its
  normal exit (``atexit``).

The starting process is one process of the instance, usually the first vLLM worker: a vLLM engine process
left running after its front end was killed still counts as the instance (its server stays).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import os
import select
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tiercache.server.listen import MAX_SOCKET_PATH, socket_path_fits

__all__ = [
    "DEFAULT_SOCKET",
    "AutostartError",
    "ensure_private_server",
    "main",
    "private_dir",
    "socket_answers",
]

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/tiercache/tiercache.sock"
"""Where ``"auto"`` looks for a node's daemon when the config sets no ``server.socket``."""

SOCKET_NAME = "l1.sock"
INFO_NAME = "server.json"
"""``{"pid", "server_pid", "socket"}``, written by the keeper once the server answers (operators, tests).
``pid`` is the keeper's: it exits last, after the server and after removing the directory."""
FAILED_NAME = "failed"
"""Present (one line: why) while the instance's server could not start: every process of the instance runs
in-process. Removed with the directory once the starting process exited."""
LOG_NAME = "server.log"
"""The keeper's and the server's output (kept while the directory is)."""
_LOCK_NAME = "lock"
_KEEPER_NAME = "keeper"
"""``KEEPER_PID STARTER_PID`` of the keeper that owns the directory now (an older keeper leaves the directory
to it; a failed record whose keeper and starter are both gone is stale)."""
_STATUS_GRACE_S = 10.0
"""How long the starter waits for the keeper's answer beyond the keeper's own start timeout."""
_PR_SET_PDEATHSIG = 1
_MODULE = "tiercache.server.autostart"  # run with -m: __name__ is "__main__" there


class AutostartError(RuntimeError):
    """The private server could not be started (the one-line message says why)."""


def socket_answers(path: str, timeout_s: float = 1.0) -> bool:
    """Whether a tiercache server completes a HELLO on ``path`` now (role ``probe``: nothing is mapped; the
    connection is closed again). ``ImportError`` when server mode is not installed."""
    from tiercache.server.client import ServerConnection, ServerUnavailable

    try:
        conn = ServerConnection(path, role="probe", timeout_s=timeout_s)
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

    Exactly one process of the instance starts it (``flock``); it runs until that process has exited.
    ``config_path`` may be relative (to this process's working directory): the server gets it absolute.
    ``AutostartError`` (one line) when it cannot start: then, and for every later caller of the instance
    while the starting process lives, at once.
    """
    if config_path:
        config_path = os.path.abspath(config_path)  # the server runs in the private directory
    for _ in range(8):  # a keeper removing the directory between our open and our flock: take a fresh one
        where = private_dir(instance, base)
        sock_path = str(where / SOCKET_NAME)
        if not socket_path_fits(sock_path):
            raise AutostartError(f"socket path {sock_path} is over {MAX_SOCKET_PATH} bytes; set TMPDIR")
        with _instance_lock(where) as held:
            if not held:
                continue
            failed = where / FAILED_NAME
            if failed.exists() and not _stale(where):
                raise AutostartError(
                    f"the private server of {instance} did not start before: {_read(failed) or '?'}"
                )
            if socket_answers(sock_path):
                return sock_path
            _spawn(where, sock_path, slot_bytes, config_path, timeout_s, python)
            return sock_path
    raise AutostartError(f"the private directory of {instance} kept being removed")


def _spawn(
    where: Path, sock_path: str, slot_bytes: int, config_path: str | None, timeout_s: float, python: str
) -> None:
    """Start the keeper and wait for its one status line (bounded); ``AutostartError`` unless it says the
    server answers. Called under the instance's flock."""
    read_end, write_end = os.pipe()  # we keep write_end (never inherited by exec'd children): EOF = we exited
    status_r, status_w = os.pipe()  # the keeper's one status line
    argv = [python, "-m", _MODULE, str(read_end), str(where), repr(float(timeout_s)), "--"]
    argv += ["--socket", sock_path, "--slot-bytes", str(slot_bytes)]
    if config_path:
        argv += ["--config", config_path]
    try:
        with (where / LOG_NAME).open("ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=status_w,
                stderr=log,
                pass_fds=(read_end,),
                cwd=where,  # not the caller's cwd: a source checkout there would shadow the installed package
                start_new_session=True,  # no signal to the instance's process group: the pipe decides
            )
    except OSError as exc:
        os.close(write_end)
        os.close(status_r)
        _mark_failed(where, f"cannot start {argv[0]}: {exc}", keeper=0)
        raise AutostartError(f"cannot start {argv[0]}: {exc}") from exc
    finally:
        os.close(read_end)
        os.close(status_w)
    _KEEP.append(write_end)
    threading.Thread(target=proc.wait, name="tiercache-autostart-reaper", daemon=True).start()
    try:
        status = _read_status(status_r, timeout_s + _STATUS_GRACE_S)
    finally:
        os.close(status_r)
    if status.get("ready"):
        return
    why = status.get("failed")
    if not isinstance(why, str):  # the keeper died or hung before it could record anything
        owners = _owners(where)
        why = f"its keeper gave no answer: {_last_line(where / LOG_NAME)}"
        _mark_failed(where, why, keeper=owners[0] if owners else 0)
    raise AutostartError(f"private tiercache server did not start on {sock_path}: {why}")


_KEEP: list[int] = []
"""Write ends of the pipes the keepers watch, held until this process exits."""


def _read_status(fd: int, timeout_s: float) -> dict[str, object]:
    """The JSON line the keeper writes on ``fd`` (empty when it closed it first or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return {}
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        status = json.loads(data.split(b"\n", 1)[0] or b"{}")
    except ValueError:
        return {}
    return status if isinstance(status, dict) else {}


def _owners(where: Path) -> list[int]:
    """The keeper's and its starter's pids from the ``keeper`` file (empty without one)."""
    try:
        return [int(p) for p in (_read(where / _KEEPER_NAME) or "").split()]
    except ValueError:
        return []


def _stale(where: Path) -> bool:
    """Whether the directory's keeper and its starter are both gone (a keeper killed while it kept a failed
    record): then the record is cleared here (the caller holds the flock) and a new start may follow."""
    owners = _owners(where)
    if not owners or any(_alive(pid) for pid in owners):
        return False
    for entry in os.scandir(where):
        if entry.name != _LOCK_NAME and not entry.is_dir(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    return True


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie left unreaped has exited)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # cannot tell: assume it runs
    try:
        return not select.select([fd], [], [], 0)[0]
    finally:
        os.close(fd)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except FileNotFoundError:
        return None


def _last_line(log: Path) -> str:
    """The last non-empty line of ``log`` (an exception's message ends a traceback)."""
    lines = [line.strip() for line in (_read(log) or "").splitlines() if line.strip()]
    return lines[-1][-500:] if lines else "(no output)"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _mark_failed(where: Path, why: str, keeper: int | None = None) -> None:
    """Record a failed start (one line) for every process of the instance. ``keeper``: the starter records
    it because that keeper (0: none) could not; its directory is then removed when the starter exits
    normally (``atexit``: a best effort, since no keeper is left to watch the starter)."""
    with contextlib.suppress(OSError):
        _write_atomic(where / FAILED_NAME, " ".join(why.split()) + "\n")
    if keeper is not None:
        atexit.register(_remove, where, keeper)


# ----- the keeper -------------------------------------------------------------------------------------------
class _Keeper:
    """Runs the server as its child and owns the directory (see the module docstring)."""

    def __init__(
        self, starter_fd: int, where: Path, timeout_s: float, serve_args: Sequence[str], starter: int
    ) -> None:
        self.starter_fd = starter_fd
        self.starter = starter
        self.where = where
        self.timeout_s = timeout_s
        self.serve_args = list(serve_args)
        self.sock_path = str(where / SOCKET_NAME)
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)  # SIGTERM/SIGINT wake our selects: stop as if the starter had exited
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: None)

    def run(self) -> int:
        """Start, report to the starter, serve until the starter exits, clean up; the exit status."""
        _write_atomic(self.where / _KEEPER_NAME, f"{os.getpid()} {self.starter}\n")
        with contextlib.suppress(OSError):  # not the starter's pinned cores (vLLM's CPU workers pin theirs)
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        argv = [sys.executable, "-m", _MODULE, "--server", str(os.getpid()), str(self.where), "--"]
        try:
            server = subprocess.Popen(
                argv + self.serve_args, stdin=subprocess.DEVNULL, stdout=2, stderr=2, cwd=self.where
            )
        except OSError as exc:
            return self._failed(f"cannot start the server: {exc}")
        pidfd = os.pidfd_open(server.pid)
        try:
            why = self._wait_ready(server, pidfd)
            if why == "":  # the starter exited (or we were told to stop) while the server started
                self._stop(server, pidfd)
                self._remove()
                return 0
            if why is not None:
                if server.poll() is None:
                    server.kill()
                server.wait()
                return self._failed(why)
            info = {"pid": os.getpid(), "server_pid": server.pid, "socket": self.sock_path}
            _write_atomic(self.where / INFO_NAME, json.dumps(info))
            self._report({"ready": True, "pid": server.pid})
            fired = self._wait_for(pidfd)
            if fired is not pidfd:
                self._stop(server, pidfd)
            else:
                log.warning("tiercache autostart: the server exited by itself (%s)", server.wait())
        finally:
            os.close(pidfd)
        self._remove()
        return 0

    def _wait_ready(self, server: subprocess.Popen[bytes], pidfd: int) -> str | None:
        """None once the server answers; ``""`` when the starter is gone first; else why it failed."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.01
        while True:
            try:
                if socket_answers(self.sock_path):
                    return None
            except Exception as exc:  # an install without a piece of server mode: the same for every caller
                return f"{type(exc).__name__}: {exc}"
            left = deadline - time.monotonic()
            if left <= 0:
                return f"no answer on {self.sock_path} within {self.timeout_s:g} s"
            fired = self._wait_for(pidfd, min(delay, left))
            if fired is pidfd:
                return f"exit {server.wait()}: {_last_line(self.where / LOG_NAME)}"
            if fired is not None:
                return ""
            delay = min(delay * 2, 0.2)  # the server is importing and mapping its segment

    def _wait_for(self, pidfd: int | None, timeout_s: float | None = None) -> int | None:
        """Block until the starter's pipe closes, a signal arrives or ``pidfd`` (if any) is readable (at most
        ``timeout_s``); which of them fired (``pidfd``, or ``self.starter_fd`` for the starter and signals),
        None on timeout."""
        fds = [self.starter_fd, self.wake_r] + ([] if pidfd is None else [pidfd])
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = select.select(fds, [], [], left)[0]
            if not ready:
                return None
            if pidfd is not None and pidfd in ready:
                return pidfd
            if self.wake_r in ready:
                with contextlib.suppress(OSError):
                    os.read(self.wake_r, 64)
                return self.starter_fd
            with contextlib.suppress(OSError):
                if os.read(self.starter_fd, 1):
                    continue  # nothing is ever written; keep waiting for EOF
            return self.starter_fd

    def _stop(self, server: subprocess.Popen[bytes], pidfd: int) -> None:
        """SIGTERM the server and wait for it (it bounds its own drain); a second signal to us kills it."""
        if server.poll() is None:
            server.terminate()
        while server.poll() is None:
            if self.wake_r in select.select([pidfd, self.wake_r], [], [])[0]:
                with contextlib.suppress(OSError):
                    os.read(self.wake_r, 64)
                if server.poll() is None:
                    server.kill()
        server.wait()

    def _failed(self, why: str) -> int:
        """Record a failed start, tell the starter, keep the record until the starter exits, clean up."""
        _mark_failed(self.where, why)
        self._report({"failed": " ".join(why.split())})
        self._wait_for(None)
        self._remove()
        return 1

    def _report(self, status: dict[str, object]) -> None:
        """One JSON line to the starter on our stdout, then closed (``/dev/null`` takes its place)."""
        with contextlib.suppress(OSError):
            os.write(1, (json.dumps(status) + "\n").encode())
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # the starter sees EOF; fd 1 stays taken
        os.close(devnull)

    def _remove(self) -> None:
        _remove(self.where, os.getpid())


def _remove(where: Path, keeper: int) -> None:
    """Remove the private directory and everything in it, under the instance's flock, unless another keeper
    owns it by now (a server that exited by itself was replaced meanwhile)."""
    with _instance_lock(where) as held:
        owners = _owners(where)
        if not held or (owners and owners[0] != keeper):
            return
        for entry in os.scandir(where):  # the lock file too: a caller waiting on it then takes a fresh one
            if not entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
        with contextlib.suppress(OSError):
            where.rmdir()


@contextlib.contextmanager
def _instance_lock(where: Path) -> Iterator[bool]:
    """Hold the instance's flock (its lock file in ``where``) for the block; False when the directory is
    gone, or was removed while we waited for the lock (take a fresh one)."""
    try:
        lock_fd = os.open(where / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        yield False
        return
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        yield os.fstat(lock_fd).st_nlink != 0
    finally:
        os.close(lock_fd)


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(0)


_KEEPER_GONE = signal.SIGUSR1
"""The server's parent-death signal: its keeper died (SIGKILL); the server stops and cleans up itself."""


def _serve_as_child(keeper: int, where: Path, args: Sequence[str]) -> int:
    """The server process: the CLI until SIGTERM (its keeper stopping it) or its keeper's death (then the
    directory is removed here, since no keeper is left to do it)."""
    import ctypes

    gone: list[bool] = []

    def keeper_died(signum: int, frame: object) -> None:
        gone.append(True)
        os.kill(os.getpid(), signal.SIGTERM)  # the server's own clean stop

    signal.signal(_KEEPER_GONE, keeper_died)
    signal.signal(signal.SIGTERM, _exit_on_term)  # until the server's loop installs its own handler
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, _KEEPER_GONE, 0, 0, 0)
    if os.getppid() != keeper:
        _remove(where, keeper)  # the keeper died before we could watch it
        return 1
    from tiercache.server.cli import serve

    try:
        return serve(args)
    finally:
        if gone:
            _remove(where, keeper)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tiercache.server.autostart FD DIR TIMEOUT_S -- SERVE_FLAGS``: the keeper (see the module
    docstring); ``FD`` is the read end of the starter's pipe. ``--server KEEPER_PID DIR -- SERVE_FLAGS``: the
    server, run by the keeper."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) >= 4 and args[0] == "--server" and args[3] == "--":
        return _serve_as_child(int(args[1]), Path(args[2]), args[4:])
    if len(args) < 4 or args[3] != "--":
        print("usage: python -m tiercache.server.autostart FD DIR TIMEOUT_S -- SERVE_FLAGS", file=sys.stderr)
        return 2
    starter = os.getppid()
    if os.fork():  # no thread runs yet: the keeper leaves the starter's process tree, which vLLM's forced
        os._exit(0)  # shutdown SIGKILLs whole (kill_process_tree); the starter reaps this parent at once
    return _Keeper(int(args[0]), Path(args[1]), float(args[2]), args[4:], starter).run()


if __name__ == "__main__":
    sys.exit(main())
