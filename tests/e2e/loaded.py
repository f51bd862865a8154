"""What the e2e tests need to hold on a loaded 2-core CI machine, where two vLLM engines' CPU workers spin on
both cores. Tests import it as ``tests.e2e.loaded``; the child scripts beside it as ``loaded``."""

from __future__ import annotations

__all__ = ["ROOMY", "drain_server"]

ROOMY: dict[str, float] = {"lookup_timeout_s": 10.0, "load_timeout_s": 30.0}
"""``kv_connector_extra_config`` deadlines for the tests that are not about timeouts (the hung-server tests
are): with the defaults one request to ``tiercache serve`` may take 1.5 s, and a loaded machine can pass that
(the connection ends, the worker is cache-off a while: its stores are lost, its lookups miss, and a test
that counts what was stored or restored fails); with these it may take 5 s, the connector's longest."""


def drain_server(socket_path: str, timeout_s: float = 60.0) -> None:
    """Wait until the server on ``socket_path`` has written behind to its L2 tiers everything published so
    far (DRAIN); RuntimeError when it did not within ``timeout_s``."""
    from tiercache.server.client import SharedL1

    admin = SharedL1(socket_path, role="admin", timeout_s=timeout_s)
    try:
        if not admin.drain(timeout_s):
            raise RuntimeError(
                f"the write-behind of the server on {socket_path} did not drain in {timeout_s} s"
            )
    finally:
        admin.close()
