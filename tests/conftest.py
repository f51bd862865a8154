"""Suite-wide collection order: the files holding a ``slow`` test first, collection order otherwise.

``make test`` runs two xdist workers with ``--dist loadfile --no-loadscope-reorder``: each file goes whole to
the next free worker in this order, so the long vLLM and interpreter files start early and the many short
files fill both workers at the end (no long file left alone at the tail).
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: order within a file is kept
