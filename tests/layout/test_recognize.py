"""Tests for kvconnector.layout.recognize: the block chunks behind per-layer KV cache tensors.

Byte checks use an independent reference: the storage byte address of every byte a view covers,
computed from the view's own offset and strides. The `vllm` tests feed the recogniser exactly
what vLLM's own config builder (0.32 and 0.33) and `allocate_kv_cache` make.
"""

from __future__ import annotations

import pytest
import torch

from kvconnector.layout.descriptor import BLOCK_MAJOR_ORDERS, KVForm, KVLayout
from kvconnector.layout.recognize import Recognition, recognize
from kvconnector.layout.views import ViewKind, layer_view

NUM_BLOCKS = 5


# -- reference helpers ------------------------------------------------------------------------
def byte_addresses(view: torch.Tensor) -> torch.Tensor:
    """Storage byte address of every byte of `view`, shaped like `view.view(torch.uint8)`."""
    esize = view.element_size()
    index = torch.arange(view.untyped_storage().nbytes(), dtype=torch.int64)
    addresses = index.as_strided((*view.shape, esize), (*(s * esize for s in view.stride()), 1),
                                 view.storage_offset() * esize)
    return addresses.reshape(*view.shape[:-1], view.shape[-1] * esize)


def block_addresses(view: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """(num_blocks, page_bytes): the storage addresses of each block's bytes of a layer view."""
    return byte_addresses(view).reshape(num_blocks, -1)


def chunk_positions(rec: Recognition, view: torch.Tensor) -> torch.Tensor:
    """Where each byte of each block of `view` must sit inside its block chunk."""
    chunks = rec.block_chunks
    assert chunks is not None
    blocks = torch.arange(rec.num_blocks).unsqueeze(1)
    return (block_addresses(view, rec.num_blocks) - chunks.base_offset
            - blocks * chunks.block_stride)


def check_chunks_byte_for_byte(rec: Recognition, kv: dict[str, torch.Tensor], seed: int) -> None:
    """Layer views -> chunks and chunks -> layer views, every byte, every block."""
    chunks = rec.block_chunks
    assert chunks is not None
    assert chunks.chunks.shape == (rec.num_blocks, chunks.block_bytes)
    assert chunks.chunks.stride() == (chunks.block_stride, 1)
    assert chunks.chunks.untyped_storage().data_ptr() == rec.buffer.untyped_storage().data_ptr()
    gen = torch.Generator().manual_seed(seed)
    # Forward: random bytes through each distinct layer view land exactly where expected.
    rec.buffer.zero_()
    expected = torch.zeros(rec.num_blocks, chunks.block_bytes, dtype=torch.uint8)
    covered = torch.zeros(chunks.block_bytes, dtype=torch.bool)
    for name in rec.layers:
        view = kv[name]
        data = torch.randint(0, 256, view.view(torch.uint8).shape, dtype=torch.uint8,
                             generator=gen)
        view.view(torch.uint8).copy_(data)
        positions = chunk_positions(rec, view)
        assert int(positions.min()) >= 0 and int(positions.max()) < chunks.block_bytes
        expected.scatter_(1, positions, data.reshape(rec.num_blocks, -1))
        covered[positions.reshape(-1)] = True
    assert torch.equal(chunks.chunks, expected)
    # Bytes no layer view addresses are exactly the reported gaps.
    gap_mask = torch.zeros(chunks.block_bytes, dtype=torch.bool)
    for start, end in chunks.gaps:
        gap_mask[start:end] = True
    assert torch.equal(~covered, gap_mask)
    # Nothing outside the chunks was written (trailing block padding, other bytes).
    outside = torch.ones(rec.buffer.numel(), dtype=torch.bool)
    outside[byte_addresses(chunks.chunks).reshape(-1)] = False
    assert int(rec.buffer[outside].count_nonzero()) == 0
    # Reverse: random chunk bytes read back through every layer view, shared ones included.
    data = torch.randint(0, 256, expected.shape, dtype=torch.uint8, generator=gen)
    chunks.chunks.copy_(data)
    for name in (*rec.layers, *rec.aliases):
        view = kv[name]
        got = view.view(torch.uint8).reshape(rec.num_blocks, -1)
        assert torch.equal(got, data.gather(1, chunk_positions(rec, view))), name


def check_layer_pages(rec: Recognition, kv: dict[str, torch.Tensor]) -> None:
    """Each layer's page view addresses exactly that layer's bytes of each block, in order."""
    for name in rec.layers:
        pages = rec.layer_pages[name]
        assert pages.dtype == torch.uint8 and pages.shape[0] == rec.num_blocks
        want = block_addresses(kv[name], rec.num_blocks).sort(dim=1).values
        assert torch.equal(block_addresses(pages, rec.num_blocks), want), name


# -- hand-built caches (pure torch) -------------------------------------------------------------
def kv_from_layout(layout: KVLayout, kind: ViewKind = ViewKind.VLLM, prefix: str = "layer",
                   lead: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Layer views of `layout` over a fresh buffer, starting `lead` bytes into it."""
    raw = torch.zeros(lead + layout.buffer_bytes(NUM_BLOCKS), dtype=torch.uint8)
    kv = {f"{prefix}.{i}": layer_view(raw[lead:], layout, NUM_BLOCKS, i, kind)
          for i in range(layout.num_layers)}
    return kv, raw


def packed_view(raw: torch.Tensor, offset: int, block_stride: int, heads: int, head_size: int,
                block_size: int = 4, num_blocks: int = NUM_BLOCKS,
                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[B, H, N, C] bf16 with NHC order inside the page, at byte `offset`, blocks `block_stride` B
    apart (vLLM's BLNHC/LBNHC page)."""
    typed = raw.view(dtype)
    esize = typed.element_size()
    content = 2 * head_size
    return torch.as_strided(typed, (num_blocks, heads, block_size, content),
                            (block_stride // esize, content, heads * content, 1), offset // esize)


BLOCK_MAJOR_CASES = [
    (order, form, kind, heads)
    for order in BLOCK_MAJOR_ORDERS
    for form, kind, heads in [(KVForm.PACKED, ViewKind.VLLM, 2), (KVForm.PACKED, ViewKind.VLLM, 1),
                              (KVForm.SPLIT, ViewKind.FLASHINFER_NHD, 2),
                              (KVForm.MLA, ViewKind.MLA, 1)]
]


@pytest.mark.parametrize(("order", "form", "kind", "heads"), BLOCK_MAJOR_CASES)
def test_block_major_layouts_give_exact_chunks(order: str, form: KVForm, kind: ViewKind,
                                               heads: int) -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=heads, head_size=16, block_size=4, form=form,
                      order=order, alignment=512)
    kv, raw = kv_from_layout(layout, kind, lead=1024)
    rec = recognize(kv)
    assert rec.is_block_major and rec.reason is None
    chunks = rec.block_chunks
    assert chunks is not None
    assert rec.num_blocks == NUM_BLOCKS and rec.layers == tuple(kv) and rec.aliases == {}
    assert rec.buffer.data_ptr() == raw.data_ptr() and rec.buffer.numel() == raw.numel()
    assert (chunks.block_bytes, chunks.block_stride, chunks.base_offset, chunks.gaps) == (
        layout.block_bytes, layout.block_stride_bytes, 1024, ())
    assert chunks.layer_offsets == {
        f"layer.{i}": layout.layer_offset(i, NUM_BLOCKS) * layout.element_size for i in range(3)}
    check_chunks_byte_for_byte(rec, kv, seed=1)
    check_layer_pages(rec, kv)
    page_dims = 2 if order != "BHLNC" or heads == 1 else 3  # BHLNC: one run per head
    assert all(p.dim() == page_dims for p in rec.layer_pages.values())


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC"])
def test_layer_major_refused_with_reason(order: str) -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_size=16, block_size=4, order=order)
    kv, _ = kv_from_layout(layout)
    rec = recognize(kv)
    assert not rec.is_block_major and rec.block_chunks is None
    apart = NUM_BLOCKS * layout.page_bytes  # 5 x 512 B
    assert rec.reason == ("layer-major: layer 'layer.0' and layer 'layer.1' of block 0 are "
                          f"{apart / 1024:.1f} KB apart, blocks of one layer 512 B; ask for a "
                          "block-outermost layout (BLNHC, BLHNC or BHLNC) to move a block in "
                          "one copy")
    # The fallback: one contiguous (num_blocks, page_bytes) chunk per layer.
    assert all(p.shape == (NUM_BLOCKS, layout.page_bytes) for p in rec.layer_pages.values())
    check_layer_pages(rec, kv)


def test_head_outer_layout_refused_and_paged_by_head() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=16, block_size=4, order="LHBNC")
    kv, _ = kv_from_layout(layout)
    rec = recognize(kv)
    run = layout.block_size * layout.content_size * 2
    span = NUM_BLOCKS * run + run  # head 0 of block 0 .. end of head 1 of block 0
    assert rec.reason is not None and rec.reason.startswith(
        f"blocks interleave: the page of block 0 of layer 'layer.0' spans {span / 1024:.1f} KB "
        f"but its blocks are {run} B apart")
    assert all(p.shape == (NUM_BLOCKS, 2, run) for p in rec.layer_pages.values())
    check_layer_pages(rec, kv)


def test_shared_layers_are_deduplicated() -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_size=16, block_size=4, order="BLNHC")
    kv, raw = kv_from_layout(layout)
    kv["shared.same_tensor"] = kv["layer.1"]
    kv["shared.equal_view"] = layer_view(raw, layout, NUM_BLOCKS, 2)  # a new, identical view
    rec = recognize(kv)
    assert rec.layers == ("layer.0", "layer.1", "layer.2")
    assert rec.aliases == {"shared.same_tensor": "layer.1", "shared.equal_view": "layer.2"}
    assert rec.block_chunks is not None and rec.block_chunks.block_bytes == layout.block_bytes
    check_chunks_byte_for_byte(rec, kv, seed=2)


