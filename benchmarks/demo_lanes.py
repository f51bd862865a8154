"""Several ``tiercache demo`` runs at once on one config (so one ``file://`` directory), beside busy loops.

Each lane runs ``tiercache demo --config CONFIG --json ...`` back to back until ``--seconds`` have passed, so
one demo's prefill rewrites the objects another demo's decode is reading. ``--scalar-lanes N`` runs the first
N lanes on torch's scalar kernels (``ATEN_CPU_CAPABILITY=default``), like a process on another CPU or torch
build sharing the directory; ``--snapshot DIR`` puts DIR first on the lanes' ``PYTHONPATH`` (a copy of the
package, so a reinstall meanwhile cannot change the code under a run). Prints one JSON line per run (exit
status, verified requests, hit/read/written counts, the prefill's dropped stores per tier and reason), then a
summary line.

Usage: ``python benchmarks/demo_lanes.py --config FILE [--lanes 3] [--busy 1] [--seconds 420]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_DROPPED = re.compile(r'tiercache_stores_dropped_total\{reason="(\w+)",tier="([^"]+)"\} ([0-9.e+]+)')


def _run_once(env: dict[str, str], config: str, out: Path) -> dict[str, Any]:
    """One demo run: its exit status, seconds, and what its JSON says."""
    started, load = time.time(), os.getloadavg()[0]
    proc = subprocess.run(
        [sys.executable, "-m", "tiercache", "demo", "--config", config, "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    record: dict[str, Any] = {
        "rc": proc.returncode,
        "s": round(time.time() - started, 1),
        "load": round(load, 2),
    }
    if out.is_file():
        result = json.loads(out.read_text())
        out.unlink()
        dropped = {
            f"{tier}:{reason}": int(float(n))
            for reason, tier, n in _DROPPED.findall(result["prefill"]["metrics"])
            if float(n)
        }
        record["verified"] = sum(bool(r["verified"]) for r in result["requests"])
        record["counts"] = [(r["hit"], r["read"], r["written"]) for r in result["requests"]]
        record["prefill_dropped"] = dropped
        record["frames_rejected"] = result["decode"]["frames_rejected"]
    if proc.returncode != 0:
        record["stdout"] = proc.stdout[-3000:]
    return record


def main(argv: list[str] | None = None) -> int:
    """Run the lanes; exit status 1 when any run failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", required=True, help="demo config; its file:// tier is the shared one")
    parser.add_argument("--lanes", type=int, default=3)
    parser.add_argument("--busy", type=int, default=1, help="busy-loop processes beside the lanes")
    parser.add_argument("--seconds", type=float, default=420.0, help="no run starts after this")
    parser.add_argument("--scalar-lanes", type=int, default=0, help="lanes on ATEN_CPU_CAPABILITY=default")
    parser.add_argument("--snapshot", help="directory put first on the lanes' PYTHONPATH")
    args = parser.parse_args(argv)
    config = str(Path(args.config).resolve())
    end = time.time() + args.seconds
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    runs: list[dict[str, Any]] = []
    lock = threading.Lock()
    scratch = Path(tempfile.mkdtemp(prefix="demo-lanes-"))

    def lane(k: int) -> None:
        env = {key: v for key, v in os.environ.items() if key != "ATEN_CPU_CAPABILITY"}
        if args.snapshot:
            env["PYTHONPATH"] = args.snapshot
        if k < args.scalar_lanes:
            env["ATEN_CPU_CAPABILITY"] = "default"
        time.sleep(random.Random(k).random() * 10)  # lanes out of step
        i = 0
        while time.time() < end:
            record = {"lane": k, "scalar": k < args.scalar_lanes, "i": i}
            record.update(_run_once(env, config, scratch / f"lane{k}_{i}.json"))
            with lock:
                runs.append(record)
                print(json.dumps(record), flush=True)
            i += 1

    threads = [threading.Thread(target=lane, args=(k,)) for k in range(args.lanes)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for p in busy:
            p.kill()
            p.wait()
    loads = sorted(r["load"] for r in runs)
    summary = {
        "runs": len(runs),
        "failed_runs": sum(r["rc"] != 0 for r in runs),
        "verification_failures": sum(r.get("verified", 6) < 6 for r in runs),
        "verified_counts_of_failures": sorted(r.get("verified", 0) for r in runs if r.get("verified", 6) < 6),
        "runs_with_dropped_stores": sum(bool(r.get("prefill_dropped")) for r in runs),
        "load_1min_min_median_max": [loads[0], loads[len(loads) // 2], loads[-1]] if loads else None,
        "seconds_per_run_median": sorted(r["s"] for r in runs)[len(runs) // 2] if runs else None,
    }
    print(json.dumps({"summary": summary}), flush=True)
    return 1 if summary["failed_runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
