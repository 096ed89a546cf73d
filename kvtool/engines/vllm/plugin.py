"""vLLM plugin entry point: registers :class:`~kvtool.engines.vllm.connector.KvtoolConnector`.

kvtool's pyproject declares ``[project.entry-points."vllm.general_plugins"] kvtool_connector =
"kvtool.engines.vllm.plugin:register"``; vLLM calls it in every process it starts (API server,
EngineCore, workers), so ``{"kv_connector": "KvtoolConnector"}`` works without a module path.
"""

from __future__ import annotations

CONNECTOR_NAME = "KvtoolConnector"
CONNECTOR_MODULE = "kvtool.engines.vllm.connector"


def register() -> None:
    """Register the connector with vLLM's factory (idempotent; lazy: nothing heavy imported)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
