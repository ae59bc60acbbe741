"""The shared pool's local channel: msgpack messages over a unix stream socket.

A request is `[verb, *args]`, answered by `[True, result]` or `[False, "why"]`. A notice (a verb
in NOTICES) gets no answer: completions and removals are sent as they happen and applied in
order before the next request, so a step's completions cost no round trip. msgpack frames the
stream itself (an Unpacker yields whole messages).

Access: the socket's directory is 0700 and the socket 0600, and the daemon refuses a peer whose
uid (SO_PEERCRED) is not its own.

Limits: the daemon reads a request (`read_request`) only once its whole frame is there and at
most MAX_REQUEST_BYTES long; a frame is msgpack arrays, byte strings, strings, ints, bools and
nil, at most MAX_DEPTH arrays deep (no maps, no extension types), a verb of this module and
the arguments it takes. Every error text quotes a bad value by `brief`: its type, size and a
short prefix, never the whole of it.
"""

from __future__ import annotations

import os
import re
import socket
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import msgpack

from transfer.checksums import all_uint64

HELLO = "hello"  # (namespace digests, bytes of a slot each block uses) -> PoolInfo fields
LOOKUP = "lookup"  # (keys) -> length of the stored prefix
PREPARE_STORES = "prepare_stores"  # (key lists) -> per list: StorePlan's first five fields,
#                                    in order, then the evicted keys' checksums (None: another
#                                    client's namespace's, not hashed yet, or past
#                                    MAX_EVICTED_SUMS), then whether a block committed by row
#                                    sums must get its xxh3s (StorePlan.hash_later)
PREPARE_LOAD = "prepare_load"  # (keys) -> [slots, checksums (block_sums)], all pinned; None when
#                                one is not stored
CHECKSUMS = "checksums"  # (keys) -> per key: the checksums it was committed with, or None
CHANGES = "changes"  # (sequence number, -1: all) -> [next sequence number, whether it is the
#                      whole list, [[stored, key], ...] of the client's namespaces] (KV events)
STATS = "stats"  # () -> dict
ADD_SUMS = "add_sums"  # (keys, per key its xxh3s then its committed row sums (nil xxh3s: drop
#                        it), per key the slot it was committed in) -> per key whether applied
#                        (blocks this client committed with row sums only)
READS = "reads"  # notice (by row sums, needs xxh3s): how this client checks its loads, and
#                  whether it needs blocks' xxh3s (it reads by xxh3, or keeps blocks below)
COMPLETE_STORE = "complete_store"  # notice (keys, ok flags, per key its checksums: block_sums)
COMMIT_ROW_SUMS = "commit_row_sums"  # notice (slots, row sums, ranks): a GPU writer's usual
#                                      commit, by the slots its plan gave (pack_row_sums_commit)
COMPLETE_LOAD = "complete_load"  # notice (keys)
DISCARD = "discard"  # notice (keys): drop the ones held
CLEAR = "clear"  # notice (): drop every key of this client's namespaces
REQUESTS = (HELLO, LOOKUP, PREPARE_STORES, PREPARE_LOAD, CHECKSUMS, STATS, CHANGES, ADD_SUMS)
NOTICES = (COMPLETE_STORE, COMMIT_ROW_SUMS, COMPLETE_LOAD, DISCARD, CLEAR, READS)

ARGUMENTS = {HELLO: 2, LOOKUP: 1, PREPARE_STORES: 1, PREPARE_LOAD: 1, CHECKSUMS: 1, STATS: 0,
             CHANGES: 1, ADD_SUMS: 3,
             COMPLETE_STORE: 3, COMMIT_ROW_SUMS: 3, COMPLETE_LOAD: 1, DISCARD: 1, CLEAR: 0,
             READS: 2}  # each verb's count

