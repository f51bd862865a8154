"""Run bench suites against a config: progress bars, per-suite JSON and PNG, a summary table.

``run_bench`` is what ``tiercache bench`` calls; each suite is ``async (SuiteContext) -> list[Row]``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiercache.cli.bench.measure import NOISE_LIMIT, Row, host_info
from tiercache.errors import TiercacheError

if TYPE_CHECKING:
    from tiercache.config import Config

__all__ = ["SCHEMA_VERSION", "SUITES", "SuiteContext", "run_bench", "run_suite"]

SCHEMA_VERSION = 1
"""Version of the ``<suite>.json`` layout (bump on an incompatible change)."""

Suite = Callable[["SuiteContext"], Awaitable[list[Row]]]


def _suites() -> dict[str, tuple[str, Callable[[], Suite]]]:
    def lazy(module: str, name: str) -> Callable[[], Suite]:
        def load() -> Suite:
            import importlib

            return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]

        return load

    return {
        "keys": (
            "chunk-key hashing and prefix scans vs hashlib",
            lazy("tiercache.cli.bench.keys", "keys_suite"),
        ),
        "engine": (
            "engine store/retrieve vs memcpy, lookup",
            lazy("tiercache.cli.bench.engine", "engine_suite"),
        ),
        "tiers": ("each configured tier vs its raw client", lazy("tiercache.cli.bench.tiers", "tiers_suite")),
        "codecs": (
            "codec chains on a KV sample vs memcpy",
            lazy("tiercache.cli.bench.codecs", "codecs_suite"),
        ),
        "gpu": ("GPU gather/scatter vs D2H/H2D copies (CUDA)", lazy("tiercache.cli.bench.gpu", "gpu_suite")),
    }


SUITES: dict[str, tuple[str, Callable[[], Suite]]] = _suites()
"""Suite name -> (description, loader of the suite function), in run order."""


@dataclass
class SuiteContext:
    """What a suite gets: the config, the size settings and the progress/notes channel."""

    config: Config
    quick: bool
    repeat: int
    sizes: tuple[int, ...] | None = None
    """Object sizes in bytes overriding the suites' own (``--sizes``)."""
    tokens: tuple[int, ...] | None = None
    """Request sizes in tokens overriding the suites' own (``--tokens``)."""
    on_plan: Callable[[int], None] = lambda total: None
    on_advance: Callable[[str], None] = lambda what: None
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None

    def byte_sizes(self, *, quick: Sequence[int], full: Sequence[int]) -> tuple[int, ...]:
        """The object sizes to measure: ``--sizes``, else the quick or the full list."""
        return self.sizes or tuple(quick if self.quick else full)

    def token_sizes(self, *, quick: Sequence[int], full: Sequence[int]) -> tuple[int, ...]:
        """The request sizes (tokens) to measure: ``--tokens``, else the quick or the full list."""
        return self.tokens or tuple(quick if self.quick else full)

    def plan(self, total: int) -> None:
        """Announce how many steps the suite will ``advance`` (for the progress bar)."""
        self.on_plan(total)

    def advance(self, what: str) -> None:
        """One step done (``what`` is shown next to the bar)."""
        self.on_advance(what)

    def note(self, text: str) -> None:
        """A remark for the suite's JSON (``notes``)."""
        self.notes.append(text)

    def skip(self, reason: str) -> None:
        """Mark the suite as skipped (its JSON says ``skipped: reason``)."""
        self.skipped = reason


async def run_suite(name: str, ctx: SuiteContext, config_label: str) -> dict[str, Any]:
    """Run suite ``name`` and return its JSON document."""
    if name not in SUITES:
        raise TiercacheError(f"unknown bench suite {name!r}; suites: {', '.join(SUITES)}")
    description, load = SUITES[name]
    started = time.perf_counter()
    rows = await load()(ctx)
    return {
        "suite": name,
        "description": description,
        "schema_version": SCHEMA_VERSION,
        "config": config_label,
        "quick": ctx.quick,
        "repeat": ctx.repeat,
        "host": host_info(),
        "seconds": round(time.perf_counter() - started, 3),
        "skipped": ctx.skipped,
        "notes": list(ctx.notes),
        "rows": [r.to_json() for r in rows],
        "noisy": sorted({f"{r.case} @ {r.size} {r.size_unit}" for r in rows if r.spread.get("noisy")}),
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }


def _require_bench_extra() -> None:
    missing = []
    for module in ("rich", "matplotlib"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise TiercacheError(
            f"tiercache bench needs {' and '.join(missing)}: "
            "install them with: pip install 'tiercache[bench]'"
        )


def run_bench(
    config: Config,
    suites: Sequence[str],
    out_dir: Path,
    *,
    quick: bool,
    repeat: int | None = None,
    sizes: tuple[int, ...] | None = None,
    tokens: tuple[int, ...] | None = None,
    config_label: str = "embedded default",
) -> list[dict[str, Any]]:
    """Run ``suites`` with progress bars; write ``out_dir/<suite>.json`` and ``.png``; print a summary."""
    _require_bench_extra()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tiercache.cli.bench.report import summary_table, write_json, write_png

    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise TiercacheError(f"unknown bench suite(s) {', '.join(unknown)}; suites: {', '.join(SUITES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    if not console.is_terminal:
        console.width = max(console.width, 120)  # logs and CI: keep one table row per line
    results: list[dict[str, Any]] = []
    columns = (
        TextColumn("{task.fields[suite]:<7}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, console=console) as progress:
        for name in suites:
            task = progress.add_task("starting", total=None, suite=name)
            planned_total = [0]

            def planned(total: int, task: Any = task, box: list[int] = planned_total) -> None:
                box[0] = total
                progress.update(task, total=total)

            def advanced(what: str, task: Any = task) -> None:
                progress.update(task, advance=1, description=what)

            ctx = SuiteContext(
                config=config,
                quick=quick,
                repeat=repeat or (3 if quick else 7),
                sizes=sizes,
                tokens=tokens,
                on_plan=planned,
                on_advance=advanced,
            )
            doc = asyncio.run(run_suite(name, ctx, config_label))
            write_json(doc, out_dir / f"{name}.json")
            write_png(doc, out_dir / f"{name}.png")
            done = f"skipped: {doc['skipped']}" if doc["skipped"] else f"done in {doc['seconds']:.1f} s"
            finished = max(planned_total[0], 1)
            progress.update(task, description=done, total=finished, completed=finished)
            results.append(doc)
    console.print(summary_table(results))
    noisy = [f"{doc['suite']}: {case}" for doc in results for case in doc.get("noisy", ())]
    if noisy:
        console.print(
            f"NOISY MACHINE: {len(noisy)} measurement(s) moved over their repeats (baseline p90/p10 over "
            f"{NOISE_LIMIT}; marked '!' above): their ratios are not to be trusted; rerun on a quiet machine "
            f"or with more --repeat. {', '.join(noisy[:5])}{' ...' if len(noisy) > 5 else ''}"
        )
    console.print(f"results: {out_dir}/<suite>.json and <suite>.png")
    return results
