"""Wire protocol of the remote block store, version 1 (docs/protocol.md is the prose form).

A request or a reply is one zmq multipart message between a client DEALER and the store's ROUTER:
frame 0 is a msgpack map (the header), then one raw frame per block the message carries (put
requests, get replies). Every request carries a client-chosen id that its reply echoes, so a client
can keep several requests in flight and a reply to a forgotten request is recognised and dropped.

Every key is `namespace digest (16 B) + block hash bytes` (transfer.keys); a key-carrying header
also names the namespace, and every key must start with it. A block's checksum is xxh3-64 of its
bytes seeded with xxh3-64 of its key: it is computed once by the writer, checked by the store on
put and by the reader on get, and binds the bytes to their key, so a block served under another
key (another namespace included) fails the check.
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import msgpack

from transfer.keys import DIGEST_BYTES
from transfer.remote.backend import MAX_KEY_BYTES, BlockStatus

PROTOCOL_VERSION = 1
# ZMQ_MAXMSGSIZE counts a frame as it travels: CURVE wraps each frame in a larger MESSAGE command
FRAME_SLACK_BYTES = 4096
# what a frame costs on the wire beyond its bytes: ZMTP's flags and size (9 B), with CURVE a
# MESSAGE command's name, nonce and MAC (33 B more)
FRAME_OVERHEAD_BYTES = 64
_UINT64_LIMIT = 1 << 64


class Op(str, Enum):
    PUT = "put"
    GET = "get"
    LOOKUP = "lookup"
    EXISTS = "exists"
    DELETE = "delete"
    STATS = "stats"
    PING = "ping"


KEY_OPS = frozenset({Op.PUT, Op.GET, Op.LOOKUP, Op.EXISTS, Op.DELETE})
_OPS = {op.value: op for op in Op}


WIRE_STATUSES = frozenset(s.value for s in BlockStatus if s is not BlockStatus.FAILED)


class ErrorCode(str, Enum):
    """Why a whole request was refused; the reply's `error` says it in words."""

    MALFORMED = "malformed"  # not a msgpack map, a missing field or a field of the wrong type
    VERSION = "version"  # a protocol version the store does not speak
    NAMESPACE = "namespace"  # a key outside the header's namespace
    LIMIT = "limit"  # too many keys, a block or message too large
    FRAMES = "frames"  # the block frames do not match the keys
    SHARD = "shard"  # a key that another worker of the store holds
    INTERNAL = "internal"  # a store bug; never expected


