"""The reference backend (ref_attention.py) reads and writes through strided per-layer views.

Each block-outermost layout is built the way vLLM builds it (one buffer in the physical order,
each layer's `[B, H, N, 2D]` view a permutation of a slice), so a layer's block stride is about
num_layers x page. The oracle reads the physical buffer by index, never through the view.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
from ref_attention import (  # noqa: E402
    CLASS_PATH,
    NAME,
    RefAttentionBackend,
    paged_attention,
    write_kv,
)

from kvconnector.layout import registry  # noqa: E402

pytestmark = pytest.mark.vllm

LAYERS, BLOCKS, HEADS, TOKENS, HEAD_SIZE, Q_HEADS = 3, 7, 2, 4, 8, 4
LAYER = 1
POISON = -77.0


def _physical(order: str) -> torch.Tensor:
    sizes = {"L": LAYERS, "B": BLOCKS, "H": HEADS, "N": TOKENS, "C": 2 * HEAD_SIZE}
    return torch.full([sizes[axis] for axis in order], POISON)


def _layer_view(buffer: torch.Tensor, order: str, layer: int) -> torch.Tensor:
    """Layer `layer`'s [B, H, N, C] view, as vLLM's create_kv_cache_views makes it."""
    rest = order.replace("L", "")
    return buffer.select(order.index("L"), layer).permute(*(rest.index(a) for a in "BHNC"))


def _oracle(buffer: torch.Tensor, order: str, layer: int, block: int, head: int, row: int
            ) -> torch.Tensor:
    """The C values of one (layer, block, head, row), read from the physical buffer by index."""
    where = {"L": layer, "B": block, "H": head, "N": row}
    return buffer[tuple(where[a] for a in order[:-1])]


@pytest.mark.parametrize("order", ["BLNHC", "BLHNC", "BHLNC"])
def test_the_view_vllm_hands_over_is_not_dense(order: str) -> None:
    view = _layer_view(_physical(order), order, LAYER)
    page = HEADS * TOKENS * 2 * HEAD_SIZE
    assert view.shape == (BLOCKS, HEADS, TOKENS, 2 * HEAD_SIZE)
    assert view.stride(0) == LAYERS * page  # block x page would land in another layer
    assert not view.is_contiguous()


@pytest.mark.parametrize("order", ["BLNHC", "BLHNC", "BHLNC"])
def test_writes_land_on_the_layer_s_slots_and_nowhere_else(order: str) -> None:
    buffer = _physical(order)
    before = buffer.clone()
    slots = torch.tensor([5, -1, 0, 13, 27, -1])  # block 1 row 1, block 0 row 0, ...
    key = torch.randn(len(slots) + 2, HEADS, HEAD_SIZE)  # padded past the slot mapping
    value = torch.randn(len(slots) + 2, HEADS, HEAD_SIZE)
    write_kv(_layer_view(buffer, order, LAYER), key, value, slots)
    expected = before.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for head in range(HEADS):
            _oracle(expected, order, LAYER, slot // TOKENS, head, slot % TOKENS)[:] = torch.cat(
                [key[i, head], value[i, head]])
    assert torch.equal(buffer, expected)  # every element, other layers' included


@pytest.mark.parametrize("order", ["BLNHC", "BLHNC", "BHLNC"])
def test_attention_gathers_the_layer_s_pages_through_the_strides(order: str) -> None:
    torch.manual_seed(0)
    buffer = torch.randn(_physical(order).shape)
    block_ids = torch.tensor([4, 0, 6, 2])  # out of order: pages are found by id
    seq_len, q_len = 14, 3
    query = torch.randn(q_len, Q_HEADS, HEAD_SIZE)
    scale = HEAD_SIZE ** -0.5
    out = paged_attention(query, _layer_view(buffer, order, LAYER), block_ids, seq_len, scale)

    rows = torch.stack([torch.stack([_oracle(buffer, order, LAYER, int(block_ids[t // TOKENS]),
                                             h, t % TOKENS) for h in range(HEADS)])
                        for t in range(seq_len)])  # [S, H, 2D]
    k, v = rows[..., :HEAD_SIZE].transpose(0, 1), rows[..., HEAD_SIZE:].transpose(0, 1)
    causal = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1), k, v, attn_mask=causal, scale=scale, enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(0, 1), rtol=1e-5, atol=1e-5)

    # Other layers' bytes (between this layer's pages) are never read ...
    other = buffer.clone()
    other.select(order.index("L"), 0).fill_(1e4)
    other.select(order.index("L"), 2).fill_(-1e4)
    assert torch.equal(paged_attention(query, _layer_view(other, order, LAYER), block_ids,
                                       seq_len, scale), out)
    # ... and this layer's pages are: a changed row changes the output.
    _oracle(other, order, LAYER, int(block_ids[1]), 0, 2)[:] += 1.0
    assert not torch.equal(paged_attention(query, _layer_view(other, order, LAYER), block_ids,
                                           seq_len, scale), out)


def test_the_registry_records_it_as_it_declares_with_its_evidence() -> None:
    entry = registry.lookup(NAME)
    assert entry.reads_strides and entry.vllm_class == CLASS_PATH == registry.REF_ATTN_CLASS
    assert entry.layouts == tuple(
        layout.name for layout in RefAttentionBackend.supported_kv_cache_layouts())
    assert registry.backend_name(RefAttentionBackend) == NAME  # by class path, as vLLM builds it
    assert registry.declared_layouts(entry).live
    assert "test_engine_block_major.py" in entry.evidence
