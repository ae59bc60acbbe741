"""One slab file of block slots, read and written with O_DIRECT straight from pool slots.

File `<namespace digest>.slab` in the tier's directory: a 4 KiB file header (block size, slot
count, namespace), then `num_slots` slots of `data_bytes` (the block rounded up to 4 KiB: a pool
slot's stride) + a 4 KiB footer. One pwritev writes a block and its footer (a run of consecutive
slots, each block followed by its own, in one request): magic, slot number, block length, the key
and the block's checksum, the footer sealed by its own xxh64. The checksum is the one every tier
uses (transfer.checksums.block_checksum: xxh3-64 seeded by the key), so a block that already
carries one (a shared pool's commit) is written without hashing it again; the read checks it
against the bytes read all the same, so a checksum that does not match the bytes written (a pool
copy changed after its checksum was taken) fails the read, never serves them.
A slot counts only when its footer is sound and names it; every read checks the key and the
block's checksum. So a block cut off by a crash (a prefix written: the footer comes last), torn
in any other order, flipped on the medium or misdirected is never served: a footer that survives
still names the old bytes' checksum.

Blocking calls, safe from several threads at once (positional I/O on one descriptor); the io
module runs them on threads. Errors raise DiskError (OSError from the file system included).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from transfer.checksums import block_checksum

ALIGN = 4096  # O_DIRECT: buffers, lengths and offsets aligned to the logical block size (<= 4 KiB)
FOOTER_BYTES = ALIGN
MAX_KEY_BYTES = 1024
_HEADER = struct.Struct("<8sH16sQQQ")  # magic, version, digest, block, data bytes, slots
_HEADER_MAGIC = b"KVCSLAB1"
_FOOTER = struct.Struct("<8sQQQH")  # magic, slot, block bytes, checksum, key length
_FOOTER_MAGIC = b"KVCBLK02"
_SEAL = struct.Struct("<Q")
_VERSION = 2  # 1: xxh3-128 footers (such a slab starts afresh)
_SCAN_THREADS = 8


class DiskError(Exception):
    """A slab could not be opened, or one block could not be read or written."""


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def aligned_buffer(nbytes: int) -> memoryview:
    """Page-aligned anonymous memory (O_DIRECT accepts it)."""
    return memoryview(mmap.mmap(-1, round_up(nbytes)))


def slab_path(directory: str | os.PathLike[str], digest: bytes) -> Path:
    return Path(directory) / f"{digest.hex()}.slab"


def slot_bytes(block_bytes: int) -> int:
    """Bytes a block takes on disk: the block rounded up to 4 KiB, and its footer."""
    return round_up(block_bytes) + FOOTER_BYTES


class SlabFile:
    """The slab of one namespace (`digest`): `num_slots` blocks of `block_bytes` (see module doc).

    Opening keeps the blocks of a slab with the same block size (a new slot count drops or adds
    slots at the end) and starts a fresh one otherwise. The file is preallocated where the file
    system can; where it cannot (full), writes past its free space fail block by block.
    """

    def __init__(self, directory: str | os.PathLike[str], digest: bytes, block_bytes: int,
                 num_slots: int) -> None:
        for name, value in (("block_bytes", block_bytes), ("num_slots", num_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.digest = digest
        self.block_bytes = block_bytes
        self.data_bytes = round_up(block_bytes)
        self.num_slots = num_slots
        self.path = slab_path(directory, digest)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DiskError(f"cannot create the disk tier directory {self.path.parent}: "
                            f"{exc}") from exc
        self.fd = open_direct(self.path, os.O_RDWR | os.O_CREAT)
        try:
            # One writer per slab: two engines on one directory would overwrite each other's
            # slots (never served, checksums catch it, but every block would be a miss).
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise DiskError(f"{self.path} is in use by another engine (same model and rank on "
                            f"one disk_path): give each engine its own directory") from None
        try:
            self._prepare()
        except BaseException:
            os.close(self.fd)
            raise

    @property
    def stride(self) -> int:
        return self.data_bytes + FOOTER_BYTES

    def offset(self, slot: int) -> int:
        return ALIGN + slot * self.stride

    def erase(self) -> None:
        """Forget every block (the header stays): no footer survives, none is found again."""
        os.ftruncate(self.fd, ALIGN)
        self._allocate()

    def _prepare(self) -> None:
        header = read_header(self.fd)
        if header is None or header[0] != self.digest or header[1] != self.block_bytes:
            os.ftruncate(self.fd, 0)  # another format: every old footer goes
        if header is None or header[1:] != (self.block_bytes, self.num_slots):
            buf = aligned_buffer(ALIGN)
            fields = (_HEADER_MAGIC, _VERSION, self.digest, self.block_bytes, self.data_bytes,
                      self.num_slots)
            packed = _HEADER.pack(*fields)
            buf[:len(packed) + 8] = packed + _SEAL.pack(xxhash.xxh64_intdigest(packed))
            _write_all(self.fd, [buf], 0, "the slab header")
        self._allocate()

    def _allocate(self) -> None:
        size = self.offset(self.num_slots)
        os.ftruncate(self.fd, size)
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError as exc:  # full or not supported: blocks fail one by one when written
            if exc.errno not in (errno.ENOSPC, errno.EOPNOTSUPP, errno.EINVAL, errno.EFBIG):
                raise DiskError(f"cannot preallocate {self.path}: {exc}") from exc

    def write(self, first_slot: int, keys: Sequence[bytes], datas: Sequence[memoryview],
              footers: Sequence[memoryview], sums: Sequence[int | None] | None = None) -> None:
        """Write each of `datas` (data_bytes, aligned; the block is its first block_bytes) under
        its key to consecutive slots from `first_slot`, in one request; `footers` are the calling
        thread's aligned 4 KiB scratch buffers, one a block; `sums`: each block's checksum where
        it carries one (block_checksum of its bytes and key), None where it is hashed here."""
        self._check(first_slot, keys, datas, footers)
        if sums is not None and len(sums) != len(keys):
            raise ValueError(f"{len(sums)} checksums for {len(keys)} blocks")
        buffers: list[memoryview] = []
        for j, (key, data) in enumerate(zip(keys, datas, strict=True)):
            given = None if sums is None else sums[j]
            checksum = block_checksum(data[:self.block_bytes], key) if given is None else given
            seal_footer(footers[j], first_slot + j, self.block_bytes, key, checksum)
            buffers += [data, footers[j]]
        _write_all(self.fd, buffers, self.offset(first_slot), self._slots(first_slot, len(keys)))

    def read(self, first_slot: int, keys: Sequence[bytes], intos: Sequence[memoryview],
             footers: Sequence[memoryview]) -> list[int]:
        """Read consecutive slots from `first_slot` into `intos` (data_bytes each, aligned) in
        one request; DiskError unless every slot holds its key with a matching checksum (then the
        `intos` hold garbage the caller must not use). Returns the checksums, as verified."""
        self._check(first_slot, keys, intos, footers)
        what = self._slots(first_slot, len(keys))
        buffers = [b for pair in zip(intos, footers, strict=False) for b in pair]
        sums: list[int] = []
        try:
            n = os.preadv(self.fd, buffers, self.offset(first_slot))
        except OSError as exc:
            raise DiskError(f"reading {what} of {self.path}: {exc}") from exc
        if n != self.stride * len(keys):
            raise DiskError(f"short read of {what} of {self.path}: {n} of "
                            f"{self.stride * len(keys)} B")
        for j, (key, into) in enumerate(zip(keys, intos, strict=True)):
            slot = first_slot + j
            found = open_footer(footers[j], slot)
            if found is None:
                raise DiskError(f"slot {slot} of {self.path} has no sound footer")
            block_bytes, stored_key, checksum = found
            if stored_key != key or block_bytes != self.block_bytes:
                raise DiskError(f"slot {slot} of {self.path} holds key {stored_key.hex()} of "
                                f"{block_bytes} B, not {key.hex()} of {self.block_bytes} B")
            if block_checksum(into[:self.block_bytes], key) != checksum:
                raise DiskError(f"checksum mismatch in slot {slot} of {self.path} (key "
                                f"{key.hex()})")
            sums.append(checksum)
        return sums

    def _check(self, first_slot: int, keys: Sequence[bytes], datas: Sequence[memoryview],
               footers: Sequence[memoryview]) -> None:
        if not keys or not len(keys) == len(datas) <= len(footers):
            raise ValueError(f"{len(keys)} keys, {len(datas)} blocks and {len(footers)} footers "
                             f"(keys > 0, as many blocks, footers enough)")
        last = first_slot + len(keys) - 1
        if not 0 <= first_slot <= last < self.num_slots:
            bad = first_slot if first_slot < 0 or first_slot >= self.num_slots else last
            raise ValueError(f"disk slot {bad} out of range [0, {self.num_slots})")
        for key, data in zip(keys, datas, strict=True):
            if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
                raise ValueError(f"a key is 1..{MAX_KEY_BYTES} bytes, got {key!r}")
            if len(data) != self.data_bytes:
                raise ValueError(f"a slot's data is {self.data_bytes} B, got {len(data)}")

    @staticmethod
    def _slots(first_slot: int, count: int) -> str:
        last = first_slot + count - 1
        return f"slot {first_slot}" if count == 1 else f"slots {first_slot}-{last}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_direct(path: Path, flags: int) -> int:
    """os.open with O_DIRECT; DiskError naming the file system when it refuses direct I/O."""
    try:
        return os.open(path, flags | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise DiskError(f"the file system of {path.parent} does not support O_DIRECT "
                            f"(tmpfs before Linux 6.6, some FUSE and network file systems): "
                            f"give a disk_path on a local drive") from exc
        raise DiskError(f"cannot open {path}: {exc}") from exc


def read_header(fd: int) -> tuple[bytes, int, int] | None:
    """(digest, block bytes, slots) of a sound slab header, or None."""
    buf = aligned_buffer(ALIGN)
    try:
        n = os.preadv(fd, [buf], 0)
    except OSError:
        return None
    if n < _HEADER.size + _SEAL.size:
        return None
    packed = bytes(buf[:_HEADER.size])
    (seal,) = _SEAL.unpack_from(buf, _HEADER.size)
    magic, version, digest, block_bytes, data_bytes, num_slots = _HEADER.unpack(packed)
    if (magic != _HEADER_MAGIC or version != _VERSION or seal != xxhash.xxh64_intdigest(packed)
            or data_bytes != round_up(block_bytes)):
        return None
    return digest, block_bytes, num_slots


def seal_footer(footer: memoryview, slot: int, block_bytes: int, key: bytes,
                checksum: int) -> None:
    body = _FOOTER.pack(_FOOTER_MAGIC, slot, block_bytes, checksum, len(key)) + key
    footer[:len(body) + _SEAL.size] = body + _SEAL.pack(xxhash.xxh64_intdigest(body))


def open_footer(footer: memoryview, slot: int) -> tuple[int, bytes, int] | None:
    """(block bytes, key, checksum) of a sound footer written for `slot`, else None."""
    magic, stored_slot, block_bytes, checksum, key_len = _FOOTER.unpack_from(footer, 0)
    if magic != _FOOTER_MAGIC or stored_slot != slot or not 0 < key_len <= MAX_KEY_BYTES:
        return None
    end = _FOOTER.size + key_len
    (seal,) = _SEAL.unpack_from(footer, end)
    body = bytes(footer[:end])
    if seal != xxhash.xxh64_intdigest(body):
        return None
    return block_bytes, body[_FOOTER.size:], checksum


def scan(directory: str | os.PathLike[str], digest: bytes, num_slots: int) -> dict[int, bytes]:
    """Slot -> key of every sound footer in the slab of `digest` (slots past `num_slots` are
    ignored); the blocks are checked when read. DiskError when the slab cannot be looked for or
    opened (a directory this user may not search, a file it may not read)."""
    path = slab_path(directory, digest)
    try:
        if not path.exists():
            return {}
    except OSError as exc:  # e.g. a directory this user may not search (mode 000)
        raise DiskError(f"cannot look for {path}: {exc}") from exc
    fd = open_direct(path, os.O_RDONLY)
    try:
        header = read_header(fd)
        if header is None or header[0] != digest:
            return {}
        block_bytes, slots = header[1], min(header[2], num_slots)
        stride = round_up(block_bytes) + FOOTER_BYTES
        chunks = [range(i, min(i + 256, slots)) for i in range(0, slots, 256)]

        def footers(chunk: range) -> dict[int, bytes]:
            buf, found = aligned_buffer(FOOTER_BYTES), {}
            for slot in chunk:
                try:
                    n = os.preadv(fd, [buf], ALIGN + slot * stride + stride - FOOTER_BYTES)
                except OSError:
                    continue  # an unreadable footer: the slot is free
                sound = open_footer(buf, slot) if n == FOOTER_BYTES else None
                if sound is not None and sound[0] == block_bytes:
                    found[slot] = sound[1]
            return found

        out: dict[int, bytes] = {}
        with ThreadPoolExecutor(_SCAN_THREADS) as pool:
            for found in pool.map(footers, chunks):
                out.update(found)
        return out
    finally:
        os.close(fd)


def _write_all(fd: int, buffers: list[memoryview], offset: int, what: str) -> None:
    total = sum(len(b) for b in buffers)
    try:
        n = os.pwritev(fd, buffers, offset)
    except OSError as exc:
        raise DiskError(f"writing {what}: {exc}") from exc
    if n != total:
        raise DiskError(f"short write of {what}: {n} of {total} B (file system full?)")
