"""A throwaway moto S3 server on 127.0.0.1 for tests and benchmarks (start, stop by PID, pause, restart)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tiercache.testing.harness.processes import free_port

__all__ = ["TEST_ENV", "MotoServer", "aws_test_env", "moto_argv", "moto_with_bucket"]

TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
"""Environment for clients of the test server: dummy credentials, no profile files, no instance metadata."""

_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
"""Variables that would point a client elsewhere than the test server: removed by ``aws_test_env``."""


@contextlib.contextmanager
def aws_test_env() -> Iterator[None]:
    """``TEST_ENV`` in ``os.environ`` and no AWS profile, session token or endpoint override; the environment
    as it was on leaving."""
    saved = {k: os.environ.get(k) for k in (*TEST_ENV, *_UNSET)}
    os.environ.update(TEST_ENV)
    for k in _UNSET:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def moto_argv(port: int) -> list[str]:
    """Command line of a moto server on 127.0.0.1:``port`` (the venv's console script if there is one)."""
    script = Path(sys.executable).with_name("moto_server")
    if script.exists():
        return [str(script), "-H", "127.0.0.1", "-p", str(port)]
    found = shutil.which("moto_server")
    if found:
        return [found, "-H", "127.0.0.1", "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


class MotoServer:
    """One moto_server process; ``restart`` brings it back on the same port (empty: moto is in-memory)."""

    def __init__(self, port: int | None = None, log: Path | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server not started"
        return self.proc.pid

    def start(self, timeout: float = 20.0) -> MotoServer:
        """Start the process and wait until it answers HTTP."""
        with open(self.log if self.log else os.devnull, "ab") as out:
            self.proc = subprocess.Popen(
                moto_argv(self.port), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode} (port {self.port})")
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=1):
                    return self
            except urllib.error.HTTPError:
                return self  # any HTTP answer means it is up
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"moto_server did not answer on {self.endpoint} within {timeout} s")

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (after SIGCONT, in case it is paused), then SIGKILL if it lingers; waits for exit."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def kill(self) -> None:
        """SIGKILL and reap (a crash, as the client sees it)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the kernel still accepts connections, nothing answers."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def restart(self, timeout: float = 20.0) -> None:
        """Kill if running, then start again on the same port."""
        self.kill()
        self.start(timeout)

    def boto3_client(self) -> object:
        """A plain (sync) boto3 S3 client on this server, for checks from the test side."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )


@contextlib.contextmanager
def moto_with_bucket(bucket: str, log: Path | None = None) -> Iterator[MotoServer]:
    """A started moto server holding the empty ``bucket``; stopped by PID on leaving (its clients want
    ``aws_test_env``)."""
    server = MotoServer(log=log).start()
    try:
        server.boto3_client().create_bucket(Bucket=bucket)  # type: ignore[attr-defined]
        yield server
    finally:
        server.stop()
