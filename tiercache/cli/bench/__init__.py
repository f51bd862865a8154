"""``tiercache bench``: benchmark suites, progress bars, JSON and PNG per suite (extra: ``tiercache[bench]``).

Suites (``SUITES``): ``keys``, ``engine``, ``tiers``, ``codecs``, ``gpu``. Each returns ``Row`` objects: a
case at a size, its rate, the rate of the raw baseline measured in the same run and latency percentiles.
The scripts in ``benchmarks/`` call the same functions.
"""

from __future__ import annotations

from tiercache.cli.bench.measure import Row
from tiercache.cli.bench.runner import SCHEMA_VERSION, SUITES, SuiteContext, run_bench, run_suite

__all__ = ["SCHEMA_VERSION", "SUITES", "Row", "SuiteContext", "run_bench", "run_suite"]
