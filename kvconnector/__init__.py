"""kvconnector: block-major KV-cache offloading for LLM serving engines.

Importing this package never imports CUDA-only modules (cupy, cuda-bindings) or vLLM.
"""

from kvconnector.layout import (
    BLOCK_MAJOR_ORDERS,
    LAYER_MAJOR_ORDERS,
    KVForm,
    KVLayout,
)
from kvconnector.views import ViewKind, layer_view, layer_views

__all__ = [
    "BLOCK_MAJOR_ORDERS",
    "LAYER_MAJOR_ORDERS",
    "KVForm",
    "KVLayout",
    "ViewKind",
    "layer_view",
    "layer_views",
]
__version__ = "0.1.0"
