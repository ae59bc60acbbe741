"""CheckedLoads (kvconnector/offload/checked_loads.py): a shared pool's blocks are copied only
once checked, in chunks, and nothing from the first bad block on. A real copy engine (thread
lanes) and a real checker; every destination poisoned first and compared byte by byte."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvconnector.offload import checked_loads
from kvconnector.offload.checked_loads import CheckedLoads
from kvconnector.offload.jobs import TransferJob
from transfer.checksums import block_checksum
from transfer.copy.base import Segment, ThreadBackend
from transfer.engine import CopyResult, TransferEngine
from transfer.keys import Namespace
from transfer.slot_checker import SlotChecker

NS = Namespace(model="m", dtype="bfloat16", block_size=4, block_layout="x")
WIDTH = 4096
SLOTS, BLOCKS = 24, 24
POISON = 0xA5
TIMEOUT_S = 120.0


class Bench:
    """Host slots (rank 0's part), a destination cache, a copy engine and the loads under test."""

    def __init__(self, threads: int = 2) -> None:
        self.slots = torch.randint(0, 256, (SLOTS, WIDTH), dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(3))
        self.cache = torch.full((BLOCKS, WIDTH), POISON, dtype=torch.uint8)
        self.engine = TransferEngine([Segment(self.cache, self.slots)], ThreadBackend())
        self.checker = SlotChecker(threads)
        self.loads = CheckedLoads(self.checker, 0)
        self.chunks = 0  # engine jobs the loads made

    def job(self, job_id: int, slots: list[int], blocks: list[int],
            tail: int = 0) -> TransferJob:
        """A load of `slots` into `blocks`, all but the last `tail` checked, with the sums of
        what the slots hold now."""
        keys = NS.keys([f"k{s}".encode() for s in slots[:len(slots) - tail]])
        sums = tuple((block_checksum(self.slots[s].numpy(), k),) for s, k in
                     zip(slots, keys, strict=False))
        return TransferJob(job_id, "r", tuple(blocks), tuple(slots), checked=tuple(keys),
                           sums=sums)

    def run(self) -> list[CopyResult]:
        """Submit every chunk (waiting for checks), wait for the copies, take the results."""
        self.loads.submit_all(self.engine)
        assert self.engine.wait(timeout=TIMEOUT_S)
        for result in self.engine.get_finished():
            assert self.loads.copied(result), f"engine job {result.job_id} is not a chunk"
            self.chunks += 1
        return self.loads.settled(self.engine)

    def close(self) -> None:
        self.engine.close()
        self.checker.close()


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[Bench]:
    # Chunks of 3 blocks after a first one of 2 (a block per checker thread).
    monkeypatch.setattr(checked_loads, "CHUNK_BYTES", 3 * WIDTH)
    made = Bench()
    yield made
    made.close()


def test_a_many_chunk_load_is_copied_whole(bench: Bench) -> None:
    slots, blocks = list(range(20)), [23 - i for i in range(20)]
    assert bench.loads.start(bench.job(7, slots, blocks), 20, bench.slots, bench.engine)
    (result,) = bench.run()
    assert result == CopyResult(7, True, 20 * WIDTH, result.seconds, False)
    assert bench.loads.take_good(7) is None
    assert bench.chunks == 7  # [0, 2), [2, 5), ... [17, 20)
    assert torch.equal(bench.cache[blocks], bench.slots[slots])
    assert bool((bench.cache[:4] == POISON).all())  # untouched
    assert bench.loads.settled(bench.engine) == []  # reported once


@pytest.mark.parametrize("bad", [0, 5, 7, 19])  # first block, a chunk's first, mid-chunk, last
def test_nothing_is_copied_from_a_flipped_block_on(bench: Bench, bad: int) -> None:
    slots, blocks = list(range(20)), list(range(4, 24))
    job = bench.job(1, slots, blocks)
    bench.slots[slots[bad], WIDTH - 1] ^= 0x01  # after its checksum was taken
    bench.slots[slots[bad + 1:], 0] ^= 0x80  # more bad blocks after it change nothing
    assert bench.loads.start(job, 20, bench.slots, bench.engine)
    (result,) = bench.run()
    assert result == CopyResult(1, True, bad * WIDTH, result.seconds, False)
    assert bench.loads.take_good(1) == bad
    # Every chunk that starts before the bad block, the last one cut short at it.
    assert bench.chunks == len([start for start in (0, 2, 5, 8, 11, 14, 17) if start < bad])
    assert torch.equal(bench.cache[blocks[:bad]], bench.slots[slots[:bad]])
    assert bool((bench.cache[blocks[bad:]] == POISON).all())  # not a byte of the bad slots


def test_a_chunk_is_copied_only_once_its_check_passed(bench: Bench) -> None:
    busy = threading.Event()
    held = [bench.checker._pool.submit(busy.wait, TIMEOUT_S) for _ in range(bench.checker.threads)]
    slots = [5, 6, 7, 8]
    assert bench.loads.start(bench.job(2, slots, [0, 1, 2, 3]), 4, bench.slots, bench.engine)
    for _ in range(3):  # poll points while the checker threads are busy: nothing is submitted
        bench.loads.advance(bench.engine)
        assert bench.engine.get_finished() == [] and bench.loads.settled(bench.engine) == []
    assert bool((bench.cache == POISON).all())
    busy.set()
    for future in held:
        future.result()
    (result,) = bench.run()
    assert result.ok and result.nbytes == 4 * WIDTH
    assert torch.equal(bench.cache[:4], bench.slots[slots])


def test_unchecked_tail_and_missing_checksums(bench: Bench) -> None:
    # The last 2 slots carry no checksum (fetched into the pool, checked by their tier): copied
    # after the checked head, as one more chunk.
    slots, blocks = [0, 1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15, 16]
    assert bench.loads.start(bench.job(3, slots, blocks, tail=2), 7, bench.slots, bench.engine)
    (result,) = bench.run()
    assert (result.ok, result.nbytes, bench.loads.take_good(3)) == (True, 7 * WIDTH, None)
    assert torch.equal(bench.cache[blocks], bench.slots[slots])
    # A block whose commit lacks this rank's checksum fails its check like a bad one.
    bench.cache.fill_(POISON)
    job = bench.job(4, slots[:5], blocks[:5])
    job = TransferJob(4, "r", job.block_ids, job.slots, checked=job.checked,
                      sums=job.sums[:2] + ((),) + job.sums[3:])
    assert bench.loads.start(job, 5, bench.slots, bench.engine)
    (result,) = bench.run()
    assert (result.nbytes, bench.loads.take_good(4)) == (2 * WIDTH, 2)
    assert bool((bench.cache[blocks[2:]] == POISON).all())
    # Without any checked block the caller copies the load itself.
    assert not bench.loads.start(bench.job(5, [0], [0], tail=1), 1, bench.slots, bench.engine)


def test_bad_ids_raise_before_any_check_runs(bench: Bench) -> None:
    for slots, blocks, match in (([0, 1], [0, 99], "GPU block id 99 out of range"),
                                 ([0, 1], [3, 3], "GPU block id 3 appears 2 times"),
                                 ([0, SLOTS], [0, 1], f"slot id {SLOTS} out of range")):
        job = bench.job(6, slots, blocks) if max(slots) < SLOTS else \
            TransferJob(6, "r", tuple(blocks), tuple(slots), checked=NS.keys([b"a", b"b"]),
                        sums=((1,), (2,)))
        with pytest.raises(ValueError, match=match):
            bench.loads.start(job, 2, bench.slots, bench.engine)
    assert bench.run() == []
    assert bool((bench.cache == POISON).all())

