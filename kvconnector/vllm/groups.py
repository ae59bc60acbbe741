"""vLLM's KV cache groups as the connector moves them: which group specs it offloads (full
attention, sliding window, align-mode state), the scheduler core's view of each group
(`CacheGroup`), and the state layers whose bytes lie over the attention pages."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    RSWASpec,
    SlidingWindowSpec,
)

from kvconnector.offload.groups import CacheGroup

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


def offloaded_spec(kv_cache_config: KVCacheConfig) -> FullAttentionSpec | SlidingWindowSpec:
    """The first full-attention group's spec (else the first attention group's), once every
    group is checked to be one the connector moves."""
    groups = kv_cache_config.kv_cache_groups
    specs: list[KVCacheSpec] = [g.kv_cache_spec for g in groups]
    for i, spec in enumerate(specs):
        # RSWA frees blocks inside a prefix; a state group holds a state per block boundary only
        # in vLLM's "align" cache mode (prefix caching of hybrid state models).
        if isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align":
            continue
        if not isinstance(spec, FullAttentionSpec | SlidingWindowSpec) or \
                isinstance(spec, RSWASpec):
            mode = f" (mamba_cache_mode {spec.mamba_cache_mode!r}, not 'align')" \
                if isinstance(spec, MambaSpec) else ""
            raise ValueError(f"CrossLayerOffloadConnector offloads full attention, sliding "
                             f"window and align-mode state KV cache groups; group {i} is a "
                             f"{type(spec).__name__}{mode} "
                             f"(groups: {[type(s).__name__ for s in specs]})")
    attention = [s for s in specs if not isinstance(s, MambaSpec)]
    if not attention:
        raise ValueError(f"no attention KV cache group to offload (groups: "
                         f"{[type(s).__name__ for s in specs]})")
    sizes = {spec.block_size for spec in specs}
    if len(sizes) != 1:
        raise ValueError(f"KV cache groups with different block sizes {sorted(sizes)} are not "
                         f"supported")
    pages = {spec.page_size_bytes for spec in specs}
    if len(pages) != 1:  # vLLM's hybrid manager unifies them; a physical block is one page each
        raise ValueError(f"KV cache groups with different page sizes {sorted(pages)} are not "
                         f"supported")
    # vLLM orders groups as it meets the layers (Gemma 3: sliding window first)
    spec = next((s for s in attention if isinstance(s, FullAttentionSpec)), attention[0])
    if kv_cache_config.hash_block_size not in (None, spec.block_size):
        raise ValueError(f"block hashes cover {kv_cache_config.hash_block_size} tokens but a "
                         f"block holds {spec.block_size}: they must be equal")
    return spec


def cache_groups(kv_cache_config: KVCacheConfig) -> list[CacheGroup]:
    """The scheduler core's view of the groups; one group keeps the keys it always had."""
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    return [CacheGroup(prefix=bytes([i]) if len(specs) > 1 else b"",
                       window=spec.sliding_window if isinstance(spec, SlidingWindowSpec)
                       else None, state=isinstance(spec, MambaSpec))
            for i, spec in enumerate(specs)]


def state_layers(kv_cache_config: KVCacheConfig) -> set[str]:
    """The state groups' layers, whose pages the worker does not copy itself: they lie over the
    attention groups' bytes (each of their KVCacheTensors has an attention group's offset,
    strides and at least as many layers), so copying a block's attention pages copies the state
    a state group keeps in that block; anything else is refused."""
    state = {name for g in kv_cache_config.kv_cache_groups
             if isinstance(g.kv_cache_spec, MambaSpec) for name in g.layer_names}
    placed = [t for t in kv_cache_config.kv_cache_tensors if not state & set(t.layers)]
    for tensor in kv_cache_config.kv_cache_tensors:
        if not state & set(tensor.layers):
            continue
        if not set(tensor.layers) <= state or not any(
                (a.offset, a.layer_stride, a.block_stride) == (tensor.offset, tensor.layer_stride,
                                                               tensor.block_stride)
                and len(a.layers) >= len(tensor.layers) for a in placed):
            raise ValueError(f"state layers {tensor.layers} are not placed over an attention "
                             f"group's pages ({tensor}): their state would not be copied")
    return state
