"""Write a suite's JSON and PNG (matplotlib, Agg) and build the terminal summary table (rich)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["print_json", "summary_table", "write_json", "write_png"]


def write_json(doc: dict[str, Any], path: Path) -> None:
    """``doc`` as indented JSON at ``path``."""
    path.write_text(json.dumps(doc, indent=2) + "\n")


def print_json(doc: dict[str, Any], out: str | os.PathLike[str] | None = None) -> None:
    """Print ``doc`` as indented JSON; with ``out`` (a script's ``--out``), write it there too (its folder
    made)."""
    print(json.dumps(doc, indent=2))
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(doc, path)


def _size_label(n: float, unit: str) -> str:
    if unit != "bytes":
        return f"{n:g} {unit}"
    for suffix in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or suffix == "GiB":
            return f"{n:g} {suffix}"
        n /= 1024
    return f"{n:g} B"


def write_png(doc: dict[str, Any], path: Path) -> None:
    """Per group of rows sharing a rate unit and a size unit, one line of panels: rate vs size per case
    (axes labelled with those units) and ratio to the raw baseline vs size (its p10-p90 band over the
    repeats); beside the first, latency percentiles at the largest size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[dict[str, Any]] = doc["rows"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["unit"], r["size_unit"]), []).append(r)
    fig, grid = plt.subplots(max(1, len(groups)), 3, figsize=(18, 5.5 * max(1, len(groups))), squeeze=False)
    fig.suptitle(f"tiercache bench: {doc['suite']} ({doc['description']}), config: {doc['config']}")
    if not rows:
        for ax in grid[0]:
            ax.axis("off")
        grid[0][1].text(0.5, 0.5, f"skipped: {doc.get('skipped') or 'no rows'}", ha="center", va="center")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        return
    for (unit, size_unit), group, (rate, ratio_ax, lat) in zip(
        groups.items(), groups.values(), grid, strict=True
    ):
        for case in dict.fromkeys(r["case"] for r in group):
            mine = sorted((r for r in group if r["case"] == case), key=lambda r: r["size"])
            xs = [r["size"] for r in mine]
            noisy = " (noisy)" if any(r.get("spread", {}).get("noisy") for r in mine) else ""
            line = rate.plot(xs, [r["value"] for r in mine], marker="o", label=f"{case}{noisy}")[0]
            if any(r["raw"] is not None for r in mine):
                raw = [r["raw"] if r["raw"] is not None else float("nan") for r in mine]
                rate.plot(xs, raw, linestyle="--", color=line.get_color(), alpha=0.6, label=f"{case}: raw")
                ratios = [r["ratio"] if r["ratio"] is not None else float("nan") for r in mine]
                ratio_ax.plot(xs, ratios, marker="o", color=line.get_color(), label=case)
                low = [r.get("spread", {}).get("ratio_p10", float("nan")) for r in mine]
                high = [r.get("spread", {}).get("ratio_p90", float("nan")) for r in mine]
                ratio_ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
        for ax in (rate, ratio_ax):
            ax.set_xscale("log", base=2)
            ax.set_xlabel(f"size ({size_unit})")
            ax.grid(True, alpha=0.3)
        rate.set_ylabel(f"rate ({unit}; solid: tiercache, dashed: raw baseline)")
        rate.set_title(f"throughput vs size ({unit})")
        rate.legend(fontsize=7)
        ratio_ax.axhline(1.0, color="grey", linewidth=1)
        ratio_ax.set_ylabel("ratio to raw (value / raw; band: p10-p90 of the repeats)")
        ratio_ax.set_title("ratio to the raw baseline")
        if ratio_ax.lines[1:]:
            ratio_ax.legend(fontsize=7)
        lat.axis("off")
    lat = grid[0][2]
    lat.axis("on")
    largest = max(r["size"] for r in rows if (r["unit"], r["size_unit"]) == next(iter(groups)))
    at_largest = [r for r in next(iter(groups.values())) if r["size"] == largest and r["latency_s"]]
    width = 0.8 / 3
    for i, pct in enumerate(("p50", "p90", "p99")):
        xs = [j + (i - 1) * width for j in range(len(at_largest))]
        lat.bar(xs, [r["latency_s"].get(pct, 0.0) * 1e3 for r in at_largest], width, label=pct)
    lat.set_xticks(range(len(at_largest)))
    lat.set_xticklabels([r["case"] for r in at_largest], rotation=30, ha="right", fontsize=7)
    lat.set_yscale("log")
    lat.set_ylabel("latency (ms)")
    lat.set_title(f"latency percentiles at {_size_label(largest, next(iter(groups))[1])}")
    lat.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def summary_table(docs: Sequence[dict[str, Any]]) -> Table:
    """One line per suite and case at its largest size: rate, raw rate, ratio and its p10-p90 range over the
    interleaved repeats ('!': the machine was noisy for it), p50 and p99 latency; a caption with the hit rate
    and hit-rate ceiling of the in-process lookups that report one."""
    from rich.table import Table

    table = Table(title="tiercache bench summary (largest size per case)")
    for col in ("suite", "case", "size", "rate", "raw", "ratio", "p10-p90", "p50 ms", "p99 ms"):
        table.add_column(col, justify="left" if col in ("suite", "case") else "right")
    for doc in docs:
        if doc["skipped"]:
            table.add_row(doc["suite"], f"skipped: {doc['skipped']}", "", "", "", "", "", "", "")
            continue
        largest: dict[str, dict[str, Any]] = {}
        for r in doc["rows"]:
            if r["case"] not in largest or r["size"] > largest[r["case"]]["size"]:
                largest[r["case"]] = r
        for r in largest.values():
            lat = r["latency_s"]
            sp = r.get("spread") or {}
            band = f"{sp['ratio_p10']:.2f}-{sp['ratio_p90']:.2f}" if "ratio_p10" in sp else ""
            table.add_row(
                doc["suite"],
                r["case"],
                _size_label(r["size"], r["size_unit"]),
                f"{r['value']:.3g} {r['unit']}",
                "" if r["raw"] is None else f"{r['raw']:.3g}",
                ("" if r["ratio"] is None else f"{r['ratio']:.2f}") + (" !" if sp.get("noisy") else ""),
                band,
                f"{lat['p50'] * 1e3:.3g}" if "p50" in lat else "",
                f"{lat['p99'] * 1e3:.3g}" if "p99" in lat else "",
            )
    ceilings = [
        f"{doc['suite']} {r['case']}: hit rate {r['extra']['hit_rate']:.2f}, ceiling "
        f"{r['extra']['hit_rate_ceiling']:.2f} over {r['extra']['chunks_looked_up']} chunks"
        for doc in docs
        if not doc["skipped"]
        for r in doc["rows"]
        if "hit_rate_ceiling" in r.get("extra", {})
    ]
    if ceilings:  # the ceiling: the hit rate an unbounded cache would reach on the same lookups
        table.caption = "hit-rate ceiling (an unbounded cache on the same lookups): " + "; ".join(ceilings)
    return table
