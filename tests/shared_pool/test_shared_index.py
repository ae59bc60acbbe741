"""The daemon's index (in process): leases, namespaces under one capacity, commit checksums."""

from __future__ import annotations

import pytest

from transfer.keys import Namespace
from transfer.shared.index import SharedBlockIndex

A = Namespace(model="a", dtype="bf16", block_size=4, block_layout="x")
B = Namespace(model="b", dtype="bf16", block_size=4, block_layout="x")


def make(num_slots: int = 4) -> tuple[SharedBlockIndex, list[tuple[bytes, int, int]]]:
    hashed: list[tuple[bytes, int, int]] = []

    def checksum(key: bytes, slot: int, nbytes: int) -> int:
        hashed.append((key, slot, nbytes))
        return len(hashed)

    index = SharedBlockIndex(num_slots, 4096, "lru", checksum)
    index.open(1, [A.digest], 1000)
    index.open(2, [B.digest], 2000)
    return index, hashed


def test_a_dead_clients_stores_fail_and_its_pins_drop() -> None:
    index, _ = make()
    stored = A.keys([b"s0", b"s1"])
    plan = index.prepare_store(1, stored)
    index.complete_store(1, plan.keys, [True, True])
    assert index.prepare_load(1, stored) == plan.slots
    assert index.prepare_load(1, stored[:1]) == plan.slots[:1]  # pinned twice
    storing = index.prepare_store(1, A.keys([b"w0"])).keys
    assert index.index.is_being_stored(storing[0])
    index.release(1)
    assert not index.index.is_being_stored(storing[0]) and index.lookup(2, []) == 0
    assert index.index.stats.failed_stores == 1 and index.index.num_free == 2
    # Unpinned and idle: both are evicted by another client's stores.
    plan = index.prepare_store(2, B.keys([b"x0", b"x1", b"x2", b"x3"]))
    assert len(plan.keys) == 4 and sorted(plan.evicted) == sorted(stored)


def test_completions_of_what_a_client_does_not_hold_are_ignored() -> None:
    index, hashed = make()
    keys = A.keys([b"c0"])
    index.prepare_store(1, keys)
    index.open(3, [A.digest], 1000)  # the same namespace, another connection
    index.complete_store(3, keys, [True])  # not its store: no effect
    index.complete_load(3, keys)
    assert index.index.is_being_stored(keys[0]) and not hashed
    index.complete_store(1, keys, [True])
    assert hashed == [(keys[0], index.index.slot_of(keys[0]), 1000)]
    assert index.checksums(1, keys) == [1]


def test_foreign_keys_and_oversized_blocks_are_refused() -> None:
    index, _ = make()
    with pytest.raises(ValueError, match="not of a namespace this client declared"):
        index.lookup(1, B.keys([b"f"]))
    with pytest.raises(ValueError, match="--slot-bytes 5000 or more"):
        index.open(4, [A.digest], 5000)
    with pytest.raises(ValueError, match="namespace digests"):
        index.open(4, [b"short"], 100)


def test_namespaces_share_the_capacity_and_clear_only_their_own() -> None:
    index, _ = make(num_slots=3)
    for client, ns in ((1, A), (2, B)):
        plan = index.prepare_store(client, ns.keys([b"k0"]))
        index.complete_store(client, plan.keys, [True])
    # One free slot, one eviction: the least recently used block of either model.
    plan = index.prepare_store(1, A.keys([b"k1", b"k2"]))
    assert plan.evicted == A.keys([b"k0"])
    index.complete_store(1, plan.keys, [True, True])
    assert index.prepare_load(1, A.keys([b"k0"])) is None  # gone: a load pins nothing
    index.clear(1)
    assert index.lookup(1, A.keys([b"k1", b"k2"])) == 0 and index.lookup(2, B.keys([b"k0"])) == 1
