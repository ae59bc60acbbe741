"""The daemon's index (in process): leases, namespaces under one capacity, the checksums each
block is committed with."""

from __future__ import annotations

import gc

import pytest

import transfer.shared.index as index_module
from transfer.keys import Namespace
from transfer.shared import protocol
from transfer.shared.index import SharedBlockIndex

A = Namespace(model="a", dtype="bf16", block_size=4, block_layout="x")
B = Namespace(model="b", dtype="bf16", block_size=4, block_layout="x")


def make(num_slots: int = 4) -> SharedBlockIndex:
    index = SharedBlockIndex(num_slots, 4096, "lru")
    index.open(1, [A.digest], 1000)
    index.open(2, [B.digest], 2000)
    return index


def sums(count: int, first: int = 1) -> list[list[int]]:
    """Per-rank checksums of `count` blocks of a two-rank engine."""
    return [[first + 2 * i, first + 2 * i + 1] for i in range(count)]


def kept(lists: list[list[int]]) -> list[tuple[int, ...]]:
    """Checksums as the index keeps and hands them out: tuples (untracked by Python's collector,
    so a full pass does not walk one object per stored key for them)."""
    return [tuple(values) for values in lists]


def test_kept_checksums_leave_the_collectors_passes() -> None:
    """What the index keeps per stored key for its checksums is a tuple of ints, which Python's
    collector stops tracking once it has seen it: a full pass then walks no object for them,
    committed by row sums in bulk, one by one with xxh3s, or with xxh3s attached later."""
    index = make(num_slots=8)
    bulk, single = A.keys([b"r0", b"r1"]), A.keys([b"x0"])
    plan = index.prepare_store(1, bulk + single)
    index.complete_store(1, bulk, [True, True], [[None, 7], [None, 8]])
    index.complete_store(1, single, [True], [[5, 9]])
    assert index.add_sums(1, bulk[:1], [[6, 7]], plan.slots[:1]) == [True]
    gc.collect()
    kept_sums = index.checksums(1, bulk + single)
    assert kept_sums == [(6, 7), (None, 8), (5, 9)]
    assert [gc.is_tracked(values) for values in kept_sums] == [False] * 3


def test_a_daemons_full_collections_walk_nothing_per_stored_block() -> None:
    """The daemon makes its index, then freezes what lives (`pool serve`) and serves. After
    that, a block stored, loaded and unpinned leaves no object the collector tracks: no entry
    object, and every container of one entry a block (the index's slots and pins, the LRU order,
    the checksums, the blocks not hashed, the orphans) frozen or untracked. Else a full pass
    walks one entry a stored block (up to 0.15 s a pass on the development VM)."""
    gc.collect()
    gc.freeze()
    try:
        index = SharedBlockIndex(4096, 4096, "lru")
        gc.freeze()  # as the daemon does once its index is made
        index.open(1, [A.digest], 1000)
        index.reads(1, row_sums=True, needs_xxh3=False)  # no xxh3s asked: orphans too

        def store(batch: int) -> None:
            keys = A.keys([b"%d-%d" % (batch, i) for i in range(1000)])
            plan = index.prepare_store(1, keys)
            index.complete_store(1, plan.keys, [True] * len(plan.keys),
                                 tuple(range(len(plan.keys))))  # flat row sums, as sent
            index.prepare_load(1, keys[::2])
            index.complete_load(1, keys[::2])
            index.prepare_load(1, keys[1::2])  # some keys stay pinned

        # Young passes only, as between the daemon's full ones (a full pass untracks a plain
        # dict of untracked values, until the next tuple put in tracks it again).
        store(0)
        gc.collect(1)
        tracked = len(gc.get_objects())
        store(1)
        gc.collect(1)
        assert len(gc.get_objects()) - tracked < 20  # not 1000
        young = {id(o) for o in gc.get_objects()}
        inner = index.index
        containers = {"slots": inner._slots, "pins": inner._pins, "order": inner.policy.order,
                      "sums": index._sums, "unhashed": index._unhashed,
                      "orphans": index._orphans}
        assert {name: len(c) >= 1000 for name, c in containers.items()} == \
            dict.fromkeys(containers, True)
        assert [name for name, c in containers.items() if id(c) in young] == []
    finally:
        gc.unfreeze()


