"""Plot tiercache beside LMCache 0.5.6 from the committed vs_lmcache results (one PNG, speeds in GB/s).

    .venv/bin/python -P benchmarks/plot_vs_lmcache.py [--results benchmarks/results] [--out PATH]

Left: GPU whole calls (wall time through each public API) per request size, tiercache (device-checked slots,
and trusted where measured: no checks, as LMCache's kernel) and LMCache side by side
(``vs_lmcache_gpu_h200.json``). Right: CPU L1 store / retrieve with the bare copy of the same bytes
(``vs_lmcache_cpu.json``). Figures are the medians each run recorded; nothing is re-measured here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPS = ("gather", "scatter", "to_pinned", "from_pinned")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--cpu-json", default="", help="CPU result file (default: RESULTS/vs_lmcache_cpu.json)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = Path(args.results)
    gpu = json.loads((res / "vs_lmcache_gpu_h200.json").read_text())
    cpu = json.loads((Path(args.cpu_json) if args.cpu_json else res / "vs_lmcache_cpu.json").read_text())
    fig, (ax_g, ax_c) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [3, 1]})
    labels, tc, tt, lm = [], [], [], []
    for size, row in gpu["sizes"].items():
        for op in OPS:
            labels.append(f"{op}\n{size.replace('_tokens', '')} tok")
            tc.append(row[op]["tiercache"]["call_wall_GBps"])
            tt.append(row[op].get("tiercache_trusted", {}).get("call_wall_GBps", 0.0))
            lm.append(row[op]["lmcache"]["call_wall_GBps"])
    xs = range(len(labels))
    ax_g.bar([x - 0.27 for x in xs], tc, 0.27, label="tiercache (checked slots)")
    ax_g.bar(list(xs), tt, 0.27, label="tiercache (trusted)", color="C2")
    ax_g.bar([x + 0.27 for x in xs], lm, 0.27, label="LMCache 0.5.6", color="C1")
    ax_g.set_yscale("log")
    ax_g.set_xticks(list(xs), labels, fontsize=7)
    ax_g.set_ylabel("GB/s (whole call, log scale)")
    ax_g.set_title(f"GPU ({gpu.get('device', 'H200')}): whole calls per request size")
    ax_g.legend()
    c_labels = ["store", "retrieve"]
    ax_c.bar(
        [-0.2, 0.8],
        [cpu["tiercache"]["store_GBps"], cpu["tiercache"]["retrieve_GBps"]],
        0.4,
        label="tiercache",
    )
    ax_c.bar(
        [0.2, 1.2], [cpu["lmcache"]["store_GBps"], cpu["lmcache"]["retrieve_GBps"]], 0.4, label="LMCache"
    )
    ax_c.axhline(cpu["bare_copy_GBps"], color="grey", linestyle="--", label="bare copy")
    ax_c.set_xticks([0, 1], c_labels)
    ax_c.set_ylabel("GB/s")
    ax_c.set_title(f"CPU L1, {cpu['workload'].split(',')[0]}")
    ax_c.legend(fontsize=8)
    fig.tight_layout()
    out = Path(args.out) if args.out else res / "vs_lmcache.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
