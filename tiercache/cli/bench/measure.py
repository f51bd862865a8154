"""Measuring helpers shared by the bench suites and the scripts in ``benchmarks/``: timing, rates, host info.

A result is a list of ``Row`` objects: one measured case at one size, its rate, the rate of the raw baseline
measured in the same run (interleaved, so their ratio is meaningful on a shared machine), latency
percentiles of the timed operation and the spread of the repeats (:func:`spread`): the ratio's range over
the interleaved pairs and whether the machine was too noisy for the numbers to be trusted.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "NOISE_LIMIT",
    "Row",
    "atimes",
    "best",
    "best_median",
    "gbps",
    "host_info",
    "paired",
    "percentiles",
    "ratio",
    "spread",
    "times",
]

NOISE_LIMIT = 1.5
"""A row is noisy when its baseline's (or, without one, its case's) p90 time is over this many times its
p10 time: the machine's load changed during the repeats and the ratio is not to be trusted."""

PERCENTILES = (50, 90, 99)
"""Latency percentiles every row reports (``p50``, ``p90``, ``p99``, seconds)."""


@dataclass(frozen=True, slots=True)
class Row:
    """One measured case at one size; ``ratio`` is ``value / raw`` (both in ``unit``, higher is better)."""

    case: str
    """What was measured, e.g. ``store``, ``disk put``, ``raw+lz4 encode``."""
    size: int
    """Object or request size, in ``size_unit``."""
    value: float
    """Rate of the case, in ``unit``."""
    unit: str = "GB/s"
    size_unit: str = "bytes"
    raw: float | None = None
    """Rate of the raw baseline at the same size, same unit (None: no baseline for this case)."""
    baseline: str | None = None
    """What the baseline is: ``memcpy``, ``raw file I/O``, ``redis-py``, ``hashlib.sha256`` ..."""
    latency_s: dict[str, float] = field(default_factory=dict)
    """Percentiles of one operation's duration: ``p50``, ``p90``, ``p99`` (seconds)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Case-specific facts (compression ratio, verified, ...)."""
    spread: dict[str, Any] = field(default_factory=dict)
    """How the repeats moved (:func:`spread`): ``repeats``, ``case_p90_over_p10``, ``raw_p90_over_p10``,
    ``ratio_p10``/``ratio_p50``/``ratio_p90`` over the interleaved pairs, ``noisy``."""

    @property
    def ratio(self) -> float | None:
        """``value / raw``: above 1 the case beats its baseline."""
        return ratio(self.value, self.raw)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of the row (``ratio`` included)."""
        return {**asdict(self), "ratio": self.ratio}


def ratio(value: float, raw: float | None) -> float | None:
    """``value / raw``, or None without a (positive) baseline."""
    return None if raw is None or raw <= 0 else value / raw


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of sorted ``ordered``."""
    return ordered[max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))]


def spread(case_s: Sequence[float], raw_s: Sequence[float] = ()) -> dict[str, Any]:
    """The spread of a row's repeats: each side's p90 / p10 time, the ratio (``raw time / case time``, as
    ``Row.ratio``) per interleaved pair (sample i of each; with unequal counts the ratio's range is bounded by
    both sides' p10 and p90 instead) and ``noisy`` when the baseline, or without one the case, moved more than
    :data:`NOISE_LIMIT` allows."""
    case = sorted(case_s)
    if not case:
        return {}
    out: dict[str, Any] = {
        "repeats": len(case),
        "case_p90_over_p10": _quantile(case, 0.9) / _quantile(case, 0.1) if case[0] > 0 else None,
    }
    moved = out["case_p90_over_p10"]
    raw = sorted(raw_s)
    if raw and case[0] > 0 and raw[0] > 0:
        out["raw_p90_over_p10"] = moved = _quantile(raw, 0.9) / _quantile(raw, 0.1)
        if len(raw_s) == len(case_s):
            pairs = sorted(r / c for r, c in zip(raw_s, case_s, strict=True))
            low, mid, high = (_quantile(pairs, q) for q in (0.1, 0.5, 0.9))
        else:
            low = _quantile(raw, 0.1) / _quantile(case, 0.9)
            mid = _quantile(raw, 0.5) / _quantile(case, 0.5)
            high = _quantile(raw, 0.9) / _quantile(case, 0.1)
        out.update(ratio_p10=low, ratio_p50=mid, ratio_p90=high)
    out["noisy"] = moved is not None and moved > NOISE_LIMIT
    return out


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (10**9 bytes per second)."""
    return nbytes / seconds / 1e9


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """``p50``/``p90``/``p99`` of ``samples`` (nearest rank; a single sample is every percentile)."""
    if not samples:
        return {}
    ordered = sorted(samples)
    out = {}
    for p in PERCENTILES:
        rank = max(0, min(len(ordered) - 1, -(-p * len(ordered) // 100) - 1))
        out[f"p{p}"] = ordered[rank]
    return out


def times(fn: Callable[[], object], repeat: int) -> list[float]:
    """Durations (seconds) of ``repeat`` calls of ``fn``."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


async def atimes(fn: Callable[[], Awaitable[object]], repeat: int) -> list[float]:
    """Durations (seconds) of ``repeat`` awaited calls of ``fn``."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


def best(fn: Callable[[], object], repeat: int) -> float:
    """Fastest of ``repeat`` calls (seconds)."""
    return min(times(fn, repeat))


def best_median(samples: Sequence[float]) -> tuple[float, float]:
    """(fastest, median) of ``samples``."""
    return min(samples), statistics.median(samples)


def paired(a: Callable[[], object], b: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Best times of ``a`` and ``b`` measured interleaved (a, b, a, b, ...) so load hits both alike."""
    ta, tb = [], []
    for _ in range(repeat):
        ta.append(best(a, 1))
        tb.append(best(b, 1))
    return min(ta), min(tb)


def host_info() -> dict[str, Any]:
    """The facts a reader needs to compare runs: CPU count, load, platform, library versions."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return info
