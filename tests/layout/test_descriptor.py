"""Layout arithmetic against the page and block sizes of real models (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from kvconnector.layout.descriptor import KVForm, KVLayout, parse_dtype


@pytest.mark.parametrize("layout,page,block", [
    # Llama-3.1-8B: 32 layers, 8 kv heads, head 128, block 16, bf16: 64 KB page, 2 MB block.
    (KVLayout(32, 8, 128, 16, torch.bfloat16), 64 * 1024, 2 * 1024 * 1024),
    # Llama-3.1-70B at TP 8: 80 layers, one kv head per rank: 8 KB page, 640 KB block.
    (KVLayout(80, 1, 128, 16, torch.bfloat16), 8 * 1024, 640 * 1024),
    # Qwen3-32B: 64 layers, 8 kv heads, head 128: 64 KB page, 4 MB block.
    (KVLayout(64, 8, 128, 16, torch.bfloat16), 64 * 1024, 4 * 1024 * 1024),
    # DeepSeek-V3 MLA bf16, block 64: 61 layers of 576-wide latents: 72 KB page, ~4.3 MB block.
    (KVLayout(61, 1, 576, 64, torch.bfloat16, KVForm.MLA), 72 * 1024, 61 * 72 * 1024),
])
def test_page_and_block_bytes_match_real_models(layout: KVLayout, page: int, block: int):
    assert layout.page_bytes == page
    assert layout.block_bytes == block
    assert layout.block_stride_bytes == block  # already 256-aligned: no padding
    assert layout.buffer_bytes(10) == 10 * block


def test_strides_of_each_order():
    lay = KVLayout(num_layers=3, num_kv_heads=2, head_size=4, block_size=5, dtype="fp32",
                   alignment=256)
    c, n, h, nb = 8, 5, 2, 7
    block = 3 * h * n * c * 4  # 960 B -> padded to 1024 B
    assert lay.block_stride_bytes == 1024
    assert lay.with_order("BLNHC").axis_strides(nb) == {
        "B": 256, "L": h * n * c, "N": h * c, "H": c, "C": 1, "K": 0}
    assert lay.with_order("BLHNC").axis_strides(nb) == {
        "B": 256, "L": h * n * c, "H": n * c, "N": c, "C": 1, "K": 0}
    assert lay.with_order("BHLNC").axis_strides(nb) == {
        "B": 256, "H": 3 * n * c, "L": n * c, "N": c, "C": 1, "K": 0}
    assert lay.with_order("LBHNC").axis_strides(nb) == {
        "L": nb * h * n * c, "B": h * n * c, "H": n * c, "N": c, "C": 1, "K": 0}
    assert lay.with_order("LHBNC").axis_strides(nb) == {
        "L": h * nb * n * c, "H": nb * n * c, "B": n * c, "N": c, "C": 1, "K": 0}
    assert lay.with_order("LBHNC").buffer_bytes(nb) == nb * block
    assert lay.layer_offset(2, nb) == 2 * h * n * c


def test_split_form_puts_kv_plane_inside_layer():
    lay = KVLayout(2, 2, 4, 5, "fp32", KVForm.SPLIT, "BLNHC")
    assert lay.physical_axes() == "BLKNHC"
    s = lay.axis_strides(3)
    assert s["K"] == 5 * 2 * 4 and s["L"] == 2 * s["K"]
    assert lay.page_bytes == 2 * 2 * 5 * 4 * 4


def test_blocks_in_budget_and_dtype_names():
    lay = KVLayout(32, 8, 128, 16)
    assert lay.blocks_in(5 * 2**21 + 100) == 5
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("fp8") is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="alignment must be a power of two"):
        KVLayout(2, 2, 4, 5, alignment=100)