def two_tensor_cache(pad: int = 0) -> tuple[dict[str, torch.Tensor], int, int]:
    """Two KVCacheTensors packed side by side in each block, as vLLM's BLNHC does: three layers
    of 2 heads x 16 and two of 1 head x 8, one block stride."""
    page_a, page_b = 2 * 4 * 32 * 2, 1 * 4 * 16 * 2
    block_bytes = 3 * page_a + 2 * page_b
    stride = block_bytes + pad
    raw = torch.zeros(NUM_BLOCKS * stride, dtype=torch.uint8)
    kv = {f"a.{i}": packed_view(raw, i * page_a, stride, 2, 16) for i in range(3)}
    kv |= {f"b.{j}": packed_view(raw, 3 * page_a + j * page_b, stride, 1, 8) for j in range(2)}
    return kv, block_bytes, stride


def test_two_tensors_in_one_buffer_form_one_chunk_per_block() -> None:
    kv, block_bytes, stride = two_tensor_cache(pad=256)
    kv["raw"] = torch.empty(0, dtype=torch.int8).set_(kv["a.0"].untyped_storage())
    rec = recognize(kv)
    assert rec.raw_entries == ("raw",) and "raw" not in rec.layers
    chunks = rec.block_chunks
    assert chunks is not None
    assert (chunks.block_bytes, chunks.block_stride) == (block_bytes, stride)
    assert chunks.layer_offsets == {"a.0": 0, "a.1": 512, "a.2": 1024, "b.0": 1536, "b.1": 1664}
    check_chunks_byte_for_byte(rec, kv, seed=3)
    check_layer_pages(rec, kv)


