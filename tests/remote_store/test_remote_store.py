"""The store's memory: LRU by bytes, and blocks being sent are never evicted."""

from __future__ import annotations

import pytest

from transfer.remote.store.memory import BlockStore


def _block(fill: int, size: int = 100) -> bytearray:
    return bytearray([fill]) * size


def test_lru_evicts_least_recently_used_first() -> None:
    store = BlockStore(300)
    for key in (b"a", b"b", b"c"):
        assert store.insert(key, _block(1), 0)
    assert store.get(b"a") is not None  # a becomes most recent
    assert store.insert(b"d", _block(2), 0)
    assert [k in store for k in (b"a", b"b", b"c", b"d")] == [True, False, True, True]
    assert (store.used_bytes, store.evictions, len(store)) == (300, 1, 3)


def test_block_bytes_and_checksum_are_kept() -> None:
    store = BlockStore(1000)
    payload = _block(7, 64)
    store.insert(b"k", payload, 1234)
    block = store.get(b"k")
    assert bytes(block.view) == bytes(payload)
    assert (block.checksum, block.size) == (1234, 64)


def test_existing_key_keeps_its_block() -> None:
    store = BlockStore(1000)
    store.insert(b"k", _block(1), 11)
    assert store.insert(b"k", _block(2), 22)
    block = store.get(b"k")
    assert (bytes(block.view)[0], block.checksum, store.used_bytes) == (1, 11, 100)


def test_pinned_blocks_are_never_evicted() -> None:
    store = BlockStore(200)
    store.insert(b"a", _block(1), 0)
    store.insert(b"b", _block(2), 0)
    store.pin(store.get(b"a"))  # a is oldest after b's touch below
    store.pin(store.get(b"a"))  # twice: two replies in flight
    store.get(b"b")
    store.pin(store.get(b"b"))
    assert store.pinned_blocks == 2
    assert not store.insert(b"c", _block(3), 0)  # everything pinned: no room
    assert (len(store), store.used_bytes, store.evictions) == (2, 200, 0)
    store.unpin(store.get(b"b"))
    assert store.insert(b"c", _block(3), 0)  # b was the only unpinned block
    assert [k in store for k in (b"a", b"b", b"c")] == [True, False, True]
    assert store.pinned_blocks == 1
    store.unpin(store.get(b"a"))
    assert store.pinned_blocks == 1  # one reply still in flight
    store.unpin(store.get(b"a"))
    assert store.pinned_blocks == 0


def test_delete_of_a_pinned_block_counts_its_bytes_until_unpinned() -> None:
    store = BlockStore(200)
    store.insert(b"a", _block(1), 0)
    block = store.get(b"a")
    store.pin(block)
    assert store.delete(b"a")
    assert (b"a" in store, store.used_bytes) == (False, 100)
    assert not store.delete(b"a")
    store.unpin(block)
    assert store.used_bytes == 0


def test_block_larger_than_capacity_is_refused() -> None:
    store = BlockStore(99)
    assert not store.insert(b"a", _block(1), 0)
    assert (len(store), store.used_bytes) == (0, 0)


def test_prefix_length() -> None:
    store = BlockStore(1000)
    for key in (b"a", b"b", b"d"):
        store.insert(key, _block(0, 10), 0)
    assert store.prefix_length([b"a", b"b", b"c", b"d"]) == 2
    assert store.prefix_length([b"c"]) == 0
    assert store.prefix_length([]) == 0


@pytest.mark.parametrize("capacity", [0, -5, 1.5, "8GiB"])
def test_capacity_must_be_a_positive_int(capacity: object) -> None:
    with pytest.raises(ValueError, match=repr(capacity).replace(".", r"\.")):
        BlockStore(capacity)  # type: ignore[arg-type]
