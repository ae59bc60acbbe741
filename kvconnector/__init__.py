"""kvconnector: block-major KV-cache offloading for LLM serving engines.

The parts, each in its own folder: `kvconnector.layout` (the layout core: descriptor, allocator,
views, recognition, backend registry), `transfer` (host pool, block index, copy engine, tiers),
`kvconnector.offload` (the vLLM-free scheduler and worker cores), `kvconnector.vllm` (the thin vLLM
adapter), `kvconnector.cli` and `kvconnector.bench`.

Importing this package never imports CUDA-only modules (cupy, cuda-bindings) or vLLM.
"""

# The public names are the layout core's (KVLayout, allocate, layer_view, ...).
from kvconnector.layout import *  # noqa: F403
from kvconnector.layout import __all__  # noqa: F401

__version__ = "0.1.0"
