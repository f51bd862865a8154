"""Suite-wide collection order (the files holding a ``slow`` test first, collection order otherwise), the
short directory for unix sockets (``sock_dir``), and Hypothesis's settings: no per-example deadline and no
too-slow health check (a loaded machine makes examples slow, never wrong; the suite's timeout ends a hang).

``make test`` runs two xdist workers with ``--dist loadfile --no-loadscope-reorder``: each file goes whole to
the next free worker in this order, so the long vLLM and interpreter files start early and the many short
files fill both workers at the end (no long file left alone at the tail).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tiercache.testing.harness.processes import socket_dir

settings.register_profile("tiercache", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("tiercache")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: order within a file is kept


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A fresh directory for unix sockets (``socket_dir``: pytest's ``tmp_path`` can be too deep for one)."""
    d = socket_dir("tc-sock-")
    yield d
    shutil.rmtree(d, ignore_errors=True)