def test_separate_block_grids_are_refused() -> None:
    first, _, stride = two_tensor_cache()
    region = NUM_BLOCKS * stride
    raw = torch.zeros(2 * region, dtype=torch.uint8)
    kv = {f"{name}@{k}": packed_view(raw, k * region + t.storage_offset() * 2, stride,
                                     t.shape[1], t.shape[3] // 2)
          for k in range(2) for name, t in first.items()}
    rec = recognize(kv)
    assert rec.reason == (f"separate block grids: layer 'a.0@0' and layer 'a.0@1' of block 0 are "
                          f"{region / 1024:.1f} KB apart, farther than the {stride / 1024:.1f} KB "
                          f"between blocks, so one copy cannot move a block")


def test_padded_pages_are_reported_as_gaps() -> None:
    # Pages padded to 384 B (vLLM page_size_padded): 128 B after each 256 B page is no layer's.
    raw = torch.zeros(NUM_BLOCKS * 3 * 384, dtype=torch.uint8)
    kv = {f"l{i}": packed_view(raw, i * 384, 3 * 384, 1, 16) for i in range(3)}
    rec = recognize(kv)
    chunks = rec.block_chunks
    assert chunks is not None
    assert (chunks.block_bytes, chunks.block_stride) == (2 * 384 + 256, 3 * 384)
    assert chunks.gaps == ((256, 384), (640, 768))
    check_chunks_byte_for_byte(rec, kv, seed=4)


def test_aliased_cache_groups_need_declaring() -> None:
    kv, block_bytes, _ = two_tensor_cache()
    buffer = torch.empty(0, dtype=torch.uint8).set_(kv["a.0"].untyped_storage())
    # A second group overlays the first from byte 0 with two layers of another shape.
    kv["g1.0"] = packed_view(buffer, 0, block_bytes, 4, 8)
    kv["g1.1"] = packed_view(buffer, 512, block_bytes, 4, 8)
    with pytest.raises(ValueError, match="layer 'g1.0' and layer 'a.0' overlap at byte 0"):
        recognize(kv)
    groups = [["a.0", "a.1", "a.2", "b.0", "b.1"], ["g1.0", "g1.1"]]
    rec = recognize(kv, cache_groups=groups)
    assert rec.block_chunks is not None and rec.block_chunks.block_bytes == block_bytes
    check_chunks_byte_for_byte(rec, kv, seed=5)
    with pytest.raises(ValueError, match="layer 'g1.1' is in no cache group"):
        recognize(kv, cache_groups=groups[:1] + [["g1.0"]])


def test_non_uniform_block_stride_is_refused() -> None:
    raw = torch.zeros(8192, dtype=torch.uint8)
    kv = {"x": packed_view(raw, 0, 1024, 1, 16), "y": packed_view(raw, 256, 1280, 1, 16)}
    assert recognize(kv).reason == ("no uniform block stride: blocks of layer 'x' are 1024 B "
                                    "apart, blocks of layer 'y' 1280 B")


def test_kernel_blocks_regrouped_with_num_blocks() -> None:
    # Layer-major pages split into 2 kernel blocks each (vLLM's kernel block splitting).
    page, kernel_page = 256, 128  # a kernel page: 2 heads x 2 tokens x 16 bf16
    raw = torch.zeros(2 * NUM_BLOCKS * page, dtype=torch.uint8)
    kv = {f"l{i}": packed_view(raw, i * NUM_BLOCKS * page, kernel_page, 2, 8, block_size=2,
                               num_blocks=2 * NUM_BLOCKS) for i in range(2)}
    assert recognize(kv).num_blocks == 2 * NUM_BLOCKS
    rec = recognize(kv, num_blocks=NUM_BLOCKS)
    assert rec.num_blocks == NUM_BLOCKS and rec.reason is not None
    assert rec.reason.startswith("layer-major: layer 'l0' and layer 'l1'")
    assert all(p.shape == (NUM_BLOCKS, page) for p in rec.layer_pages.values())
    with pytest.raises(ValueError, match=r"layer 'l0' has 10 blocks .* expected 3"):
        recognize(kv, num_blocks=3)


def test_single_block_is_one_chunk_in_any_order() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=16, block_size=4, order="LBNHC")
    raw = torch.zeros(layout.buffer_bytes(1), dtype=torch.uint8)
    kv = {f"l{i}": layer_view(raw, layout, 1, i) for i in range(2)}
    rec = recognize(kv)
    assert rec.block_chunks is not None and rec.block_chunks.block_bytes == layout.block_bytes
    check_chunks_byte_for_byte(rec, kv, seed=6)


