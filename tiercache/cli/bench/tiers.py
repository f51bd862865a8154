"""The tiers suite: each configured L2 tier's put/get against its raw client, per object size.

The raw baseline talks to the same place through the client library alone, with the adapter's own
connection (so auth, TLS and endpoints match): POSIX tiers write/read a file in the tier's directory with
plain ``open``; Redis/Valkey tiers ``SET``/``GET`` through the adapter's redis-py client; S3 tiers
``put_object``/``get_object`` through its aioboto3 client. Tiers of other schemes are measured without a
baseline (``raw`` is null). Adapter and raw calls alternate, one object per call, ``repeat`` times per size.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from tiercache.cli.bench.measure import Row, atimes, gbps, percentiles, spread
from tiercache.errors import TiercacheError

if TYPE_CHECKING:
    from tiercache.adapters import Adapter
    from tiercache.cli.bench.runner import SuiteContext

__all__ = ["RawClient", "raw_client", "tiers_suite"]

Put = Callable[[str, bytes], Awaitable[object]]
Get = Callable[[str], Awaitable[object]]


class RawClient:
    """A baseline: ``put``/``get``/``delete`` of one object through the backend's library alone."""

    def __init__(self, name: str, put: Put, get: Get, delete: Callable[[str], Awaitable[object]]) -> None:
        self.name = name
        self.put = put
        self.get = get
        self.delete = delete


def _posix(root: str) -> RawClient:
    def path(key: str) -> str:
        return os.path.join(root, f"raw-baseline-{key}")

    async def put(key: str, data: bytes) -> None:
        with open(path(key), "wb") as f:  # noqa: ASYNC230 - the baseline is the blocking call itself
            f.write(data)

    async def get(key: str) -> bytes:
        with open(path(key), "rb") as f:  # noqa: ASYNC230
            return f.read()

    async def delete(key: str) -> None:
        os.unlink(path(key))

    return RawClient("raw file I/O (open/write, open/read)", put, get, delete)


def _redis(client: Any, prefix: str) -> RawClient:
    async def put(key: str, data: bytes) -> None:
        await client.set(f"{prefix}raw-{key}", data)

    async def get(key: str) -> object:
        return await client.get(f"{prefix}raw-{key}")

    async def delete(key: str) -> None:
        await client.delete(f"{prefix}raw-{key}")

    return RawClient("redis-py SET/GET", put, get, delete)


def _s3(client: Any, bucket: str, prefix: str) -> RawClient:
    def name(key: str) -> str:
        return f"{prefix}/raw-{key}".lstrip("/")

    async def put(key: str, data: bytes) -> None:
        await client.put_object(Bucket=bucket, Key=name(key), Body=data)

    async def get(key: str) -> bytes:
        resp = await client.get_object(Bucket=bucket, Key=name(key))
        async with resp["Body"] as body:
            return bytes(await body.read())

    async def delete(key: str) -> None:
        await client.delete_object(Bucket=bucket, Key=name(key))

    return RawClient("aioboto3 put_object/get_object", put, get, delete)


def raw_client(adapter: Adapter) -> RawClient | None:
    """The raw baseline for ``adapter``'s backend, reusing its connection; None for other schemes."""
    scheme = getattr(adapter, "scheme", "")
    if scheme in ("file", "posix") and isinstance(getattr(adapter, "root", None), str):
        return _posix(adapter.root)  # type: ignore[attr-defined]
    client = getattr(adapter, "_client", None)
    if client is None:
        return None
    if scheme.startswith(("redis", "valkey")) and hasattr(client, "set"):
        return _redis(client, str(getattr(adapter, "prefix", "") or ""))
    if scheme in ("s3", "s3a") and hasattr(client, "put_object"):
        return _s3(client, adapter.bucket, adapter.prefix)  # type: ignore[attr-defined]
    return None


async def _one_tier(ctx: SuiteContext, tier: Any, sizes: tuple[int, ...]) -> list[Row]:
    from tiercache._open import open_adapter

    adapter = await open_adapter(tier.url, adapter=tier.adapter, **tier.adapter_options())
    rows: list[Row] = []
    try:
        raw = raw_client(adapter)
        for size in sizes:
            data = secrets.token_bytes(size)
            key = f"tiercache-bench.{secrets.token_hex(8)}"

            async def a_put() -> None:
                if (await adapter.batched_put([key], [data])) != [True]:
                    raise RuntimeError(f"tier {tier.name!r} refused a {size}-byte put")

            async def a_get() -> None:
                got = (await adapter.batched_get([key]))[0]
                if got is None or len(got) != size:
                    raise RuntimeError(f"tier {tier.name!r} lost a {size}-byte object")

            t: dict[str, list[float]] = {"put": [], "get": [], "raw put": [], "raw get": []}
            for _ in range(ctx.repeat):  # interleaved: adapter, raw, adapter, raw
                t["put"] += await atimes(a_put, 1)
                t["get"] += await atimes(a_get, 1)
                if raw is not None:
                    t["raw put"] += await atimes(lambda: raw.put(key, data), 1)
                    t["raw get"] += await atimes(lambda: raw.get(key), 1)
            for op in ("put", "get"):
                raw_t = t[f"raw {op}"]
                rows.append(
                    Row(
                        case=f"{tier.name} {op}",
                        size=size,
                        value=gbps(size, min(t[op])),
                        raw=gbps(size, min(raw_t)) if raw_t else None,
                        baseline=raw.name if raw is not None else None,
                        latency_s=percentiles(t[op]),
                        spread=spread(t[op], raw_t),
                        extra={
                            "url_scheme": tier.url.partition("://")[0],
                            "raw_latency_s": percentiles(raw_t),
                        },
                    )
                )
            if adapter.capabilities.delete:
                await adapter.batched_delete([key])
            if raw is not None:
                await raw.delete(key)
            ctx.advance(f"tier {tier.name} {size} B")
    finally:
        await adapter.aclose()
    return rows


async def tiers_suite(ctx: SuiteContext) -> list[Row]:
    """Every configured tier, every size: put/get GB/s, ratio to the raw client, latency percentiles."""
    sizes = ctx.byte_sizes(quick=(64 << 10, 1 << 20, 8 << 20), full=(4 << 10, 64 << 10, 1 << 20, 16 << 20))
    tiers = list(ctx.config.tiers)
    if not tiers:
        ctx.skip("the config has no L2 tiers")
        return []
    ctx.plan(len(tiers) * len(sizes))
    rows: list[Row] = []
    for tier in tiers:
        try:
            rows += await _one_tier(ctx, tier, sizes)
        except (TiercacheError, RuntimeError) as exc:  # one unreachable tier must not hide the others
            ctx.note(f"tier {tier.name!r} not measured: {type(exc).__name__}: {exc}")
            for _ in sizes:
                ctx.advance(f"tier {tier.name} failed")
    return rows
