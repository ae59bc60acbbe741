"""Layer-view factory: zero-copy per-layer tensors, in the shape each attention backend reads.

Every view is `torch.as_strided` over the one buffer, so its block stride is the block-major chunk
stride (about num_layers x page), never page size. Kernels that compute page addresses as
block x page size instead of reading stride(block) read another layer through such a view; the
backend registry records which kernels read strides.

Stride rules applied to every view (docs/design.md, "Views, and the stride rules"):
- stride(-1) == 1 and content rows never overlap (every other non-size-1 stride >= row length);
- size-1 dims get their canonical stride (zero-copy; no address changes);
- non-outermost strides are multiples of 16 bytes (TMA); the base is 16-byte aligned.
"""

from __future__ import annotations

from enum import Enum

import torch

from kvconnector.layout.descriptor import KVForm, KVLayout

TMA_ALIGNMENT = 16


class ViewKind(str, Enum):
    """Logical per-layer shapes. D is head_size; C is the packed content (2 * head_size)."""

    VLLM = "vllm"  # [B, H, N, C]: vLLM >= 0.32, K|V packed in C (MLA: H = 1, C = latent + rope)
    FLASH_ATTN = "flash_attn"  # (2, B, N, H, D)
    FLASHINFER_NHD = "flashinfer_nhd"  # (B, 2, N, H, D)
    FLASHINFER_HND = "flashinfer_hnd"  # (B, 2, H, N, D)
    MLA = "mla"  # (B, N, D)


# View axes: K = the K/V selector (size 2), D = one head's content, C = packed content.
_VIEW_AXES: dict[ViewKind, str] = {
    ViewKind.VLLM: "BHNC",
    ViewKind.FLASH_ATTN: "KBNHD",
    ViewKind.FLASHINFER_NHD: "BKNHD",
    ViewKind.FLASHINFER_HND: "BKHND",
    ViewKind.MLA: "BND",
}


def view_axes(kind: ViewKind | str) -> str:
    return _VIEW_AXES[ViewKind(kind)]


def layer_view(raw: torch.Tensor, layout: KVLayout, num_blocks: int, layer: int,
               kind: ViewKind | str = ViewKind.VLLM) -> torch.Tensor:
    """The view of `layer` in the shape `kind`, over `raw`, the buffer's 1-D uint8 tensor."""
    kind = ViewKind(kind)
    layout.check_layer(layer)
    _check_raw(raw, layout, num_blocks)
    axes = _VIEW_AXES[kind]
    _check_form(layout, kind)
    strides = layout.axis_strides(num_blocks)
    sizes = layout.axis_sizes(num_blocks)
    # The K/V selector steps over a plane (SPLIT) or over head_size within packed content.
    kv_stride = strides["K"] if layout.form is KVForm.SPLIT else layout.head_size
    dims = {
        "B": (sizes["B"], strides["B"]),
        "H": (sizes["H"], strides["H"]),
        "N": (sizes["N"], strides["N"]),
        "C": (sizes["C"], strides["C"]),
        "D": (layout.head_size, strides["C"]),
        "K": (2, kv_stride),
    }
    shape = [dims[a][0] for a in axes]
    stride = canonical_strides(shape, [dims[a][1] for a in axes])
    typed = raw[: layout.buffer_bytes(num_blocks)].view(layout.dtype)
    view = torch.as_strided(typed, shape, stride,
                            typed.storage_offset() + layout.layer_offset(layer, num_blocks))
    check_kernel_strides(view, axes, what=f"layer {layer} {kind.value} view ({layout.order})")
    return view


def layer_views(raw: torch.Tensor, layout: KVLayout, num_blocks: int,
                kind: ViewKind | str = ViewKind.VLLM) -> list[torch.Tensor]:
    return [layer_view(raw, layout, num_blocks, i, kind) for i in range(layout.num_layers)]


def canonical_strides(shape: list[int], stride: list[int]) -> list[int]:
    """Rewrite strides of size-1 dims to the canonical value (inner size x inner stride).

    A size-1 dim is never stepped across, so this changes no address; it keeps TMA, which
    checks every non-outermost stride, from rejecting an arbitrary value there.
    """
    out = list(stride)
    for i in range(len(shape) - 1, -1, -1):
        if shape[i] == 1:
            out[i] = 1 if i == len(shape) - 1 else out[i + 1] * shape[i + 1]
    return out


def canonicalize_size1_strides(t: torch.Tensor) -> torch.Tensor:
    """Zero-copy: the same tensor with size-1 strides rewritten to their canonical values."""
    return torch.as_strided(t, t.shape, canonical_strides(list(t.shape), list(t.stride())),
                            t.storage_offset())


def check_kernel_strides(t: torch.Tensor, axes: str | None = None, what: str = "tensor") -> None:
    """Raise ValueError, naming the dim, when `t` breaks a stride rule real kernels impose."""
    names = axes or "".join(str(i) for i in range(t.dim()))
    esize = t.element_size()
    shape, stride = list(t.shape), list(t.stride())
    if stride[-1] != 1:
        raise ValueError(f"{what}: innermost dim {names[-1]!r} has stride {stride[-1]}, not 1")
    row = shape[-1]
    for i in range(t.dim() - 1):
        if shape[i] > 1 and stride[i] < row:
            raise ValueError(f"{what}: dim {i} ({names[i]!r}) has stride {stride[i]} < row "
                             f"length {row}: content rows overlap")
        if i > 0 and stride[i] * esize % TMA_ALIGNMENT:
            raise ValueError(f"{what}: dim {i} ({names[i]!r}) has stride {stride[i] * esize} B, "
                             f"not a multiple of {TMA_ALIGNMENT} B (TMA rejects it)")
    if t.data_ptr() % TMA_ALIGNMENT:
        raise ValueError(f"{what}: base address {t.data_ptr():#x} is not "
                         f"{TMA_ALIGNMENT}-byte aligned")


def _check_form(layout: KVLayout, kind: ViewKind) -> None:
    if kind is ViewKind.MLA and layout.form is not KVForm.MLA:
        raise ValueError(f"view {kind.value!r} needs an MLA layout, got form {layout.form.value!r}")
    if kind is ViewKind.VLLM and layout.form is KVForm.SPLIT:
        raise ValueError("view 'vllm' packs K|V in content; a SPLIT layout keeps them in planes")
    if "K" in _VIEW_AXES[kind] and layout.form is KVForm.MLA:
        raise ValueError(f"view {kind.value!r} has a K/V axis; an MLA cache has no V")


def _check_raw(raw: torch.Tensor, layout: KVLayout, num_blocks: int) -> None:
    if raw.dtype != torch.uint8 or raw.dim() != 1 or not raw.is_contiguous():
        raise ValueError(f"raw buffer must be a contiguous 1-D uint8 tensor, got "
                         f"{raw.dtype} shape {tuple(raw.shape)}")
    need = layout.buffer_bytes(num_blocks)
    if raw.numel() < need:
        raise ValueError(f"raw buffer has {raw.numel()} bytes; {num_blocks} blocks of "
                         f"{layout.describe()} need {need}")
