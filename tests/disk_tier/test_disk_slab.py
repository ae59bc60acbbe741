"""transfer/disk/slab.py and io.py on a real file system: bytes round trip (across processes),
a writer killed mid-write, flipped bytes, a full file system, injected read errors, bounds."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from disk_helpers import (
    NS_DIGEST,
    POISON,
    block_data,
    direct_dir,
    key,
    make_pool,
    small_filesystem,
)

from transfer.checksums import block_checksum
from transfer.disk.io import DiskIO
from transfer.disk.slab import FOOTER_BYTES, DiskError, SlabFile, scan, slab_path

BLOCK = 3 * 4096 + 100  # not a multiple of 4 KiB: a slot's padding travels with it
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    return direct_dir(tmp_path / "disk")


def write_blocks(directory: Path, names: list[int], disk_slots: list[int], num_slots: int = 8,
                 block: int = BLOCK) -> tuple[bool, ...]:
    pool = make_pool(block, len(names))
    io = DiskIO(SlabFile(directory, NS_DIGEST, block, num_slots), pool.slots, threads=3)
    try:
        for i, name in enumerate(names):
            pool.slots[i].copy_(block_data(name, block))
        io.submit_write(1, [key(n) for n in names], range(len(names)), disk_slots)
        assert io.wait(timeout=60)
        (result,) = io.get_finished()
        return result.ok
    finally:
        io.close()
        pool.close()


def read_blocks(directory: Path, names: list[int], disk_slots: list[int], num_slots: int = 8,
                block: int = BLOCK) -> tuple[tuple[bool, ...], list[bool]]:
    """(per-block ok flags, per-block 'bytes equal what was written') into a poisoned pool."""
    pool = make_pool(block, len(names))
    pool.slots.fill_(POISON)
    io = DiskIO(SlabFile(directory, NS_DIGEST, block, num_slots), pool.slots, threads=3)
    try:
        io.submit_read(2, [key(n) for n in names], disk_slots, range(len(names)))
        assert io.wait(timeout=60)
        (result,) = io.get_finished()
        same = [torch.equal(pool.slots[i], block_data(n, block)) for i, n in enumerate(names)]
        return result.ok, same
    finally:
        io.close()
        pool.close()


def run_writer(directory: Path, script: str) -> subprocess.CompletedProcess[str]:
    """`script` in a new interpreter with the helpers imported and `directory` as DIR."""
    prelude = (f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(Path(__file__).parent)!r}]\n"
               f"from pathlib import Path; DIR = Path({str(directory)!r})\n")
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(script)],
                          capture_output=True, text=True, timeout=300)


def test_round_trip_into_a_new_process_is_bit_exact(disk: Path) -> None:
    done = run_writer(disk, """
        from test_disk_slab import write_blocks
        assert write_blocks(DIR, [10, 11, 12, 13], [7, 0, 3, 4]) == (True,) * 4
    """)
    assert done.returncode == 0, done.stderr
    assert scan(disk, NS_DIGEST, 8) == {7: key(10), 0: key(11), 3: key(12), 4: key(13)}
    ok, same = read_blocks(disk, [12, 10, 13, 11], [3, 7, 4, 0])
    assert ok == (True,) * 4 and same == [True] * 4


def test_consecutive_slots_move_in_runs_each_block_checked(
        disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's blocks in consecutive disk slots go as one request a run (at most 3 blocks here;
    a gap ends a run); a block flipped inside a run fails alone, its run retried block by block.
    """
    data = BLOCK + 4096 - BLOCK % 4096  # the slot's data bytes
    names, slots = list(range(50, 62)), [0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13]
    pool = make_pool(BLOCK, len(names))
    for i, name in enumerate(names):
        pool.slots[i].copy_(block_data(name, BLOCK))
    slab = SlabFile(disk, NS_DIGEST, BLOCK, 16)
    calls: list[tuple[str, int, int]] = []  # (verb, first slot, blocks)
    for verb in ("preadv", "pwritev"):
        real = getattr(os, verb)

        def counted(fd: int, buffers: list[memoryview], offset: int, verb: str = verb,
                    real: object = real) -> int:
            calls.append((verb, (offset - 4096) // (data + FOOTER_BYTES), len(buffers) // 2))
            return real(fd, buffers, offset)  # type: ignore[operator]

        monkeypatch.setattr(os, verb, counted)
    io = DiskIO(slab, pool.slots, threads=2, max_extent_bytes=3 * data + 100)
    assert io.extent_blocks == 3
    # small blocks: at most 64 a request (two iovecs each, far below IOV_MAX)
    assert [DiskIO.extent_blocks_for(n << 10) for n in (4, 256, 2048, 32768)] == [64, 64, 8, 1]
    io.submit_write(1, [key(n) for n in names], range(12), slots)
    assert io.wait(timeout=60)
    assert [r.ok for r in io.get_finished()] == [(True,) * 12]
    assert sorted(calls) == [("pwritev", first, count) for first, count in
                             [(0, 3), (3, 3), (6, 1), (9, 3), (12, 2)]]
    with slab_path(disk, NS_DIGEST).open("r+b") as f:  # a byte of slot 4's block (name 54)
        f.seek(slab.offset(4) + 777)
        byte = f.read(1)[0]
        f.seek(slab.offset(4) + 777)
        f.write(bytes([byte ^ 0x01]))
    calls.clear()
    pool.slots.fill_(POISON)
    io.submit_read(2, [key(n) for n in names], slots, range(12))
    assert io.wait(timeout=60)
    assert [r.ok for r in io.get_finished()] == [tuple(n != 54 for n in names)]
    assert sorted(calls) == sorted([("preadv", first, count) for first, count in
                                    [(0, 3), (3, 3), (6, 1), (9, 3), (12, 2),
                                     (3, 1), (4, 1), (5, 1)]])  # the bad run, block by block
    for i, name in enumerate(names):
        assert torch.equal(pool.slots[i], block_data(name, BLOCK)) == (name != 54), name
    assert "checksum mismatch in slot 4" in io.last_error
    counters = io.take_counters()
    assert (counters.read_bytes, counters.failed_reads) == (11 * BLOCK, 1)
    io.close()
    pool.close()


@pytest.mark.parametrize("tear", ["prefix", "footer-first"])
def test_writer_killed_mid_write_never_serves_the_partial_block(disk: Path, tear: str) -> None:
    """Slot 0 held block 1; its overwrite by block 2 is cut off by SIGKILL: a prefix of the
    data (the footer comes last), or the footer and half the data (a tear in another order)."""
    assert write_blocks(disk, [1, 3], [0, 1]) == (True, True)
    done = run_writer(disk, f"""
        import os, signal
        from test_disk_slab import write_blocks
        real = os.pwritev
        def torn(fd, buffers, offset):
            data, footer = buffers
            half = len(data) // 2 // 4096 * 4096
            if {tear!r} == "footer-first":
                real(fd, [footer], offset + len(data))
            real(fd, [data[:half]], offset)
            os.kill(os.getpid(), signal.SIGKILL)
        os.pwritev = torn
        write_blocks(DIR, [2], [0])
    """)
    assert done.returncode == -signal.SIGKILL, done.stderr
    found = scan(disk, NS_DIGEST, 8)
    assert found == ({0: key(1), 1: key(3)} if tear == "prefix" else {0: key(2), 1: key(3)})
    for name in (1, 2):  # neither the old block nor the new one is served from slot 0
        assert read_blocks(disk, [name], [0])[0] == (False,)
    assert read_blocks(disk, [3], [1]) == ((True,), [True])  # the other slot is intact


def test_flipped_bytes_fail_that_block_only(disk: Path) -> None:
    assert write_blocks(disk, [20, 21, 22, 23], [0, 1, 2, 3]) == (True,) * 4
    slab = SlabFile(disk, NS_DIGEST, BLOCK, 8)
    data_off, footer_off = slab.offset(1) + 5000, slab.offset(2) + slab.data_bytes + 30
    slab.close()
    with slab_path(disk, NS_DIGEST).open("r+b") as f:
        for offset in (data_off, footer_off):
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ 0x10]))
        f.flush()
        os.fsync(f.fileno())
    assert sorted(scan(disk, NS_DIGEST, 8)) == [0, 1, 3]  # slot 2's footer is broken
    ok, same = read_blocks(disk, [20, 21, 22, 23], [0, 1, 2, 3])
    assert ok == (True, False, False, True)  # slot 2's bytes are intact, its footer is not
    assert same == [True, False, True, True]


