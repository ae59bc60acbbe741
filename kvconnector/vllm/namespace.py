"""What a vLLM engine's offloaded blocks are called: the namespace of an engine's slots, the one
each worker rank's own blocks have, and the one it shares with the ranks that hold the same bytes
(MLA)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from transfer.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import ParallelConfig, VllmConfig


def slot_order(layout: str) -> str:
    """Byte order inside a pool slot for a cache in `layout`: a block-major chunk is copied
    whole (BHLNC -> HLNC); the per-layer fallback puts each layer's page in layer order
    (LBNHC -> LNHC, LHBNC -> LHNC), so equal orders mean equal bytes."""
    if layout.startswith("B"):
        return layout[1:]
    return "L" + "".join(axis for axis in layout if axis not in "LB")


def engine_namespace(vllm_config: VllmConfig, spec: FullAttentionSpec, num_layers: int,
                     tp_size: int) -> Namespace:
    """What a slot's bytes mean: one block of every layer of one rank, in `slot_order`."""
    layout = vllm_config.cache_config.kv_cache_layout or "LBNHC"
    block_layout = (f"{type(spec).__name__} {slot_order(layout)} L={num_layers} "
                    f"H={spec.num_kv_heads} "
                    f"D={spec.head_size} page={spec.page_size_bytes}")
    return Namespace(model=vllm_config.model_config.model,
                     dtype=str(spec.dtype).removeprefix("torch."), block_size=spec.block_size,
                     block_layout=block_layout, tp_size=tp_size,
                     hash_algo=vllm_config.cache_config.prefix_caching_hash_algo,
                     hash_seed=os.environ.get("PYTHONHASHSEED", ""))


def with_groups(engine: Namespace, groups: Sequence[tuple[KVCacheSpec, Sequence[str]]]
                ) -> Namespace:
    """Several KV cache groups share each physical block (vLLM's hybrid manager): which layers
    each group keeps there, and as what, is part of what a slot's bytes mean. One group: the
    namespace is unchanged (so are its keys)."""
    if len(groups) == 1:
        return engine
    parts = []
    for i, (spec, layers) in enumerate(groups):
        window = f" W={spec.sliding_window}" if isinstance(spec, SlidingWindowSpec) else ""
        parts.append(f"{i}:{type(spec).__name__}{window} page={spec.page_size_bytes} "
                     f"layers={','.join(layers)}")
    return dataclasses.replace(engine, block_layout=f"{engine.block_layout} "
                                                    f"groups[{'; '.join(parts)}]")


def same_bytes_on_every_tp_rank(spec: FullAttentionSpec, parallel: ParallelConfig) -> bool:
    """MLA's latent cache: one head, projected by replicated weights from the hidden state every
    TP rank holds after the all-reduce, so each rank writes the same bytes. With context
    parallel each rank keeps its own copy: decode context parallel splits a sequence's tokens
    among the ranks."""
    return (isinstance(spec, MLAAttentionSpec)
            and parallel.decode_context_parallel_size == 1
            and parallel.prefill_context_parallel_size == 1)


def rank_namespace(engine: Namespace, spec: FullAttentionSpec,
                   parallel: ParallelConfig) -> tuple[Namespace, bool]:
    """(the namespace this rank's blocks have in a remote store, whether this rank puts them).

    A rank's bytes have keys of their own: its TP rank, and its PP stage (other layers) in the
    salt; vLLM numbers ranks with TP fastest. Where every TP rank writes the same bytes, the
    ranks of a stage share TP rank 0's keys and only it puts: one copy in the store, not one
    per rank.
    """
    tp_rank = parallel.rank % parallel.tensor_parallel_size
    pp_rank = parallel.rank // parallel.tensor_parallel_size
    salt = engine.salt + (f"/pp{pp_rank}" if pp_rank else "")
    if same_bytes_on_every_tp_rank(spec, parallel):
        return dataclasses.replace(engine, tp_rank=0, salt=salt), tp_rank == 0
    return dataclasses.replace(engine, tp_rank=tp_rank, salt=salt), True


def own_namespace(engine: Namespace, rank: int, tp_size: int) -> Namespace:
    """The namespace of rank `rank`'s own blocks (a disk slab's): its TP rank and PP stage, as
    `rank_namespace`, but never shared (each rank writes its own, even where the bytes are the
    same)."""
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    salt = engine.salt + (f"/pp{pp_rank}" if pp_rank else "")
    return dataclasses.replace(engine, tp_rank=tp_rank, salt=salt)
