"""The driver's batched copy call, cuMemcpyBatchAsync (CUDA >= 12.8), through ctypes.

The descriptor arrays go to the driver in place, as vLLM's C++ passes them: cuda-bindings'
cudaMemcpyBatchAsync converts every descriptor from a Python list (~1.3 us each on the H200, most
of a plain cudaMemcpyAsync call's ~2 us). Loaded on CUDA machines only (libcuda).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np


class MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes (cuda.h): source access order, source and destination location hints,
    flags."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_type", ctypes.c_int),
                ("src_loc_id", ctypes.c_int), ("dst_loc_type", ctypes.c_int),
                ("dst_loc_id", ctypes.c_int), ("flags", ctypes.c_uint)]


SRC_ORDER_STREAM, SRC_ORDER_ANY = 1, 3  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, _ANY
PREFER_OVERLAP_WITH_COMPUTE = 1  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE


def driver_batch_call(driver: ctypes.CDLL) -> Callable[..., int]:
    """`driver`'s (libcuda's) cuMemcpyBatchAsync, taking arguments in the CUDA 13 order."""
    ptr, count = ctypes.c_void_p, ctypes.c_size_t
    try:
        call = driver.cuMemcpyBatchAsync_v2  # CUDA 13 drivers
        call.argtypes = [ptr, ptr, ptr, count, ptr, ptr, count, ptr]
        call.restype = ctypes.c_int
        return call
    except AttributeError:  # CUDA 12.8-12.9 drivers: one more argument, the failing copy's index
        call = driver.cuMemcpyBatchAsync
        call.argtypes = [ptr, ptr, ptr, count, ptr, ptr, count, ptr, ptr]
        call.restype = ctypes.c_int
        # failIdx, per call (lanes issue from several threads); nothing reads it.
        return lambda *args: call(*args[:7], ctypes.byref(ctypes.c_size_t(0)), args[7])


class BatchCopy:
    """cuMemcpyBatchAsync with one set of attributes for every copy of a call (see module doc)."""

    def __init__(self, attrs: MemcpyAttributes, call: Callable[..., int] | None = None) -> None:
        self._call = call or driver_batch_call(ctypes.CDLL("libcuda.so.1"))
        self._attrs = attrs
        self._attrs_index = ctypes.c_size_t(0)  # every copy takes attrs[0]

    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int,
                 what: str = "") -> None:
        """Queue copy i (`sizes[i]` bytes, `srcs[i]` -> `dsts[i]`) on `stream` for every i; the
        arrays are contiguous int64. RuntimeError naming `what` (default: the copy count) and the
        CUresult if the driver refuses the call."""
        for array in (dsts, srcs, sizes):
            if array.dtype != np.int64 or not array.flags.c_contiguous:
                raise ValueError(f"descriptor arrays must be contiguous int64, got {array.dtype} "
                                 f"(contiguous: {array.flags.c_contiguous})")
        err = self._call(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes),
                         ctypes.byref(self._attrs), ctypes.byref(self._attrs_index), 1, stream)
        if err:
            raise RuntimeError(f"cuMemcpyBatchAsync of {what or f'{len(sizes)} copies'} failed: "
                               f"CUresult {err}")
