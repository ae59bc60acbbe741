"""Layer views against an independent reshape of the raw bytes, and against kernel emulators.

The reference never uses KVLayout's stride arithmetic: it reshapes the buffer's bytes in the
physical order (block chunks cut at the aligned stride) and permutes to the logical axes.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvconnector.layout.allocator import allocate
from kvconnector.layout.descriptor import ALL_ORDERS, BLOCK_MAJOR_ORDERS, KVForm, KVLayout
from kvconnector.layout.views import (
    ViewKind,
    canonical_strides,
    canonicalize_size1_strides,
    check_kernel_strides,
    layer_view,
)

NUM_BLOCKS = 5
SHAPES = {
    # name: (layers, kv heads, head size, tokens per block, form)
    "gqa": (3, 2, 16, 4, KVForm.PACKED),
    "one_head": (3, 1, 16, 4, KVForm.PACKED),  # 70B at TP 8: one kv head per rank
    "split": (2, 2, 16, 4, KVForm.SPLIT),
    "mla": (2, 1, 32, 8, KVForm.MLA),
}
DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float32]
VIEW_KINDS = {
    KVForm.PACKED: [ViewKind.VLLM, ViewKind.FLASH_ATTN, ViewKind.FLASHINFER_NHD,
                    ViewKind.FLASHINFER_HND],
    KVForm.SPLIT: [ViewKind.FLASH_ATTN, ViewKind.FLASHINFER_NHD, ViewKind.FLASHINFER_HND],
    KVForm.MLA: [ViewKind.VLLM, ViewKind.MLA],
}
CASES = list(itertools.product(SHAPES, ALL_ORDERS, DTYPES))


def make_layout(shape: str, order: str, dtype: torch.dtype) -> KVLayout:
    layers, heads, head_size, block_size, form = SHAPES[shape]
    return KVLayout(layers, heads, head_size, block_size, dtype, form, order)


def logical_reference(raw: torch.Tensor, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """[L, B, K, H, N, C] tensor over raw's bytes, derived by reshape + permute only."""
    typed_dtype = layout.dtype
    sizes = {"L": layout.num_layers, "B": num_blocks, "K": layout.kv_planes,
             "H": layout.num_kv_heads, "N": layout.block_size, "C": layout.content_size}
    axes = layout.order
    if layout.form is KVForm.SPLIT:
        at = layout.order.index("L") + 1
        axes = layout.order[:at] + "K" + layout.order[at:]
    if layout.is_block_major:
        chunks = raw[: num_blocks * layout.block_stride_bytes].view(num_blocks, -1)
        phys = chunks[:, : layout.block_bytes].contiguous().view(typed_dtype)
    else:
        phys = raw[: layout.buffer_bytes(num_blocks)].view(typed_dtype)
    phys = phys.reshape([sizes[a] for a in axes])
    full = axes if "K" in axes else axes + "K"
    if "K" not in axes:
        phys = phys.unsqueeze(-1)
    return phys.permute([full.index(a) for a in "LBKHNC"])


