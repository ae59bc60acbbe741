"""kvconnector: block-major KV-cache offloading for LLM serving engines.

The parts, each in its own folder: `kvconnector.layout` (the layout core: descriptor, allocator,
views, recognition, backend registry), `transfer` (host pool, block index, copy engine, the tier
contract and its registry, one folder per tier), `kvconnector.offload` (the vLLM-free scheduler
and worker cores), `kvconnector.vllm` (the thin vLLM adapter), `kvconnector.cli`,
`kvconnector.bench`, and `kvconnector.servers` (local servers for the bench, the examples and the
tests: not part of the connector).

Importing this package never imports CUDA-only modules (cupy, cuda-bindings) or vLLM, nor torch:
the public names (the layout core's: `KVLayout`, `allocate`, `layer_view`, ...) load on first use,
so `kvconnector store serve` and other torch-free parts start in a fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Not `from kvconnector import layout`: that would ask this very __getattr__ for "layout".
    layout = importlib.import_module("kvconnector.layout")
    if name in layout.__all__:
        return getattr(layout, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *importlib.import_module("kvconnector.layout").__all__])
