"""Large-value reads: several GETs of a batch in flight, replies received into reused buffers
(adapters/redis.py, adapters/_resp.py, adapters/_recvbuf.py)."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest

from tiercache.adapters.redis import GET_VALUES_IN_FLIGHT, RedisAdapter

pytestmark = pytest.mark.asyncio

MiB = 1 << 20


def _values(n: int, size: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


@pytest.mark.parametrize("size", [MiB, 6 * MiB])  # whole values; values stored as parts
async def test_a_held_result_is_never_overwritten_and_a_dropped_one_is_reused(
    redis_server: Any, size: int
) -> None:
    adapter = await RedisAdapter.open(
        redis_server.url, prefix=f"t{uuid.uuid4().hex[:12]}:", socket_timeout=10
    )
    try:
        n = 2 * GET_VALUES_IN_FLIGHT + 1
        keys_a, keys_b = [f"a{i}" for i in range(n)], [f"b{i}" for i in range(n)]
        vals_a, vals_b = _values(n, size, 1), _values(n, size, 2)
        assert all(await adapter.batched_put(keys_a, vals_a))
        assert all(await adapter.batched_put(keys_b, vals_b))
        held = await adapter.batched_get(keys_a)
        assert [bytes(v) for v in held if v is not None] == vals_a  # in key order, every byte
        for _ in range(2):  # more reads of the same sizes while the first results are held
            again = await adapter.batched_get(keys_b)
            assert [bytes(v) for v in again if v is not None] == vals_b
            del again
        assert [bytes(v) for v in held if v is not None] == vals_a, "a held result was overwritten"
        reused = adapter._recv.reused
        assert reused > 0, "dropped receive buffers were not used again"
        del held
        assert [bytes(v) for v in await adapter.batched_get(keys_a) if v is not None] == vals_a
        assert adapter._recv.reused > reused
        missing = await adapter.batched_get([keys_a[0], "absent", keys_b[-1]])
        assert missing[1] is None
        assert bytes(missing[0] or b"") == vals_a[0]
        assert bytes(missing[2] or b"") == vals_b[-1]
    finally:
        await adapter.aclose()
