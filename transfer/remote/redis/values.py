"""How a block is stored as a Redis value, and the URL and credentials of a Redis Cluster.

A value is a 40-byte header, then the block's bytes:

    magic b"KVCB" | version u16 | header size u16 | namespace digest 16 B |
    payload size u64 | checksum u64                      (little-endian)

The checksum is the same as the zmq store's (transfer.checksums.block_checksum): xxh3-64 of
the payload seeded with xxh3-64 of the block's key, so a value copied under another key, written
by another namespace, cut short or altered fails the check and never reaches a pool slot. The
Redis key is `kvc:` + the block's key (namespace digest + block hash), so namespaces never
collide and an operator can tell our keys apart.
"""

from __future__ import annotations

import ipaddress
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from transfer.checksums import block_checksum
from transfer.keys import DIGEST_BYTES
from transfer.remote.backend import BlockStatus

VALUE_VERSION = 1
VALUE_MAGIC = b"KVCB"
KEY_PREFIX = b"kvc:"
_HEADER = struct.Struct(f"<4sHH{DIGEST_BYTES}sQQ")
HEADER_BYTES = _HEADER.size
PASSWORD_ENV = "KVCONNECTOR_REDIS_PASSWORD"
_LOOPBACK_NAMES = ("localhost",)


def redis_key(key: bytes) -> bytes:
    return KEY_PREFIX + key


def value_header(key: bytes, row: np.ndarray) -> bytes:
    """The header stored before the slot's bytes (the value is header + bytes)."""
    return _HEADER.pack(VALUE_MAGIC, VALUE_VERSION, HEADER_BYTES, key[:DIGEST_BYTES],
                        row.nbytes, block_checksum(row, key))


def encode_value(key: bytes, row: np.ndarray) -> bytes:
    """Header + the slot's bytes as one buffer (a copy; puts send the two parts as they are)."""
    return b"".join((value_header(key, row), memoryview(row)))


def decode_value(value: bytes, key: bytes, block_bytes: int) -> tuple[BlockStatus, str]:
    """Whether `value` is the block stored under `key`: (OK, "") or why not. Checks the header
    against the key and the pool, then the checksum, before any byte reaches a slot."""
    if len(value) < HEADER_BYTES:
        return BlockStatus.CORRUPT, f"the value is {len(value)} B, shorter than its header"
    magic, version, header_bytes, namespace, size, checksum = _HEADER.unpack_from(value)
    if magic != VALUE_MAGIC or header_bytes != HEADER_BYTES:
        return BlockStatus.CORRUPT, "the value does not start with a kvconnector block header"
    if version != VALUE_VERSION:
        return BlockStatus.CORRUPT, (f"the value has format version {version}; this client "
                                     f"reads version {VALUE_VERSION}")
    if namespace != key[:DIGEST_BYTES]:
        return BlockStatus.CORRUPT, (f"the value belongs to namespace {namespace.hex()}, not "
                                     f"{key[:DIGEST_BYTES].hex()}")
    if size != block_bytes:
        return BlockStatus.SIZE, f"the store holds a {size} B block; a pool slot is {block_bytes} B"
    if len(value) != HEADER_BYTES + size:
        return BlockStatus.SIZE, (f"the value carries {len(value) - HEADER_BYTES} B where its "
                                  f"header declares {size} B")
    if block_checksum(memoryview(value)[HEADER_BYTES:], key) != checksum:
        return BlockStatus.CORRUPT, "the bytes do not match their checksum"
    return BlockStatus.OK, ""


def holds_block(head: Any, length: Any, key: bytes, block_bytes: int) -> bool:
    """Whether a value of `length` bytes (STRLEN) whose first HEADER_BYTES are `head` (GETRANGE)
    is a block of ours stored under `key`: lookups count nothing else as held (a value someone
    else wrote, another namespace's, a huge one, another block size's when `block_bytes` is
    known)."""
    if not isinstance(head, bytes) or len(head) != HEADER_BYTES:
        return False
    magic, version, header_bytes, namespace, size, _ = _HEADER.unpack_from(head)
    return (magic == VALUE_MAGIC and version == VALUE_VERSION and header_bytes == HEADER_BYTES
            and namespace == key[:DIGEST_BYTES] and length == HEADER_BYTES + size
            and (not block_bytes or size == block_bytes))


@dataclass(frozen=True)
class RedisAuth:
    """Credentials for a Redis Cluster: an ACL user and its password, and for `rediss://` the
    CA that signed the nodes' certificates (None: the system's CAs)."""

    user: str | None = None
    password: str | None = None
    ca_file: Path | None = None

    @classmethod
    def from_sources(cls, user: str | None = None, password_file: str | Path | None = None,
                     ca_file: str | Path | None = None) -> RedisAuth:
        """The password from `password_file`, else from $KVCONNECTOR_REDIS_PASSWORD."""
        password = os.environ.get(PASSWORD_ENV) or None
        if password_file is not None:
            path = Path(password_file)
            if not path.is_file():
                raise ValueError(f"Redis password file {str(path)!r} does not exist")
            password = path.read_text().strip()
            if not password:
                raise ValueError(f"Redis password file {str(path)!r} is empty")
        if ca_file is not None and not Path(ca_file).is_file():
            raise ValueError(f"Redis CA file {str(ca_file)!r} does not exist")
        return cls(user, password, None if ca_file is None else Path(ca_file))

    def __repr__(self) -> str:  # never print the password
        return f"RedisAuth(user={self.user!r}, password={'***' if self.password else None}, " \
               f"ca_file={self.ca_file!r})"


@dataclass(frozen=True)
class RedisURL:
    """`redis://[user@]host:port[,host:port...]` (`rediss://` for TLS): the cluster's seeds."""

    tls: bool
    user: str | None
    seeds: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, url: str) -> RedisURL:
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in ("redis", "rediss"):
            raise ValueError(f"Redis URL {url!r} must start with redis:// or rediss://")
        user = None
        if "@" in rest:
            user, _, rest = rest.rpartition("@")
            if ":" in user:
                raise ValueError(f"Redis URL {url!r} carries a password: give it in a file or "
                                 f"${PASSWORD_ENV}, never in the URL")
        rest = rest.rstrip("/")
        seeds = []
        for seed in rest.split(","):
            host, _, port = seed.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"Redis URL {url!r}: seed {seed!r} is not host:port")
            seeds.append((host.strip("[]"), int(port)))
        return cls(scheme == "rediss", user or None, tuple(seeds))

    @property
    def loopback(self) -> bool:
        return all(_is_loopback(host) for host, _ in self.seeds)


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
