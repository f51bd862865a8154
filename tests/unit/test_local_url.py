"""A local-file adapter URL: its absolute path and options, or a one-line ConfigError naming the URL."""

from __future__ import annotations

import re

import pytest

from tiercache.adapters._local_url import local_url
from tiercache.adapters.nvme_slab import SlabAdapter
from tiercache.adapters.posix import PosixAdapter
from tiercache.errors import ConfigError


@pytest.mark.parametrize(
    ("url", "path", "query"),
    [
        ("file:///data/kv", "/data/kv", ""),
        ("posix:///data/kv?threads=2", "/data/kv", "threads=2"),
        ("file://localhost/data/kv", "/data/kv", ""),
        ("file:///data/with%20space", "/data/with space", ""),
    ],
)
def test_a_local_url_gives_its_absolute_path_and_query(url: str, path: str, query: str) -> None:
    assert local_url(url, ("file", "posix"), "file") == (path, query)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("s3:///data/kv", "expected a file:///absolute/path URL"),
        ("file://host/data/kv", "(no host)"),
        ("file:relative/kv", "must name an absolute path"),
    ],
)
def test_a_bad_local_url_is_one_line_naming_it(url: str, why: str) -> None:
    with pytest.raises(ConfigError) as raised:
        local_url(url, ("file", "posix"), "file")
    message = str(raised.value)
    assert why in message
    assert repr(url) in message
    assert "\n" not in message
    assert message.startswith("file: ")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("adapter", "url", "why"),
    [
        (PosixAdapter, "nvme+slab:///data/kv", "file: expected a file:///absolute/path URL"),
        (PosixAdapter, "file://host/data/kv", "file: URL must be file:///absolute/path (no host)"),
        (SlabAdapter, "file:///data/kv.slab", "nvme+slab: expected a nvme+slab:///absolute/path URL"),
        (SlabAdapter, "nvme+slab://host/kv", "nvme+slab: URL must be nvme+slab:///absolute/path (no host)"),
        (SlabAdapter, "nvme+slab:kv.slab?capacity=1GiB", "nvme+slab: URL must name an absolute path"),
    ],
)
async def test_the_local_adapters_refuse_a_bad_url_at_open(
    adapter: type[PosixAdapter] | type[SlabAdapter], url: str, why: str
) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(why)):
        await adapter.open(url)
