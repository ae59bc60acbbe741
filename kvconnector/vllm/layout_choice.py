"""The KV cache layout the connector asks vLLM for, and what it says of what vLLM did with it.

Engine-core side, before any backend exists: `layout_request` answers the connector's
`get_required_kvcache_layout` (kvconnector.layout.registry decides for the backends that may run).
Worker side, once vLLM has built the layers and resolved the layout: `resolved_backends` names
the backends that read the cache, `check_resolved` refuses at start-up a layout the connector
asked for that one of them is not known to read (its first forward would read another layer's
pages, or fail), and `layout_line` is the one log line saying what was asked, what vLLM resolved
for which backends, and when vLLM refused the request, whose declaration decided.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvconnector.layout.descriptor import BLOCK_MAJOR_ORDERS
from kvconnector.layout.registry import backend_name, decide, refusal_for, show_layouts
from kvconnector.vllm.options import ConnectorOptions

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Backends vLLM may pick by itself on CUDA when none is configured (all opted in, by evidence).
CUDA_AUTO_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLASHMLA", "FLASH_ATTN_MLA",
                      "FLASHINFER_MLA", "CUTLASS_MLA", "TRITON_MLA")
DEFAULT = "vLLM's default"  # what the line says when the connector asks for no layout


def required_layout(options: ConnectorOptions, backend_names: Sequence[str] | None, kv_dtype: str,
                    compute_capability: tuple[int, int] | None = None) -> tuple[str | None, str]:
    """(the layout to ask vLLM for, or None for its default; why).

    `backend_names`: the attention backends that may read the cache (the configured one, or every
    backend the platform may pick); None when that set is unknown (a non-CUDA platform with no
    backend configured may pick one whose kernels are not known to read strides).
    """
    if options.layout == "engine":
        return None, "opted out (layout 'engine')"
    if options.layout != "auto":
        return options.layout, "set in kv_connector_extra_config"
    if backend_names is None:
        return None, ("no attention backend configured on a non-CUDA platform: vLLM may pick one "
                      "not known to read strides, so its default layout")
    decision = decide(list(backend_names), compute_capability=compute_capability,
                      kv_dtype=kv_dtype)
    return decision.layout, decision.explain()


def layout_request(vllm_config: VllmConfig, options: ConnectorOptions) -> tuple[str | None, str]:
    """`required_layout` for this engine: its configured backend, else the platform's."""
    backend = vllm_config.attention_config.backend
    kv_dtype = str(vllm_config.cache_config.cache_dtype)
    if backend is not None:
        return required_layout(options, [backend.name], kv_dtype)
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return required_layout(options, None, kv_dtype)
    return required_layout(options, CUDA_AUTO_BACKENDS, kv_dtype, _compute_capability())


@dataclass(frozen=True)
class ResolvedBackend:
    """An attention backend that reads the cache, and the layouts it declares to vLLM."""

    name: str  # its registry name (kvconnector.layout.registry.backend_name)
    declared: tuple[str, ...] | None  # supported_kv_cache_layouts(); None: any
    source: str  # where `declared` was read


def resolved_backends(vllm_config: VllmConfig, layer_names: Iterable[str]
                      ) -> tuple[ResolvedBackend, ...]:
    """The backends of the attention layers vLLM built for `layer_names` (the configured backend
    where no layer is registered, as in a harness without a model; () when neither is known)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(layer_names))
    classes = list(dict.fromkeys(layer.get_attn_backend() for layer in layers.values()))
    configured = vllm_config.attention_config.backend
    if not classes and configured is not None:
        try:
            classes = [configured.get_class()]
        except ImportError as exc:  # a GPU-only module on a machine without one
            return (ResolvedBackend(configured.name, None, f"not importable here: {exc}"),)
    out = []
    for cls in classes:
        layouts = cls.supported_kv_cache_layouts()
        out.append(ResolvedBackend(
            backend_name(cls), None if layouts is None else tuple(lay.name for lay in layouts),
            f"{cls.__module__}.{cls.__qualname__}.supported_kv_cache_layouts()"))
    return tuple(out)


def check_resolved(asked: str | None, why: str, resolved: str | None,
                   backends: Sequence[ResolvedBackend], kv_dtype: str) -> None:
    """ValueError naming the backend when vLLM took the layout the connector asked for and a
    backend reading the cache is not known to read per-layer views of it."""
    if asked is None or asked != resolved:
        return  # vLLM's own choice (or a refusal): its backends declared what they read
    cc = _compute_capability()
    for backend in backends:
        refusal = refusal_for(backend.name, asked, cc, kv_dtype)
        if refusal is not None:
            raise ValueError(
                f"CrossLayerOffloadConnector asked for KV cache layout {asked} ({why}) and vLLM "
                f"resolved it, but attention backend {backend.name} reads the cache and is not "
                f"known to read per-layer views of a block-major buffer: {refusal.reason} "
                f"[{refusal.evidence}]. Its first forward would read another layer's pages or "
                f"fail: set kv_connector_extra_config layout to 'auto' or 'engine'")


def layout_line(rank: int, asked: str | None, why: str, resolved: str | None,
                backends: Sequence[ResolvedBackend], worker_line: str) -> str:
    """The connector's one log line per worker: request, resolution, backends, how blocks move."""
    names = ", ".join(b.name for b in backends) or "an attention backend not known here"
    line = f"CrossLayerOffloadConnector rank {rank}: asked for {asked or DEFAULT} ({why}), "
    if asked is None or asked == resolved:
        return f"{line}vLLM resolved {resolved} for {names}; {worker_line}"
    env = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    if env:
        return (f"{line}VLLM_KV_CACHE_LAYOUT={env} overrode it: vLLM resolved {resolved} for "
                f"{names}; {worker_line}")
    deciders = [b for b in backends if b.declared is not None and asked not in b.declared]
    because = "; ".join(f"{b.name} declares {show_layouts(b.declared)} only ({b.source})"
                        for b in deciders) or "no backend here excludes it by its declaration"
    return f"{line}vLLM refused it ({because}) and resolved {resolved} for {names}; {worker_line}"


def advise_block_outermost(asked: str | None, backends: Sequence[ResolvedBackend],
                           kv_dtype: str) -> bool:
    """Whether advice to ask for a block-outermost layout helps: the connector did not ask for
    one, and every backend here would be handed one."""
    if asked in BLOCK_MAJOR_ORDERS or not backends:
        return False
    return decide([b.name for b in backends], _compute_capability(),
                  kv_dtype).layout is not None


def _compute_capability() -> tuple[int, int] | None:
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    capability = current_platform.get_device_capability()
    return None if capability is None else (capability.major, capability.minor)
