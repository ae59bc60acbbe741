"""Layout descriptor: where every byte of a paged KV cache lives.

A physical layout is a permutation of the axes L (layer), B (block), H (kv head), N (token in the
block) and C (content), named as vLLM names them. Block-outermost orders (BLNHC, BLHNC, BHLNC) keep
block b of every layer in one contiguous chunk, so one copy moves a whole block; layer-major orders
(LBHNC, LBNHC, LHBNC) are what engines use by default and are kept for comparison and fallback.

K/V forms:
- PACKED: vLLM >= 0.32, K|V packed in the content axis, C = 2 * head_size;
- SPLIT: a separate K/V plane of size 2, placed just inside the layer axis; C = head_size;
- MLA: one latent per token, H = 1, C = head_size (latent + rope), no V.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

import torch

BLOCK_MAJOR_ORDERS = ("BLNHC", "BLHNC", "BHLNC")
LAYER_MAJOR_ORDERS = ("LBHNC", "LBNHC", "LHBNC")
ALL_ORDERS = BLOCK_MAJOR_ORDERS + LAYER_MAJOR_ORDERS

GPU_ALIGNMENT = 256
HOST_ALIGNMENT = 4096

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in SUPPORTED_DTYPES.items()}
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32", "fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
            "float8_e5m2": "fp8_e5m2"}


class KVForm(str, Enum):
    PACKED = "packed"
    SPLIT = "split"
    MLA = "mla"


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Return the torch dtype for a name or dtype; ValueError naming anything unsupported."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported KV dtype {dtype}; supported: {sorted(SUPPORTED_DTYPES)}")
        return dtype
    name = _ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; supported: {sorted(SUPPORTED_DTYPES)}")
    return SUPPORTED_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class KVLayout:
    """Shape, K/V form and physical order of a paged KV cache; computes every offset and stride.

    All strides returned are in elements of `dtype`; byte figures say so in their names.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype = torch.bfloat16
    form: KVForm = KVForm.PACKED
    order: str = "BLNHC"
    alignment: int = GPU_ALIGNMENT

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size", "alignment"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        object.__setattr__(self, "form", KVForm(self.form))
        if self.order not in ALL_ORDERS:
            raise ValueError(f"unknown physical order {self.order!r}; known: {ALL_ORDERS}")
        if self.form is KVForm.MLA and self.num_kv_heads != 1:
            raise ValueError(f"an MLA cache has one latent head, "
                             f"got num_kv_heads={self.num_kv_heads}")
        if self.alignment & (self.alignment - 1) or self.alignment % self.element_size:
            raise ValueError(f"alignment must be a power of two >= the element size, "
                             f"got {self.alignment}")

    # -- sizes -------------------------------------------------------------------------------
    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def content_size(self) -> int:
        """C: elements per (token, head) row in one K/V plane."""
        return 2 * self.head_size if self.form is KVForm.PACKED else self.head_size

    @property
    def kv_planes(self) -> int:
        return 2 if self.form is KVForm.SPLIT else 1

    @property
    def page_elements(self) -> int:
        """Elements of one layer's share of one block."""
        return self.kv_planes * self.num_kv_heads * self.block_size * self.content_size

    @property
    def page_bytes(self) -> int:
        return self.page_elements * self.element_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers (what one block copy moves)."""
        return self.num_layers * self.page_bytes

    @property
    def is_block_major(self) -> bool:
        return self.order[0] == "B"

    @property
    def block_stride_bytes(self) -> int:
        """Distance between consecutive blocks: an aligned chunk when block-major, else a page."""
        if self.is_block_major:
            return round_up(self.block_bytes, self.alignment)
        return self.page_bytes

    def buffer_bytes(self, num_blocks: int) -> int:
        _check_positive("num_blocks", num_blocks)
        if self.is_block_major:
            return num_blocks * self.block_stride_bytes
        return num_blocks * self.block_bytes

    def blocks_in(self, budget_bytes: int) -> int:
        """How many blocks a byte budget holds."""
        _check_positive("budget_bytes", budget_bytes)
        per_block = self.block_stride_bytes if self.is_block_major else self.block_bytes
        return budget_bytes // per_block

    def with_order(self, order: str) -> KVLayout:
        return replace(self, order=order)

    def with_alignment(self, alignment: int) -> KVLayout:
        return replace(self, alignment=alignment)

    # -- strides -----------------------------------------------------------------------------
    def axis_sizes(self, num_blocks: int) -> dict[str, int]:
        return {"L": self.num_layers, "B": num_blocks, "H": self.num_kv_heads,
                "N": self.block_size, "C": self.content_size, "K": self.kv_planes}

    def physical_axes(self) -> str:
        """The order with the K/V plane axis (SPLIT only) placed just inside the layer axis."""
        if self.form is not KVForm.SPLIT:
            return self.order
        at = self.order.index("L") + 1
        return self.order[:at] + "K" + self.order[at:]

    def axis_strides(self, num_blocks: int) -> dict[str, int]:
        """Element stride of every logical axis (L, B, H, N, C, K) in the buffer."""
        _check_positive("num_blocks", num_blocks)
        sizes = self.axis_sizes(num_blocks)
        strides: dict[str, int] = {"K": 0}
        running = 1
        for axis in reversed(self.physical_axes()):
            if axis == "B" and self.is_block_major:
                running = self.block_stride_bytes // self.element_size
            strides[axis] = running
            running *= sizes[axis]
        return strides

    def layer_offset(self, layer: int, num_blocks: int) -> int:
        """Element offset of (layer, block 0, head 0, token 0, content 0) from the buffer start."""
        self.check_layer(layer)
        return layer * self.axis_strides(num_blocks)["L"]

    def check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer!r} out of range for {self.num_layers} layers")

    def describe(self) -> str:
        return (f"{self.order} {self.form.value} {dtype_name(self.dtype)} L={self.num_layers} "
                f"H={self.num_kv_heads} D={self.head_size} N={self.block_size} "
                f"page={self.page_bytes} B block={self.block_bytes} B")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")

