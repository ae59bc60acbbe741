"""The inverse of the layer-view factory: recognise a block-major buffer behind per-layer KV caches.

An engine hands its connector a dict of layer name -> tensor (vLLM: `register_kv_caches`, exactly
what `vllm.v1.worker.utils.allocate_kv_cache` makes). `recognize` finds the storage behind those
tensors and decides whether block b of every layer lies in one chunk that one copy can move.
When it does, the result carries the chunk view `(num_blocks, block_bytes)` uint8 over the
storage; when it does not, a reason a person can act on, and callers copy layer by layer.

What is accepted, and why (vLLM 0.32 is the reference):
- All tensors are views of ONE storage (vLLM allocates one int8 buffer). A tensor elsewhere, or
  a different block count, is malformed input: ValueError naming the layer.
- Dim 0 of every layer view is the block (vLLM's `[B, H, N, C]`, FlashInfer, MLA `(B, N, D)`).
  vLLM may split a block into kernel blocks (layer-major layouts only; dim 0 is then k x the
  block count): pass `num_blocks` and dim 0 is regrouped to whole blocks.
- One-dim entries are raw-buffer entries (specs without layer views get the whole int8 buffer and
  place their bytes themselves): listed in `raw_entries`, not analysed.
- Layers sharing one tensor (KV sharing: same storage, offset, shape, strides, dtype) count once;
  `aliases` maps the others to the layer whose tensor they share. Cache-group overlays whose
  views are identical (vLLM BLNHC/BLHNC, groups of equal specs) are counted once the same way.
- Several KVCacheTensors in one buffer: in block-outermost layouts vLLM packs them side by side
  inside each block with one common block stride, so they form ONE chunk per block. A buffer
  holding separate block grids is refused: one copy could not move a block.
- Cache groups overlay the same bytes (a block id belongs to one group at a time): layers of
  different `cache_groups` may overlap; two layers of one group overlapping is a ValueError.
- Bytes inside a chunk that no layer view addresses (vLLM's padded pages) are reported in `gaps`
  and move with their block; the chunk ends at the last byte a layer view addresses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

BLOCK_MAJOR_HINT = ("ask for a block-outermost layout (BLNHC, BLHNC or BHLNC) to move a block "
                    "in one copy")


@dataclass(frozen=True)
class BlockChunks:
    """One chunk per block holding that block of every layer: what a per-block copy needs."""

    chunks: torch.Tensor  # (num_blocks, block_bytes) uint8 view over the storage
    block_bytes: int  # bytes one copy moves
    block_stride: int  # bytes from one chunk to the next (>= block_bytes)
    base_offset: int  # storage byte where block 0's chunk starts
    layer_offsets: dict[str, int]  # per distinct layer: its first byte of a block, within the chunk
    gaps: tuple[tuple[int, int], ...]  # [start, end) byte ranges in a chunk no layer view addresses


@dataclass(frozen=True)
class Recognition:
    """What lies behind an engine's per-layer KV cache tensors.

    `layer_pages[name]` is a uint8 view of one distinct layer's bytes, block first. It is
    `(num_blocks, page_bytes)` when each page of that layer is one contiguous run (LBNHC, LBHNC,
    BLNHC, BLHNC); otherwise `(num_blocks, runs..., run_bytes)`, one dim per stride break inside
    the page (LHBNC and BHLNC: `(num_blocks, H, N * C bytes)`), ready for a 2-D strided copy.
    """

    buffer: torch.Tensor  # the whole storage behind the tensors, 1-D uint8
    num_blocks: int
    layers: tuple[str, ...]  # distinct layer views, in dict order
    aliases: dict[str, str]  # layer -> the earlier layer whose tensor it shares
    raw_entries: tuple[str, ...]  # entries that are the raw buffer, not layer views
    layer_pages: dict[str, torch.Tensor]
    block_chunks: BlockChunks | None  # set when block-major
    reason: str | None  # why not block-major (None when block-major)

    @property
    def is_block_major(self) -> bool:
        return self.block_chunks is not None


@dataclass(frozen=True)
class _Geometry:
    """Bytes of one layer: block 0 starts at `offset`; a page is runs of `run_bytes`."""

    offset: int
    block_stride: int
    outer: tuple[tuple[int, int], ...]  # (size, byte stride) of page dims outside a run
    run_bytes: int

    @property
    def span(self) -> int:
        """Bytes from the first to the last byte of one page."""
        return sum((size - 1) * stride for size, stride in self.outer) + self.run_bytes

    def run_starts(self) -> list[int]:
        starts = [0]
        for size, stride in self.outer:
            starts = [start + i * stride for start in starts for i in range(size)]
        return starts


def recognize(kv_caches: Mapping[str, torch.Tensor],
              cache_groups: Sequence[Iterable[str]] | None = None,
              num_blocks: int | None = None) -> Recognition:
    """Find the buffer behind `kv_caches` and its block chunks, or the reason there are none.

    `cache_groups`: layer names per KV cache group (vLLM: `[g.layer_names for g in
    kv_cache_config.kv_cache_groups]`); layers of different groups may overlay each other.
    Without it all layers form one group. `num_blocks`: the engine's block count (vLLM:
    `kv_cache_config.num_blocks`); without it dim 0 of the first layer view sets it.
    """
    if not kv_caches:
        raise ValueError("no KV cache tensors to recognise: the dict is empty")
    if num_blocks is not None and (not isinstance(num_blocks, int) or isinstance(num_blocks, bool)
                                   or num_blocks <= 0):
        raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
    first = _check_one_storage(kv_caches)
    buffer = _storage_bytes(first)

    raw_entries = tuple(name for name, t in kv_caches.items() if t.dim() == 1)
    views, aliases = _deduplicate(kv_caches)
    if not views:
        return Recognition(buffer, num_blocks or 0, (), aliases, raw_entries, {}, None,
                           f"no layer views: all {len(raw_entries)} entries are the raw buffer")

    views, blocks = _regroup_blocks(views, num_blocks)
    geometry = {name: _geometry(name, t) for name, t in views.items()}
    layer_pages = {name: _pages(buffer, g, blocks) for name, g in geometry.items()}
    group_of = _group_of(geometry, aliases, cache_groups)
    chunks_or_reason = _block_chunks(buffer, geometry, group_of, blocks)
    chunks = chunks_or_reason if isinstance(chunks_or_reason, BlockChunks) else None
    reason = chunks_or_reason if isinstance(chunks_or_reason, str) else None
    return Recognition(buffer, blocks, tuple(views), aliases, raw_entries, layer_pages, chunks,
                       reason)


def _check_one_storage(kv_caches: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The first tensor; ValueError naming any entry that is not a view of its storage."""
    first_name, first = next(iter(kv_caches.items()))
    for name, t in kv_caches.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"layer {name!r}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0 or t.numel() == 0:
            raise ValueError(f"layer {name!r}: empty or 0-dim tensor of shape {tuple(t.shape)}")
        if (t.device != first.device
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            raise ValueError(
                f"layer {name!r} is not in the buffer of layer {first_name!r} "
                f"({t.device} storage at {t.untyped_storage().data_ptr():#x} vs {first.device} "
                f"storage at {first.untyped_storage().data_ptr():#x}): the tensors of one KV "
                f"cache must be views of one buffer")
    return first


def _deduplicate(kv_caches: Mapping[str, torch.Tensor]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Distinct layer views (raw entries left out), and each duplicate -> its first holder."""
    views: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    holder: dict[tuple, str] = {}
    for name, t in kv_caches.items():
        if t.dim() == 1:
            continue
        key = (t.storage_offset() * t.element_size(), tuple(t.shape),
               tuple(s * t.element_size() for s in t.stride()), t.dtype)
        if key in holder:
            aliases[name] = holder[key]
        else:
            holder[key] = name
            views[name] = t
    return views, aliases


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        storage, 0, (storage.nbytes(),), (1,))


def _regroup_blocks(views: dict[str, torch.Tensor],
                    num_blocks: int | None) -> tuple[dict[str, torch.Tensor], int]:
    """Check every layer has the same block count; regroup kernel blocks to whole blocks."""
    blocks = num_blocks if num_blocks is not None else next(iter(views.values())).shape[0]
    out: dict[str, torch.Tensor] = {}
    for name, t in views.items():
        count = t.shape[0]
        if count == blocks:
            out[name] = t
        elif num_blocks is not None and count % num_blocks == 0:
            # Kernel blocks of one block are uniformly strided, so this is a pure view.
            out[name] = t.unflatten(0, (num_blocks, count // num_blocks))
        else:
            raise ValueError(f"layer {name!r} has {count} blocks (dim 0 of shape "
                             f"{tuple(t.shape)}), expected {blocks}")
    return out, blocks


def _geometry(name: str, t: torch.Tensor) -> _Geometry:
    """Byte geometry of one layer view; ValueError when its elements overlap."""
    esize = t.element_size()
    if t.shape[0] > 1 and t.stride(0) == 0:
        raise ValueError(f"layer {name!r}: block dim has stride 0, every block is the same bytes")
    # Page dims in bytes, the element itself as the innermost dim, outermost first.
    dims = [(size, stride * esize)
            for size, stride in zip(t.shape[1:], t.stride()[1:], strict=True) if size > 1]
    dims.sort(key=lambda d: d[1], reverse=True)
    dims.append((esize, 1))
    extent = esize
    for size, stride in reversed(dims[:-1]):
        if stride < extent:
            raise ValueError(f"layer {name!r}: its elements overlap (shape {tuple(t.shape)}, "
                             f"strides {t.stride()} in {esize}-byte elements)")
        extent += (size - 1) * stride
    merged = [dims[-1]]  # innermost first while merging
    for size, stride in reversed(dims[:-1]):
        inner_size, inner_stride = merged[-1]
        if stride == inner_size * inner_stride:
            merged[-1] = (size * inner_size, inner_stride)
        else:
            merged.append((size, stride))
    merged.reverse()
    return _Geometry(offset=t.storage_offset() * esize, block_stride=t.stride(0) * esize,
                     outer=tuple(merged[:-1]), run_bytes=merged[-1][0])


def _pages(buffer: torch.Tensor, g: _Geometry, blocks: int) -> torch.Tensor:
    shape = (blocks, *(size for size, _ in g.outer), g.run_bytes)
    stride = (g.block_stride, *(s for _, s in g.outer), 1)
    return torch.as_strided(buffer, shape, stride, g.offset)


def _group_of(geometry: Mapping[str, _Geometry], aliases: Mapping[str, str],
              cache_groups: Sequence[Iterable[str]] | None) -> dict[str, int]:
    """Cache group index of every distinct layer (a shared layer may be listed under an alias)."""
    if cache_groups is None:
        return dict.fromkeys(geometry, 0)
    listed: dict[str, int] = {}
    for index, names in enumerate(cache_groups):
        for name in names:
            if name in listed and listed[name] != index:
                raise ValueError(f"layer {name!r} is in cache groups {listed[name]} and {index}")
            listed[name] = index
    groups: dict[str, int] = {}
    for name in geometry:
        names = [name] + [alias for alias, target in aliases.items() if target == name]
        found = [listed[n] for n in names if n in listed]
        if not found:
            raise ValueError(f"layer {name!r} is in no cache group of {len(listed)} listed layers")
        groups[name] = found[0]
    return groups


def _block_chunks(buffer: torch.Tensor, geometry: Mapping[str, _Geometry],
                  group_of: Mapping[str, int], blocks: int) -> BlockChunks | str:
    """The block chunks, or why block b of all layers is not one chunk."""
    names = list(geometry)
    lo = min(g.offset for g in geometry.values())
    hi = max(g.offset + g.span for g in geometry.values())
    if blocks > 1:
        reason = _not_one_chunk(geometry, hi - lo)
        if reason is not None:
            return reason
        stride = geometry[names[0]].block_stride
    else:
        stride = hi - lo  # one block: any order is one chunk
    runs = sorted((g.offset - lo + start, g.offset - lo + start + g.run_bytes, name)
                  for name, g in geometry.items() for start in g.run_starts())
    _check_no_overlap(runs, group_of)
    gaps: list[tuple[int, int]] = []
    covered = 0
    for start, end, _ in runs:
        if start > covered:
            gaps.append((covered, start))
        covered = max(covered, end)
    chunks = torch.as_strided(buffer, (blocks, hi - lo), (stride, 1), lo)
    offsets = {name: g.offset - lo for name, g in geometry.items()}
    return BlockChunks(chunks, hi - lo, stride, lo, offsets, tuple(gaps))


def _not_one_chunk(geometry: Mapping[str, _Geometry], extent: int) -> str | None:
    """Why consecutive blocks are not consecutive chunks; None when they are."""
    for name, g in geometry.items():
        if g.span > g.block_stride:
            return (f"blocks interleave: the page of block 0 of layer {name!r} spans "
                    f"{_size(g.span)} but its blocks are {_size(g.block_stride)} apart (a "
                    f"head-outer layout such as LHBNC); {BLOCK_MAJOR_HINT}")
    if extent > min(g.block_stride for g in geometry.values()):
        a, b = _pair_not_in_one_chunk(geometry)
        ga, gb = geometry[a], geometry[b]
        apart = abs(gb.offset - ga.offset)
        neighbours = [g for n, g in geometry.items()
                      if n != a and 0 < abs(g.offset - ga.offset) < ga.block_stride]
        if not neighbours:  # nothing sits between two blocks of layer a
            return (f"layer-major: layer {a!r} and layer {b!r} of block 0 are {_size(apart)} "
                    f"apart, blocks of one layer {_size(ga.block_stride)}; {BLOCK_MAJOR_HINT}")
        return (f"separate block grids: layer {a!r} and layer {b!r} of block 0 are "
                f"{_size(apart)} apart, farther than the {_size(ga.block_stride)} between "
                f"blocks, so one copy cannot move a block")
    strides = {name: g.block_stride for name, g in geometry.items()}
    first = next(iter(strides))
    for name, stride in strides.items():
        if stride != strides[first]:
            return (f"no uniform block stride: blocks of layer {first!r} are "
                    f"{strides[first]} B apart, blocks of layer {name!r} {stride} B")
    return None


def _pair_not_in_one_chunk(geometry: Mapping[str, _Geometry]) -> tuple[str, str]:
    """The first layer (dict order) with a partner that cannot share its chunk, and the nearest
    such partner."""
    items = list(geometry.items())
    for a, ga in items:
        far = [(abs(gb.offset - ga.offset), i, b) for i, (b, gb) in enumerate(items)
               if max(ga.offset + ga.span, gb.offset + gb.span) - min(ga.offset, gb.offset)
               > ga.block_stride]
        if far:
            return a, min(far)[2]
    raise AssertionError("extent exceeds the block stride, so some pair cannot share a chunk")


def _check_no_overlap(runs: list[tuple[int, int, str]], group_of: Mapping[str, int]) -> None:
    """ValueError when two layers of one cache group address the same bytes of a block."""
    reach: dict[int, tuple[int, str]] = {}  # group -> furthest end so far and its layer
    for start, end, name in runs:
        group = group_of[name]
        furthest, owner = reach.get(group, (0, name))
        if start < furthest:
            raise ValueError(f"layer {name!r} and layer {owner!r} overlap at byte {start} of "
                             f"every block; only layers of different cache groups may alias")
        if end > furthest:
            reach[group] = (end, name)


def _size(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024:
            return f"{num_bytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TB"
