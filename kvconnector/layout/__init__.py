"""The layout core: what a block-major KV cache is, how it is allocated and viewed.

- descriptor: `KVLayout` (shape, K/V form, physical order; page, block and stride arithmetic);
- allocator: one buffer (GPU, host, pinned host or named shared memory), aligned block chunks;
- views: per-layer zero-copy views in each attention backend's shape, checked against kernel rules;
- recognize: the inverse, the block-major buffer behind an engine's per-layer tensors (or why not);
- registry: which attention backends read such views, and on what evidence.

This package imports neither `transfer` nor vLLM nor the adapter: everything else builds on it.
"""

from kvconnector.layout.allocator import KVBuffer, allocate
from kvconnector.layout.descriptor import (
    BLOCK_MAJOR_ORDERS,
    LAYER_MAJOR_ORDERS,
    KVForm,
    KVLayout,
)
from kvconnector.layout.views import ViewKind, layer_view, layer_views

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