def test_only_raw_entries_is_a_refusal() -> None:
    raw = torch.zeros(64, dtype=torch.int8)
    rec = recognize({"r0": raw, "r1": raw})
    assert rec.raw_entries == ("r0", "r1") and rec.layers == ()
    assert rec.reason == "no layer views: all 2 entries are the raw buffer"


def test_malformed_input_raises_naming_the_layer() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=16, block_size=4, order="BLNHC")
    kv, _ = kv_from_layout(layout)
    other, _ = kv_from_layout(layout, prefix="other")
    with pytest.raises(ValueError, match="no KV cache tensors"):
        recognize({})
    with pytest.raises(ValueError, match="layer 'other.1' is not in the buffer of layer 'layer.0'"):
        recognize({**kv, "other.1": other["other.1"]})
    with pytest.raises(ValueError, match=r"layer 'short' has 4 blocks .* expected 5"):
        recognize({**kv, "short": kv["layer.1"][:4]})
    with pytest.raises(ValueError, match="layer 'spread': its elements overlap"):
        spread = kv["layer.0"][:, :1].expand(-1, 2, -1, -1)
        recognize({**kv, "spread": spread})
    with pytest.raises(ValueError, match="layer 'same': block dim has stride 0"):
        recognize({**kv, "same": kv["layer.0"][:1].expand(NUM_BLOCKS, -1, -1, -1)})
    with pytest.raises(ValueError, match="layer 'empty': empty or 0-dim"):
        recognize({**kv, "empty": kv["layer.0"][:0]})
    with pytest.raises(ValueError, match="num_blocks must be a positive integer, got 0"):
        recognize(kv, num_blocks=0)
    with pytest.raises(ValueError, match="layer 'layer.0' is in cache groups 0 and 1"):
        recognize(kv, cache_groups=[["layer.0"], ["layer.0", "layer.1"]])
    with pytest.raises(ValueError, match="layer 'layer.1' and layer 'layer.0' overlap"):
        recognize({"layer.0": kv["layer.0"], "layer.1": kv["layer.0"].view(torch.float16)})


