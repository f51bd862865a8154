"""Tier-call latency histograms in vLLM's stats: the per-bucket increments of each engine's
``tiercache_tier_latency_seconds{tier, op}`` ride in the stats payload and become the histogram
``vllm:tiercache_tier_latency_seconds`` (labels: vLLM's engine labels, ``tier``, ``op``) on ``/metrics``.

Payload section (JSON-able)::

    {"histograms": {"tier_latency": {"<tier>|<op>": [count per bucket (not cumulative; +Inf last)..., sum]}}}
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tiercache.metrics import LATENCY_BUCKETS

if TYPE_CHECKING:
    from tiercache.metrics import Metrics

__all__ = ["HISTOGRAMS", "PromHistograms", "add_histograms", "histogram_increments", "merge_histograms"]

HISTOGRAMS: dict[str, str] = {"tier_latency": "Tier call latency (op: contains, get, put, delete)"}
"""Payload name -> help text; the Prometheus name is ``vllm:tiercache_<name>_seconds``."""

Rows = dict[str, dict[str, list[float]]]

_SEEN: weakref.WeakKeyDictionary[Metrics, dict[str, list[float]]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _read(metrics: Metrics) -> dict[str, list[float]]:
    """``{"tier|op": [bucket counts..., sum]}`` of the latency histogram now."""
    out: dict[str, list[float]] = {}
    wrapper = metrics.latency
    names = list(wrapper._labelnames)
    tier_at, op_at = names.index("tier"), names.index("op")
    children: list[tuple[Sequence[str], Any]] = list(wrapper._metrics.items())
    for labels, child in children:
        row = [bucket.get() for bucket in child._buckets]
        out[f"{labels[tier_at]}|{labels[op_at]}"] = [*row, child._sum.get()]
    return out


def histogram_increments(metrics: Metrics) -> Rows:
    """The latency histogram's increments since the previous call for the same ``Metrics`` (any caller in
    this process); rows that did not move are left out."""
    now = _read(metrics)
    with _LOCK:
        seen = _SEEN.setdefault(metrics, {})
        rows: dict[str, list[float]] = {}
        for key, values in now.items():
            before = seen.get(key, [0.0] * len(values))
            delta = [v - b for v, b in zip(values, before, strict=True)]
            seen[key] = values
            if any(d < 0 for d in delta):  # a reset source starts again from zero
                delta = values
            if any(delta[:-1]):
                rows[key] = delta
    return {"tier_latency": rows} if rows else {}


def merge_histograms(into: Rows, incoming: Rows) -> None:
    """Add ``incoming``'s rows to ``into`` element by element."""
    for name, rows in incoming.items():
        mine = into.setdefault(name, {})
        for key, values in rows.items():
            have = mine.get(key)
            mine[key] = list(values) if have is None else [a + b for a, b in zip(have, values, strict=True)]


def add_histograms(data: dict[str, Any], rows: Rows) -> None:
    """Merge ``rows`` into a stats payload's ``histograms`` section (created when needed)."""
    if rows:
        merge_histograms(data.setdefault("histograms", {}), rows)


class PromHistograms:
    """``vllm:tiercache_<name>_seconds`` histograms in vLLM's registry, fed with bucket increments."""

    def __init__(self, histogram_cls: Any, prefix: str, labelnames: list[str]) -> None:
        self._labelnames = labelnames
        self._histograms = {
            name: histogram_cls(
                name=f"{prefix}{name}_seconds",
                documentation=f"tiercache: {doc}",
                labelnames=[*labelnames, "tier", "op"],
                buckets=list(LATENCY_BUCKETS),
            )
            for name, doc in HISTOGRAMS.items()
        }

    def touch(self, labels: list[str], tier: str, ops: tuple[str, ...]) -> None:
        """Create the children of ``tier`` (at 0) for each op."""
        for histogram in self._histograms.values():
            for op in ops:
                histogram.labels(*labels, tier, op)

    def observe(self, labels: list[str], rows: Rows) -> None:
        """Add one interval's bucket increments."""
        for name, by_key in rows.items():
            histogram = self._histograms.get(name)
            if histogram is None:
                continue
            for key, values in by_key.items():
                tier, _, op = key.partition("|")
                child = histogram.labels(*labels, tier, op)
                counts, total = values[:-1], values[-1]
                buckets = getattr(child, "_buckets", None)
                if buckets is not None and len(buckets) == len(counts):
                    for bucket, n in zip(buckets, counts, strict=True):
                        if n > 0:
                            bucket.inc(n)
                    child._sum.inc(total)
                    continue
                # another histogram class: one observation per count at its bucket's bound
                bounds = [*LATENCY_BUCKETS, LATENCY_BUCKETS[-1]]
                for bound, n in zip(bounds, counts, strict=True):
                    for _ in range(int(n)):
                        child.observe(bound)
