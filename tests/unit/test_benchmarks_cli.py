"""Every benchmark script still imports and answers ``--help`` (a moved module broke redis_cold.py unnoticed).

One fresh interpreter loads each ``benchmarks/*.py`` by path, as ``python benchmarks/X.py`` would (its
folder on ``sys.path``), and calls its ``main()`` with ``--help``: argparse prints the usage and exits 0.
The CUDA-only scripts take no options and need a GPU to run: they are checked for import and ``main`` only.
Imports inside functions (run only by a real benchmark run) are resolved too: every ``tiercache`` module and
name a script imports anywhere must exist.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
CUDA_ONLY = {"fp8_l1_bench.py", "gpu_ab.py", "gpu_bench.py", "server_gpu_bench.py"}

_CHILD = """
import ast, contextlib, importlib, importlib.util, io, json, sys
from pathlib import Path
from tiercache.testing.harness.scripts import load_by_path
bench, cuda_only = Path(sys.argv[1]), set(sys.argv[2].split(","))
sys.path.insert(0, str(bench))
out = {}
for f in sorted(bench.glob("*.py")):
    if f.name.startswith("_"):
        continue
    try:
        mod = load_by_path(f, f"bench_{f.stem}")
    except BaseException as exc:
        out[f.name] = f"import: {type(exc).__name__}: {exc}"
        continue
    missing = []
    for node in ast.walk(ast.parse(f.read_text())):  # imports anywhere, lazy ones in functions included
        name = (node.module or "") if isinstance(node, ast.ImportFrom) and node.level == 0 else ""
        if name.startswith("tiercache"):
            if importlib.util.find_spec(name) is None:
                missing.append(name)
                continue
            target = importlib.import_module(name)
            missing += [f"{name}.{a.name}" for a in node.names if not hasattr(target, a.name)
                        and importlib.util.find_spec(f"{name}.{a.name}") is None]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tiercache") and importlib.util.find_spec(a.name) is None:
                    missing.append(a.name)
    if missing:
        out[f.name] = f"imports missing: {missing}"
        continue
    if not callable(getattr(mod, "main", None)):
        out[f.name] = "no main()"
        continue
    if f.name in cuda_only:
        out[f.name] = "ok"
        continue
    sys.argv = [str(f), "--help"]
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            mod.main()
        out[f.name] = "main() returned on --help"
    except SystemExit as exc:
        out[f.name] = "ok" if exc.code == 0 and "usage:" in text.getvalue() else f"exit {exc.code}"
    except BaseException as exc:
        out[f.name] = f"--help: {type(exc).__name__}: {exc}"
print("RESULT " + json.dumps(out))
"""


def test_every_benchmark_imports_and_answers_help(tmp_path: pathlib.Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-P", "-c", _CHILD, str(BENCHMARKS), ",".join(sorted(CUDA_ONLY))],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    results = json.loads(line.removeprefix("RESULT "))
    scripts = {p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")}
    assert set(results) == scripts
    assert scripts >= CUDA_ONLY  # a renamed CUDA-only script must be renamed here too
    assert {name: r for name, r in results.items() if r != "ok"} == {}
