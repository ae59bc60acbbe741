"""The vLLM adapter: module path "kvconnector.vllm", class `CrossLayerOffloadConnector`.

- connector: the KV connector vLLM loads (both roles), a thin layer over `kvconnector.offload`;
- options: its `kv_connector_extra_config` keys; namespace: the key namespace of an engine and rank;
- tiers: each tier's slots, the key namespace and groups of an engine, sized alike on every side;
- stats: its counters and Prometheus metrics.

The connector class is imported on first use, so `kvconnector.vllm.options` and friends import
without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CrossLayerOffloadConnector"]


def __getattr__(name: str) -> Any:
    # vLLM's factory does getattr(import_module("kvconnector.vllm"), class_name): load it then.
    if name == "CrossLayerOffloadConnector":
        from kvconnector.vllm.connector import CrossLayerOffloadConnector

        return CrossLayerOffloadConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
