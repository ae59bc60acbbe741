"""The shared pool's local channel: msgpack messages over a unix stream socket.

A request is `[verb, *args]`, answered by `[True, result]` or `[False, "why"]`. A notice (a verb
in NOTICES) gets no answer: completions and removals are sent as they happen and applied in
order before the next request, so a step's completions cost no round trip. msgpack frames the
stream itself (an Unpacker yields whole messages).

Access: the socket's directory is 0700 and the socket 0600, and the daemon refuses a peer whose
uid (SO_PEERCRED) is not its own.
"""

from __future__ import annotations

import os
import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

HELLO = "hello"  # (namespace digests, bytes of a slot each block uses) -> PoolInfo fields
LOOKUP = "lookup"  # (keys) -> length of the stored prefix
PREPARE_STORES = "prepare_stores"  # (key lists) -> per list: StorePlan's fields, in order
PREPARE_LOAD = "prepare_load"  # (keys) -> [slots, checksums (block_sums)], all pinned; None when
#                                one is not stored
CHECKSUMS = "checksums"  # (keys) -> per key: the checksums it was committed with, or None
STATS = "stats"  # () -> dict
COMPLETE_STORE = "complete_store"  # notice (keys, ok flags, per key its checksums: block_sums)
COMPLETE_LOAD = "complete_load"  # notice (keys)
DISCARD = "discard"  # notice (keys): drop the ones held
CLEAR = "clear"  # notice (): drop every key of this client's namespaces
REQUESTS = (HELLO, LOOKUP, PREPARE_STORES, PREPARE_LOAD, CHECKSUMS, STATS)
NOTICES = (COMPLETE_STORE, COMPLETE_LOAD, DISCARD, CLEAR)

MAX_MESSAGE_BYTES = 64 << 20  # a step's keys are far smaller; a bigger message is an attack
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class PoolInfo:
    """What a client learns at hello: where the slots are and how big."""

    segment: str  # the shared-memory name (/dev/shm), new for every daemon start
    num_slots: int
    slot_bytes: int

    def as_list(self) -> list[object]:
        return [self.segment, self.num_slots, self.slot_bytes]


def block_sums(by_rank: list[list[int]], blocks: int) -> list[list[int]]:
    """A commit's checksums, per block, from each rank's list: the xxh3-64 of every rank's part
    (its first `blocks` entries), then every rank's row sum (transfer/copy/row_sums.py) where
    every rank took them (its next `blocks`). The daemon keeps the lists as they are."""
    host = [list(s) for s in zip(*(sums[:blocks] for sums in by_rank), strict=True)]
    if all(len(sums) == 2 * blocks for sums in by_rank):
        rows = zip(*(sums[blocks:] for sums in by_rank), strict=True)
        return [h + list(r) for h, r in zip(host, rows, strict=True)]
    return host


def split_sums(sums: list[int], ranks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A block's committed checksums (`block_sums`) of an engine of `ranks` ranks -> (per-rank
    xxh3-64s, per-rank row sums or ())."""
    return tuple(sums[:ranks]), tuple(sums[ranks:2 * ranks]) if len(sums) == 2 * ranks else ()


def check_name(name: str) -> str:
    """A pool name: letters, digits, '_', '.', '-' (it names a socket and a segment)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"pool name must be 1-64 of [A-Za-z0-9_.-] starting with a letter or "
                         f"digit, got {name!r}")
    return name


def socket_dir() -> Path:
    """Where this user's pool sockets live: $XDG_RUNTIME_DIR/kvconnector, else
    /tmp/kvconnector-UID."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "kvconnector"
    return Path(f"/tmp/kvconnector-{os.geteuid()}")


def socket_path(name: str, directory: Path | None = None) -> Path:
    return (directory or socket_dir()) / f"pool-{check_name(name)}.sock"


def segment_prefix(name: str) -> str:
    """Every segment of pool `name` starts with this (a restart makes a new one)."""
    return f"kvconnector-pool-{check_name(name)}-"


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return _PEERCRED.unpack(raw)[1]


def check_peer(uid: int, owner: int) -> None:
    """PermissionError unless the peer runs as the pool's owner."""
    if uid != owner:
        raise PermissionError(f"uid {uid} may not use this pool: it belongs to uid {owner}")
