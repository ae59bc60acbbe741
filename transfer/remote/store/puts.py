"""Checking a put's blocks against their checksums before the store keeps them.

A large put's checksums are checked on worker threads (xxhash releases the GIL), its blocks in
parallel, while the serving thread goes on receiving (inline on a machine with no core to spare
for them; see DEFAULT_VERIFY_THREADS). Puts leave `ready()` in arrival order once checked, so
a block is never stored (or served) before its bytes have matched their checksum.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass

import zmq

from transfer.checksums import block_checksum
from transfer.remote.store.protocol import Request

log = logging.getLogger(__name__)

# Puts carrying at least this many bytes are checked on the worker threads, one task per thread;
# smaller ones inline, where hashing them costs less than a thread hop.
VERIFY_INLINE_BYTES = 1 << 20
# Cores beyond the serving thread and zmq's IO thread check several clients' puts at once (four
# at most). With none to spare (2 cores) puts are checked inline: there thread hand-offs only
# add CPU, and CPU per byte is what a busy 2-core machine's throughput is (docs/benchmarks.md).
DEFAULT_VERIFY_THREADS = max(0, min(4, (os.cpu_count() or 1) - 2))


@dataclass(eq=False)
class PendingPut:
    """A put whose checksums are being checked; ready once `remaining` is 0."""

    identity: bytes
    request: Request
    blocks: list[zmq.Frame]
    valid: list[bool | None]  # per block: bytes match the checksum; None: not checked
    remaining: int = 0  # verifier tasks still running
    failed: bool = False  # a verifier task raised: the put gets an internal error


class PutChecker:
    """The serving thread's puts being checked, on `threads` threads (0: inline)."""

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[PendingPut] = deque()  # in arrival order
        self._done_lock = threading.Lock()
        self._wake_read = self._wake_write = -1

    def start(self) -> int:
        """Start the threads; returns a descriptor that turns readable when a put is ready."""
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        if self._threads:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="kvconnector-verify")
        return self._wake_read

    def close(self) -> None:
        """Stop the threads; puts still being checked are dropped unanswered."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        os.close(self._wake_read)
        os.close(self._wake_write)

    def drain_wakeups(self) -> None:
        with suppress(BlockingIOError):
            while os.read(self._wake_read, 4096):
                pass

    def submit(self, identity: bytes, request: Request, blocks: list[zmq.Frame],
               held: Callable[[bytes], bool]) -> None:
        """Check the blocks of a put whose frames match its keys; blocks of keys already
        `held` (and frames of another size than declared) are left unchecked."""
        pending = PendingPut(identity, request, blocks, [None] * len(blocks))
        todo = [i for i, (key, size, frame) in enumerate(zip(request.keys, request.sizes, blocks,
                                                             strict=True))
                if frame.buffer.nbytes == size and not held(key)]
        todo.reverse()  # the last blocks received are the likeliest still in cache
        if self._pool is None or sum(request.sizes[i] for i in todo) < VERIFY_INLINE_BYTES:
            _check(pending, todo)
        else:  # a task per thread, not per block: fewer hand-offs and wake-ups
            tasks = [todo[i::self._threads] for i in range(self._threads)]
            tasks = [task for task in tasks if task]
            pending.remaining = len(tasks)
            for task in tasks:
                self._pool.submit(self._verify, pending, task)
        self._pending.append(pending)

    def ready(self) -> Iterator[PendingPut]:
        """The checked puts at the head of the queue, in arrival order."""
        while self._pending and self._pending[0].remaining == 0:
            yield self._pending.popleft()

    def _verify(self, pending: PendingPut, indices: list[int]) -> None:
        """A verifier task: check some blocks of a put; the last task of a put wakes the loop."""
        try:
            _check(pending, indices)
        except BaseException:
            pending.failed = True
            log.exception("internal error checking a put's blocks")
        finally:
            with self._done_lock:
                pending.remaining -= 1
                finished = pending.remaining == 0
            if finished:
                with suppress(BlockingIOError):  # the pipe is full of wake-ups already
                    os.write(self._wake_write, b"\0")


def _check(pending: PendingPut, indices: list[int]) -> None:
    request = pending.request
    for index in indices:
        key = request.keys[index]
        pending.valid[index] = (block_checksum(pending.blocks[index].buffer, key)
                                == request.checksums[index])
