"""The e2e vLLM runner's ``serve`` mode (the checkout's ``tests/e2e/run_vllm.py``): its line protocol (each
answer to a command is one stdout line, ``REPLY`` then JSON; vLLM's own log lines go to stdout too) and
:class:`ServeProcess`, one such runner in its own OS process driven by JSON lines."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

__all__ = ["REPLY", "ServeProcess"]

REPLY = "@@tiercache-reply "
"""Prefix of ``serve``'s answer lines on stdout."""


class ServeProcess:
    """``script`` (``run_vllm.py``) on ``spec`` in ``serve`` mode, in its own session: a JSON command per
    stdin line, one ``REPLY`` line per command. Files ``NAME.spec.json``, ``NAME.out.json`` and ``NAME.log``
    (everything else it prints) go to ``workdir``; ``env`` is added to this process's environment (vLLM
    offline; the runner sizes its own KV cache)."""

    def __init__(
        self,
        script: str | Path,
        spec: Mapping[str, Any],
        workdir: Path,
        name: str = "vllm",
        env: Mapping[str, str] | None = None,
        reply_timeout_s: float = 600.0,
    ) -> None:
        self.name = name
        self.reply_timeout_s = reply_timeout_s
        spec_path = workdir / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        self.log_path = workdir / f"{name}.log"
        self._log: IO[str] = self.log_path.open("w")
        child_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
        child_env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(spec_path), str(workdir / f"{name}.out.json")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=child_env,
            start_new_session=True,
        )
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        """Answers to the queue, everything else vLLM prints to the log; None once stdout closes."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                self._replies.put(json.loads(line[len(REPLY) :]))
            else:
                self._log.write(line)
        self._replies.put(None)

    def send(self, op: str, **args: Any) -> None:
        """Command ``op`` with ``args``; its answer comes from :meth:`answer`."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The next answer (the first is ``{"ready": true}``); RuntimeError with the log's tail when the
        process exited, ``queue.Empty`` after ``timeout_s`` (default ``reply_timeout_s``)."""
        reply = self._replies.get(timeout=self.reply_timeout_s if timeout_s is None else timeout_s)
        if reply is None:
            self._log.flush()
            tail = self.log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"vLLM {self.name} exited ({self.proc.poll()}): {tail}")
        return reply

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """:meth:`send`, then its :meth:`answer`."""
        self.send(op, **args)
        return self.answer()

    def stop(self, timeout_s: float = 120.0) -> None:
        """Close its stdin (the runner exits), SIGKILL it after ``timeout_s``, then SIGKILL its process
        group (engine processes left behind)."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