# -- vLLM 0.32 / 0.33: exactly what a worker receives --------------------------------------------
VLLM_BLOCK = 16


def vllm_cache(layout: str, groups: list[tuple[list[str], object]], budget: int
               ) -> tuple[dict[str, torch.Tensor], object]:
    """Build a KVCacheConfig with vLLM's own builder and allocate it with vLLM's allocator."""
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    try:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    except ImportError:  # vLLM 0.33 moved the planner
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, UniformTypeKVCacheSpecs
    from vllm.v1.worker.utils import allocate_kv_cache

    cache_config = CacheConfig(block_size=VLLM_BLOCK)
    cache_config.kv_cache_layout = layout  # what resolve_kv_cache_layout honours as pre-set
    vllm_config = VllmConfig(cache_config=cache_config, device_config=DeviceConfig(device="cpu"))
    group_specs = []
    for names, spec in groups:
        if isinstance(spec, dict):  # per-layer specs of one type: one KVCacheTensor per shape
            spec = UniformTypeKVCacheSpecs.from_specs(spec)
        group_specs.append(KVCacheGroupSpec(names, spec))
    config = get_kv_cache_config_from_groups(vllm_config, group_specs, budget)
    kv = allocate_kv_cache(config, torch.device("cpu"),
                           vllm_config.cache_config.get_resolved_kv_cache_layout())
    return kv, config


