"""What a put or get returns: each block's status and error text, from the store's replies,
the client's own checks and the requests that got no usable reply."""

from __future__ import annotations

from typing import Any

from transfer.checksums import block_checksum
from transfer.remote.backend import BlockStatus, TransferResult
from transfer.remote.store.connection import Exchange

STORE_STATUS_TEXT = {
    BlockStatus.MISSING: "the store does not hold this key",
    BlockStatus.CORRUPT: "the store found the bytes do not match their checksum",
    BlockStatus.SIZE: "the store received a frame of another size than declared",
    BlockStatus.FULL: "the store has no room that is not pinned by sends",
}


def failed(count: int, error: str) -> TransferResult:
    return TransferResult((BlockStatus.FAILED,) * count, (error,) * count, ())


def checked(row: Any, key: bytes, checksum: int) -> tuple[BlockStatus, str]:
    """A received block's status: OK only where its bytes match the checksum sent with it."""
    if block_checksum(row, key) == checksum:
        return BlockStatus.OK, ""
    return BlockStatus.CORRUPT, "the bytes received do not match their checksum"


def result(requests: list[Exchange], statuses: list[BlockStatus], errors: list[str],
            pinned: tuple[int, ...]) -> TransferResult:
    for request in requests:
        for index in request.indices if request.error else ():
            statuses[index], errors[index] = BlockStatus.FAILED, request.error
    errors = ["" if s is BlockStatus.OK else e for s, e in zip(statuses, errors, strict=True)]
    return TransferResult(tuple(statuses), tuple(errors), pinned)
