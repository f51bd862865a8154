"""A tiny PromQL evaluator over Prometheus text scrapes, for checking dashboards against live metrics.

It evaluates the query shapes the bundled Grafana dashboard uses, and refuses anything else with a
``ValueError`` naming it:

- selectors ``name{label="v", label=~"re", label!="v", label!~"re"}``;
- ``rate(selector[range])`` (over the first and last scrape: both must hold the series, as Prometheus needs
  two samples), ``sum``/``max``/``min``/``avg`` with ``by (labels)`` or none, ``histogram_quantile(q, v)``;
- binary ``+ - * /`` between vectors (one-to-one on identical label sets) or with a number.

The value of a query is an instant vector: ``{labels: value}`` (labels as a sorted tuple of pairs); an empty
vector is what Grafana shows as "No data".
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Labels", "Scrape", "Vector", "evaluate", "parse_scrape"]

Labels = tuple[tuple[str, str], ...]
Vector = dict[Labels, float]
Scrape = dict[str, dict[Labels, float]]
"""Sample name -> {labels: value} of one scrape."""

_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)"
    r'|(?P<str>"(?:[^"\\]|\\.)*")|(?P<op>=~|!=|!~|[-+*/(){}\[\],=]))'
)
_AGGREGATIONS: dict[str, Callable[[list[float]], float]] = {
    "sum": sum,
    "max": max,
    "min": min,
    "avg": lambda values: sum(values) / len(values),
}


def parse_scrape(text: str) -> Scrape:
    """One Prometheus text exposition as ``{sample name: {labels: value}}``."""
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = float(sample.value)
    return out


def evaluate(
    query: str, scrapes: Sequence[Scrape], seconds: float, variables: dict[str, str] | None = None
) -> Vector:
    """The instant vector ``query`` gives at the last of ``scrapes`` (taken ``seconds`` apart in all);
    ``variables`` replace Grafana's ``$name`` first (longest name first)."""
    for name in sorted(variables or {}, key=len, reverse=True):
        query = query.replace(f"${name}", (variables or {})[name])
    if not scrapes:
        raise ValueError("no scrapes to evaluate against")
    return _Parser(query, scrapes, seconds).parse()


