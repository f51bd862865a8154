"""Built-in adapters, registered through the same pluggy hook third-party packages use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiercache.hookspecs import hookimpl

if TYPE_CHECKING:
    from tiercache.hookspecs import AdapterRegistrar

__all__ = ["tiercache_register_adapters"]


@hookimpl
def tiercache_register_adapters(register: AdapterRegistrar) -> None:
    """Register the memory and file (POSIX directory) adapters."""
    register("memory", "tiercache.adapters.memory:MemoryAdapter")
    register("file", "tiercache.adapters.posix:PosixAdapter", aliases=("posix",))
    register("nvme+slab", "tiercache.adapters.nvme_slab:SlabAdapter")
    # redis: imported on first use; a missing redis-py gives the "pip install 'tiercache[redis]'" hint.
    register(
        "redis",
        "tiercache.adapters.redis:RedisAdapter",
        aliases=("rediss", "valkey", "valkeys"),
        extra="redis",
    )
    register(
        "redis+cluster",
        "tiercache.adapters.redis:RedisClusterAdapter",
        aliases=("rediss+cluster", "valkey+cluster", "valkeys+cluster"),
        extra="redis",
    )
    register("s3", "tiercache.adapters.s3:S3Adapter", aliases=("s3a",), extra="s3")
    register("mooncake", "tiercache.adapters.mooncake:MooncakeAdapter", extra="mooncake")
