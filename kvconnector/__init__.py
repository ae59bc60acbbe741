"""kvconnector: block-major KV-cache offloading for LLM serving engines.

The parts, each in its own folder: `kvconnector.layout` (the layout core: descriptor, allocator,
views, recognition, backend registry), `transfer` (host pool, block index, copy engine, tiers),
`kvconnector.offload` (the vLLM-free scheduler and worker cores), `kvconnector.vllm` (the thin vLLM
adapter), `kvconnector.cli` and `kvconnector.bench`.

Importing this package never imports CUDA-only modules (cupy, cuda-bindings) or vLLM.
"""

from kvconnector.layout import (
    BLOCK_MAJOR_ORDERS,
    LAYER_MAJOR_ORDERS,
    KVBuffer,
    KVForm,
    KVLayout,
    ViewKind,
    allocate,
    layer_view,
    layer_views,
)

__all__ = [
    "BLOCK_MAJOR_ORDERS",
    "LAYER_MAJOR_ORDERS",
    "KVBuffer",
    "KVForm",
    "KVLayout",
    "ViewKind",
    "allocate",
    "layer_view",
    "layer_views",
]
__version__ = "0.1.0"