class FaultySlab(SlabFile):
    """Reads touching `bad` slots fail with EIO; writes wait for `gate` when it is set."""

    bad: set[int] = set()
    crash: set[int] = set()
    gate: threading.Event | None = None

    def read(self, first_slot: int, keys: Sequence[bytes], intos: Sequence[memoryview],
             footers: Sequence[memoryview]) -> list[int]:
        for slot in range(first_slot, first_slot + len(keys)):
            if slot in self.bad:
                raise OSError(errno.EIO, f"injected read error in slot {slot}")
            if slot in self.crash:
                raise RuntimeError(f"injected bug in slot {slot}")
        return super().read(first_slot, keys, intos, footers)

    def write(self, first_slot: int, keys: Sequence[bytes], datas: Sequence[memoryview],
              footers: Sequence[memoryview], sums: Sequence[int | None] | None = None) -> None:
        if self.gate is not None:
            assert self.gate.wait(60)
        super().write(first_slot, keys, datas, footers, sums)


def test_injected_read_error_fails_that_block_and_is_counted(disk: Path) -> None:
    assert write_blocks(disk, [30, 31, 32], [5, 6, 7]) == (True,) * 3
    pool = make_pool(BLOCK, 3)
    pool.slots.fill_(POISON)
    slab = FaultySlab(disk, NS_DIGEST, BLOCK, 8)
    slab.bad = {6}
    io = DiskIO(slab, pool.slots, threads=2)
    io.submit_read(9, [key(30), key(31), key(32)], [5, 6, 7], [0, 1, 2])
    assert io.wait(timeout=60)
    (result,) = io.get_finished()
    assert result.ok == (True, False, True) and result.nbytes == 2 * BLOCK
    assert torch.equal(pool.slots[0], block_data(30, BLOCK))
    assert torch.equal(pool.slots[2], block_data(32, BLOCK))
    counters = io.take_counters()
    assert (counters.read_bytes, counters.failed_reads) == (2 * BLOCK, 1)
    assert "injected read error in slot 6" in io.last_error
    io.close()
    pool.close()