def test_a_dead_clients_stores_fail_and_its_pins_drop() -> None:
    index = make()
    stored = A.keys([b"s0", b"s1"])
    plan = index.prepare_store(1, stored)
    index.complete_store(1, plan.keys, [True, True], sums(2))
    assert index.prepare_load(1, stored) == (plan.slots, kept(sums(2)))
    assert index.prepare_load(1, stored[:1]) == (plan.slots[:1], kept(sums(1)))  # pinned twice
    storing = index.prepare_store(1, A.keys([b"w0"])).keys
    assert index.index.is_being_stored(storing[0])
    index.release(1)
    assert not index.index.is_being_stored(storing[0]) and index.lookup(2, []) == 0
    assert index.index.stats.failed_stores == 1 and index.index.num_free == 2
    # Unpinned and idle: both are evicted by another client's stores.
    plan = index.prepare_store(2, B.keys([b"x0", b"x1", b"x2", b"x3"]))
    assert len(plan.keys) == 4 and sorted(plan.evicted) == sorted(stored)


def test_completions_of_what_a_client_does_not_hold_are_ignored() -> None:
    index = make()
    keys = A.keys([b"c0"])
    index.prepare_store(1, keys)
    index.open(3, [A.digest], 1000)  # the same namespace, another connection
    index.complete_store(3, keys, [True], sums(1, 50))  # not its store: no effect
    index.complete_load(3, keys)
    assert index.index.is_being_stored(keys[0]) and index.checksums(1, keys) == [None]
    index.complete_store(1, keys, [True], sums(1))
    assert index.checksums(1, keys) == kept(sums(1))


def _pins(index: SharedBlockIndex, client: int) -> dict[bytes, int]:
    return dict(index.leases[client].pins)


def test_an_unpin_drops_each_named_pin_once_and_only_the_clients_own() -> None:
    """complete_load's usual case (every key named once, pinned once by this lease) and each way
    out of it: a key pinned twice, a key named twice, a key not pinned, another lease's pin, a
    bad value; the index's counts of idle keys follow (what eviction may take)."""
    index = make(num_slots=6)
    index.open(3, [A.digest], 1000)
    keys = A.keys([b"u0", b"u1", b"u2", b"u3"])
    plan = index.prepare_store(1, keys)
    index.complete_store(1, plan.keys, [True] * 4, sums(4))
    idle = index.index.num_reclaimable
    index.prepare_load(1, keys)
    index.prepare_load(1, keys[:1])  # u0 pinned twice
    index.prepare_load(3, keys[1:2])  # u1 pinned by another lease too
    assert index.index.num_reclaimable == idle - 4
    index.complete_load(1, keys[1:3])  # the usual unpin
    assert _pins(index, 1) == {keys[0]: 2, keys[3]: 1} and _pins(index, 3) == {keys[1]: 1}
    assert index.index.num_reclaimable == idle - 3  # u2 idle; u1 still pinned by client 3
    for bad in ([keys[0], [1]], [keys[0], b"short"], "not a list"):
        with pytest.raises(ValueError):
            index.complete_load(1, bad)  # type: ignore[arg-type]
        assert _pins(index, 1) == {keys[0]: 2, keys[3]: 1}
    index.complete_load(1, [keys[3], keys[3]])  # named twice, pinned once: unpinned once
    index.complete_load(1, [keys[0], keys[2]])  # pinned twice; not pinned by this lease
    assert _pins(index, 1) == {keys[0]: 1} and index.index.num_reclaimable == idle - 2  # u3
    index.complete_load(1, keys[:1])
    index.complete_load(3, keys[1:2])
    assert _pins(index, 1) == _pins(index, 3) == {} and index.index.num_reclaimable == idle
    assert len(index.prepare_store(2, B.keys([b"x0", b"x1", b"x2", b"x3", b"x4", b"x5"])).keys) \
        == 6  # every unpinned block evicted for another namespace's store


def test_a_commit_naming_keys_it_does_not_hold_commits_the_rest_with_their_own_sums() -> None:
    """Keys another client stores, or none does, are skipped; each held key keeps its own flag
    and checksums (a mixed commit, as after a store the daemon dropped part of)."""
    index = make(num_slots=6)
    ours = A.keys([b"m0", b"m1", b"m2"])
    index.prepare_store(1, ours)
    index.open(3, [A.digest], 1000)
    theirs = A.keys([b"t0"])
    index.prepare_store(3, theirs)
    never = A.keys([b"n0"])
    mixed = [ours[0], theirs[0], ours[1], never[0], ours[2]]
    index.complete_store(1, mixed, [True, True, False, True, True],
                         [[10, 11], [20, 21], None, [30, 31], [None, None, 40, 41]])
    assert index.checksums(1, ours) == [(10, 11), None, (None, None, 40, 41)]
    assert index.lookup(1, ours[:1]) == 1 and index.index.num_free == 6 - 3  # m1 freed
    assert index.index.is_being_stored(theirs[0]) and index.checksums(1, never) == [None]
    assert index.unhashed == 1


