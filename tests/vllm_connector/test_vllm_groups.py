"""kvconnector/vllm/groups.py: the state layers the worker leaves to the attention pages' copy."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)

from kvconnector.vllm.groups import state_layers  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 16


def test_state_layers_must_lie_over_the_attention_pages() -> None:
    # vLLM's hybrid layout: the state group's tensor aliases the attention group's bytes, so
    # copying a block's attention pages copies its state; any other placement is refused.
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.bfloat16,),
                      page_size_padded=full.page_size_bytes, mamba_cache_mode="align")
    page = full.page_size_bytes
    groups = [KVCacheGroupSpec(["m0", "m2"], mamba), KVCacheGroupSpec(["l1", "l3"], full)]

    def tensors(state_offset: int) -> list[KVCacheTensor]:
        return [KVCacheTensor(16 * page, ["m0", "m2"], 8 * page, page, state_offset),
                KVCacheTensor(16 * page, ["l1", "l3"], 8 * page, page, 0)]

    aliased = KVCacheConfig(num_blocks=8, kv_cache_tensors=tensors(0), kv_cache_groups=groups)
    assert state_layers(aliased) == {"m0", "m2"}
    apart = KVCacheConfig(num_blocks=8, kv_cache_tensors=tensors(page), kv_cache_groups=groups)
    with pytest.raises(ValueError, match=r"state layers \['m0', 'm2'\] are not placed over"):
        state_layers(apart)
