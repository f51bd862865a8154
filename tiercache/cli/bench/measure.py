"""Measuring helpers shared by the bench suites and the scripts in ``benchmarks/``: timing, rates, host info.

A result is a list of ``Row`` objects: one measured case at one size, its rate, the rate of the raw baseline
measured in the same run (interleaved, so their ratio is meaningful on a shared machine) and latency
percentiles of the timed operation.
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
    "Row",
    "atimes",
    "best",
    "best_median",
    "gbps",
    "host_info",
    "paired",
    "percentiles",
    "ratio",
    "times",
]

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