@pytest.mark.parametrize("bad", [None, [], ["1"], [-1], [1 << 64], [True]])
def test_a_commit_without_valid_checksums_changes_nothing(bad: object) -> None:
    index = make()
    keys = A.keys([b"n0", b"n1"])
    index.prepare_store(1, keys)
    with pytest.raises(ValueError, match="committed without its per-rank xxh3-64 checksums"):
        index.complete_store(1, keys, [True, True], [[5], bad])
    assert all(index.index.is_being_stored(key) for key in keys)  # the first was not committed
    index.complete_store(1, keys, [False, False], [None, None])  # a failed store needs none
    assert index.lookup(1, keys) == 0 and index.index.num_free == 4


@pytest.mark.parametrize("bad", [[None, None], [None, -1], [None, 1 << 64], [None, True],
                                 [None, 5.0], (None, "5"), [5, None], [None, 5, None, 6],
                                 [None], [None, None, 5, None], 5, [{}, 5], [[1], 5]])
def test_a_commit_by_row_sums_with_one_bad_list_changes_nothing(bad: object) -> None:
    """A GPU writer's commit (every list a nil, then a row sum) is checked a column at a time;
    one list that is not such a valid list sends it through the per-key check, which refuses."""
    index = make()
    keys = A.keys([b"r0", b"r1", b"r2"])
    index.prepare_store(1, keys)
    with pytest.raises(ValueError, match="committed without its per-rank xxh3-64 checksums"):
        index.complete_store(1, keys, [True] * 3, [[None, 5], bad, [None, 7]])
    assert all(index.index.is_being_stored(key) for key in keys) and index.unhashed == 0
    index.complete_store(1, keys, [True] * 3, [[None, 5], [None, 0], [None, (1 << 64) - 1]])
    assert index.checksums(1, keys) == [(None, 5), (None, 0), (None, (1 << 64) - 1)]
    assert index.unhashed == 3 and index.lookup(1, keys) == 0  # xxh3 readers wait for hashes
    index.reads(1, row_sums=True, needs_xxh3=False)
    assert index.lookup(1, keys) == 3


@pytest.mark.parametrize("lists", [
    [[None, 1]], [[None, None, 1, 2]] * 3, [(None, 3)], [[None, 1], [None, 2, None, 3]],
    [[None, 1], [2, 3]], [[None, 1], None], [[None, -1]], [[None, True]], [[None, 1 << 64]],
    [[None, 1.0]], [[None]], [[]], [[None] * 130 + [1] * 130], [[None, 2, 3]], [[1, None]],
    [[None, None, None, 1]], [[None, 1, 2, 3]]])
def test_the_column_check_accepts_only_what_the_per_key_check_accepts(lists: list) -> None:
    accepted = protocol.row_sums_only_commit(lists)
    per_key = True
    for block_sums in lists:
        try:
            index_module._check_sums(b"k", block_sums, unhashed=True)
        except ValueError:
            per_key = False
    every_by_row_sums = per_key and all(block_sums[0] is None for block_sums in lists)
    if accepted:
        assert every_by_row_sums
    else:  # checked per key: lists of different lengths may all be valid
        assert not every_by_row_sums or len(set(map(len, lists))) > 1


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_commit_by_row_sums_sent_flat_is_kept_as_its_lists_are(ranks: int) -> None:
    """A GPU writer's usual commit goes over the wire as its row sums alone, key by key (no
    array a key); the daemon keeps and logs it as the same commit sent a list a key, and skips
    a key the client does not hold as it would there."""
    lists = [[None] * ranks + [100 * i + r for r in range(ranks)] for i in range(3)]
    flat = protocol.commit_sums([True] * 3, lists)
    assert flat == [100 * i + r for i in range(3) for r in range(ranks)]
    keys = A.keys([b"f0", b"f1", b"f2"])
    by_lists, by_flat = make(num_slots=8), make(num_slots=8)
    for index, sums in ((by_lists, lists), (by_flat, tuple(flat))):  # msgpack unpacks tuples
        plan = index.prepare_store(1, keys[:2])
        index.prepare_store(2, B.keys([b"other"]))
        index.complete_store(1, keys, [True] * 3, sums)  # f2 is not being stored: skipped
        assert plan.keys == keys[:2] and index.unhashed == 2
        assert index.checksums(1, keys) == kept(lists[:2]) + [None]
        index.reads(1, row_sums=True, needs_xxh3=False)
        assert index.lookup(1, keys) == 2
    assert by_flat.changes(1, -1) == by_lists.changes(1, -1)