def attn_spec(heads: int, head_size: int, sliding_window: int | None = None) -> object:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if sliding_window is not None:
        return SlidingWindowSpec(block_size=VLLM_BLOCK, num_kv_heads=heads, head_size=head_size,
                                 dtype=torch.bfloat16, sliding_window=sliding_window)
    return FullAttentionSpec(block_size=VLLM_BLOCK, num_kv_heads=heads, head_size=head_size,
                             dtype=torch.bfloat16)


def tiny_model(layout: str, mixed_pages: bool) -> tuple[dict[str, torch.Tensor], object]:
    """Six attention layers of two shapes (two KVCacheTensors) and a seventh that shares layer
    1's KV, added the way GPUModelRunner.initialize_kv_cache_tensors adds it."""
    a = attn_spec(2, 64)  # 8 KB page
    b = attn_spec(1, 64) if mixed_pages else attn_spec(4, 32)  # 4 KB or 8 KB page
    names = [f"model.layers.{i}.attn" for i in range(6)]
    specs = dict(zip(names, [a, a, b, a, b, a], strict=True))
    kv, config = vllm_cache(layout, [(names, specs)], budget=64 * 1024 * 12)
    kv["model.layers.6.attn"] = kv["model.layers.1.attn"]
    return kv, config


@pytest.mark.vllm
@pytest.mark.parametrize(("layout", "mixed_pages"), [
    ("BLNHC", False), ("BLNHC", True), ("BLHNC", False), ("BLHNC", True), ("BHLNC", False)])
def test_vllm_block_major_layouts(layout: str, mixed_pages: bool) -> None:
    kv, config = tiny_model(layout, mixed_pages)
    tensors = config.kv_cache_tensors
    assert len(tensors) == 2
    rec = recognize(kv, num_blocks=config.num_blocks)
    chunks = rec.block_chunks
    assert chunks is not None, rec.reason
    assert rec.num_blocks == config.num_blocks
    assert rec.layers == tuple(name for t in tensors for name in t.layers)
    assert rec.aliases == {"model.layers.6.attn": "model.layers.1.attn"}
    page_b = 4096 if mixed_pages else 8192
    assert chunks.block_bytes == 4 * 8192 + 2 * page_b
    assert chunks.block_stride == tensors[0].block_stride == tensors[1].block_stride
    assert chunks.base_offset == 0 and chunks.gaps == ()
    assert chunks.layer_offsets == {name: t.offset + i * t.layer_stride
                                    for t in tensors for i, name in enumerate(t.layers)}
    check_chunks_byte_for_byte(rec, kv, seed=7)
    check_layer_pages(rec, kv)


@pytest.mark.vllm
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_vllm_layer_major_layouts_refused(layout: str) -> None:
    kv, config = tiny_model(layout, mixed_pages=False)
    rec = recognize(kv, num_blocks=config.num_blocks)
    assert rec.block_chunks is None
    apart = config.num_blocks * 8192  # one layer's whole region
    assert rec.reason == (
        f"layer-major: layer 'model.layers.0.attn' and layer 'model.layers.1.attn' of block 0 "
        f"are {apart / 1024:.1f} KB apart, blocks of one layer 8.0 KB; ask for a "
        f"block-outermost layout (BLNHC, BLHNC or BHLNC) to move a block in one copy")
    assert all(p.shape == (config.num_blocks, 8192) for p in rec.layer_pages.values())
    check_layer_pages(rec, kv)


@pytest.mark.vllm
def test_vllm_head_outer_layout_refused() -> None:
    kv, config = tiny_model("LHBNC", mixed_pages=False)
    rec = recognize(kv, num_blocks=config.num_blocks)
    assert rec.reason is not None and rec.reason.startswith(
        "blocks interleave: the page of block 0 of layer 'model.layers.0.attn'")
    check_layer_pages(rec, kv)


