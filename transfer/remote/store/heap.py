"""Keep the memory of received blocks in the process: no page faults per block received.

zmq receives each block frame into a buffer it mallocs (one per message), and a put's or get's
blocks come and go by the gigabyte. With glibc's default, buffers of a few MiB are mmapped or
carved from per-thread heaps that are handed back to the kernel as soon as they are free, so
the next block's buffer is fresh memory: a page fault per 4 KiB page, and the kernel zeroing it,
on the zmq IO thread that is the stream's limit. Measured on the 2-core development VM, 2 MiB
blocks on loopback: 88-340 faults per block received by a client's get, 263 by the store's
put; 0-53 and 6-16 with freed memory kept, and the CPU per GiB of the client's IO thread (gets)
and of the store (puts) fell by a third to a half (docs/benchmarks.md, "One client: lanes
across workers, received memory, checks on the lane").

`keep_received_memory()` makes glibc serve every allocation up to MMAP_THRESHOLD_BYTES from its
heaps and keep up to TRIM_THRESHOLD_BYTES of free memory at a heap's top instead of returning
it. The cost: a process keeps up to that much freed memory per heap after a transfer, reused by
the next (a thread's heap that is wholly free is still returned).
It is process-wide and set once by the processes that receive blocks: a StoreClient with a pool,
a store server, the raw baseline; elsewhere (not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import platform
import threading

# mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2): blocks up to it come from heaps
MMAP_THRESHOLD_BYTES = 32 << 20
# a heap's free top kept (a thread's heap is at most 64 MiB, dropped whole once free)
TRIM_THRESHOLD_BYTES = 64 << 20
_lock = threading.Lock()
_applied: bool | None = None  # None: not tried yet


def keep_received_memory() -> bool:
    """Set glibc's thresholds (once per process); False where the C library is not glibc or
    refused them."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _set_thresholds()
        return _applied


def _set_thresholds() -> bool:
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the process's own symbols: glibc's mallopt among them
    # mallopt returns 1 on success; either threshold alone leaves the faults (setting one turns
    # off glibc's own adjustment of the other)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
