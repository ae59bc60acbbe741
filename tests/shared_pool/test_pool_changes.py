"""The daemon's change log (in process): what a client publishing KV events reads once a step,
and the whole list a reader gets when it starts or falls behind."""

from __future__ import annotations

import pytest

from transfer.keys import Namespace
from transfer.shared.index import ChangeLog, SharedBlockIndex

A = Namespace(model="a", dtype="bf16", block_size=4, block_layout="x")
B = Namespace(model="b", dtype="bf16", block_size=4, block_layout="x")
SUMS = [7, 8]


def make(num_slots: int = 4) -> SharedBlockIndex:
    index = SharedBlockIndex(num_slots, 4096, "lru")
    index.open(1, [A.digest], 1000)
    index.open(2, [A.digest], 1000)  # a second engine of the same model
    index.open(3, [B.digest], 1000)  # another model
    return index


def store(index: SharedBlockIndex, client: int, keys: list[bytes], ok: bool = True) -> None:
    plan = index.prepare_store(client, keys)
    index.complete_store(client, plan.keys, [ok] * len(plan.keys), [SUMS] * len(plan.keys))


def test_commits_and_evictions_of_every_engine_in_order_of_the_namespace_only() -> None:
    index = make()
    assert index.changes(1, -1) == [0, True, []]
    a = A.keys([b"a0", b"a1", b"a2"])
    store(index, 1, a)
    store(index, 2, A.keys([b"w0"]), ok=False)  # a failed store: no change
    store(index, 3, B.keys([b"b0", b"b1"]))  # another model's: evicts a2 (LRU: tail first)
    store(index, 2, [a[2]])  # the other engine stores a2 again: evicts a1
    index.discard(2, [a[2], A.key(b"never")])  # dropped (a failed load): only a2 was held
    nxt, whole, changes = index.changes(1, 0)
    assert not whole and nxt == index.log.next_seq == 9
    assert changes == [[True, a[0]], [True, a[1]], [True, a[2]], [False, a[2]],
                       [False, a[1]], [True, a[2]], [False, a[2]]]
    held: set[bytes] = set()
    for stored, key in changes:  # a replay is what the pool can serve now
        (held.add if stored else held.discard)(key)
    assert held == {key for key in a if index.index.contains(key)} == {a[0]}
    assert index.changes(1, nxt) == [nxt, False, []]
    assert index.changes(3, 0)[2] == [[True, k] for k in B.keys([b"b0", b"b1"])]


def test_a_reader_the_log_left_behind_gets_the_whole_list() -> None:
    index = make(num_slots=8)
    index.log = ChangeLog(size=3)
    keys = A.keys([b"k0", b"k1", b"k2", b"k3"])
    store(index, 1, keys)
    assert index.changes(2, 1) == [4, False, [[True, k] for k in keys[1:]]]
    index.discard(1, keys[:2])
    nxt, whole, held = index.changes(2, 1)  # entries from 1 on are gone: the list instead
    assert (nxt, whole, sorted(held)) == (6, True, sorted([True, k] for k in keys[2:]))


def test_a_full_log_keeps_each_entry_with_its_meaning() -> None:
    """The log drops its oldest entries as it fills: what each kept entry says (stored or
    removed) stays with its own key."""
    index = make(num_slots=8)
    index.log = ChangeLog(size=3)
    keys = A.keys([b"k0", b"k1", b"k2"])
    store(index, 1, keys[:2])  # entries 0, 1: k0, k1 stored
    index.discard(1, keys[:1])  # 2: k0 removed
    store(index, 1, keys[2:])  # 3: k2 stored; entry 0 is dropped
    assert index.changes(2, 0)[1] is True  # entry 0 is gone: the whole list instead
    assert index.changes(2, 1) == [4, False, [[True, keys[1]], [False, keys[0]],
                                              [True, keys[2]]]]
    assert index.changes(2, 2) == [4, False, [[False, keys[0]], [True, keys[2]]]]