def test_an_unexpected_exception_fails_the_block_not_the_thread(disk: Path) -> None:
    assert write_blocks(disk, [33, 34], [0, 1]) == (True, True)
    pool = make_pool(BLOCK, 2)
    slab = FaultySlab(disk, NS_DIGEST, BLOCK, 8)
    slab.crash = {0}
    io = DiskIO(slab, pool.slots, threads=1)  # one thread: it must survive to read slot 1
    io.submit_read(1, [key(33), key(34)], [0, 1], [0, 1])
    assert io.wait(timeout=60)
    assert [r.ok for r in io.get_finished()] == [(False, True)]
    assert "injected bug in slot 0" in io.last_error
    io.close()
    pool.close()


def test_writes_past_the_bound_are_refused_whole(disk: Path) -> None:
    pool = make_pool(BLOCK, 4)
    slab = FaultySlab(disk, NS_DIGEST, BLOCK, 8)
    slab.gate = threading.Event()
    io = DiskIO(slab, pool.slots, threads=2, max_write_bytes=2 * slab.data_bytes)
    assert io.submit_write(1, [key(1), key(2)], [0, 1], [0, 1])
    assert not io.submit_write(2, [key(3)], [2], [2])  # nothing written, reported failed
    assert [(r.job_id, r.ok) for r in io.get_finished()] == [(2, (False,))]
    slab.gate.set()
    assert io.wait(timeout=60)
    assert [(r.job_id, r.ok) for r in io.get_finished()] == [(1, (True, True))]
    assert io.submit_write(3, [key(3)], [2], [2])  # room again
    io.close()
    pool.close()
    assert sorted(scan(disk, NS_DIGEST, 8)) == [0, 1, 2]


