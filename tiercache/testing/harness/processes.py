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

__all__ = [
    "ConfigServer",
    "NodeServer",
    "ServerProcess",
    "exits_within",
    "free_port",
    "port_open",
    "start_process",
    "wait_for",
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
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            raise RuntimeError(f"{argv[0]} exited with {popen.returncode} before ready:\n{proc.log()}")
        try:
            if ready():
                return proc
        except Exception:  # readiness probes may fail while starting
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{argv[0]} not ready after {timeout} s:\n{proc.log()}")
        time.sleep(0.02)


class NodeServer:
    """A ``python -m tiercache.server`` child on the Unix socket ``path`` (for server-mode tests).

    ``extra``: more flags; ``prefix``: a command to run it under (e.g. ``unshare``); ``preexec``: run in the
    child before exec. ``ready`` and ``epoch`` come from its ready line (stdout); ``pid`` is the server's own
    pid, also under ``unshare --fork``. :meth:`stop` sends SIGCONT then SIGTERM and returns the exit code.
    """

    def __init__(
        self,
        path: str,
        *extra: str,
        slot_bytes: int = 4096,
        slots: int = 4,
        prefix: Sequence[str] = (),
        preexec: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        cmd = [*prefix, sys.executable, "-m", "tiercache.server", "--socket", path]
        cmd += ["--slot-bytes", str(slot_bytes), "--slots", str(slots), *extra]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(path),
            preexec_fn=preexec,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the ready line, or "" when it exited
        self.ready = line.startswith("tiercache server listening")
        self.epoch = int(line.split()[-1]) if self.ready else -1

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
        self._close_pipes()

    def stop(self) -> int:
        """SIGTERM the server itself (a stopped one is continued first) and wait; its exit code."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            self._close_pipes()

    def _close_pipes(self) -> None:
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def wait_for(cond: Callable[[], bool], attempts: int = 3000) -> bool:
    """Poll ``cond`` (each poll a server round trip or a syscall, never a sleep); True once it holds."""
    for _ in range(attempts):
        if cond():
            return True
        os.sched_yield()
    return cond()


class ConfigServer:
    """``tiercache serve --config CONFIG`` (as ``python -m tiercache``), run in the config's folder (not a
    checkout's root, whose ``tiercache/`` would shadow the installed package), logging to ``serve.log``
    beside it. ``socket``: a ``--socket`` flag (else the config's). Started ready: the listening line was
    read, else AssertionError with its log. :meth:`stop` (or leaving the ``with`` block) sends SIGTERM and
    waits."""

    def __init__(self, config: Path, socket_path: str | None = None, *extra: str) -> None:
        argv = [sys.executable, "-m", "tiercache", "serve", "--config", str(config)]
        if socket_path is not None:
            argv += ["--socket", socket_path]
        self.path = socket_path
        self.log_path = config.parent / "serve.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [*argv, *extra], stdout=subprocess.PIPE, stderr=log, text=True, cwd=config.parent
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("tiercache server listening"):
            self.proc.kill()
            self.proc.wait(60)
            raise AssertionError(f"tiercache serve did not start: {line!r}\n{self.log_path.read_text()}")

    def stop(self) -> None:
        """SIGTERM and wait (idempotent)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> ConfigServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
