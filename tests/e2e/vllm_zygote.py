"""A process that has imported vLLM once and forks a child per run of a vLLM child script (``run_vllm.py`` and
its siblings): each child is a real vLLM process, as ``python SCRIPT SPEC OUT`` would be, without the 10-20 s
of imports a fresh interpreter pays on a small CPU machine (most of a tiny model's run). vLLM forks its own
workers the same way, after its imports. The children share the zygote's string-hash seed: a test of what
must not depend on it (``PYTHONHASHSEED``) starts its processes itself.

Server: ``python vllm_zygote.py SOCKET`` imports vLLM and the connector, then listens on the unix socket
``SOCKET``. A request is one JSON line ``{"script", "argv", "log", "env", "cwd"}``; the answer is
``{"pid": N}`` once the child is forked and ``{"returncode": R}`` once it has ended (R as ``subprocess``
reports it: negative for a signal), or ``{"fresh": KEYS}`` at once where ``env`` differs from the zygote's
own in more than what importing vLLM sets and the name of the running test (``KEYS``: the others; a variable
read at interpreter start or at import, such as ``PYTHONPATH``, would not reach a forked child): the caller
then starts a fresh interpreter, and the zygote's log names them.
The child takes ``env`` as its environment and ``cwd`` as its working directory, writes its stdout and
stderr to ``log``, runs ``script`` as ``__main__`` with ``argv`` and ends as that script would, through the
interpreter's normal exit.

Client: ``Zygote`` (start, run, stop by PID), and ``Forker``, which keeps one zygote per test process.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class Zygote:
    """A started zygote (``python vllm_zygote.py SOCKET``); ``run`` forks one child script through it."""

    def __init__(self, sock_path: Path, env: dict[str, str], timeout: float = 600.0) -> None:
        from tiercache.testing.harness.processes import start_process

        self.sock_path = sock_path
        argv = [sys.executable, str(HERE / "vllm_zygote.py"), str(sock_path)]
        self.proc = start_process(argv, ready=sock_path.exists, timeout=timeout, env=env)

    def run(
        self, script: Path, argv: list[str], env: dict[str, str], log: Path, timeout: float
    ) -> int | None:
        """Run ``script`` with ``argv`` and ``env`` in a forked child, in this process's working directory
        (its output to ``log``); its return code, or None where ``env`` needs a fresh interpreter.
        ``subprocess.TimeoutExpired`` after ``timeout`` seconds, the child killed."""
        request = {"script": str(script), "argv": argv, "log": str(log), "env": env, "cwd": os.getcwd()}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(self.sock_path))
            conn.sendall(json.dumps(request).encode() + b"\n")
            replies = conn.makefile("r")
            forked = json.loads(replies.readline())
            if "fresh" in forked:
                return None
            pid = int(forked["pid"])
            conn.settimeout(timeout)
            try:
                line = replies.readline()
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)  # the zygote reaps it
                raise subprocess.TimeoutExpired([str(script), *argv], timeout) from None
            return int(json.loads(line)["returncode"])

    def stop(self) -> None:
        self.proc.kill()
        shutil.rmtree(self.sock_path.parent, ignore_errors=True)


class Forker:
    """A test process's zygote, started on first use with that run's environment. A run whose environment it
    refuses starts a fresh interpreter (``run`` gives None); when the next run needs that same environment
    too, the change has lasted (vLLM sets variables in a process that runs it), and a zygote with it takes
    over. ``TIERCACHE_TEST_ZYGOTE=0``: every run starts fresh."""

    def __init__(self) -> None:
        self.zygote: Zygote | None = None
        self.refused: dict[str, str] | None = None  # the environment of the last run, if refused
        self.off = os.environ.get("TIERCACHE_TEST_ZYGOTE", "1") == "0"

    def run(
        self, script: Path, argv: list[str], env: dict[str, str], log: Path, timeout: float
    ) -> int | None:
        """``Zygote.run`` through this process's zygote; None: start a fresh interpreter instead."""
        if self.off:
            return None
        lasting = self.refused is not None and not _differences(env, self.refused)
        if lasting or self.zygote is None or not self.zygote.proc.alive():
            self._start(env)
        if self.zygote is None:
            return None
        returncode = self.zygote.run(script, argv, env, log, timeout)
        self.refused = env if returncode is None else None
        return returncode

    def _start(self, env: dict[str, str]) -> None:
        self.stop()
        self.refused = None
        sock_dir = Path(tempfile.mkdtemp(prefix="tc-zyg-", dir="/tmp" if os.path.isdir("/tmp") else None))
        try:
            self.zygote = Zygote(sock_dir / "zygote.sock", env)
        except RuntimeError as exc:
            warnings.warn(f"no vLLM zygote, every child starts a fresh interpreter: {exc}", stacklevel=3)
            shutil.rmtree(sock_dir, ignore_errors=True)
            self.off = True

    def stop(self) -> None:
        """Stop the zygote, if one runs (by its PID)."""
        if self.zygote is not None:
            self.zygote.stop()
            self.zygote = None


def _preload() -> None:
    """What every child imports first: vLLM's offline entry point and the connector."""
    import vllm.entrypoints.llm  # noqa: F401
    from tiercache_vllm import connector  # noqa: F401


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python SCRIPT ARGV...`` with output to the request's log."""
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script = request["script"]
    sys.argv = [script, *request["argv"]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


PER_TEST = {"PYTEST_CURRENT_TEST"}  # pytest names the running test here; no child reads it at start


def _differences(env: dict[str, str], *own: dict[str, str]) -> list[str]:
    """The variables but ``PER_TEST`` in which ``env`` differs from every environment of ``own``."""
    keys = set(env).union(*own) - PER_TEST
    return sorted(k for k in keys if all(env.get(k) != o.get(k) for o in own))


def serve(sock_path: str) -> None:
    """Accept requests until killed; fork a child per request and report its end (module docstring)."""
    started = dict(os.environ)
    _preload()
    imported = dict(os.environ)  # vLLM's imports set a few variables
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path + ".tmp")
    listener.listen(16)
    os.rename(sock_path + ".tmp", sock_path)  # ready: the socket appears once it accepts
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection that asked for it
    while True:
        if selector.select(timeout=0.05):
            conn, _ = listener.accept()
            request = json.loads(conn.makefile("r").readline())
            different = _differences(request["env"], started, imported)
            if different:
                print(f"a fresh interpreter for {request['argv'][0]}: {different}", flush=True)
                conn.sendall(json.dumps({"fresh": different}).encode() + b"\n")
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                _child(request)
                sys.exit(0)  # the script returned: exit as its interpreter would
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid)
            with contextlib.suppress(OSError):  # the client gave up (a timeout killed the child)
                conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