@pytest.mark.vllm
@pytest.mark.parametrize("layout", ["BLNHC", "BHLNC"])
def test_vllm_aliased_groups_and_raw_entry(layout: str) -> None:
    from vllm.v1.kv_cache_interface import (
        HiSparseResidentSpec,
        KVCacheGroupSpec,
        KVCacheLayout,
        KVCacheTensor,
    )
    from vllm.v1.worker.utils import allocate_kv_cache

    full = [f"model.layers.{i}.attn" for i in range(4)]
    window = [f"model.layers.{i}.attn" for i in range(4, 6)]
    _, config = vllm_cache(layout, [(full, attn_spec(2, 64)), (window, attn_spec(2, 64, 64))],
                           budget=32 * 1024 * 6)
    # A spec without layer views gets the raw int8 buffer from allocate_kv_cache.
    config.kv_cache_groups.append(
        KVCacheGroupSpec(["raw.0"], HiSparseResidentSpec(block_size=VLLM_BLOCK, page_size=1024)))
    config.kv_cache_tensors.append(KVCacheTensor(size=config.kv_cache_tensors[0].size,
                                                 layers=["raw.0"], layer_stride=0, block_stride=0))
    kv = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[layout])
    assert kv["raw.0"].dim() == 1 and kv["raw.0"].dtype == torch.int8
    groups = [g.layer_names for g in config.kv_cache_groups]
    rec = recognize(kv, cache_groups=groups, num_blocks=config.num_blocks)
    chunks = rec.block_chunks
    assert chunks is not None, rec.reason
    assert rec.raw_entries == ("raw.0",)
    if layout == "BLNHC":  # the window layers' views equal those of layers 0 and 1: counted once
        assert rec.layers == tuple(full)
        assert rec.aliases == {window[0]: full[0], window[1]: full[1]}
    else:  # BHLNC: a group's head stride depends on its layer count, so the views differ
        assert rec.layers == tuple(full + window) and rec.aliases == {}
    assert (chunks.block_bytes, chunks.block_stride) == (4 * 8192, 4 * 8192)
    check_chunks_byte_for_byte(rec, kv, seed=8)
    if layout == "BHLNC":  # undeclared, the overlay is two layers writing the same bytes
        with pytest.raises(ValueError, match=f"layer '{window[0]}' and layer '{full[0]}' overlap"):
            recognize(kv, num_blocks=config.num_blocks)


@pytest.mark.vllm
def test_vllm_padded_mla_pages_are_gaps() -> None:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=VLLM_BLOCK, num_kv_heads=1, head_size=72,
                            dtype=torch.bfloat16, alignment=4096)  # 2304 B padded to 4096 B
    names = [f"model.layers.{i}.attn" for i in range(3)]
    kv, config = vllm_cache("BLNHC", [(names, spec)], budget=3 * 4096 * 4)
    rec = recognize(kv, num_blocks=config.num_blocks)
    chunks = rec.block_chunks
    assert chunks is not None, rec.reason
    assert (chunks.block_bytes, chunks.block_stride) == (2 * 4096 + 2304, 3 * 4096)
    assert chunks.gaps == ((2304, 4096), (4096 + 2304, 2 * 4096))
    check_chunks_byte_for_byte(rec, kv, seed=9)


@pytest.mark.vllm
def test_vllm_kernel_block_split_regrouped() -> None:
    from vllm.v1.kv_cache_interface import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    names = ["model.layers.0.attn", "model.layers.1.attn"]
    _, config = vllm_cache("LBNHC", [(names, attn_spec(2, 64))], budget=8192 * 2 * 4)

    kv = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBNHC, [VLLM_BLOCK // 2])
    assert kv[names[0]].shape[0] == 2 * config.num_blocks  # kernel blocks of 8 tokens
    rec = recognize(kv, num_blocks=config.num_blocks)
    assert rec.num_blocks == config.num_blocks and rec.reason is not None
    assert all(p.shape == (config.num_blocks, 8192) for p in rec.layer_pages.values())
    check_layer_pages(rec, kv)
