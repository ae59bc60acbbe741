"""Redis value format, URL and credentials (transfer/remote/redis/values.py): no server needed."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from transfer.remote.backend import BlockStatus
from transfer.remote.redis.values import (
    HEADER_BYTES,
    PASSWORD_ENV,
    RedisAuth,
    RedisURL,
    decode_value,
    encode_value,
    redis_key,
)

NS = bytes(range(16))
OTHER_NS = bytes(range(16, 32))
KEY = NS + b"block-0001"
BLOCK = 4096


@pytest.fixture
def row() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, BLOCK, dtype=np.uint8)


def test_value_is_header_then_the_block_bytes(row: np.ndarray) -> None:
    value = encode_value(KEY, row)
    assert len(value) == HEADER_BYTES + BLOCK == 40 + BLOCK
    assert value[:4] == b"KVCB" and value[8:24] == NS
    assert struct.unpack_from("<HHQ", value, 4)[:2] == (1, HEADER_BYTES)
    assert value[HEADER_BYTES:] == row.tobytes()
    assert decode_value(value, KEY, BLOCK) == (BlockStatus.OK, "")
    assert redis_key(KEY) == b"kvc:" + KEY


@pytest.mark.parametrize(("tamper", "status", "message"), [
    (lambda v: v[:-1], BlockStatus.SIZE, "carries 4095 B"),
    (lambda v: v + b"x", BlockStatus.SIZE, "carries 4097 B"),
    (lambda v: v[:10], BlockStatus.CORRUPT, "shorter than its header"),
    (lambda v: b"XXXX" + v[4:], BlockStatus.CORRUPT, "does not start with a kvconnector"),
    (lambda v: v[:4] + struct.pack("<H", 2) + v[6:], BlockStatus.CORRUPT, "format version 2"),
    (lambda v: v[:8] + OTHER_NS + v[24:], BlockStatus.CORRUPT, "belongs to namespace"),
    (lambda v: v[:24] + struct.pack("<Q", 8192) + v[32:], BlockStatus.SIZE, "8192 B block"),
    (lambda v: v[:-7] + bytes([v[-7] ^ 1]) + v[-6:], BlockStatus.CORRUPT, "checksum"),
    (lambda v: v[:32] + bytes(8) + v[40:], BlockStatus.CORRUPT, "checksum"),
])
def test_a_tampered_value_is_refused_with_the_reason(row: np.ndarray, tamper, status: BlockStatus,
                                                     message: str) -> None:
    got, why = decode_value(tamper(encode_value(KEY, row)), KEY, BLOCK)
    assert got is status
    assert message in why


def test_a_value_stored_under_another_key_fails_its_checksum(row: np.ndarray) -> None:
    # Same namespace, same bytes, another block's key: the checksum is seeded by the key.
    assert decode_value(encode_value(NS + b"block-0002", row), KEY, BLOCK)[0] is \
        BlockStatus.CORRUPT
    # Another namespace's value copied under our key: the header says whose it is.
    foreign = encode_value(OTHER_NS + b"block-0001", row)
    assert "namespace" in decode_value(foreign, KEY, BLOCK)[1]


def test_a_slot_of_another_size_is_a_size_error(row: np.ndarray) -> None:
    status, why = decode_value(encode_value(KEY, row), KEY, 2 * BLOCK)
    assert status is BlockStatus.SIZE and "a pool slot is 8192 B" in why


@pytest.mark.parametrize(("url", "tls", "user", "seeds"), [
    ("redis://127.0.0.1:7000", False, None, ((("127.0.0.1", 7000)),)),
    ("rediss://kv@10.0.0.1:7000,10.0.0.2:7001/", True, "kv",
     (("10.0.0.1", 7000), ("10.0.0.2", 7001))),
    ("redis://[::1]:7000", False, None, (("::1", 7000),)),
])
def test_urls_name_the_seeds(url: str, tls: bool, user: str | None, seeds: tuple) -> None:
    parsed = RedisURL.parse(url)
    assert (parsed.tls, parsed.user, parsed.seeds) == (tls, user, seeds)


def test_loopback_is_every_seed_on_loopback() -> None:
    assert RedisURL.parse("redis://127.0.0.1:1,localhost:2,[::1]:3").loopback
    assert not RedisURL.parse("redis://127.0.0.1:1,10.0.0.1:2").loopback


@pytest.mark.parametrize(("url", "message"), [
    ("tcp://127.0.0.1:7000", "must start with redis://"),
    ("redis://kv:hunter2@127.0.0.1:7000", "never in the URL"),
    ("redis://127.0.0.1", "is not host:port"),
    ("redis://127.0.0.1:0", "is not host:port"),
    ("redis://127.0.0.1:7000,:7001", "':7001' is not host:port"),
])
def test_bad_urls_are_refused_naming_the_problem(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RedisURL.parse(url)


def test_password_comes_from_the_file_else_the_environment(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    assert RedisAuth.from_sources("kv").password is None
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    assert RedisAuth.from_sources("kv").password == "from-env"
    (tmp_path / "pw").write_text("from-file\n")
    auth = RedisAuth.from_sources("kv", tmp_path / "pw")
    assert (auth.user, auth.password) == ("kv", "from-file")
    assert "from-file" not in repr(auth) and "***" in repr(auth)


@pytest.mark.parametrize(("name", "content", "message"), [
    ("missing", None, "does not exist"),
    ("empty", "\n", "is empty"),
])
def test_bad_password_files_are_refused(tmp_path: Path, name: str, content: str | None,
                                        message: str) -> None:
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        RedisAuth.from_sources("kv", tmp_path / name)
    with pytest.raises(ValueError, match="CA file"):
        RedisAuth.from_sources("kv", None, tmp_path / "no-ca.pem")
