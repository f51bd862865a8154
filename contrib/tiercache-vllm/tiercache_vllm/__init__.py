"""tiercache's vLLM V1 KV connector (``TierCacheConnector``) and its vLLM plugin hook (``register``).

``import tiercache_vllm`` is light; the connector class (and vLLM) load on first access, so vLLM's
``kv_connector_module_path="tiercache_vllm"`` and the ``vllm.general_plugins`` entry point both work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiercache_vllm.connector import TierCacheConnector

__all__ = ["CONNECTOR_NAME", "TierCacheConnector", "register"]

__version__ = "0.1.0"

CONNECTOR_NAME = "TierCacheConnector"


def register() -> None:
    """vLLM general plugin: make ``kv_connector="TierCacheConnector"`` work without a module path."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "tiercache_vllm.connector", CONNECTOR_NAME)


def __getattr__(name: str) -> Any:
    if name == "TierCacheConnector":
        from tiercache_vllm.connector import TierCacheConnector

        return TierCacheConnector
    raise AttributeError(f"module 'tiercache_vllm' has no attribute {name!r}")
