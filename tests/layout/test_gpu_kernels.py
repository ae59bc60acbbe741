"""GPU evidence for the layer views: a stride-reading Triton decode kernel on block-major views.

For layer views of one block-major buffer (vLLM's packed [B, H, N, C] and the MLA shapes), the
stride-reading kernel must give bit-identical output on the view and on a contiguous copy of it,
and a packed-page kernel (page address = block x page size, the upstream MLA bug) must read
another layer through the same view while it still agrees on the contiguous copy.

Default: `pytest -m gpu tests/layout/test_gpu_kernels.py` on a CUDA machine (skipped without CUDA).
Development on CPU: KVC_TRITON_INTERPRET_TEST=1 runs the same checks on smaller shapes under
Triton's interpreter (the `gpu` mark is then left off so the tests run).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

INTERPRET = os.environ.get("KVC_TRITON_INTERPRET_TEST") == "1"
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. on import
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from attention_kernels import paged_decode_attention, paged_decode_mla  # noqa: E402

from kvconnector.layout.descriptor import KVForm, KVLayout  # noqa: E402
from kvconnector.layout.views import layer_view  # noqa: E402

pytestmark = [] if INTERPRET else [pytest.mark.gpu]

DEVICE = "cpu" if INTERPRET else "cuda"
# The interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584, unsupported);
# fp16 has the same element size, so every stride and address is the same as with bf16.
DTYPE = torch.float16 if INTERPRET else torch.bfloat16
NUM_LAYERS = 32
LAYERS = (0, NUM_LAYERS // 2, NUM_LAYERS - 1)  # first, middle, last
GQA_RATIO = 4
MLA_Q_HEADS = 16
MLA_DIM = 576  # latent 512 + rope 64


@dataclass(frozen=True)
class Shape:
    num_kv_heads: int
    head_size: int
    seq_lens: tuple[int, ...]


# Interpreted kernels run per program in Python: fewer heads, a smaller head and shorter sequences.
GQA_SHAPE = Shape(2, 32, (1, 37, 70)) if INTERPRET else Shape(8, 128, (1, 17, 100, 333, 512, 257))
MLA_SEQ_LENS = (1, 150) if INTERPRET else (1, 63, 200, 512, 1000)


def make_buffer(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """A block-major raw buffer (1-D uint8) filled with random values of the layout's dtype."""
    raw = torch.empty(layout.buffer_bytes(num_blocks), dtype=torch.uint8, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    raw.view(layout.dtype).normal_(generator=gen)
    return raw


def make_block_table(seq_lens: tuple[int, ...], block_size: int,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(block_table, seq_lens, num_blocks): random odd block ids, so none is 0 or adjacent."""
    max_blocks = -(-max(seq_lens) // block_size)
    needed = len(seq_lens) * max_blocks
    gen = torch.Generator().manual_seed(seed)
    ids = 2 * torch.randperm(needed, generator=gen) + 1
    table = ids.view(len(seq_lens), max_blocks).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return table.to(DEVICE), lens.to(DEVICE), 2 * needed + 1


def make_query(num_seqs: int, num_heads: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(num_seqs, num_heads, dim, generator=gen, device=DEVICE).to(DTYPE)


def reference_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """fp32 torch attention; keys/values [B, H, N, D] contiguous per-layer pages."""
    num_q_heads, k_dim = query.shape[1], query.shape[2]
    block_size = keys.shape[2]
    group = num_q_heads // keys.shape[1]
    outs = []
    for seq, seq_len in enumerate(seq_lens.tolist()):
        blocks = block_table[seq, : -(-seq_len // block_size)].long()
        # [blocks, H, N, D] -> [H, tokens, D], cut to the sequence length
        k = keys[blocks].permute(1, 0, 2, 3).flatten(1, 2)[:, :seq_len].float()
        v = values[blocks].permute(1, 0, 2, 3).flatten(1, 2)[:, :seq_len].float()
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = torch.einsum("hd,htd->ht", query[seq].float(), k) / k_dim**0.5
        outs.append(torch.einsum("ht,htd->hd", scores.softmax(-1), v))
    return torch.stack(outs)


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    # 16-bit output of 16-bit inputs; the point is that the kernel computes attention at all.
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@dataclass
class Case:
    """One block-major buffer, a query batch and a random non-adjacent block table."""

    layout: KVLayout
    num_blocks: int
    raw: torch.Tensor
    query: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor

    def views(self, kind: str) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(layer, block-major view, contiguous copy) for the first, middle and last layer."""
        out = []
        for layer in LAYERS:
            view = layer_view(self.raw, self.layout, self.num_blocks, layer, kind)
            dense = view.contiguous()
            assert view.stride(0) >= NUM_LAYERS * dense.stride(0)  # really a cross-layer view
            out.append((layer, view, dense))
        return out


def gqa_case(order: str, seed: int) -> Case:
    shape = GQA_SHAPE
    table, lens, num_blocks = make_block_table(shape.seq_lens, 16, seed)
    layout = KVLayout(NUM_LAYERS, shape.num_kv_heads, shape.head_size, 16, DTYPE,
                      KVForm.PACKED, order)
    query = make_query(len(shape.seq_lens), GQA_RATIO * shape.num_kv_heads, shape.head_size,
                       seed + 1)
    return Case(layout, num_blocks, make_buffer(layout, num_blocks, seed + 2), query, table, lens)


def mla_case(seed: int) -> Case:
    table, lens, num_blocks = make_block_table(MLA_SEQ_LENS, 64, seed)
    layout = KVLayout(NUM_LAYERS, 1, MLA_DIM, 64, DTYPE, KVForm.MLA, "BLNHC")
    query = make_query(len(MLA_SEQ_LENS), MLA_Q_HEADS, MLA_DIM, seed + 1)
    return Case(layout, num_blocks, make_buffer(layout, num_blocks, seed + 2), query, table, lens)


@pytest.mark.parametrize("order", ["BLNHC", "BLHNC"])
def test_gqa_kernel_bit_identical_on_block_major_views(order: str) -> None:
    case = gqa_case(order, seed=1)
    args = (case.block_table, case.seq_lens)
    d = case.layout.head_size
    for layer, view, dense in case.views("vllm"):
        out_view = paged_decode_attention(case.query, view, *args)
        out_dense = paged_decode_attention(case.query, dense, *args)
        assert torch.equal(out_view, out_dense), f"layer {layer}: view and contiguous differ"
        ref = reference_attention(case.query, dense[..., :d], dense[..., d:], *args)
        assert_close_to_reference(out_dense, ref)


@pytest.mark.parametrize("kind", ["mla", "vllm"])
def test_mla_kernel_bit_identical_on_block_major_views(kind: str) -> None:
    case = mla_case(seed=4)
    latent = MLA_DIM - 64
    for layer, view, dense in case.views(kind):
        out_view = paged_decode_mla(case.query, view, case.block_table, case.seq_lens)
        out_dense = paged_decode_mla(case.query, dense, case.block_table, case.seq_lens)
        assert torch.equal(out_view, out_dense), f"layer {layer}: view and contiguous differ"
        pages = dense.view(case.num_blocks, 1, 64, MLA_DIM)
        ref = reference_attention(case.query, pages, pages[..., :latent], case.block_table,
                                  case.seq_lens)
        assert_close_to_reference(out_dense, ref)


def check_packed_pages_read_another_layer(kernel: Callable[..., torch.Tensor], case: Case,
                                          kind: str) -> None:
    for layer, view, dense in case.views(kind):
        args = (case.block_table, case.seq_lens)
        right = kernel(case.query, dense, *args)
        assert torch.equal(kernel(case.query, dense, *args, packed_pages=True), right), \
            f"layer {layer}: packed pages must agree on a contiguous cache"
        assert not torch.equal(kernel(case.query, view, *args, packed_pages=True), right), \
            f"layer {layer}: packed-page addressing should read another layer through the view"


@pytest.mark.parametrize("order", ["BLNHC", "BLHNC"])
def test_gqa_packed_page_kernel_reads_another_layer(order: str) -> None:
    check_packed_pages_read_another_layer(paged_decode_attention, gqa_case(order, seed=7), "vllm")


@pytest.mark.parametrize("kind", ["mla", "vllm"])
def test_mla_packed_page_kernel_reads_another_layer(kind: str) -> None:
    check_packed_pages_read_another_layer(paged_decode_mla, mla_case(seed=10), kind)