@pytest.mark.parametrize("since", [-2, True, "0", 99, 1.5])
def test_a_bad_sequence_number_is_refused(since: object) -> None:
    with pytest.raises(ValueError, match="changes since"):
        make().changes(1, since)  # type: ignore[arg-type]


def row_sum_commit(index: SharedBlockIndex, client: int, keys: list[bytes]) -> list[int]:
    """Store `keys` committed by row sums only (xxh3s nil); their slots."""
    plan = index.prepare_store(client, keys)
    index.complete_store(client, plan.keys, [True] * len(plan.keys),
                         [[None, 10 + i] for i in range(len(plan.keys))])
    return plan.slots


def replay(changes: list[list[object]], held: set[bytes] | None = None) -> set[bytes]:
    held = set() if held is None else held
    for stored, key in changes:
        (held.add if stored else held.discard)(key)  # type: ignore[arg-type]
    return held


def test_each_lease_sees_a_block_committed_by_row_sums_when_it_can_load_it() -> None:
    """A commit by row sums is a store to a row-sum reader at once and to an xxh3 reader once
    hashed; one dropped by a nil late hash, or removed before its hash, was only ever the row-sum
    reader's: a replay of each lease's changes (and its whole list) is what it can load."""
    index = make(num_slots=8)
    index.reads(1, True, False)
    keys = A.keys([b"r0", b"r1", b"r2", b"r3"])
    slots = row_sum_commit(index, 1, keys)
    assert sorted(index.changes(1, 0)[2]) == [[True, key] for key in keys]
    assert index.changes(2, 0)[2] == []
    assert index.add_sums(1, keys[:2], [[5, 10], [None, 11]], slots[:2]) == [True, True]
    index.discard(1, [keys[2]])  # before its hash
    index.discard(1, [keys[0]])  # after its hash
    loadable = {1: {keys[3]}, 2: set()}
    for client in (1, 2):
        assert replay(index.changes(client, 0)[2]) == loadable[client]
        nxt, whole, held = index.changes(client, -1)
        assert whole and replay(held) == loadable[client]
        assert [index.lookup(client, [key]) for key in keys] == \
            [int(key in loadable[client]) for key in keys]
    assert index.changes(2, 0)[2] == [[True, keys[0]], [False, keys[0]]]


def test_a_lease_that_changes_how_it_reads_gets_the_whole_list_next() -> None:
    """A lease following the log by xxh3 that turns to row sums: blocks committed by row sums
    before were never in its changes, so its next read is the whole list (then the log again)."""
    index = make(num_slots=8)
    keys = A.keys([b"s0", b"s1"])
    row_sum_commit(index, 1, keys)
    nxt, whole, _ = index.changes(2, -1)
    assert index.changes(2, nxt) == [nxt, False, []]
    index.reads(2, True, True)
    nxt, whole, held = index.changes(2, nxt)
    assert whole and held == [[True, key] for key in keys]  # in the order they were stored
    assert index.changes(2, nxt) == [nxt, False, []]
    index.reads(2, True, False)  # the same reading: no whole list
    assert index.changes(2, nxt) == [nxt, False, []]


def test_stores_are_hashed_while_a_lease_of_their_namespace_needs_xxh3s() -> None:
    index = make()
    assert index.hash_later(1)  # every lease needs them until it says otherwise
    index.reads(1, True, False)
    assert index.hash_later(1)  # lease 2, an engine of the same model
    index.reads(2, True, False)
    assert not index.hash_later(1) and not index.hash_later(2)  # lease 3: another model
    assert index.hash_later(3)
    index.open(4, [A.digest, B.digest], 1000)
    assert index.hash_later(1)
    index.release(4)
    assert not index.hash_later(1)


@pytest.mark.parametrize("row_sums, needs", [(False, False), (1, True), (True, None)])
def test_a_bad_reads_notice_is_refused_and_changes_nothing(row_sums: object,
                                                          needs: object) -> None:
    index = make()
    index.reads(1, True, False)
    with pytest.raises(ValueError, match="xxh3"):
        index.reads(1, row_sums, needs)  # type: ignore[arg-type]
    lease = index.leases[1]
    assert (lease.row_sum_reader, lease.needs_xxh3, lease.whole_changes) == (True, False, True)


