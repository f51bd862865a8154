"""A process that has imported vLLM once and forks a child per run of a vLLM child script (``run_vllm.py`` and
its siblings): each child is a real vLLM process, as ``python SCRIPT SPEC OUT`` would be, without the 10-20 s
of imports a fresh interpreter pays on a small CPU machine (most of a tiny model's run). vLLM forks its own
workers the same way, after its imports. The children share the zygote's string-hash seed: a test of what
must not depend on it (``PYTHONHASHSEED``) starts its processes itself.

Server: ``python vllm_zygote.py SOCKET PID`` imports vLLM and the connector, then listens on the unix
socket ``SOCKET`` until process ``PID`` (the test process) ends. A request is one JSON line ``{"script",
"argv", "log", "env", "cwd"}``; the answer is ``{"pid": N}`` once the child is forked and ``{"returncode":
R}`` once it has ended (R as ``subprocess`` reports it: negative for a signal), or ``{"fresh": KEYS}`` at
once where ``env`` differs from the zygote's own in more than what importing vLLM sets and the name of the
running test (``KEYS``: the others; a variable read at interpreter start or at import, such as
``PYTHONPATH``, would not reach a forked child): the caller then starts a fresh interpreter, and the
zygote's log names them.

The child takes ``env`` (over what vLLM's imports set) as its environment and ``cwd`` as its working
directory, writes its stdout and stderr to ``log``, runs ``script`` as ``__main__`` with ``argv`` and ends
as that script would, through the interpreter's normal exit. A client that closes its connection before the
answer (a timeout, an interrupted test) has its child killed; the zygote ends with the process that
started it.

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
import warnings
from pathlib import Path
from typing import IO, Any

from tiercache.server.listen import listen_at
from tiercache.testing.harness.processes import socket_dir, start_process

HERE = Path(__file__).resolve().parent


class Zygote:
    """A started zygote (``python vllm_zygote.py SOCKET PID``, PID this process); ``run`` forks one child
    script through it."""

    def __init__(self, sock_path: Path, env: dict[str, str], timeout: float = 600.0) -> None:
        self.sock_path = sock_path
        argv = [sys.executable, str(HERE / "vllm_zygote.py"), str(sock_path), str(os.getpid())]
        self.proc = start_process(argv, ready=sock_path.exists, timeout=timeout, env=env)

    def run(
        self, script: Path, argv: list[str], env: dict[str, str], log: Path, timeout: float
    ) -> int | None:
        """Run ``script`` with ``argv`` and ``env`` in a forked child, in this process's working directory
        (its output to ``log``); its return code, or None where ``env`` needs a fresh interpreter.
        ``subprocess.TimeoutExpired`` after ``timeout`` seconds. However the wait ends, the connection
        closes with it, and the zygote kills a child whose connection closed."""
        request = {"script": str(script), "argv": argv, "log": str(log), "env": env, "cwd": os.getcwd()}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(str(self.sock_path))
            conn.sendall(json.dumps(request).encode() + b"\n")
            replies = conn.makefile("r")
            try:
                forked = _reply(replies, log)
                if "fresh" in forked:
                    return None
                return int(_reply(replies, log)["returncode"])
            except TimeoutError:  # leaving closes the connection: the zygote kills the child
                raise subprocess.TimeoutExpired([str(script), *argv], timeout) from None

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
        sock_dir = socket_dir("tc-zyg-")
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


def _child(request: dict[str, Any], set_by_imports: dict[str, str]) -> None:
    """In the forked child: become ``python SCRIPT ARGV...`` with output to the request's log, in the
    request's environment over what vLLM's imports set (as a fresh interpreter would have it)."""
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt, as in any interpreter
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(set_by_imports)
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script = request["script"]
    sys.argv = [script, *request["argv"]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


REQUEST_TIMEOUT_S = 30.0  # a client sends its request line at once; a silent one is dropped
PER_TEST = {"PYTEST_CURRENT_TEST"}  # pytest names the running test here; no child reads it at start


def _differences(env: dict[str, str], *own: dict[str, str]) -> list[str]:
    """The variables but ``PER_TEST`` in which ``env`` differs from every environment of ``own``."""
    keys = set(env).union(*own) - PER_TEST
    return sorted(k for k in keys if all(env.get(k) != o.get(k) for o in own))


def _reply(replies: IO[str], log: Path) -> dict[str, Any]:
    """The zygote's next answer line; RuntimeError if it ended instead."""
    line = replies.readline()
    if not line:
        raise RuntimeError(f"the vLLM zygote ended during a run (the run's log: {log})")
    answer: dict[str, Any] = json.loads(line)
    return answer