def expected_view(ref: torch.Tensor, layout: KVLayout, layer: int, kind: ViewKind) -> torch.Tensor:
    page = ref[layer]  # [B, K, H, N, C]
    if kind is ViewKind.VLLM:
        return page[:, 0]
    if kind is ViewKind.MLA:
        return page[:, 0, 0]
    if layout.form is KVForm.PACKED:  # K|V halves of C become the K/V axis
        b, _, h, n, c = page.shape
        page = page[:, 0].reshape(b, h, n, 2, c // 2).permute(0, 3, 1, 2, 4)
    # page is now [B, 2, H, N, D]
    return {ViewKind.FLASH_ATTN: page.permute(1, 0, 3, 2, 4),
            ViewKind.FLASHINFER_NHD: page.permute(0, 1, 3, 2, 4),
            ViewKind.FLASHINFER_HND: page}[kind]


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def emulate_strided_read(view: torch.Tensor) -> torch.Tensor:
    """What a stride-reading kernel loads: storage + (offset + sum(index * stride)) elements."""
    flat = _typed_storage(view)
    offsets = torch.full(view.shape, view.storage_offset(), dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(view.shape, view.stride(), strict=True)):
        shape = [1] * view.dim()
        shape[dim] = size
        offsets = offsets + torch.arange(size).mul(stride).view(shape)
    return flat[offsets]


def emulate_packed_page_read(view: torch.Tensor) -> torch.Tensor:
    """A buggy kernel: page address = base + block x page size, ignoring stride(block)."""
    flat = _typed_storage(view)
    page = 1
    for size in view.shape[1:]:
        page *= size
    offsets = torch.full(view.shape, view.storage_offset(), dtype=torch.int64)
    inner = view[0].contiguous().shape
    dense = torch.arange(page).view(inner)  # packed page: dense inner dims
    offsets = offsets + torch.arange(view.shape[0]).mul(page).view(-1, *[1] * len(inner)) + dense
    return flat[offsets.clamp(max=flat.numel() - 1)]


def _typed_storage(view: torch.Tensor) -> torch.Tensor:
    storage = torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage())
    return storage[: storage.numel() // view.element_size() * view.element_size()].view(view.dtype)


@pytest.mark.parametrize("shape,order,dtype", CASES)
def test_write_through_view_lands_at_formula_bytes(shape: str, order: str, dtype: torch.dtype):
    layout = make_layout(shape, order, dtype)
    buf = allocate(layout, num_blocks=NUM_BLOCKS)
    for kind in VIEW_KINDS[layout.form]:
        for layer in range(layout.num_layers):
            buf.raw.zero_()
            view = buf.layer_view(layer, kind)
            values = random_bytes(view.numel() * view.element_size(), seed=layer)
            values = values.view(dtype).view(view.shape)
            view.copy_(values)
            ref = logical_reference(buf.raw, buf.layout, NUM_BLOCKS)
            assert torch.equal(expected_view(ref, layout, layer, kind).contiguous().view(
                torch.uint8), values.view(torch.uint8)), (kind, layer)
            # Exactly those bytes changed: every other layer is still zero.
            others = [i for i in range(layout.num_layers) if i != layer]
            assert not ref[others].contiguous().view(torch.uint8).any(), (kind, layer)
            written = int(buf.raw.count_nonzero())
            assert written == int(values.view(torch.uint8).count_nonzero())


@pytest.mark.parametrize("shape,order,dtype", CASES)
def test_raw_bytes_read_back_through_every_view(shape: str, order: str, dtype: torch.dtype):
    layout = make_layout(shape, order, dtype)
    buf = allocate(layout, num_blocks=NUM_BLOCKS)
    buf.raw.copy_(random_bytes(buf.raw.numel(), seed=7))
    ref = logical_reference(buf.raw, buf.layout, NUM_BLOCKS)
    for kind in VIEW_KINDS[layout.form]:
        for layer in range(layout.num_layers):
            got = buf.layer_view(layer, kind).contiguous().view(torch.uint8)
            want = expected_view(ref, layout, layer, kind).contiguous().view(torch.uint8)
            assert torch.equal(got, want), (kind, layer)


@pytest.mark.parametrize("order", BLOCK_MAJOR_ORDERS)
def test_block_chunk_holds_every_layer_of_its_block(order: str):
    layout = make_layout("gqa", order, torch.bfloat16)
    buf = allocate(layout, num_blocks=NUM_BLOCKS)
    chunks = buf.block_chunks()
    assert chunks.shape == (NUM_BLOCKS, layout.block_bytes)
    assert chunks.stride(0) % 4096 == 0 and chunks.data_ptr() % 4096 == 0
    chunks[3].fill_(0xAB)
    for layer in range(layout.num_layers):
        view = buf.layer_view(layer).view(torch.uint8)
        assert bool((view[3] == 0xAB).all())
        assert not view[[0, 1, 2, 4]].any()


@pytest.mark.parametrize("shape,order", itertools.product(SHAPES, BLOCK_MAJOR_ORDERS))
def test_strided_emulator_matches_and_packed_page_emulator_does_not(shape: str, order: str):
    layout = make_layout(shape, order, torch.bfloat16)
    buf = allocate(layout, num_blocks=NUM_BLOCKS)
    buf.raw.copy_(random_bytes(buf.raw.numel(), seed=3))
    ref = logical_reference(buf.raw, buf.layout, NUM_BLOCKS)
    kind = ViewKind.MLA if layout.form is KVForm.MLA else VIEW_KINDS[layout.form][-1]
    for layer in range(layout.num_layers):
        view = buf.layer_view(layer, kind)
        want = expected_view(ref, layout, layer, kind).contiguous()
        assert torch.equal(emulate_strided_read(view).view(torch.uint8), want.view(torch.uint8))
        naive = emulate_packed_page_read(view)
        # Block 0 of layer 0 may coincide; any later block is read from the wrong place.
        assert not torch.equal(naive[1:].view(torch.uint8), want[1:].view(torch.uint8)), layer
        # On a contiguous per-layer cache both emulators agree with the data.
        packed = want.clone()
        assert torch.equal(emulate_packed_page_read(packed).view(torch.uint8),
                           packed.view(torch.uint8))


def test_one_kv_head_strides_are_canonical_and_addresses_unchanged():
    layout = make_layout("one_head", "BLNHC", torch.bfloat16)
    buf = allocate(layout, num_blocks=NUM_BLOCKS)
    view = buf.layer_view(1)  # [B, 1, N, C]
    n, c = layout.block_size, layout.content_size
    # Physically H sits inside N with stride C; the view carries the canonical N * C instead.
    assert view.stride()[1] == n * c
    assert view.stride()[2] == c
    raw_stride = torch.as_strided(view, view.shape, (view.stride(0), c, c, 1),
                                  view.storage_offset())
    assert torch.equal(raw_stride.contiguous().view(torch.uint8),
                       view.contiguous().view(torch.uint8))
    canon = canonicalize_size1_strides(raw_stride)
    assert canon.stride() == view.stride() and canon.data_ptr() == raw_stride.data_ptr()
    assert canonical_strides([4, 1, 3, 8], [100, 2, 8, 1]) == [100, 24, 8, 1]


def test_sixteen_byte_violation_names_the_dim():
    layout = KVLayout(2, 3, 4, 4, torch.bfloat16, KVForm.SPLIT, "BLNHC")
    buf = allocate(layout, num_blocks=2)
    with pytest.raises(ValueError, match=r"dim 2 \('N'\) has stride 24 B, not a multiple of 16"):
        buf.layer_view(0, ViewKind.FLASH_ATTN)
    bad = torch.zeros(4, 3, 8, dtype=torch.bfloat16)[:, :, :5]
    with pytest.raises(ValueError, match=r"dim 1 \('1'\) has stride 16 B|dim 1"):
        check_kernel_strides(bad.as_strided((4, 3, 5), (24, 5, 1)))


@pytest.mark.parametrize("kwargs,match", [
    ({"num_layers": 0}, "num_layers must be a positive integer, got 0"),
    ({"num_kv_heads": -2}, "num_kv_heads must be a positive integer, got -2"),
    ({"head_size": 0}, "head_size must be a positive integer, got 0"),
    ({"block_size": -16}, "block_size must be a positive integer, got -16"),
    ({"dtype": torch.int64}, "unsupported KV dtype torch.int64"),
    ({"dtype": "int4"}, "unsupported KV dtype 'int4'"),
    ({"order": "BNLHC"}, "unknown physical order 'BNLHC'"),
    ({"form": "mla", "num_kv_heads": 8}, "one latent head, got num_kv_heads=8"),
])
def test_bad_parameters_raise_naming_the_value(kwargs: dict, match: str):
    args = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "block_size": 4} | kwargs
    with pytest.raises(ValueError, match=match):
        KVLayout(**args)


def test_bad_view_requests_raise_naming_the_value():
    layout = make_layout("gqa", "BLNHC", torch.bfloat16)
    buf = allocate(layout, num_blocks=2)
    with pytest.raises(ValueError, match="layer 3 out of range for 3 layers"):
        buf.layer_view(3)
    with pytest.raises(ValueError, match="layer -1 out of range"):
        buf.layer_view(-1)
    with pytest.raises(ValueError, match="'mla' needs an MLA layout"):
        buf.layer_view(0, ViewKind.MLA)
    with pytest.raises(ValueError, match="'bogus' is not a valid ViewKind"):
        buf.layer_view(0, "bogus")
    with pytest.raises(ValueError, match="raw buffer has 100 bytes"):
        layer_view(buf.raw[:100], layout, 2, 0)
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        layer_view(buf.raw.view(torch.bfloat16), layout, 2, 0)
    split = allocate(make_layout("split", "BLNHC", torch.bfloat16), num_blocks=2)
    with pytest.raises(ValueError, match="SPLIT layout keeps them in planes"):
        split.layer_view(0, ViewKind.VLLM)
