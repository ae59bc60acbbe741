"""Bytes changed in another process's memory, as a bit flip in a server's RAM would: the only way
to damage a block a store (or a Redis node) checked when it was put (the tier contract tests,
the remote tier's engine tests)."""

from __future__ import annotations

import os


def flip_in_process(pid: int, block: bytes) -> int:
    """Flip one byte of every copy of `block` in the writable memory of process `pid` (as a bit
    flip in the server's RAM would); returns the copies changed."""
    changed = 0
    with open(f"/proc/{pid}/maps") as maps:
        regions = [line.split()[:2] for line in maps]
    fd = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    try:
        for span, perms in regions:
            if not perms.startswith("rw"):
                continue
            low, high = (int(x, 16) for x in span.split("-"))
            try:
                memory = os.pread(fd, high - low, low)
            except OSError:
                continue  # a region gone or unreadable since the maps were read
            at = memory.find(block)
            while at >= 0:
                middle = low + at + len(block) // 2
                os.pwrite(fd, bytes([memory[at + len(block) // 2] ^ 0x01]), middle)
                changed += 1
                at = memory.find(block, at + 1)
    finally:
        os.close(fd)
    return changed
