"""Run the adapter conformance kit against any URL.

``pytest --pyargs tiercache.testing.url_suite --tiercache-url file:///tmp/x`` opens the adapter through
``tiercache.open_adapter`` (so the scheme resolves through the plugin registry) for every test.
"""

from __future__ import annotations

import pytest

from tiercache.testing.adapters import AdapterConformance, AdapterFactory

__all__ = ["TestAdapterAtURL"]


class TestAdapterAtURL(AdapterConformance):
    """The whole kit against the adapter at ``--tiercache-url``."""

    @pytest.fixture
    def adapter_factory(self, tiercache_url: str) -> AdapterFactory:
        """Open the adapter at the configured URL (the same location on every call)."""
        from tiercache import open_adapter

        return lambda: open_adapter(tiercache_url)