@dataclass(frozen=True)
class Limits:
    """What one request may carry; the store refuses anything larger with ErrorCode.LIMIT."""

    max_block_bytes: int = 64 << 20
    max_batch_blocks: int = 4096
    max_message_bytes: int = 64 << 20  # the blocks of one put
    max_header_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("max_block_bytes", "max_batch_blocks", "max_message_bytes",
                     "max_header_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def max_frame_bytes(self) -> int:
        """Transport limit (ZMQ_MAXMSGSIZE): a peer sending a larger frame is disconnected."""
        return max(self.max_block_bytes, self.max_header_bytes) + FRAME_SLACK_BYTES

    @property
    def max_request_bytes(self) -> int:
        """The most a valid request puts on the wire: header, blocks and framing."""
        return (self.max_header_bytes + self.max_message_bytes
                + (self.max_batch_blocks + 1) * FRAME_OVERHEAD_BYTES)


@dataclass(frozen=True)
class Request:
    """A validated request header."""

    request_id: int
    op: Op
    namespace: bytes | None = None
    keys: tuple[bytes, ...] = ()
    sizes: tuple[int, ...] = ()
    checksums: tuple[int, ...] = ()


@dataclass(frozen=True)
class Reply:
    """A decoded reply header; `fields` holds the op-specific part (see docs/protocol.md)."""

    request_id: int | None
    ok: bool
    code: str = ""
    error: str = ""
    fields: dict[str, Any] = field(default_factory=dict)


class RequestError(Exception):
    """A request the store refuses as a whole; becomes an error reply."""

    def __init__(self, code: ErrorCode, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


class ProtocolError(Exception):
    """A reply that does not follow the protocol."""


# what an error reply or a log line quotes of a peer's value: a header may nest arrays ~1000 deep
# (repr raised RecursionError) or carry a 1 MiB field (quoted in full, 4 MiB of reply)
QUOTE_CHARS = 40


class _ShortRepr(reprlib.Repr):
    """reprlib's bounded repr, bytes cut before they are written out."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 2
        self.maxstring = self.maxother = QUOTE_CHARS
        self.maxlist = self.maxtuple = self.maxdict = 4

    def repr_bytes(self, value: bytes, level: int) -> str:
        if len(value) <= QUOTE_CHARS:
            return repr(value)
        return f"{value[:QUOTE_CHARS]!r}... ({len(value)} B)"

    def repr_ExtType(self, value: msgpack.ExtType, level: int) -> str:  # reprlib's naming
        return f"ExtType({value.code}, {self.repr_bytes(value.data, level)})"


_SHORT_REPR = _ShortRepr()


def quoted(value: Any) -> str:
    """A short repr of a peer's value (at most a few hundred characters, any nesting)."""
    return _SHORT_REPR.repr(value)


def _pack(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _unpack_map(raw: bytes | memoryview) -> dict[Any, Any] | None:
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException):  # msgpack's errors for bad input
        return None
    return obj if isinstance(obj, dict) else None


def _is_uint64(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _UINT64_LIMIT


def encode_request(request_id: int, op: Op, namespace: bytes | None = None,
                   keys: Sequence[bytes] = (), sizes: Sequence[int] = (),
                   checksums: Sequence[int] = ()) -> bytes:
    """The header frame of a request (put requests add `sizes` and `checksums`)."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": request_id, "op": op.value}
    if op in KEY_OPS:
        header["ns"] = namespace
        header["keys"] = list(keys)
    if op is Op.PUT:
        header["sizes"] = list(sizes)
        header["sums"] = list(checksums)
    return _pack(header)


def decode_request(raw: bytes | memoryview, limits: Limits) -> Request:
    """Validate a request header; RequestError (with the request id when one was readable)."""
    if len(raw) > limits.max_header_bytes:
        raise RequestError(ErrorCode.LIMIT, f"header of {len(raw)} B exceeds the "
                           f"{limits.max_header_bytes} B limit")
    header = _unpack_map(raw)
    if header is None:
        raise RequestError(ErrorCode.MALFORMED, "the header frame is not a msgpack map")
    request_id = header.get("id")
    request_id = request_id if _is_uint64(request_id) else None
    version = header.get("v")
    if not _is_uint64(version):
        raise RequestError(ErrorCode.MALFORMED, f"protocol version must be an unsigned int, "
                           f"got {quoted(version)}", request_id)
    if version != PROTOCOL_VERSION:
        raise RequestError(ErrorCode.VERSION, f"protocol version {version} is not supported; "
                           f"this store speaks version {PROTOCOL_VERSION}", request_id)
    if request_id is None:
        raise RequestError(ErrorCode.MALFORMED, f"request id must be an unsigned 64-bit int, "
                           f"got {quoted(header.get('id'))}")
    name = header.get("op")
    op = _OPS.get(name) if isinstance(name, str) else None  # (Op(x) writes out repr(x))
    if op is None:
        raise RequestError(ErrorCode.MALFORMED, f"unknown op {quoted(name)}; expected one "
                           f"of {list(_OPS)}", request_id)
    if op not in KEY_OPS:
        return Request(request_id, op)
    namespace, keys = _check_keys(header, limits, request_id)
    if op is not Op.PUT:
        return Request(request_id, op, namespace, keys)
    sizes = _check_uints(header, "sizes", len(keys), request_id)
    checksums = _check_uints(header, "sums", len(keys), request_id)
    for index, size in enumerate(sizes):
        if not 0 < size <= limits.max_block_bytes:
            raise RequestError(ErrorCode.LIMIT, f"block {index} declares {size} B; blocks are "
                               f"1..{limits.max_block_bytes} B", request_id)
    if sum(sizes) > limits.max_message_bytes:
        raise RequestError(ErrorCode.LIMIT, f"put carries {sum(sizes)} B; the limit is "
                           f"{limits.max_message_bytes} B per message", request_id)
    return Request(request_id, op, namespace, keys, sizes, checksums)


def _check_keys(header: dict[Any, Any], limits: Limits,
                request_id: int) -> tuple[bytes, tuple[bytes, ...]]:
    namespace = header.get("ns")
    if not isinstance(namespace, bytes) or len(namespace) != DIGEST_BYTES:
        raise RequestError(ErrorCode.MALFORMED, f"namespace must be {DIGEST_BYTES} bytes, got "
                           f"{quoted(namespace)}", request_id)
    keys = header.get("keys")
    if not isinstance(keys, list):
        raise RequestError(ErrorCode.MALFORMED, f"keys must be a list, got {type(keys).__name__}",
                           request_id)
    if len(keys) > limits.max_batch_blocks:
        raise RequestError(ErrorCode.LIMIT, f"{len(keys)} keys in one request; the limit is "
                           f"{limits.max_batch_blocks}", request_id)
    for index, key in enumerate(keys):
        if not isinstance(key, bytes) or not DIGEST_BYTES < len(key) <= MAX_KEY_BYTES:
            raise RequestError(ErrorCode.MALFORMED, f"key {index} must be {DIGEST_BYTES + 1}.."
                               f"{MAX_KEY_BYTES} bytes, got {quoted(key)}", request_id)
        if key[:DIGEST_BYTES] != namespace:
            raise RequestError(ErrorCode.NAMESPACE, f"key {index} ({key.hex()}) is not in the "
                               f"request's namespace {namespace.hex()}", request_id)
    return namespace, tuple(keys)


def _check_uints(header: dict[Any, Any], name: str, count: int,
                 request_id: int) -> tuple[int, ...]:
    values = header.get(name)
    if (not isinstance(values, list) or len(values) != count
            or not all(_is_uint64(v) for v in values)):
        raise RequestError(ErrorCode.MALFORMED, f"{name} must be a list of {count} unsigned "
                           f"64-bit ints, got {quoted(values)}", request_id)
    return tuple(values)


def encode_reply(request_id: int, **fields: Any) -> bytes:
    """A success reply header with op-specific fields."""
    return _pack({"v": PROTOCOL_VERSION, "id": request_id, "ok": True, **fields})


def encode_error(request_id: int | None, code: ErrorCode, message: str) -> bytes:
    """An error reply header; `request_id` is None when the request's id was unreadable."""
    return _pack({"v": PROTOCOL_VERSION, "id": request_id, "ok": False, "code": code.value,
                  "error": message})


def decode_reply(raw: bytes | memoryview) -> Reply:
    """Parse a reply header; ProtocolError if it is not one."""
    header = _unpack_map(raw)
    if header is None:
        raise ProtocolError("reply header is not a msgpack map")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"reply speaks protocol version {quoted(header.get('v'))}, "
                            f"not {PROTOCOL_VERSION}")
    request_id, ok = header.pop("id", None), header.pop("ok", None)
    if not (request_id is None or _is_uint64(request_id)) or not isinstance(ok, bool):
        raise ProtocolError(f"reply id {quoted(request_id)} / ok {quoted(ok)} malformed")
    if ok:
        return Reply(request_id, True, fields=header)
    code, error = header.get("code"), header.get("error")
    if not isinstance(code, str) or not isinstance(error, str):
        raise ProtocolError(f"error reply without code/error strings: {quoted(header)}")
    return Reply(request_id, False, code, error)


def reply_statuses(reply: Reply, count: int) -> list[BlockStatus]:
    """The per-block statuses of a put or get reply."""
    statuses = reply.fields.get("status")
    if (not isinstance(statuses, list) or len(statuses) != count
            or not all(isinstance(s, str) and s in WIRE_STATUSES for s in statuses)):
        raise ProtocolError(f"reply status must be {count} of {sorted(WIRE_STATUSES)}, "
                            f"got {quoted(statuses)}")
    return [BlockStatus(s) for s in statuses]


def reply_uints(reply: Reply, name: str, count: int) -> list[int]:
    """A list of `count` unsigned ints from a reply (get sizes and checksums)."""
    values = reply.fields.get(name)
    if not isinstance(values, list) or len(values) != count or not all(map(_is_uint64, values)):
        raise ProtocolError(f"reply {name} must be {count} unsigned ints, got {quoted(values)}")
    return values


def reply_bools(reply: Reply, name: str, count: int) -> list[bool]:
    values = reply.fields.get(name)
    if (not isinstance(values, list) or len(values) != count
            or not all(isinstance(v, bool) for v in values)):
        raise ProtocolError(f"reply {name} must be {count} bools, got {quoted(values)}")
    return values


def reply_count(reply: Reply, name: str, upper: int) -> int:
    value = reply.fields.get(name)
    if not _is_uint64(value) or value > upper:
        raise ProtocolError(f"reply {name} must be an int in 0..{upper}, got {quoted(value)}")
    return value