def test_full_file_system_fails_blocks_not_the_tier(tmp_path: Path) -> None:
    block = 256 << 10
    with small_filesystem(tmp_path / "fs.img", tmp_path / "mnt", 8) as mnt:
        directory = direct_dir(mnt / "disk")
        num = 48  # ~12.6 MiB of slots on a ~6 MiB file system
        pool = make_pool(block, num)
        for i in range(num):
            pool.slots[i].copy_(block_data(100 + i, block))
        io = DiskIO(SlabFile(directory, NS_DIGEST, block, num), pool.slots, threads=4)
        io.submit_write(1, [key(100 + i) for i in range(num)], range(num), range(num))
        assert io.wait(timeout=120)
        (result,) = io.get_finished()
        good = [i for i, ok in enumerate(result.ok) if ok]
        assert 0 < len(good) < num, result.ok
        assert "No space left" in io.last_error or "short write" in io.last_error
        pool.slots.fill_(POISON)
        io.submit_read(2, [key(100 + i) for i in range(num)], range(num), range(num))
        assert io.wait(timeout=120)
        (read,) = io.get_finished()
        assert [i for i, ok in enumerate(read.ok) if ok] == good
        assert all(torch.equal(pool.slots[i], block_data(100 + i, block)) for i in good)
        io.close()
        pool.close()


def test_reopen_keeps_blocks_of_the_same_block_size_only(disk: Path) -> None:
    assert write_blocks(disk, [40, 41, 42], [1, 5, 6]) == (True,) * 3
    assert read_blocks(disk, [40, 41], [1, 5], num_slots=6) == ((True, True), [True, True])
    assert scan(disk, NS_DIGEST, 8) == {1: key(40), 5: key(41)}  # 6, 7 were dropped
    SlabFile(disk, NS_DIGEST, BLOCK + 4096, 8).close()  # another block size: a fresh slab
    assert scan(disk, NS_DIGEST, 8) == {}


