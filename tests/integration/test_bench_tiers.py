"""The bench ``tiers`` suite against live Redis and S3 (moto): each tier against its raw client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aioboto3")
pytest.importorskip("moto")

from tiercache.cli.bench.runner import SuiteContext, run_suite
from tiercache.config import config_from_dict
from tiercache.testing.harness.s3 import aws_test_env, moto_with_bucket

BUCKET = "tc-bench-suite"


@pytest.fixture
def moto_endpoint(tmp_path: Path) -> Iterator[str]:
    """A private moto server with the bench bucket; dummy credentials in the environment."""
    with aws_test_env(), moto_with_bucket(BUCKET, tmp_path / "moto.log") as server:
        yield server.endpoint


@pytest.mark.asyncio
async def test_tiers_suite_uses_each_backends_raw_client(redis_server: Any, moto_endpoint: str) -> None:
    """Redis tiers get the redis-py baseline, S3 tiers aioboto3's (the adapter's connection); ratios agree."""
    config = config_from_dict(
        {
            "tiers": [
                {"name": "redis", "url": redis_server.url},
                {
                    "name": "bucket",
                    "url": f"s3://{BUCKET}/bench",
                    "options": {"endpoint_url": moto_endpoint, "addressing_style": "path"},
                },
            ]
        }
    )
    ctx = SuiteContext(config=config, quick=True, repeat=2, sizes=(4096, 65536))
    doc = await run_suite("tiers", ctx, "test")
    assert doc["notes"] == []
    rows = {(r["case"], r["size"]): r for r in doc["rows"]}
    assert set(rows) == {
        (f"{t} {op}", s) for t in ("redis", "bucket") for op in ("put", "get") for s in (4096, 65536)
    }
    for (case, _), row in rows.items():
        expected = "redis-py SET/GET" if case.startswith("redis") else "aioboto3 put_object/get_object"
        assert row["baseline"] == expected
        assert row["raw"] > 0
        assert row["ratio"] == pytest.approx(row["value"] / row["raw"])
        assert len(row["extra"]["raw_latency_s"]) == 3