MAX_MESSAGE_BYTES = 64 << 20  # the largest answer a client reads
# The largest request the daemon reads: a prompt's keys (~50 B each: 160,000 keys, 2.6M tokens
# at 16 a block) or a step's commit fit many times over. Unpacked, a request's objects take up
# to ~36x its bytes (a tuple of uncached ints), one request at a time.
MAX_REQUEST_BYTES = 8 << 20
MAX_BLOCK_SUMS = 128  # per block: an xxh3-64 and a row sum for each of up to 64 ranks
MAX_KEY_BYTES = 256  # a key: a 16-byte namespace digest + a block hash (vLLM's: 32 B)
MAX_DEPTH = 3  # arrays in arrays: [verb, [[key, ...], ...]], [verb, keys, flags, [[sum, ...]]]
MAX_ARRAY_ITEMS = 1 << 19  # keys of one request: over 3x what MAX_REQUEST_BYTES holds
MAX_VERB_CHARS = 64
QUOTE_CHARS = 64  # what an error text quotes of a bad value
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


def brief(value: object) -> str:
    """A bad value for an error text or a log line: at most QUOTE_CHARS of it, with its type and
    size, never its whole repr (a client's value may be megabytes, or nested 1,000 deep)."""
    if value is None or isinstance(value, bool | float) or (
            isinstance(value, int) and -(1 << 64) < value < 1 << 64):
        return repr(value)
    if isinstance(value, str):
        if len(value) <= QUOTE_CHARS:
            return repr(value)
        return f"{value[:QUOTE_CHARS]!r}... (a str of {len(value)} chars)"
    if isinstance(value, bytes | bytearray):
        shown = bytes(value[:QUOTE_CHARS // 2]).hex()
        more = "..." if len(value) > QUOTE_CHARS // 2 else ""
        return f"{len(value)} bytes {shown}{more}"
    if isinstance(value, list | tuple | dict | set | frozenset):
        return f"an array of {len(value)} items" if isinstance(value, list | tuple) else \
            f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def clip(text: str, limit: int = 4 * QUOTE_CHARS) -> str:
    """`text` (an exception's, for a reply or a log line) cut to `limit` chars."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def read_request(frame: bytes, max_bytes: int = MAX_REQUEST_BYTES
                 ) -> tuple[str, tuple[Any, ...]]:
    """One whole request frame -> (verb, its arguments); ValueError naming what is wrong (see
    module doc). Arrays come as tuples."""
    if len(frame) > max_bytes:
        raise ValueError(f"a request of {len(frame)} B is over the limit of {max_bytes} B")
    try:
        message = msgpack.unpackb(
            frame, use_list=False, raw=False, object_hook=_no_map,
            ext_hook=_no_extension, max_str_len=MAX_VERB_CHARS, max_bin_len=max_bytes,
            max_array_len=MAX_ARRAY_ITEMS, max_map_len=0, max_ext_len=0)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # StackError: > 1024 deep
        raise ValueError(f"not a request: {clip(str(exc) or type(exc).__name__)}") from None
    if isinstance(message, tuple):
        _check_depth(message)
    if not isinstance(message, tuple) or not message or not isinstance(message[0], str):
        raise ValueError(f"a request is an array [verb, *arguments], got {brief(message)}")
    verb, args = message[0], message[1:]
    if verb not in ARGUMENTS:
        raise ValueError(f"unknown verb {brief(verb)}")
    if len(args) != ARGUMENTS[verb]:
        raise ValueError(f"{verb} takes {ARGUMENTS[verb]} arguments, got {len(args)}")
    return verb, args


def pack_row_sums_commit(slots: Sequence[int], sums: Sequence[Sequence[int | None] | None]
                         ) -> list[Any] | None:
    """COMMIT_ROW_SUMS's arguments for a GPU writer's usual commit (every block ok, each with nil
    xxh3s then as many row sums, all with the same ranks) of blocks placed in `slots`: the
    slots as little-endian uint32s, the row sums as little-endian uint64s (slot by slot, each
    slot's ranks in turn), the ranks. The daemon, which applies every engine's commits on one
    thread, then neither unpacks nor checks a key or an int a block (docs/pool.md). None for any
    other commit: it goes as COMPLETE_STORE, a list a key."""
    columns = _row_sum_columns(sums) if len(slots) == len(sums) else None
    if columns is None:
        return None
    ranks = len(columns)
    rows = columns[0] if ranks == 1 else list(chain.from_iterable(zip(*columns, strict=True)))
    if set(map(type, rows)) != {int}:  # struct.pack would take a bool as 1
        return None
    try:
        return [struct.pack(f"<{len(slots)}I", *slots), struct.pack(f"<{len(rows)}Q", *rows),
                ranks]
    except struct.error:  # a value past a uint64, a slot past a uint32: a list a key
        return None


def read_row_sums_commit(slots: object, row_sums: object, ranks: object, num_slots: int
                         ) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """COMMIT_ROW_SUMS's arguments as (slots, row sums, ranks), checked whole: ValueError naming
    what is wrong (a slot past the pool's `num_slots` or named twice, row sums that are not
    `ranks` uint64s a slot)."""
    if type(ranks) is not int or not 0 < ranks <= MAX_BLOCK_SUMS // 2:
        raise ValueError(f"a commit by row sums has 1 to {MAX_BLOCK_SUMS // 2} ranks a block, "
                         f"got {brief(ranks)}")
    if type(slots) is not bytes or not slots or len(slots) % 4:
        raise ValueError(f"a commit by row sums names its slots as uint32s, got {brief(slots)}")
    count = len(slots) // 4
    if type(row_sums) is not bytes or len(row_sums) != 8 * ranks * count:
        raise ValueError(f"a commit by row sums of {count} slots at {ranks} ranks sends "
                         f"{8 * ranks * count} B of row sums, got {brief(row_sums)}")
    at = struct.unpack(f"<{count}I", slots)
    if max(at) >= num_slots:
        raise ValueError(f"slot {max(at)} is not one of the pool's {num_slots}")
    if len(set(at)) != count:
        twice = next(slot for slot, times in Counter(at).items() if times > 1)
        raise ValueError(f"slot {twice} is named twice in one commit")
    return at, struct.unpack(f"<{count * ranks}Q", row_sums), ranks


def every_stored(flags: Sequence[object]) -> bool:
    """Whether every ok flag of a commit says stored: each the bool True (a 1 is no flag)."""
    return flags.count(True) == len(flags) and set(map(type, flags)) == {bool}


def row_sums_only_commit(sums: Sequence[object]) -> bool:
    """Whether every list of a commit is a valid commit by row sums only with the same number
    of ranks (a GPU writer's): checked a column at a time, in C. False says nothing about
    validity: the daemon checks each list then (transfer/shared/index.py `_check_sums`)."""
    columns = _row_sum_columns(sums)
    return columns is not None and all(map(all_uint64, columns))


def _row_sum_columns(sums: Sequence[object]) -> list[tuple[object, ...]] | None:
    """Each rank's row sums across a commit's lists, where every list is nil xxh3s then as many
    values, all with the same ranks; else None (the values themselves unchecked)."""
    if not sums or not set(map(type, sums)) <= {list, tuple}:
        return None
    lengths = set(map(len, sums))  # type: ignore[arg-type]
    if len(lengths) != 1:
        return None
    (length,) = lengths
    if length % 2 or not 0 < length <= MAX_BLOCK_SUMS:
        return None
    columns = list(zip(*sums, strict=True))  # type: ignore[call-overload]
    ranks = length // 2
    try:
        if not all(set(column) == {None} for column in columns[:ranks]):
            return None
    except TypeError:  # an unhashable value where a nil belongs: the per-key check names it
        return None
    return columns[ranks:]


def _check_depth(message: tuple[Any, ...]) -> None:
    """ValueError when arrays nest deeper than MAX_DEPTH (checked without recursion)."""
    level, depth = [message], 1
    while level:
        inner = [item for array in level for item in array if type(item) is tuple]
        if inner and depth == MAX_DEPTH:
            raise ValueError(f"arrays nested deeper than {MAX_DEPTH}: no request has those")
        level, depth = inner, depth + 1


def _no_map(_: object) -> None:
    raise ValueError("a map: no request has one")


def _no_extension(code: int, _: bytes) -> None:
    raise ValueError(f"an extension type ({code}): no request has one")


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
    return peer_credentials(sock)[1]


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def check_peer(uid: int, owner: int) -> None:
    """PermissionError unless the peer runs as the pool's owner."""
    if uid != owner:
        raise PermissionError(f"uid {uid} may not use this pool: it belongs to uid {owner}")