def test_a_file_system_without_o_direct_is_refused_clearly(
        disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(DiskError, match="does not support O_DIRECT.*disk_path"):
        SlabFile(disk, NS_DIGEST, BLOCK, 8)


def test_bad_input_raises_before_any_io(disk: Path) -> None:
    pool = make_pool(BLOCK, 2)
    io = DiskIO(SlabFile(disk, NS_DIGEST, BLOCK, 4), pool.slots, threads=1)
    with pytest.raises(ValueError, match="disk slot 4 out of range"):
        io.submit_write(1, [key(1)], [0], [4])
    with pytest.raises(ValueError, match="pool slot 2 out of range"):
        io.submit_read(1, [key(1)], [0], [2])
    with pytest.raises(ValueError, match="1 keys, 2 disk slots"):
        io.submit_read(1, [key(1)], [0, 1], [0, 1])
    with pytest.raises(ValueError, match="block_bytes must be a positive int"):
        SlabFile(disk, NS_DIGEST, 0, 4)
    other = SlabFile(disk / "other", NS_DIGEST, BLOCK + FOOTER_BYTES, 4)
    with pytest.raises(ValueError, match="do not take the slab.s"):
        DiskIO(other, pool.slots)
    other.close()
    assert io.get_finished() == []
    io.close()
    pool.close()
    assert scan(disk, NS_DIGEST, 4) == {}


def test_a_slab_has_one_writer(disk: Path) -> None:
    first = SlabFile(disk, NS_DIGEST, BLOCK, 4)
    with pytest.raises(DiskError, match="in use by another engine"):
        SlabFile(disk, NS_DIGEST, BLOCK, 4)
    first.close()
    SlabFile(disk, NS_DIGEST, BLOCK, 4).close()


def test_a_carried_checksum_is_written_without_hashing_and_checked_on_read(
        disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks that carry their checksum (a shared pool's commit) are not hashed on write; one
    without (None) is; every read still hashes the bytes read and compares."""
    import transfer.disk.slab as slab_module

    pool = make_pool(BLOCK, 3)
    for i in range(3):
        pool.slots[i].copy_(block_data(40 + i, BLOCK))
    sums = [block_checksum(pool.slots[i].numpy(), key(40 + i)) for i in range(3)]
    hashed: list[bytes] = []

    def counted(block: object, name: bytes) -> int:
        hashed.append(name)
        return block_checksum(block, name)

    monkeypatch.setattr(slab_module, "block_checksum", counted)
    io = DiskIO(SlabFile(disk, NS_DIGEST, BLOCK, 8), pool.slots, threads=2)
    assert io.submit_write(1, [key(40 + i) for i in range(3)], range(3), [0, 1, 2],
                           sums=[sums[0], None, sums[2]])
    assert io.wait(timeout=60)
    assert [r.ok for r in io.get_finished()] == [(True,) * 3]
    assert hashed == [key(41)]  # only the block without a checksum
    hashed.clear()
    pool.slots.fill_(POISON)
    io.submit_read(2, [key(40 + i) for i in range(3)], [0, 1, 2], range(3))
    assert io.wait(timeout=60)
    assert [r.ok for r in io.get_finished()] == [(True,) * 3]
    assert sorted(hashed) == [key(40), key(41), key(42)]  # every read is checked
    for i in range(3):
        assert torch.equal(pool.slots[i], block_data(40 + i, BLOCK))
    io.close()
    pool.close()


def test_a_block_changed_after_its_checksum_was_taken_is_never_served(disk: Path) -> None:
    """The pool copy changed after its checksum was taken (a stray write, a bug): the write
    cannot tell, but the read compares the footer's checksum with the bytes read and fails."""
    pool = make_pool(BLOCK, 2)
    for i in range(2):
        pool.slots[i].copy_(block_data(60 + i, BLOCK))
    sums = [block_checksum(pool.slots[i].numpy(), key(60 + i)) for i in range(2)]
    pool.slots[1, 4321] ^= 0x10  # changed after its checksum
    io = DiskIO(SlabFile(disk, NS_DIGEST, BLOCK, 8), pool.slots, threads=2)
    assert io.submit_write(1, [key(60), key(61)], [0, 1], [0, 1], sums=sums)
    assert io.wait(timeout=60)
    assert [r.ok for r in io.get_finished()] == [(True, True)]
    io.close()
    pool.close()
    assert scan(disk, NS_DIGEST, 8) == {0: key(60), 1: key(61)}  # both footers are sound
    ok, same = read_blocks(disk, [60, 61], [0, 1])
    assert ok == (True, False) and same == [True, False]


def test_a_ranks_part_of_wider_slots_round_trips_within_its_room(disk: Path) -> None:
    """Rows of one rank's part of shared slots (6 KiB at 8 KiB of 16 KiB slots): a read fills
    whole pages, the 8 KiB of the part's room, and never the other rank's bytes; rows whose room
    is smaller than the pages a read fills are refused."""
    block, room = 6144, 8192
    pool = make_pool(2 * room, 3)
    part = pool.rows(room, block)
    for i in range(3):
        part[i].copy_(block_data(70 + i, block))
    io = DiskIO(SlabFile(disk, NS_DIGEST, block, 8), None, threads=2)
    with pytest.raises(ValueError, match="do not take the slab's 6144 B blocks"):
        io.rebind(part, room=block)
    io.rebind(part, room=room)
    assert io.submit_write(1, [key(70 + i) for i in range(3)], range(3), [0, 1, 2])
    assert io.wait(timeout=60)
    assert [r.ok for r in io.get_finished()] == [(True,) * 3]
    pool.slots.fill_(POISON)
    io.submit_read(2, [key(70 + i) for i in range(3)], [0, 1, 2], range(3))
    assert io.wait(timeout=60)
    assert [r.ok for r in io.get_finished()] == [(True,) * 3]
    for i in range(3):
        assert torch.equal(part[i], block_data(70 + i, block))
        assert bool((pool.slots[i, :room] == POISON).all())  # the other rank's part
    io.close()
    pool.close()