def serve(sock_path: str, parent: int) -> None:
    """Fork a child per request and report its end (module docstring) until process ``parent`` ends; a
    child whose client went away (its connection closed) is killed with its process group."""
    try:
        parent_fd = os.pidfd_open(parent)  # readable once the test process has ended
    except ProcessLookupError:
        return
    started = dict(os.environ)
    _preload()
    imported = dict(os.environ)  # vLLM's imports set a few variables
    set_by_imports = {k: v for k, v in imported.items() if started.get(k) != v}
    listener = listen_at(sock_path, socket.SOCK_STREAM, backlog=16)  # ready: the path accepts
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "listener")
    selector.register(parent_fd, selectors.EVENT_READ, "parent")
    waiting: dict[int, Run] = {}
    while True:
        events = [key for key, _ in selector.select()]
        if any(key.data == "parent" for key in events):
            break
        for key in events:
            if key.data == "listener":
                request = _request(listener, (started, imported))
                if request is not None:
                    _fork(*request, set_by_imports, selector, waiting)
            elif key.fileobj is key.data.conn:  # a run's connection turned readable: its client left
                selector.unregister(key.fileobj)
                key.data.kill()
            else:  # a run's pidfd: the child ended
                _report(key.data, selector, waiting)
    for run in waiting.values():  # the test process is gone: so are its runs
        run.kill()
    shutil.rmtree(os.path.dirname(sock_path), ignore_errors=True)


class Run:
    """A forked child: its pid, a pidfd (readable once it ended) and the connection waiting for it."""

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid, self.conn = pid, conn
        self.pidfd = os.pidfd_open(pid)

    def kill(self) -> None:
        """SIGKILL the child and its process group (vLLM's own processes); it is reaped on its pidfd."""
        for kill in (os.kill, os.killpg):  # the child may not have made its group yet
            with contextlib.suppress(ProcessLookupError):
                kill(self.pid, signal.SIGKILL)


def _request(
    listener: socket.socket, own: tuple[dict[str, str], dict[str, str]]
) -> tuple[dict[str, Any], socket.socket] | None:
    """Accept one request; answer ``fresh`` where its environment needs a fresh interpreter. The request
    and its connection, or None: answered, or dropped when malformed or not sent at once."""
    conn, _ = listener.accept()
    try:
        conn.settimeout(REQUEST_TIMEOUT_S)
        request = _parsed(conn.makefile("r").readline())
        different = _differences(request["env"], *own)
        if not different:
            conn.settimeout(None)
            return request, conn
        print(f"a fresh interpreter for {request['script']}: {different}", flush=True)
        conn.sendall(json.dumps({"fresh": different}).encode() + b"\n")
    except Exception as exc:  # this request only; the zygote serves the next
        print(f"a request dropped: {exc!r}", flush=True)
    conn.close()
    return None


def _parsed(line: str) -> dict[str, Any]:
    """A request line as the child needs it (``ValueError``, ``KeyError``, ... where it is not one)."""
    raw = json.loads(line)
    return {
        "script": str(raw["script"]),
        "argv": [str(a) for a in raw["argv"]],
        "log": str(raw["log"]),
        "cwd": str(raw["cwd"]),
        "env": {str(k): str(v) for k, v in raw["env"].items()},
    }


def _fork(
    request: dict[str, Any],
    conn: socket.socket,
    set_by_imports: dict[str, str],
    selector: selectors.BaseSelector,
    waiting: dict[int, Run],
) -> None:
    """Fork the request's child (it never returns here) and tell the client its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: an error in the script propagates and ends it as an interpreter would
        for key in list(selector.get_map().values()):  # the listener, the pidfds, the other connections
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()
            else:
                os.close(key.fd)
        selector.close()
        conn.close()
        os.setsid()  # its own process group: an abandoned run is killed with vLLM's processes
        _child(request, set_by_imports)
        sys.exit(0)  # the script returned: exit as its interpreter would
    run = Run(pid, conn)
    waiting[pid] = run
    selector.register(run.pidfd, selectors.EVENT_READ, run)
    try:
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        selector.register(conn, selectors.EVENT_READ, run)
    except OSError:  # the client already left
        run.kill()


def _report(run: Run, selector: selectors.BaseSelector, waiting: dict[int, Run]) -> None:
    """Reap an ended child and tell its client (if still there) its return code."""
    _, status = os.waitpid(run.pid, 0)
    del waiting[run.pid]
    selector.unregister(run.pidfd)
    os.close(run.pidfd)
    with contextlib.suppress(KeyError):
        selector.unregister(run.conn)
    with contextlib.suppress(OSError):  # the client gave up (its run was killed)
        run.conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    run.conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
