"""Allocator: one buffer per cache, on a GPU, in (pinned) host memory or in named shared memory.

Two kinds of buffer: a `KVBuffer` holds a cache whose `KVLayout` gives its bytes meaning; a
`SlotBuffer` holds `num_slots` slots of a byte size and nothing else (a host pool's slots, whose
bytes mean what the GPU cache says; the bench's arenas). Block-major layouts put block b of every
layer in one aligned chunk, and slots are aligned the same way (>= 256 B on GPU, a page on the
host), so one copy moves a whole block. Host memory comes from mmap (page-aligned); it is touched
by torch's multi-threaded fill, never page by page from Python, and pinned with cudaHostRegister in
block-aligned chunks from several threads (faster than torch's pin_memory, which is one serial
cudaHostAlloc).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack
import torch

from kvconnector.layout.descriptor import (
    GPU_ALIGNMENT,
    HOST_ALIGNMENT,
    KVLayout,
    _check_positive,
    dtype_name,
    round_up,
)
from kvconnector.layout.views import ViewKind, layer_view

SHM_DIR = "/dev/shm"
# cudaHostRegister granularity: big enough to amortise a call, small enough to spread on threads.
_PIN_CHUNK_BYTES = 1 << 30
_HEADER_MAGIC = "kvconnector-buffer-v1"
_SLOTS_MAGIC = "kvconnector-slots-v1"


@dataclass
class KVBuffer:
    """One allocated cache buffer and the layout that gives its bytes meaning."""

    layout: KVLayout
    num_blocks: int
    raw: torch.Tensor  # 1-D uint8 over exactly layout.buffer_bytes(num_blocks) bytes
    pinned: bool = False
    shared_name: str | None = None
    _host: _HostMemory | None = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def block_chunks(self) -> torch.Tensor:
        """(num_blocks, block_bytes) uint8 view: row b is block b of every layer, one copy."""
        if not self.layout.is_block_major:
            raise ValueError(f"order {self.layout.order} is layer-major: a block is not one chunk")
        return torch.as_strided(self.raw, (self.num_blocks, self.layout.block_bytes),
                                (self.layout.block_stride_bytes, 1), self.raw.storage_offset())

    def layer_view(self, layer: int, kind: ViewKind | str = ViewKind.VLLM) -> torch.Tensor:
        return layer_view(self.raw, self.layout, self.num_blocks, layer, kind)

    def layer_views(self, kind: ViewKind | str = ViewKind.VLLM) -> list[torch.Tensor]:
        return [self.layer_view(i, kind) for i in range(self.layout.num_layers)]

    def close(self, unlink: bool = False) -> None:
        """Release host memory (unpinning it first); `unlink` removes the shared-memory name."""
        _release(self._host, self.shared_name, unlink)
        self._host = None


@dataclass
class SlotBuffer:
    """`num_slots` slots of `slot_bytes` each, `stride` bytes apart (aligned): no layout.

    A host pool's slots hold blocks of whatever layout the GPU cache has; only their size counts.
    """

    num_slots: int
    slot_bytes: int
    stride: int  # slot_bytes rounded up to the alignment: slot s starts at s * stride
    raw: torch.Tensor  # 1-D uint8 over exactly num_slots * stride bytes
    pinned: bool = False
    shared_name: str | None = None
    _host: _HostMemory | None = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def rows(self) -> torch.Tensor:
        """(num_slots, slot_bytes) uint8 view: row s is slot s."""
        return torch.as_strided(self.raw, (self.num_slots, self.slot_bytes), (self.stride, 1),
                                self.raw.storage_offset())

    def close(self, unlink: bool = False) -> None:
        """Release host memory (unpinning it first); `unlink` removes the shared-memory name."""
        _release(self._host, self.shared_name, unlink)
        self._host = None


def slot_stride(slot_bytes: int, device: str | torch.device = "cpu") -> int:
    """Bytes from one slot to the next: `slot_bytes` rounded up to a page on the host (to 256 B
    on a GPU), so every slot starts aligned."""
    _check_positive("slot_bytes", slot_bytes)
    return round_up(slot_bytes, _alignment(torch.device(device)))


def slots_in(budget_bytes: int, slot_bytes: int, device: str | torch.device = "cpu") -> int:
    """How many slots of `slot_bytes` a byte budget holds (0 when not one)."""
    _check_positive("budget_bytes", budget_bytes)
    return budget_bytes // slot_stride(slot_bytes, device)


def allocate_slots(num_slots: int, slot_bytes: int, *, device: str | torch.device = "cpu",
                   pinned: bool = False, shared_name: str | None = None) -> SlotBuffer:
    """Allocate `num_slots` zeroed, aligned slots of `slot_bytes` each.

    device "cuda[:i]" gives GPU memory; "cpu" gives host memory, pinned if asked (needs CUDA) and
    in named shared memory (/dev/shm) if `shared_name` is given, so a second process can
    `attach_slots`.
    """
    _check_positive("num_slots", num_slots)
    device = torch.device(device)
    stride = slot_stride(slot_bytes, device)
    _check_host_options(device, pinned, shared_name)
    nbytes = num_slots * stride
    if device.type == "cuda":
        raw = _aligned_gpu_bytes(nbytes, device)
        raw.zero_()
        return SlotBuffer(num_slots, slot_bytes, stride, raw)
    host = _HostMemory.create(nbytes, shared_name)
    host.touch()
    if shared_name is not None:
        _write_fields(host, [_SLOTS_MAGIC, num_slots, slot_bytes, stride])
    if pinned:
        host.pin(_pin_chunk(stride))
    return SlotBuffer(num_slots, slot_bytes, stride, host.tensor, pinned, shared_name, host)


def attach_slots(shared_name: str, *, pinned: bool = False) -> SlotBuffer:
    """Map the slots another process allocated with `shared_name` (their count and size come
    from the creator's header page), registered with CUDA here if `pinned`."""
    host = _HostMemory.open(shared_name)
    try:
        magic, num_slots, slot_bytes, stride = _read_fields(host)
        if magic != _SLOTS_MAGIC:
            raise ValueError(magic)
    except Exception as exc:
        host.release()
        raise ValueError(f"{shared_name!r} in {SHM_DIR} is not a kvconnector slot buffer") from exc
    if host.size != num_slots * stride or stride < slot_bytes:
        host.release()
        raise ValueError(f"shared buffer {shared_name!r} is {host.size} B; its header says "
                         f"{num_slots} slots of {slot_bytes} B, {stride} B apart")
    if pinned:
        host.pin(_pin_chunk(stride))
    return SlotBuffer(num_slots, slot_bytes, stride, host.tensor, pinned, shared_name, host)


def allocate(layout: KVLayout, *, num_blocks: int | None = None, budget_bytes: int | None = None,
             device: str | torch.device = "cpu", pinned: bool = False,
             shared_name: str | None = None) -> KVBuffer:
    """Allocate a zeroed buffer for `num_blocks` blocks, or as many as `budget_bytes` holds.

    device "cuda[:i]" gives GPU memory; "cpu" gives host memory, pinned if asked (needs CUDA) and
    in named shared memory (/dev/shm) if `shared_name` is given, so a second process can `attach`.
    """
    device = torch.device(device)
    if (num_blocks is None) == (budget_bytes is None):
        raise ValueError(f"give exactly one of num_blocks ({num_blocks!r}) and budget_bytes "
                         f"({budget_bytes!r})")
    on_gpu = device.type == "cuda"
    _check_host_options(device, pinned, shared_name)
    layout = layout.with_alignment(max(layout.alignment, _alignment(device)))
    if num_blocks is None:
        num_blocks = layout.blocks_in(budget_bytes)  # type: ignore[arg-type]
        if num_blocks == 0:
            raise ValueError(f"budget_bytes {budget_bytes} holds no block of "
                             f"{layout.block_stride_bytes} B ({layout.describe()})")
    nbytes = layout.buffer_bytes(num_blocks)
    if on_gpu:
        raw = _aligned_gpu_bytes(nbytes, device)
        raw.zero_()
        return KVBuffer(layout, num_blocks, raw)
    host = _HostMemory.create(nbytes, shared_name)
    host.touch()
    if shared_name is not None:
        _write_header(host, layout, num_blocks)
    if pinned:
        host.pin(_pin_chunk(_block_step(layout)))
    return KVBuffer(layout, num_blocks, host.tensor, pinned, shared_name, host)


def attach(shared_name: str, layout: KVLayout | None = None, *,
           pinned: bool = False) -> KVBuffer:
    """Map a buffer another process allocated with `shared_name`.

    The creator wrote its layout and block count into a header page; `layout`, when given, must
    match it (a second process reading the bytes with another layout would read garbage).
    """
    host = _HostMemory.open(shared_name)
    found, num_blocks = _read_header(host, shared_name)
    if layout is not None and layout.with_alignment(found.alignment) != found:
        host.release()
        raise ValueError(f"shared buffer {shared_name!r} holds {found.describe()}, "
                         f"not {layout.describe()}")
    if pinned:
        host.pin(_pin_chunk(_block_step(found)))
    return KVBuffer(found, num_blocks, host.tensor, pinned, shared_name, host)


def _write_header(host: _HostMemory, layout: KVLayout, num_blocks: int) -> None:
    _write_fields(host, [_HEADER_MAGIC, layout.num_layers, layout.num_kv_heads, layout.head_size,
                         layout.block_size, dtype_name(layout.dtype), layout.form.value,
                         layout.order, layout.alignment, num_blocks])


def _write_fields(host: _HostMemory, fields: list[object]) -> None:
    packed = msgpack.packb(fields)
    host.header[: len(packed)].copy_(torch.frombuffer(bytearray(packed), dtype=torch.uint8))


def _read_fields(host: _HostMemory) -> list[object]:
    unpacker = msgpack.Unpacker(max_buffer_size=HOST_ALIGNMENT)
    unpacker.feed(host.header.numpy().tobytes())  # msgpack stops at the object's end
    return next(unpacker)


def _read_header(host: _HostMemory, shared_name: str) -> tuple[KVLayout, int]:
    try:
        fields = _read_fields(host)
        magic, layers, heads, head_size, block_size, dtype, form, order, align, blocks = fields
        if magic != _HEADER_MAGIC:
            raise ValueError(magic)
        layout = KVLayout(layers, heads, head_size, block_size, dtype, form, order, align)
    except Exception as exc:
        host.release()
        raise ValueError(f"{shared_name!r} in {SHM_DIR} is not a kvconnector buffer") from exc
    if host.size != layout.buffer_bytes(blocks):
        host.release()
        raise ValueError(f"shared buffer {shared_name!r} is {host.size} B; its header says "
                         f"{blocks} blocks of {layout.describe()}")
    return layout, blocks


def unlink_shared(shared_name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_shm_path(shared_name))


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


class _HostMemory:
    """Page-aligned host bytes from mmap (anonymous or a /dev/shm file), optionally pinned."""

    def __init__(self, mm: mmap.mmap, size: int, offset: int = 0) -> None:
        self.mm = mm
        self.size = size
        whole = torch.frombuffer(mm, dtype=torch.uint8, count=offset + size)
        self.base_ptr = whole.data_ptr()  # an empty header slice would report 0
        self.header = whole[:offset]  # shared buffers: layout and block count, one page
        self.tensor = whole[offset:]
        self.pinned_ranges: list[tuple[int, int]] = []

    @classmethod
    def create(cls, size: int, shared_name: str | None) -> _HostMemory:
        if shared_name is None:
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                mm.madvise(mmap.MADV_HUGEPAGE)  # fewer pages to fault in and to pin
            return cls(mm, size)
        free = shm_free_bytes()
        if free < HOST_ALIGNMENT + size:
            raise ValueError(f"{SHM_DIR} has {free / 2**30:.2f} GiB free; shared buffer "
                             f"{shared_name!r} needs {size / 2**30:.2f} GiB: enlarge /dev/shm "
                             f"(docker --shm-size) or give a smaller budget")
        fd = os.open(_shm_path(shared_name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # fallocate reserves tmpfs pages now, so a full /dev/shm fails here, not at a SIGBUS.
            os.posix_fallocate(fd, 0, HOST_ALIGNMENT + size)
            mm = mmap.mmap(fd, HOST_ALIGNMENT + size, flags=mmap.MAP_SHARED)
        except OSError as exc:
            os.close(fd)
            unlink_shared(shared_name)
            raise ValueError(f"cannot create shared buffer {shared_name!r} of {size} B in "
                             f"{SHM_DIR}: {exc}") from exc
        os.close(fd)
        return cls(mm, size, HOST_ALIGNMENT)

    @classmethod
    def open(cls, shared_name: str) -> _HostMemory:
        try:
            fd = os.open(_shm_path(shared_name), os.O_RDWR)
        except FileNotFoundError as exc:
            raise ValueError(f"no shared buffer named {shared_name!r} in {SHM_DIR}") from exc
        try:
            size = os.fstat(fd).st_size
            if size <= HOST_ALIGNMENT:
                raise ValueError(f"{shared_name!r} in {SHM_DIR} is not a kvconnector buffer")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return cls(mm, size - HOST_ALIGNMENT, HOST_ALIGNMENT)

    def touch(self) -> None:
        # torch's fill is multi-threaded: the first touch of every page runs in parallel.
        self.tensor.zero_()

    def pin(self, chunk: int) -> None:
        cudart = torch.cuda.cudart()
        # Ranges cover whole blocks of the data; the first also takes the header page, so the
        # storage's base (what torch's is_pinned checks) is registered too.
        base = self.base_ptr
        head = self.header.numel()
        ends = [*range(head + chunk, head + self.size, chunk), head + self.size]
        ranges = [(start, end - start) for start, end in zip([0, *ends[:-1]], ends, strict=True)]

        def register(r: tuple[int, int]) -> int:
            return int(cudart.cudaHostRegister(base + r[0], r[1], 0))

        with ThreadPoolExecutor(max_workers=min(16, len(ranges))) as pool:
            errors = list(pool.map(register, ranges))
        self.pinned_ranges = [r for r, err in zip(ranges, errors, strict=True) if err == 0]
        if any(errors):
            self.unpin()
            failed = next(r for r, err in zip(ranges, errors, strict=True) if err)
            raise RuntimeError(f"cudaHostRegister of {failed[1]} B failed (error "
                               f"{max(errors)}); nothing is left pinned")

    def unpin(self) -> None:
        cudart = torch.cuda.cudart()
        for off, _ in self.pinned_ranges:
            cudart.cudaHostUnregister(self.base_ptr + off)
        self.pinned_ranges = []

    def release(self) -> None:
        if self.pinned_ranges:
            self.unpin()
        del self.tensor, self.header
        # Views still alive elsewhere keep the mapping; it goes with the last of them.
        with contextlib.suppress(BufferError):
            self.mm.close()


def _block_step(layout: KVLayout) -> int:
    """Bytes a block spans: its aligned chunk when block-major, else its pages' sum."""
    return layout.block_stride_bytes if layout.is_block_major else layout.block_bytes


def _pin_chunk(per_block: int) -> int:
    # Whole blocks per registered range: a copy never straddles two registrations.
    return max(1, _PIN_CHUNK_BYTES // per_block) * per_block


def _alignment(device: torch.device) -> int:
    return GPU_ALIGNMENT if device.type == "cuda" else HOST_ALIGNMENT


def _check_host_options(device: torch.device, pinned: bool, shared_name: str | None) -> None:
    if device.type == "cuda" and (pinned or shared_name):
        raise ValueError(f"pinned/shared memory is host memory; device {device} is a GPU")
    if pinned and not torch.cuda.is_available():
        raise ValueError("pinned=True needs CUDA; this machine has none")


def _release(host: _HostMemory | None, shared_name: str | None, unlink: bool) -> None:
    if host is not None:
        host.release()
    if unlink and shared_name is not None:
        unlink_shared(shared_name)


def _aligned_gpu_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    buf = torch.empty(nbytes + GPU_ALIGNMENT, dtype=torch.uint8, device=device)
    skip = -buf.data_ptr() % GPU_ALIGNMENT
    return buf[skip: skip + nbytes]


def _shm_path(shared_name: str) -> str:
    if not shared_name or "/" in shared_name or shared_name.startswith("."):
        raise ValueError(f"shared memory name must be a plain file name, got {shared_name!r}")
    return os.path.join(SHM_DIR, shared_name)