@pytest.mark.parametrize(("flags", "flat", "why"), [
    ([True] * 2, [5, 6, 7], "1 to 64 a key: 3 for 2 keys"),
    ([True] * 2, [5] * 130, "1 to 64 a key: 130 for 2 keys"),
    ([True, False], [5, 6], "stores every key ok"),
    ([True, 1], [5, 6], "stores every key ok"),
    ([True], [5, 6], "stores every key ok"),
    ([True] * 2, [5, -1], "is not a uint64"),
    ([True] * 2, [5, 1 << 64], "is not a uint64"),
    ([True] * 2, [5, True], "is not a uint64"),
    ([True] * 2, [5, None], "is not a uint64"),
    ([True] * 2, [5, [6]], "is not a uint64")])
def test_a_bad_flat_commit_changes_nothing(flags: list, flat: list, why: str) -> None:
    index = make()
    keys = A.keys([b"b0", b"b1"])
    index.prepare_store(1, keys)
    with pytest.raises(ValueError, match=why):
        index.complete_store(1, keys, flags, flat)
    assert all(index.index.is_being_stored(key) for key in keys) and index.unhashed == 0
    index.complete_store(1, keys, [True, True], [5, 6])
    assert index.checksums(1, keys) == [(None, 5), (None, 6)] and index.unhashed == 2


@pytest.mark.parametrize(("flags", "lists"), [
    ([True, False], [[None, 1], None]),  # a failed store
    ([True, True], [[None, 1], [7, 2]]),  # an xxh3 taken
    ([True, True], [[None, 1], [None, None, 2, 3]]),  # two rank counts
    ([True, True], [[None, 1], [None, None]]),  # a row sum missing: the daemon refuses it
    ([True], [[5]]),  # an xxh3 only
    ([True], [[]]),
    ([True, True], [[None, None, 5, 6]]),  # fewer lists than keys: the daemon refuses it
    ([True], [[None, 5], [None, 6]])])  # more
def test_any_other_commit_is_sent_a_list_a_key(flags: list, lists: list) -> None:
    assert protocol.commit_sums(flags, lists) == lists


def test_a_commit_with_the_wrong_number_of_lists_is_refused_as_sent() -> None:
    """Two keys, one list of two ranks' row sums: not the flat form of two keys (the same four
    values would read as one rank each)."""
    index = make()
    keys = A.keys([b"w0", b"w1"])
    index.prepare_store(1, keys)
    for lists in ([[None, None, 5, 6]], [[None, 5], [None, 6], [None, 7]]):
        with pytest.raises(ValueError, match="one ok flag and one checksum list per key"):
            index.complete_store(1, keys, [True, True], protocol.commit_sums([True, True], lists))
    with pytest.raises(ValueError, match="one ok flag and one checksum list per key"):
        index.complete_store(1, [], [], [5])
    assert all(index.index.is_being_stored(key) for key in keys) and index.unhashed == 0


def test_foreign_keys_and_oversized_blocks_are_refused() -> None:
    index = make()
    with pytest.raises(ValueError, match="not of a namespace this client declared"):
        index.lookup(1, B.keys([b"f"]))
    with pytest.raises(ValueError, match="--slot-bytes 5000 or more"):
        index.open(4, [A.digest], 5000)
    with pytest.raises(ValueError, match="namespace digests"):
        index.open(4, [b"short"], 100)


def test_namespaces_share_the_capacity_and_clear_only_their_own() -> None:
    index = make(num_slots=3)
    for client, ns in ((1, A), (2, B)):
        plan = index.prepare_store(client, ns.keys([b"k0"]))
        index.complete_store(client, plan.keys, [True], sums(1))
    # One free slot, one eviction: the least recently used block of either model.
    plan = index.prepare_store(1, A.keys([b"k1", b"k2"]))
    assert plan.evicted == A.keys([b"k0"])
    index.complete_store(1, plan.keys, [True, True], sums(2))
    assert index.prepare_load(1, A.keys([b"k0"])) is None  # gone: a load pins nothing
    index.clear(1)
    assert index.lookup(1, A.keys([b"k1", b"k2"])) == 0 and index.lookup(2, B.keys([b"k0"])) == 1
