"""Protocol headers: what the store accepts, what it refuses and with which code."""

from __future__ import annotations

import msgpack
import pytest

from kvconnector.cli.units import parse_size
from transfer.checksums import block_checksum
from transfer.keys import Namespace
from transfer.remote.backend import BlockStatus
from transfer.remote.store.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Limits,
    Op,
    ProtocolError,
    RequestError,
    decode_reply,
    decode_request,
    encode_error,
    encode_reply,
    encode_request,
    reply_statuses,
)

NS = Namespace("model-a", "bfloat16", 16, "BLNHC")
LIMITS = Limits(max_block_bytes=1024, max_batch_blocks=8, max_message_bytes=4096,
                max_header_bytes=4096)


def _put_header(**overrides: object) -> bytes:
    header = {"v": PROTOCOL_VERSION, "id": 7, "op": "put", "ns": NS.digest,
              "keys": NS.keys([1, 2]), "sizes": [1024, 1024], "sums": [1, 2]}
    header.update(overrides)
    return msgpack.packb(header, use_bin_type=True)


def _refusal(raw: bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        decode_request(raw, LIMITS)
    return info.value


def test_put_request_round_trips() -> None:
    keys = NS.keys([b"\x01" * 32, b"\x02" * 32])
    raw = encode_request(41, Op.PUT, NS.digest, keys, [100, 200], [5, 2**64 - 1])
    request = decode_request(raw, LIMITS)
    assert (request.request_id, request.op, request.namespace) == (41, Op.PUT, NS.digest)
    assert request.keys == tuple(keys)
    assert request.sizes == (100, 200)
    assert request.checksums == (5, 2**64 - 1)


def test_stats_and_ping_need_no_namespace() -> None:
    for op in (Op.STATS, Op.PING):
        request = decode_request(encode_request(3, op), LIMITS)
        assert (request.op, request.namespace, request.keys) == (op, None, ())


@pytest.mark.parametrize(("raw", "code", "request_id"), [
    (b"\xc1", ErrorCode.MALFORMED, None),  # not msgpack
    (msgpack.packb([1, 2, 3]), ErrorCode.MALFORMED, None),  # not a map
    (_put_header(v=2), ErrorCode.VERSION, 7),
    (_put_header(v="1"), ErrorCode.MALFORMED, 7),
    (_put_header(id=-1), ErrorCode.MALFORMED, None),
    (_put_header(id=1.0), ErrorCode.MALFORMED, None),
    (_put_header(op="steal"), ErrorCode.MALFORMED, 7),
    (_put_header(ns=b"short"), ErrorCode.MALFORMED, 7),
    (_put_header(keys="k"), ErrorCode.MALFORMED, 7),
    (_put_header(keys=[NS.digest]), ErrorCode.MALFORMED, 7),  # a digest without a hash
    (_put_header(keys=[NS.digest + b"x" * 300]), ErrorCode.MALFORMED, 7),
    (_put_header(keys=Namespace("model-b", "bfloat16", 16, "BLNHC").keys([1, 2])),
     ErrorCode.NAMESPACE, 7),
    (_put_header(sizes=[1024]), ErrorCode.MALFORMED, 7),
    (_put_header(sizes=[1024, True]), ErrorCode.MALFORMED, 7),
    (_put_header(sums=[1, -2]), ErrorCode.MALFORMED, 7),
    (_put_header(sums=[1, 2.0]), ErrorCode.MALFORMED, 7),
    (_put_header(sizes=[1024, 1025]), ErrorCode.LIMIT, 7),
    (_put_header(sizes=[0, 1]), ErrorCode.LIMIT, 7),
    (_put_header(keys=NS.keys(list(range(9))), sizes=[1] * 9, sums=[0] * 9), ErrorCode.LIMIT, 7),
    (b"\x90" * 5000, ErrorCode.LIMIT, None),  # header over max_header_bytes
])
def test_bad_requests_are_refused_with_their_code(raw: bytes, code: ErrorCode,
                                                  request_id: int | None) -> None:
    error = _refusal(raw)
    assert error.code is code
    assert error.request_id == request_id


def test_message_byte_limit() -> None:
    keys = NS.keys(list(range(5)))
    raw = encode_request(1, Op.PUT, NS.digest, keys, [1000] * 5, [0] * 5)
    error = _refusal(raw)
    assert error.code is ErrorCode.LIMIT
    assert "5000" in str(error)


def test_error_message_names_the_bad_value() -> None:
    assert "steal" in str(_refusal(_put_header(op="steal")))
    assert "version 2" in str(_refusal(_put_header(v=2)))


def test_checksum_binds_bytes_to_key() -> None:
    block = bytes(range(256)) * 4
    key_a, key_b = NS.keys([1, 2])
    assert block_checksum(block, key_a) == block_checksum(bytearray(block), key_a)
    assert block_checksum(block, key_a) != block_checksum(block, key_b)
    flipped = bytearray(block)
    flipped[513] ^= 0x10
    assert block_checksum(flipped, key_a) != block_checksum(block, key_a)


def test_replies_decode() -> None:
    reply = decode_reply(encode_reply(9, status=["ok", "missing"]))
    assert (reply.request_id, reply.ok) == (9, True)
    assert reply_statuses(reply, 2) == [BlockStatus.OK, BlockStatus.MISSING]
    error = decode_reply(encode_error(None, ErrorCode.LIMIT, "too big"))
    assert (error.request_id, error.ok, error.code, error.error) == (None, False, "limit",
                                                                     "too big")


@pytest.mark.parametrize("raw", [
    b"\xc1",
    msgpack.packb({"v": 2, "id": 1, "ok": True}),
    msgpack.packb({"v": 1, "id": "x", "ok": True}),
    msgpack.packb({"v": 1, "id": 1, "ok": False}),  # an error without code and message
])
def test_malformed_replies_raise(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_reply(raw)


def test_reply_statuses_checks_count_and_values() -> None:
    with pytest.raises(ProtocolError):
        reply_statuses(decode_reply(encode_reply(1, status=["ok"])), 2)
    with pytest.raises(ProtocolError):
        reply_statuses(decode_reply(encode_reply(1, status=["ok", "failed"])), 2)


@pytest.mark.parametrize(("text", "size"), [
    ("8GiB", 8 << 30), ("512MiB", 512 << 20), ("2MB", 2_000_000), ("4096", 4096),
    ("1.5KiB", 1536), ("64kib", 65536),
])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "8XB", "-1GiB", "0", "GiB", "1e3"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_limits_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="max_block_bytes"):
        Limits(max_block_bytes=0)
