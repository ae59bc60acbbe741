"""Paged decode attention in Triton, reading the KV cache through its strides.

The evidence kernels for the layer views (issue 2): one query token per sequence attends to its
paged KV cache, addressed through a block table. Every cache address is built from the tensor's
own strides (block, head, token, content), so a per-layer view into a block-major buffer, whose
block stride is about num_layers x page, reads exactly the bytes a contiguous cache would.

`packed_pages=True` selects the addressing of the buggy upstream kernels (vLLM's Triton decode
before PR 45111): page base = block_id x page_size from the base pointer, ignoring stride(block).
On a contiguous cache both agree; on a cross-layer view the packed-page form reads other layers.

Two entry points share one kernel pair (split-KV partial pass, then a combine pass):
- `paged_decode_attention`: vLLM's packed view [B, H, N, C], K = C[:D], V = C[D:], GQA;
- `paged_decode_mla`: the MLA latent cache (B, N, D) or [B, 1, N, D], K = all D (latent + rope),
  V = the latent part; every query head reads the one latent head.
Both accumulate in fp32 and return the query dtype (bf16 in our tests and benchmark).

Runs on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set before this import).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# tl.dot needs at least 16 rows; query heads of one kv head are padded up to this.
MIN_DOT_ROWS = 16
DEFAULT_NUM_SPLITS = 8
MLA_ROPE_DIM = 64


@triton.jit
def _decode_partial_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    sm_scale,
    stride_q_seq, stride_q_head,
    stride_c_block, stride_c_head, stride_c_token, stride_c_content,
    stride_bt_seq,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    page_elements,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, PAGE_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr,
    K_MAIN: tl.constexpr, K_EXTRA: tl.constexpr, V_OFFSET: tl.constexpr, V_DIM: tl.constexpr,
    V_SHARES_K: tl.constexpr, NUM_SPLITS: tl.constexpr, PACKED_PAGES: tl.constexpr,
):
    """One (sequence, kv head, split): online softmax over the split's tokens, fp32 state."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)

    heads = kv_head * GROUP + tl.arange(0, BLOCK_H)
    head_mask = tl.arange(0, BLOCK_H) < GROUP
    dk = tl.arange(0, K_MAIN)
    dv = tl.arange(0, V_DIM)
    q_rows = q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head
    q_main = tl.load(q_rows + dk[None, :], mask=head_mask[:, None], other=0.0)
    if K_EXTRA > 0:
        de = K_MAIN + tl.arange(0, K_EXTRA)
        q_extra = tl.load(q_rows + de[None, :], mask=head_mask[:, None], other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, V_DIM], tl.float32)

    for start in range(split_start, split_end, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        tok_mask = tok < split_end
        block_id = tl.load(block_table_ptr + seq * stride_bt_seq + tok // PAGE_TOKENS,
                           mask=tok_mask, other=0).to(tl.int64)
        # The point of the whole module: where does the page of `block_id` start?
        page_stride = page_elements if PACKED_PAGES else stride_c_block
        row = (block_id * page_stride + kv_head * stride_c_head
               + (tok % PAGE_TOKENS) * stride_c_token)

        k = tl.load(cache_ptr + row[:, None] + dk[None, :] * stride_c_content,
                    mask=tok_mask[:, None], other=0.0)
        scores = tl.dot(q_main, tl.trans(k))
        if K_EXTRA > 0:
            k_extra = tl.load(cache_ptr + row[:, None] + de[None, :] * stride_c_content,
                              mask=tok_mask[:, None], other=0.0)
            scores += tl.dot(q_extra, tl.trans(k_extra))
        scores = tl.where(tok_mask[None, :], scores * sm_scale, float("-inf"))

        m_new = tl.maximum(m, tl.max(scores, 1))
        rescale = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        if V_SHARES_K:
            v = k  # MLA: V is the latent part of the K row already loaded
        else:
            v = tl.load(cache_ptr + row[:, None] + (V_OFFSET + dv)[None, :] * stride_c_content,
                        mask=tok_mask[:, None], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        denom = denom * rescale + tl.sum(p, 1)
        m = m_new

    # An empty split (seq shorter than NUM_SPLITS tokens) gets lse = -inf: weight 0 when combined.
    has_tokens = denom > 0
    safe_denom = tl.where(has_tokens, denom, 1.0)
    lse = tl.where(has_tokens, m + tl.log(safe_denom), float("-inf"))
    out_rows = part_out_ptr + seq * stride_po_seq + heads[:, None] * stride_po_head
    tl.store(out_rows + split * stride_po_split + dv[None, :], acc / safe_denom[:, None],
             mask=head_mask[:, None])
    tl.store(part_lse_ptr + seq * stride_pl_seq + heads * stride_pl_head + split, lse,
             mask=head_mask)


@triton.jit
def _decode_combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    stride_o_seq, stride_o_head,
    V_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr,
):
    """One (sequence, query head): merge the splits' partial softmaxes by their log-sum-exp."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_POW2)
    split_mask = splits < NUM_SPLITS
    dv = tl.arange(0, V_DIM)
    lse = tl.load(part_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + splits,
                  mask=split_mask, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, 0))
    partial = tl.load(part_out_ptr + seq * stride_po_seq + head * stride_po_head
                      + splits[:, None] * stride_po_split + dv[None, :],
                      mask=split_mask[:, None], other=0.0)
    out = tl.sum(partial * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + dv,
             out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                           sm_scale: float | None = None, num_splits: int = DEFAULT_NUM_SPLITS,
                           packed_pages: bool = False) -> torch.Tensor:
    """Decode attention over vLLM's packed cache view [B, H, N, C] (K = C[:D], V = C[D:]).

    query [num_seqs, num_q_heads, D] (num_q_heads a multiple of H); block_table
    [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32 (>= 1). Returns
    [num_seqs, num_q_heads, D] in query's dtype. `packed_pages` selects the buggy addressing.
    """
    if kv_cache.dim() != 4:
        raise ValueError(f"kv_cache must be [B, H, N, C], got shape {tuple(kv_cache.shape)}")
    num_kv_heads, content = kv_cache.shape[1], kv_cache.shape[3]
    head_size = content // 2
    _check_query(query, head_size, num_kv_heads)
    return _launch(query, kv_cache, block_table, seq_lens,
                   k_main=head_size, k_extra=0, v_offset=head_size, v_dim=head_size,
                   block_n=64, sm_scale=sm_scale, num_splits=num_splits,
                   packed_pages=packed_pages)


def paged_decode_mla(query: torch.Tensor, kv_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                     rope_dim: int = MLA_ROPE_DIM, sm_scale: float | None = None,
                     num_splits: int = DEFAULT_NUM_SPLITS,
                     packed_pages: bool = False) -> torch.Tensor:
    """MLA decode over the latent cache (B, N, D) or vLLM's [B, 1, N, D], D = latent + rope.

    K is the whole D row, V its first D - rope_dim elements (the latent). query
    [num_seqs, num_q_heads, D]; returns [num_seqs, num_q_heads, D - rope_dim].
    """
    if kv_cache.dim() == 3:
        kv_cache = kv_cache.unsqueeze(1)  # the one latent head; its stride is never used
    if kv_cache.dim() != 4 or kv_cache.shape[1] != 1:
        raise ValueError(f"MLA kv_cache must be (B, N, D) or [B, 1, N, D], "
                         f"got shape {tuple(kv_cache.shape)}")
    dim = kv_cache.shape[3]
    _check_query(query, dim, 1)
    return _launch(query, kv_cache, block_table, seq_lens,
                   k_main=dim - rope_dim, k_extra=rope_dim, v_offset=0, v_dim=dim - rope_dim,
                   block_n=32, sm_scale=sm_scale, num_splits=num_splits,
                   packed_pages=packed_pages)


def _check_query(query: torch.Tensor, k_dim: int, num_kv_heads: int) -> None:
    if query.dim() != 3 or query.shape[2] != k_dim or query.shape[1] % num_kv_heads:
        raise ValueError(f"query must be [num_seqs, k * {num_kv_heads} heads, {k_dim}], "
                         f"got shape {tuple(query.shape)}")
    if query.stride(2) != 1:
        raise ValueError("query's last dim must be contiguous")


def _launch(query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, *, k_main: int, k_extra: int, v_offset: int, v_dim: int,
            block_n: int, sm_scale: float | None, num_splits: int,
            packed_pages: bool) -> torch.Tensor:
    num_seqs, num_q_heads, k_dim = query.shape
    num_kv_heads, page_tokens = cache.shape[1], cache.shape[2]
    group = num_q_heads // num_kv_heads
    for name, dim in (("K main", k_main), ("V", v_dim)):
        if dim < 16 or dim & (dim - 1):
            raise ValueError(f"{name} dim {dim} must be a power of two >= 16 (tl.dot, tl.arange)")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_table and seq_lens must be int32")
    if block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(k_dim)

    part_out = torch.empty(num_seqs, num_q_heads, num_splits, v_dim,
                           dtype=torch.float32, device=query.device)
    part_lse = torch.empty(num_seqs, num_q_heads, num_splits,
                           dtype=torch.float32, device=query.device)
    out = torch.empty(num_seqs, num_q_heads, v_dim, dtype=query.dtype, device=query.device)
    # What the packed-page kernels assume a page is: the dense H x N x C of the logical shape.
    page_elements = num_kv_heads * page_tokens * cache.shape[3]

    _decode_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, cache, block_table, seq_lens, part_out, part_lse,
        sm_scale,
        query.stride(0), query.stride(1),
        *cache.stride(),
        block_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        page_elements,
        GROUP=group, BLOCK_H=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        PAGE_TOKENS=page_tokens, BLOCK_N=block_n,
        K_MAIN=k_main, K_EXTRA=k_extra, V_OFFSET=v_offset, V_DIM=v_dim,
        V_SHARES_K=(v_offset == 0 and v_dim == k_main),
        NUM_SPLITS=num_splits, PACKED_PAGES=packed_pages,
        num_warps=4, num_stages=2,  # as vLLM's grouped decode; keeps MLA tiles within smem
    )
    _decode_combine_kernel[(num_seqs, num_q_heads)](
        part_out, part_lse, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        V_DIM=v_dim, NUM_SPLITS=num_splits, SPLITS_POW2=triton.next_power_of_2(num_splits),
    )
    return out
