"""pytest plugin (entry point ``pytest11: tiercache``): the ``--tiercache-url`` option and the kit's marker.

Imports only pytest and the standard library, so loading it in every pytest run is free.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from _pytest.config import Config
    from _pytest.config.argparsing import Parser
    from _pytest.fixtures import FixtureRequest

__all__ = ["ENV_VAR", "pytest_addoption", "pytest_configure", "tiercache_url"]

ENV_VAR = "TIERCACHE_URL"
"""Environment variable naming the L2 URL under test when neither the option nor the ini value is set."""


def pytest_addoption(parser: Parser) -> None:
    """Add ``--tiercache-url`` and the ``tiercache_url`` ini value."""
    group = parser.getgroup("tiercache", "tiercache adapter conformance")
    group.addoption(
        "--tiercache-url",
        dest="tiercache_url",
        default=None,
        metavar="URL",
        help=f"L2 URL the conformance suite runs against (fallbacks: ini tiercache_url, ${ENV_VAR})",
    )
    parser.addini("tiercache_url", help="L2 URL the conformance suite runs against", default="")


def pytest_configure(config: Config) -> None:
    """Register the kit's marker (so ``--strict-markers`` suites can use it)."""
    config.addinivalue_line("markers", "tiercache_adapter: an adapter conformance test (tiercache kit)")


def _configured_url(config: Config) -> str | None:
    url = config.getoption("tiercache_url", default=None) or config.getini("tiercache_url")
    return str(url) if url else os.environ.get(ENV_VAR) or None


@pytest.fixture
def tiercache_url(request: FixtureRequest) -> str:
    """The URL from ``--tiercache-url``, ini ``tiercache_url`` or ``$TIERCACHE_URL``; skips if none."""
    url = _configured_url(request.config)
    if url is None:
        pytest.skip(f"no adapter URL: pass --tiercache-url URL (or set ini tiercache_url or ${ENV_VAR})")
    return url
