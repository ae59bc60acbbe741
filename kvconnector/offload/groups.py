"""KV cache groups as the scheduler core sees them (vLLM's hybrid manager: full attention, sliding
window and state groups drawing block ids from one pool, their layers sharing one set of
buffers).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache group as the scheduler sees it.

    `prefix`: bytes before the block hash in its keys (b"" when it is the only group);
    `window`: a sliding window group's window in tokens (None: full attention, every block of a
    prefix is needed to resume it); `state`: a state group (Mamba, short convolutions, linear
    attention in vLLM's "align" cache mode): its block at a block boundary holds the state there,
    so resuming a prefix needs that one block, the one at the prefix's last position.
    """

    prefix: bytes = b""
    window: int | None = None
    state: bool = False


def window_blocks(window: int, block_size: int) -> int:
    """Blocks a sliding window group keeps before a prefix end: vLLM frees the block table's
    first (P * block_size - window + 1) // block_size blocks of a P-block prefix."""
    return -(-(window - 1) // block_size)
