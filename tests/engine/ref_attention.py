"""REF_ATTN: a stride-reading reference attention backend, test support for the engine tier.

vLLM's CPU attention backend (CPU_ATTN) declares only LBHNC, so on CPU vLLM never resolves a
block-outermost layout and the connector's one-copy-per-block path never meets a real forward.
This backend declares the three block-outermost layouts and writes and reads the per-layer views
vLLM hands it (`[B, H, N, 2 * head_size]`, K|V packed in the last dim) with torch indexing only:
every page is reached through the view's own strides, never as block x page size, so a per-layer
view into a block-major buffer (block stride ~ num_layers x page) reads its own layer. It is a
correctness reference (float32 softmax, one request at a time), not a fast kernel.

vLLM's CPU platform picks CPU_ATTN for every non-MLA model whatever backend is configured, so
`ref_attention_backend()` registers this class through vLLM's out-of-tree registration
(`register_backend`) as a new member REF_ATTN and as the override of CPU_ATTN's slot, and takes
both back on exit. Build the engine inside it; the layers keep their backend after it closes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.selector import _cached_get_attn_backend
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

NAME = "REF_ATTN"
CLASS_PATH = f"{__name__}.RefAttentionBackend"


class RefAttentionBackend(AttentionBackend):
    """Declares the block-outermost layouts; its kernels are torch indexing through the view."""

    forward_includes_kv_cache_update: bool = False  # vLLM calls do_kv_cache_update first
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.BLNHC, KVCacheLayout.BLHNC, KVCacheLayout.BHLNC)

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[RefAttentionImpl]:
        return RefAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[RefAttentionMetadataBuilder]:
        return RefAttentionMetadataBuilder


@dataclass
class RefAttentionMetadata:
    """What one step's forward needs, with the per-request bounds as Python ints."""

    num_actual_tokens: int
    query_starts: list[int]  # num_reqs + 1 offsets into the step's tokens
    seq_lens: list[int]  # tokens in each request's cache after this step
    block_table: torch.Tensor  # (num_reqs, max_blocks) block ids


class RefAttentionMetadataBuilder(AttentionMetadataBuilder[RefAttentionMetadata]):
    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: object, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> RefAttentionMetadata:
        meta = common_attn_metadata
        return RefAttentionMetadata(
            num_actual_tokens=meta.num_actual_tokens,
            query_starts=meta.query_start_loc_cpu[:meta.num_reqs + 1].tolist(),
            seq_lens=meta.seq_lens[:meta.num_reqs].tolist(),
            block_table=meta.block_table_tensor[:meta.num_reqs])


class RefAttentionImpl(AttentionImpl[RefAttentionMetadata]):
    """Causal decoder attention over paged K|V, read and written through the layer's view."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None) -> None:
        unsupported = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                       "logits_soft_cap": logits_soft_cap}
        for what, value in unsupported.items():
            if value is not None:
                raise NotImplementedError(f"{NAME} does not implement {what} (got {value!r})")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{NAME} implements decoder attention only, got "
                                      f"{attn_type!r}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor,
                           value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """Write each token's K and V at its slot: block slot // N, row slot % N."""
        write_kv(kv_cache, key, value, slot_mapping)

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: RefAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{NAME} has no fused output quantisation")
        if attn_metadata is None:  # profiling and warm-up runs carry no metadata
            return output
        starts = attn_metadata.query_starts
        for req, seq_len in enumerate(attn_metadata.seq_lens):
            start, end = starts[req], starts[req + 1]
            if end > start:
                output[start:end] = paged_attention(
                    query[start:end], kv_cache, attn_metadata.block_table[req], seq_len,
                    self.scale).to(output.dtype)
        return output


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store K and V of each token at its slot through the `[B, H, N, 2D]` view (padding: -1)."""
    head_size = kv_cache.shape[-1] // 2
    slots = slot_mapping.to(torch.long)
    count = slots.shape[0]
    keep = slots >= 0
    slots = slots[keep]
    blocks, rows = slots // kv_cache.shape[2], slots % kv_cache.shape[2]
    # Indexing writes through the view, at the addresses its strides give.
    kv_cache[blocks, :, rows, :head_size] = key[:count][keep].to(kv_cache.dtype)
    kv_cache[blocks, :, rows, head_size:] = value[:count][keep].to(kv_cache.dtype)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                    seq_len: int, scale: float) -> torch.Tensor:
    """Causal attention of one request's `query` ([q, Hq, D], its last q tokens) over its first
    `seq_len` cached tokens, gathered page by page from `kv_cache` ([B, H, N, 2D]) -> [q, Hq, D].

    One query row at a time, over exactly the keys up to its own position: a token's output is
    then the same bits however the batch was cut (a prompt computed whole, or after a loaded
    prefix), as the engine tier's exact comparisons need.
    """
    block_size, head_size = kv_cache.shape[2], kv_cache.shape[-1] // 2
    pages = kv_cache[block_ids[:math.ceil(seq_len / block_size)].to(torch.long)]  # [b, H, N, 2D]
    tokens = pages.transpose(1, 2).flatten(0, 1)[:seq_len].float()  # [S, H, 2D]
    group = query.shape[1] // tokens.shape[1]  # query heads per KV head (GQA)
    k = tokens[..., :head_size].repeat_interleave(group, dim=1)
    v = tokens[..., head_size:].repeat_interleave(group, dim=1)
    q_len = query.shape[0]
    out = torch.empty(q_len, query.shape[1], v.shape[-1])
    for row in range(q_len):
        keys = seq_len - q_len + row + 1  # this token's position + 1
        scores = torch.einsum("hd,shd->hs", query[row].float(), k[:keys]) * scale
        out[row] = torch.einsum("hs,shd->hd", scores.softmax(dim=-1), v[:keys])
    return out


@contextmanager
def ref_attention_backend() -> Iterator[type[RefAttentionBackend]]:
    """Make vLLM's CPU platform pick REF_ATTN for engines built inside the block."""
    if NAME not in AttentionBackendEnum.__members__:
        register_backend(NAME, CLASS_PATH)
    register_backend(AttentionBackendEnum.CPU_ATTN, CLASS_PATH)
    _cached_get_attn_backend.cache_clear()  # the selector caches per argument set
    try:
        yield RefAttentionBackend
    finally:
        AttentionBackendEnum.CPU_ATTN.clear_override()
        _cached_get_attn_backend.cache_clear()
