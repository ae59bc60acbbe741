"""What a Redis node's reply means for one block: a put's status, a key's answer, an error's text.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import AskError, MovedError, ResponseError, TryAgainError

from transfer.remote.backend import BlockStatus
from transfer.remote.redis.values import holds_block

REDIRECTS = (MovedError, AskError, TryAgainError)  # the slot moved: refresh the map and redo
REDIRECT_TEXT = "redirected: "


def put_status(reply: Any) -> tuple[BlockStatus, str]:
    if reply is True:
        return BlockStatus.OK, ""
    if isinstance(reply, REDIRECTS):
        return BlockStatus.FAILED, describe(reply)
    if isinstance(reply, ResponseError) and str(reply).startswith("OOM"):
        return BlockStatus.FULL, f"the node has no room: {reply}"
    return BlockStatus.FAILED, describe(reply) if isinstance(reply, Exception) else \
        f"unexpected reply {reply!r:.80}"


def key_answer(verb: str, reply: Any, length: Any, key: bytes, block_bytes: int) -> bool | str:
    """A key's answer to `held` (`length`: the value's STRLEN) or `delete`: True/False, or why
    there is none."""
    if verb == "held" and isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE"):
        return False  # not a string: not ours
    if isinstance(reply, Exception):
        return describe(reply)
    if verb != "held":
        return reply == 1
    return describe(length) if isinstance(length, Exception) else \
        holds_block(reply, length, key, block_bytes)


def describe(error: Any) -> str:
    if isinstance(error, REDIRECTS):
        return f"{REDIRECT_TEXT}{type(error).__name__} {error}"
    return f"{type(error).__name__}: {error}"