class _Parser:
    def __init__(self, query: str, scrapes: Sequence[Scrape], seconds: float) -> None:
        self.query = query
        self.tokens = self._lex(query)
        self.at = 0
        self.scrapes = scrapes
        self.seconds = seconds

    def _lex(self, text: str) -> list[tuple[str, str]]:
        tokens, pos = [], 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            match = _TOKEN.match(text, pos)
            if match is None:
                raise ValueError(f"cannot read {text[pos:]!r} in {text!r}")
            kind = match.lastgroup
            assert kind is not None
            tokens.append((kind, match.group(kind)))
            pos = match.end()
        return tokens

    # ----- tokens
    def _peek(self, offset: int = 0) -> tuple[str, str]:
        at = self.at + offset
        return self.tokens[at] if at < len(self.tokens) else ("end", "")

    def _take(self, value: str | None = None, kind: str | None = None) -> str:
        got_kind, got = self._peek()
        if (value is not None and got != value) or (kind is not None and got_kind != kind):
            raise ValueError(f"expected {value or kind!r}, got {got!r} in {self.query!r}")
        self.at += 1
        return got

    # ----- grammar
    def parse(self) -> Vector:
        value = self._sum()
        if self._peek()[0] != "end":
            raise ValueError(f"unexpected {self._peek()[1]!r} in {self.query!r}")
        return _vector(value)

    def _sum(self) -> Vector | float:
        left = self._product()
        while self._peek() in (("op", "+"), ("op", "-")):
            op = self._take()
            left = _binary(op, left, self._product())
        return left

    def _product(self) -> Vector | float:
        left = self._term()
        while self._peek() in (("op", "*"), ("op", "/")):
            op = self._take()
            left = _binary(op, left, self._term())
        return left

    def _term(self) -> Vector | float:
        kind, value = self._peek()
        if kind == "num":
            self.at += 1
            return float(value)
        if value == "(":
            self._take("(")
            inner = self._sum()
            self._take(")")
            return inner
        if kind != "name":
            raise ValueError(f"unexpected {value!r} in {self.query!r}")
        if value in _AGGREGATIONS:
            return self._aggregate()
        if value == "rate":
            return self._rate()
        if value == "histogram_quantile":
            return self._quantile()
        if self._peek(1) == ("op", "("):
            raise ValueError(f"function {value!r} is not supported (in {self.query!r})")
        name, matchers = self._selector()
        if self._peek() == ("op", "["):
            raise ValueError(f"a range vector outside rate() in {self.query!r}")
        return _select(self.scrapes[-1], name, matchers)

    def _selector(self) -> tuple[str, list[tuple[str, str, str]]]:
        name = self._take(kind="name")
        matchers: list[tuple[str, str, str]] = []
        if self._peek() == ("op", "{"):
            self._take("{")
            while self._peek() != ("op", "}"):
                label = self._take(kind="name")
                op = self._take()
                if op not in ("=", "!=", "=~", "!~"):
                    raise ValueError(f"bad label matcher {op!r} in {self.query!r}")
                text = self._take(kind="str")[1:-1].encode().decode("unicode_escape")
                matchers.append((label, op, text))
                if self._peek() == ("op", ","):
                    self._take(",")
            self._take("}")
        return name, matchers

    def _rate(self) -> Vector:
        self._take("rate")
        self._take("(")
        name, matchers = self._selector()
        self._take("[")
        while self._peek() != ("op", "]"):  # the range itself: the scrapes define the window
            self.at += 1
        self._take("]")
        self._take(")")
        if len(self.scrapes) < 2:
            raise ValueError("rate() needs two scrapes")
        first = _select(self.scrapes[0], name, matchers)
        last = _select(self.scrapes[-1], name, matchers)
        out: Vector = {}
        for labels, value in last.items():
            if labels in first:
                before = first[labels]
                out[labels] = (value - before if value >= before else value) / self.seconds
        return out

    def _aggregate(self) -> Vector:
        fn = _AGGREGATIONS[self._take()]
        by: list[str] | None = None
        if self._peek() == ("name", "by"):
            self._take("by")
            by = self._labels()
        self._take("(")
        inner = _vector(self._sum())
        self._take(")")
        if self._peek() == ("name", "by"):
            self._take("by")
            by = self._labels()
        groups: dict[Labels, list[float]] = {}
        for labels, value in inner.items():
            key = tuple((k, v) for k, v in labels if by is not None and k in by)
            groups.setdefault(key, []).append(value)
        return {key: fn(values) for key, values in groups.items()}

    def _labels(self) -> list[str]:
        self._take("(")
        names = []
        while self._peek() != ("op", ")"):
            names.append(self._take(kind="name"))
            if self._peek() == ("op", ","):
                self._take(",")
        self._take(")")
        return names

    def _quantile(self) -> Vector:
        self._take("histogram_quantile")
        self._take("(")
        q = float(self._take(kind="num"))
        self._take(",")
        buckets = _vector(self._sum())
        self._take(")")
        series: dict[Labels, list[tuple[float, float]]] = {}
        for labels, value in buckets.items():
            le = dict(labels).get("le")
            if le is None:
                continue
            rest = tuple((k, v) for k, v in labels if k != "le")
            series.setdefault(rest, []).append((float(le), value))
        return {labels: _bucket_quantile(q, sorted(points)) for labels, points in series.items()}


def _bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative ``(le, count)`` pairs (sorted, +Inf last)."""
    if not buckets or buckets[-1][0] != math.inf:
        return math.nan
    total = buckets[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == math.inf:
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return math.nan


def _select(scrape: Scrape, name: str, matchers: list[tuple[str, str, str]]) -> Vector:
    out: Vector = {}
    for labels, value in scrape.get(name, {}).items():
        have = dict(labels)
        if all(_matches(have.get(label, ""), op, text) for label, op, text in matchers):
            out[labels] = value
    return out


def _matches(value: str, op: str, text: str) -> bool:
    if op == "=":
        return value == text
    if op == "!=":
        return value != text
    hit = re.fullmatch(text, value) is not None
    return hit if op == "=~" else not hit


def _vector(value: Vector | float) -> Vector:
    if isinstance(value, dict):
        return value
    return {(): value}


def _apply(op: str, a: float, b: float) -> float:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a)
    return a / b


def _binary(op: str, left: Vector | float, right: Vector | float) -> Vector | float:
    if not isinstance(left, dict) and not isinstance(right, dict):
        return _apply(op, left, right)
    if not isinstance(left, dict):
        assert isinstance(right, dict)
        return {k: _apply(op, left, v) for k, v in right.items()}
    if not isinstance(right, dict):
        return {k: _apply(op, v, right) for k, v in left.items()}
    return {k: _apply(op, v, right[k]) for k, v in left.items() if k in right}
