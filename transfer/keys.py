"""Namespaced block keys.

A block hash only means something inside its namespace: the same prompt hashes to the same key in
another model, dtype, block size, byte layout or TP rank, where the bytes differ. Every key the
index, the pool and the remote store handle is `namespace digest (16 B) + block hash bytes`.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from functools import cached_property

import msgpack
import xxhash

DIGEST_BYTES = 16


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two equal block hashes to mean equal bytes."""

    model: str
    dtype: str
    block_size: int
    block_layout: str  # the byte layout of one block, e.g. KVLayout.describe()
    tp_rank: int = 0
    tp_size: int = 1
    hash_algo: str = "sha256"
    hash_seed: str = ""
    salt: str = ""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank!r} out of range for tp_size {self.tp_size!r}")

    @cached_property
    def digest(self) -> bytes:  # once: every key of the namespace starts with it
        return xxhash.xxh3_128_digest(msgpack.packb(astuple(self)))

    def key(self, block_hash: bytes | int) -> bytes:
        """The namespaced key of one block hash (bytes as vLLM gives them, or an int)."""
        return self.digest + block_hash_bytes(block_hash)

    def keys(self, block_hashes: list[bytes] | list[int]) -> list[bytes]:
        digest = self.digest
        return [digest + block_hash_bytes(h) for h in block_hashes]

    def owns(self, key: bytes) -> bool:
        return key[:DIGEST_BYTES] == self.digest


def block_hash_bytes(block_hash: bytes | int) -> bytes:
    if type(block_hash) is bytes:  # vLLM's hashes: no union isinstance on the per-key path
        return block_hash
    if isinstance(block_hash, bytes | bytearray | memoryview):
        return bytes(block_hash)
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        return block_hash.to_bytes(16, "little", signed=True)
    raise ValueError(f"a block hash is bytes or int, got {type(block_hash).__name__}: "
                     f"{block_hash!r}")
