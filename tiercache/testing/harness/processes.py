"""Start a server process for tests and benchmarks, wait until it is ready, stop it by PID. ::

    port = free_port()
    proc = start_process([...argv...], ready=lambda: port_open("127.0.0.1", port), timeout=10)
    proc.pause(); proc.resume()   # SIGSTOP / SIGCONT
    proc.stop()                   # SIGTERM, then SIGKILL after a grace period; idempotent
    proc.kill()                   # SIGKILL at once; idempotent

Only the process started here is signalled (by its PID), never anything found by name.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

__all__ = [
    "ConfigServer",
    "NodeServer",
    "ServeFailed",
    "ServerProcess",
    "exits_within",
    "free_port",
    "port_open",
    "run_as",
    "socket_dir",
    "start_process",
    "wait_for",
    "wait_until",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def exits_within(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` (not a child of ours) is gone within ``timeout_s`` (waits on its pidfd, no
    polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """Whether a TCP connection to ``host:port`` is accepted now."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class ServerProcess:
    """A started child process; every signal goes to its PID only."""

    def __init__(self, argv: Sequence[str], popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.argv = list(argv)
        self.popen = popen
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        """The process's stdout and stderr so far (for failure messages)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: the process stops answering but keeps its sockets (a hung server)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL now and reap; idempotent."""
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)

    def stop(self, grace: float = 5.0) -> None:
        """SIGCONT (in case it is paused), SIGTERM, then SIGKILL after ``grace`` seconds; idempotent."""
        if not self.alive():
            return
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.kill()


def start_process(
    argv: Sequence[str],
    ready: Callable[[], bool],
    timeout: float = 15.0,
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """Start ``argv`` and poll ``ready()`` until it is true; RuntimeError (with the log) after ``timeout``."""
    fd, log_name = tempfile.mkstemp(prefix="tiercache-server-", suffix=".log")
    log_path = Path(log_name)
    with os.fdopen(fd, "wb") as log:
        popen = subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd, env=env
        )
    proc = ServerProcess(argv, popen, log_path)
    try:
        _await_ready(proc, ready, timeout)
    except BaseException:  # not ready in time, or the wait interrupted: nothing is left running
        proc.kill()
        raise
    return proc