def fleet() -> SharedBlockIndex:
    """Leases 1 and 2 of model A read by row sums and need no xxh3s (GPU engines, no tier
    below); lease 3 is model B's."""
    index = make(num_slots=8)
    index.reads(1, True, False)
    index.reads(2, True, False)
    return index


def test_a_block_nobody_was_asked_to_hash_is_replaced_by_a_store_that_needs_xxh3s() -> None:
    """Committed by row sums under a plan that asked no hashes: an orphan, a hit to row-sum
    readers, a miss to a lease needing xxh3s; that lease's store of it removes it (a removal in
    the row-sum readers' log), places the key and commits its own, hashed block."""
    index = fleet()
    keys = A.keys([b"o0", b"o1", b"o2"])
    assert not index.prepare_stores(1, [[]])[0].hash_later
    old = row_sum_commit(index, 1, keys)
    assert (index.unhashed, index.orphans) == (3, 3)
    index.open(4, [A.digest], 1000)  # a CPU engine of model A: needs xxh3s
    assert index.lookup(4, keys) == 0 and index.lookup(2, keys) == 3
    nxt = index.changes(2, -1)[0]
    plan = index.prepare_store(4, keys)
    assert plan.keys == keys and plan.hash_later and not plan.not_placed
    assert index.changes(2, nxt)[2] == [[False, key] for key in keys]
    assert (index.unhashed, index.orphans) == (0, 0)
    assert index.lookup(2, keys) == 0  # being stored: nobody reads it
    hashed = [[100 + i, 10 + i] for i in range(3)]
    index.complete_store(4, plan.keys, [True] * 3, hashed)
    assert index.lookup(4, keys) == 3 and index.lookup(2, keys) == 3
    assert index.checksums(4, keys) == list(map(tuple, hashed))
    assert index.add_sums(1, keys, [[7, 10 + i] for i in range(3)], old) == [False] * 3
    # the orphan's writer attaches nothing now
    assert index.checksums(2, keys) == list(map(tuple, hashed))


def test_only_orphans_are_replaced_and_only_by_a_lease_that_needs_xxh3s() -> None:
    """A block whose plan asked for its xxh3s waits for them (not replaced); a row-sum reader
    needing no xxh3s never replaces an orphan (its lookups find it); a pinned orphan drains, the
    orphans after it stay, and its key is placed once the pin drops."""
    index = fleet()
    orphans = A.keys([b"p0", b"p1"])
    row_sum_commit(index, 1, orphans)
    assert index.prepare_store(2, orphans).keys == []  # lease 2 needs no xxh3s: kept
    index.open(4, [A.digest], 1000)
    asked = A.keys([b"q0"])
    plan = index.prepare_store(1, asked)
    assert plan.hash_later
    index.complete_store(1, plan.keys, [True], [[None, 5]])
    assert (index.unhashed, index.orphans) == (3, 2)
    assert index.prepare_store(4, asked).keys == []  # its xxh3s are coming
    assert index.prepare_load(2, orphans[:1]) is not None  # lease 2 loads p0: pinned
    plan = index.prepare_store(4, orphans)
    assert plan.keys == [] and plan.not_placed == orphans[:1]  # p0 drains
    assert index.orphans == 1 and index.lookup(2, orphans[1:]) == 1  # p1 stays till then
    index.complete_load(2, orphans[:1])
    assert index.prepare_store(4, orphans).keys == orphans
    assert index.orphans == 0


def test_a_writer_gone_before_its_hashes_leaves_orphans() -> None:
    index = make(num_slots=8)
    index.reads(1, True, True)
    index.reads(2, True, True)
    keys = A.keys([b"g0", b"g1"])
    row_sum_commit(index, 1, keys)  # asked to hash them: not orphans yet
    assert (index.unhashed, index.orphans) == (2, 0)
    index.release(1)
    assert (index.unhashed, index.orphans) == (2, 2)
    assert index.prepare_store(2, keys).keys == keys
