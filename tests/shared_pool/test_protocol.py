"""The shared pool's protocol helpers: a commit's per-block checksums (`block_sums`) and their
split back into per-rank xxh3s and row sums (`split_sums`)."""

from __future__ import annotations

import pytest

from transfer.checksums import block_sums, split_sums


def rank_list(rank: int, blocks: int, rows: bool) -> list[int]:
    """A rank's list: its blocks' xxh3s (rank*1000 + 10 + b), then their row sums
    (rank*1000 + 500 + b) when `rows`; distinct values, large ones included."""
    host = [rank * 1000 + 10 + b for b in range(blocks)]
    sums = [rank * 1000 + 500 + b for b in range(blocks)]
    if rank == 1:
        host[0], sums[-1] = 2**64 - 1, 2**63
    return host + (sums if rows else [])


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("blocks", [1, 3])
def test_every_rank_with_row_sums_packs_both(ranks: int, blocks: int) -> None:
    by_rank = [rank_list(r, blocks, True) for r in range(ranks)]
    packed = block_sums(by_rank, blocks)
    assert packed == [[by_rank[r][b] for r in range(ranks)]
                      + [by_rank[r][blocks + b] for r in range(ranks)] for b in range(blocks)]
    for b, sums in enumerate(packed):
        assert len(sums) == 2 * ranks
        host, rows = split_sums(sums, ranks)
        assert host == tuple(by_rank[r][b] for r in range(ranks))
        assert rows == tuple(by_rank[r][blocks + b] for r in range(ranks))


def test_two_ranks_two_blocks_literally() -> None:
    packed = block_sums([[1, 2, 11, 12], [3, 4, 13, 14]], 2)
    assert packed == [[1, 3, 11, 13], [2, 4, 12, 14]]
    assert split_sums(packed[1], 2) == ((2, 4), (12, 14))
    assert block_sums([[1, 2], [3, 4, 13, 14]], 2) == [[1, 3], [2, 4]]
    assert split_sums([2, 4], 2) == ((2, 4), ())


@pytest.mark.parametrize("without", [0, 2])
def test_a_rank_without_row_sums_keeps_only_the_xxh3s(without: int) -> None:
    ranks, blocks = 3, 4
    by_rank = [rank_list(r, blocks, r != without) for r in range(ranks)]
    packed = block_sums(by_rank, blocks)
    assert packed == [[by_rank[r][b] for r in range(ranks)] for b in range(blocks)]
    for b, sums in enumerate(packed):
        assert split_sums(sums, ranks) == (tuple(by_rank[r][b] for r in range(ranks)), ())


def test_no_rank_with_row_sums_and_no_blocks() -> None:
    by_rank = [rank_list(r, 2, False) for r in range(2)]
    assert block_sums(by_rank, 2) == [[10, 2**64 - 1], [11, 1011]]
    assert block_sums([[], []], 0) == []


def test_packing_leaves_the_rank_lists_alone() -> None:
    by_rank = [rank_list(r, 2, True) for r in range(2)]
    before = [list(s) for s in by_rank]
    packed = block_sums(by_rank, 2)
    packed[0][0] = -1
    assert by_rank == before