def _await_ready(proc: ServerProcess, ready: Callable[[], bool], timeout: float) -> None:
    """Poll ``ready()`` until true; RuntimeError (with the log) if ``proc`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            raise RuntimeError(
                f"{proc.argv[0]} exited with {proc.popen.returncode} before ready:\n{proc.log()}"
            )
        try:
            if ready():
                return
        except Exception:  # readiness probes may fail while starting
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.argv[0]} not ready after {timeout} s:\n{proc.log()}")
        time.sleep(0.02)


_LISTENING = "tiercache server listening on "
_METRICS = "tiercache server metrics on "


def _read_ready_line(stdout: IO[str]) -> tuple[str, str]:
    """A starting server's ready line (``""``: it exited first) and its ``/metrics`` URL (``""`` unless the
    metrics line came first)."""
    line = stdout.readline()
    if not line.startswith(_METRICS):
        return line, ""
    return stdout.readline(), line.split()[-1]


def _listening(line: str) -> tuple[str, int] | None:
    """(socket path, epoch) of a ``tiercache server listening on PATH epoch N`` line, else None."""
    if not line.startswith(_LISTENING):
        return None
    address, _, epoch = line[len(_LISTENING) :].rpartition(" epoch ")
    return address, int(epoch)


class NodeServer:
    """A ``python -m tiercache.server`` child on the Unix socket ``path`` (for server-mode tests).

    ``slots``: exactly that many slots of ``slot_bytes`` (None: a segment of the ``--capacity`` in
    ``extra``, else 1 GiB); ``extra``: more flags; ``prefix``: a command to run it under (e.g.
    ``unshare``); ``preexec``: run in the child before exec. Its stderr goes to ``path + ".log"``
    (:meth:`log`). ``ready`` and ``epoch`` come from its ready line (stdout), read at once unless
    ``read_ready=False`` (then call :meth:`read_ready`: two servers started before either is awaited);
    ``pid`` is the server's own pid, also under ``unshare --fork``. :meth:`stop` sends SIGCONT then SIGTERM
    and returns the exit code.
    """

    def __init__(
        self,
        path: str,
        *extra: str,
        slot_bytes: int = 4096,
        slots: int | None = 4,
        prefix: Sequence[str] = (),
        preexec: Callable[[], None] | None = None,
        read_ready: bool = True,
    ) -> None:
        self.path = path
        self.log_path = Path(path + ".log")
        cmd = [*prefix, sys.executable, "-m", "tiercache.server", "--socket", path]
        cmd += ["--slot-bytes", str(slot_bytes), *([] if slots is None else ["--slots", str(slots)]), *extra]
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=os.path.dirname(path),
                preexec_fn=preexec,
            )
        self.ready = False
        self.epoch = -1
        if read_ready:
            self.read_ready()

    def read_ready(self) -> bool:
        """Read the ready line (``""`` when it exited first); whether it is the listening line."""
        assert self.proc.stdout is not None
        listening = _listening(_read_ready_line(self.proc.stdout)[0])
        self.ready = listening is not None
        self.epoch = -1 if listening is None else listening[1]
        return self.ready

    def log(self) -> str:
        """What the server wrote on stderr so far (every server started on this path appends to it)."""
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        """The server's pid (under ``unshare --fork`` the server is the child of the started process)."""
        kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        with contextlib.suppress(OSError):
            first = kids.read_text().split()
            if first:
                return int(first[0])
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL and wait."""
        self.proc.kill()
        self.proc.wait(timeout=60)
        self._close_stdout()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM the server itself (a stopped one is continued first) and wait; its exit code."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._close_stdout()

    def _close_stdout(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def run_as(uid: int, fn: Callable[[], str]) -> str:
    """``fn()`` in a forked child that took ``uid`` as its user and group (no supplementary groups): the
    string it returned, or ``error <exception>`` when it raised. Needs root."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to uid, run, report, leave without running the parent's clean-ups
        os.close(r)
        try:
            os.setgid(uid)
            os.setgroups([])
            os.setuid(uid)
            outcome = fn()
        except BaseException as exc:
            outcome = f"error {exc!r}"
        try:
            os.write(w, outcome.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        outcome = f.read().decode()
    os.waitpid(pid, 0)
    return outcome


def socket_dir(prefix: str) -> Path:
    """A fresh directory for unix sockets (mode 0755), directly under /tmp where there is one: a socket path
    must stay under 108 bytes, which a deep temp directory (a long ``TMPDIR``, pytest's per-test paths) can
    pass. The caller removes it."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp" if os.path.isdir("/tmp") else None))
    os.chmod(d, 0o755)  # other uids may reach a socket when its own mode allows
    return d


def wait_for(cond: Callable[[], bool], attempts: int = 3000) -> bool:
    """Poll ``cond`` (each poll a server round trip or a syscall, never a sleep); True once it holds."""
    for _ in range(attempts):
        if cond():
            return True
        os.sched_yield()
    return cond()


def wait_until(cond: Callable[[], bool], timeout_s: float = 30.0, every_s: float = 0.1) -> None:
    """Poll ``cond`` every ``every_s`` seconds until it holds; AssertionError once ``timeout_s`` have passed
    (a bound for a broken run, never reached when all is well)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(every_s)


class ServeFailed(AssertionError):
    """``tiercache serve`` exited (or printed something other than its ready line) instead of starting;
    ``returncode`` (negative: killed by that signal) and ``log`` (its stderr) tell why."""

    def __init__(self, returncode: int, line: str, log: str) -> None:
        super().__init__(f"tiercache serve did not start (exit {returncode}): {line!r}\n{log}")
        self.returncode = returncode
        self.log = log


class ConfigServer:
    """``tiercache serve --config CONFIG`` (as ``python -m tiercache``), run in the config's folder (not a
    checkout's root, whose ``tiercache/`` would shadow the installed package), logging to ``serve.log``
    beside it. ``socket``: a ``--socket`` flag (else the config's); ``extra``: more flags; ``preexec``: run
    in the child before exec. Started ready: the listening line was read (``address`` and ``epoch`` from
    it, ``metrics_url`` from the metrics line before it when ``server.metrics_port`` is set), else
    :class:`ServeFailed`. ``proc.stdout`` holds the lines after it. :meth:`stop` (or leaving the ``with``
    block) sends SIGTERM and waits."""

    def __init__(
        self,
        config: Path,
        socket_path: str | None = None,
        *extra: str,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        argv = [sys.executable, "-m", "tiercache", "serve", "--config", str(config)]
        if socket_path is not None:
            argv += ["--socket", socket_path]
        self.path = socket_path
        self.log_path = config.parent / "serve.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [*argv, *extra],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=config.parent,
                preexec_fn=preexec,
            )
        assert self.proc.stdout is not None
        line, self.metrics_url = _read_ready_line(self.proc.stdout)
        listening = _listening(line)
        if listening is None:
            if line:  # something else: not a server we know how to use
                self.proc.kill()
            code = self.proc.wait(60)
            self.proc.stdout.close()
            raise ServeFailed(code, line, self.log())
        self.address, self.epoch = listening  # the socket it listens on, its epoch

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        """What the server wrote on stderr so far."""
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = 120.0) -> int:
        """Wait for the exit (a stop already begun); the exit code."""
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (unless it exited) and wait; the exit code (idempotent)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.wait(timeout)

    def __enter__(self) -> ConfigServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
