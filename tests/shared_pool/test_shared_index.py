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
    the checksums and keys by slot) frozen or untracked. Else a full pass
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
            index.commit_row_sums(1, *protocol.pack_row_sums_commit(  # as a GPU writer sends
                plan.slots, [[None, i] for i in range(len(plan.keys))]))
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
        # (what it keeps by slot besides: arrays of int64s, no object the collector walks)
        containers = {"slots": inner._slots, "pins": inner._pins, "order": inner.policy.order,
                      "sums": index._sums_at, "key_at": index._key_at}
        assert {name: len(c) - list(c).count(None) >= 1000 for name, c in containers.items()} \
            == dict.fromkeys(containers, True)
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


def commit_by_slots(index: SharedBlockIndex, client: int, slots: list[int],
                    lists: list[list[int | None]]) -> None:
    """A GPU writer's commit as the client sends it (COMMIT_ROW_SUMS), read by the index."""
    packed = protocol.pack_row_sums_commit(slots, lists)
    assert packed is not None
    index.commit_row_sums(client, *packed)


@pytest.mark.parametrize("ranks", [1, 3, 64])
def test_a_commit_by_slots_is_the_same_commit_by_keys(ranks: int) -> None:
    """A GPU writer's usual commit names the slots its plan gave and sends its row sums as
    bytes; the index keeps, answers and logs it as the same commit sent a key and a list a
    key, and skips a slot this client is not storing in (another client's, one never used) as
    it skips a key the client does not hold."""
    lists = [[None] * ranks + [100 * i + r + (1 << 63) for r in range(ranks)] for i in range(3)]
    keys = A.keys([b"f0", b"f1", b"f2"])
    by_keys, by_slots = make(num_slots=8), make(num_slots=8)
    for index in (by_keys, by_slots):
        plan = index.prepare_store(1, keys[:2])
        other = index.prepare_store(2, B.keys([b"other"]))
        if index is by_keys:
            index.complete_store(1, keys, [True] * 3, lists)  # f2 is not being stored: skipped
        else:
            commit_by_slots(index, 1, plan.slots + other.slots + [7],
                            lists[:2] + [[None] * ranks + [5] * ranks] * 2)
        assert plan.keys == keys[:2] and index.unhashed == 2
        assert index.checksums(1, keys) == kept(lists[:2]) + [None]
        assert index.index.is_being_stored(other.keys[0])  # the other client's: untouched
        index.reads(1, row_sums=True, needs_xxh3=False)
        assert index.lookup(1, keys) == 2
        assert index.index.stats.stores == 2 and index.index.num_free == 5
    assert by_slots.changes(1, -1) == by_keys.changes(1, -1)
    assert by_slots.changes(2, -1) == by_keys.changes(2, -1)


@pytest.mark.parametrize(("args", "why"), [
    ((b"\0\0\0\0\1\0\0\0", b"\5" * 16, 0), "1 to 64 ranks a block, got 0"),
    ((b"\0\0\0\0\1\0\0\0", b"\5" * 16, 65), "1 to 64 ranks a block, got 65"),
    ((b"\0\0\0\0\1\0\0\0", b"\5" * 16, True), "1 to 64 ranks a block, got True"),
    (([0, 1], b"\5" * 16, 1), "names its slots as uint32s, got an array of 2 items"),
    ((b"", b"", 1), "names its slots as uint32s, got 0 bytes"),
    ((b"\0\0\0\0\1\0\0", b"\5" * 16, 1), "names its slots as uint32s, got 7 bytes"),
    ((b"\0\0\0\0\1\0\0\0", b"\5" * 15, 1), "of 2 slots at 1 ranks sends 16 B"),
    ((b"\0\0\0\0\1\0\0\0", b"\5" * 16, 2), "of 2 slots at 2 ranks sends 32 B"),
    ((b"\0\0\0\0\1\0\0\0", [5, 6], 1), "sends 16 B of row sums, got an array of 2"),
    ((b"\0\0\0\0\4\0\0\0", b"\5" * 16, 1), "slot 4 is not one of the pool's 4"),
    ((b"\0\0\0\0\0\0\0\0", b"\5" * 16, 1), "slot 0 is named twice")])
def test_a_bad_commit_by_slots_changes_nothing(args: tuple, why: str) -> None:
    index = make()
    keys = A.keys([b"b0", b"b1"])
    plan = index.prepare_store(1, keys)
    assert sorted(plan.slots) == [0, 1]
    with pytest.raises(ValueError, match=why):
        index.commit_row_sums(1, *args)
    assert all(index.index.is_being_stored(key) for key in keys) and index.unhashed == 0
    commit_by_slots(index, 1, plan.slots, [[None, 5], [None, 6]])
    assert index.checksums(1, keys) == [(None, 5), (None, 6)] and index.unhashed == 2


def test_a_slots_state_leaves_with_its_block() -> None:
    """What the index keeps by slot (the client storing into it and whether its plan asked
    xxh3s; who is to hash the block stored there, or that nobody will) goes with the block:
    a block placed in the slot next, evicted, discarded or released, keeps only its own."""
    index = make(num_slots=2)
    index.reads(1, row_sums=True, needs_xxh3=False)  # A: nobody needs xxh3s
    index.reads(2, row_sums=True, needs_xxh3=True)  # B: hashed after their commit
    first = index.prepare_store(1, A.keys([b"o0", b"o1"]))
    assert not first.hash_later and index.held()[1]["storing"] == 2
    commit_by_slots(index, 1, first.slots, [[None, 1], [None, 2]])
    assert (index.unhashed, index.orphans, index.storing) == (2, 2, 0)
    second = index.prepare_store(2, B.keys([b"h0", b"h1"]))  # evicts both, takes their slots
    assert second.hash_later and sorted(second.slots) == sorted(first.slots)
    assert (index.unhashed, index.orphans) == (0, 0)
    assert {c: held["storing"] for c, held in index.held().items()} == {1: 0, 2: 2}
    commit_by_slots(index, 1, second.slots, [[None, 5], [None, 6]])  # not its slots now
    assert index.storing == 2 and index.checksums(2, second.keys) == [None, None]
    index.complete_store(2, second.keys[:1], [True], [[7, 3]])  # with its xxh3: hashed
    commit_by_slots(index, 2, second.slots[1:], [[None, 4]])
    assert (index.unhashed, index.orphans, index.storing) == (1, 0, 0)
    index.release(1)  # its blocks are gone: another's in their slots are not orphaned
    assert (index.unhashed, index.orphans) == (1, 0)
    assert index.lookup(2, second.keys) == 2
    index.reads(2, row_sums=False, needs_xxh3=True)
    assert index.lookup(2, second.keys) == 1 and index.prepare_load(2, second.keys) is None
    assert index.add_sums(2, second.keys[1:], [[8, 4]], second.slots[1:]) == [True]
    assert (index.unhashed, index.orphans) == (0, 0) and index.lookup(2, second.keys) == 2
    seq = index.changes(2, -1)[0]  # the whole list (it changed how it reads), then changes
    index.discard(2, [second.keys[0]] * 2 + second.keys[1:])  # h0 named twice: one removal
    assert index.changes(2, seq)[2] == [[False, key] for key in second.keys]
    third = index.prepare_store(2, B.keys([b"x"]))
    assert third.slots[0] in second.slots
    index.complete_store(2, third.keys, [False], [None])  # failed: the slot is free, clean
    assert index.checksums(2, third.keys) == [None] and index.storing == 0
    fourth = index.prepare_store(2, B.keys([b"y"]))
    commit_by_slots(index, 2, fourth.slots, [[None, 9]])
    assert (index.unhashed, index.orphans) == (1, 0)
    index.release(2)  # it was to hash y: nobody will now
    assert (index.unhashed, index.orphans) == (1, 1)
    index.open(3, [B.digest], 2000)  # needs xxh3s: an orphan it stores is replaced
    assert index.prepare_store(3, fourth.keys).keys == fourth.keys
    assert (index.unhashed, index.orphans, index.held()[3]["storing"]) == (0, 0, 1)


def test_a_commit_naming_only_another_clients_slots_changes_nothing() -> None:
    index = make()
    theirs = index.prepare_store(2, B.keys([b"o0", b"o1"]))
    commit_by_slots(index, 1, theirs.slots, [[None, 1], [None, 2]])
    assert all(map(index.index.is_being_stored, theirs.keys)) and index.unhashed == 0
    assert index.checksums(2, theirs.keys) == [None, None] and index.index.stats.stores == 0
    commit_by_slots(index, 2, theirs.slots, [[None, 1], [None, 2]])
    assert index.checksums(2, theirs.keys) == [(None, 1), (None, 2)]


def test_a_commit_by_slots_names_a_block_only_in_the_slot_it_holds() -> None:
    """The index keeps the key last placed in each slot; a commit by a slot its key no longer
    holds (a stale one: that key is stored again elsewhere) is skipped, and a block removed
    while being stored frees its slot at its commit, as a commit by keys does."""
    index = make(num_slots=4)
    stale, other = A.keys([b"s0", b"s1"])
    first = index.prepare_store(1, [stale, other])
    index.complete_store(1, [stale, other], [False, False], [None, None])  # both slots free
    again = index.prepare_store(1, [stale])
    assert again.slots != first.slots[:1]
    commit_by_slots(index, 1, first.slots[:1], [[None, 9]])  # where `stale` was: skipped
    assert index.index.is_being_stored(stale) and index.checksums(1, [stale]) == [None]
    commit_by_slots(index, 1, again.slots, [[None, 9]])
    assert index.checksums(1, [stale]) == [(None, 9)]
    removed = A.keys([b"r0"])
    plan = index.prepare_store(1, removed)
    index.discard(1, removed)  # being stored: it drains
    assert index.index.num_draining == 1 and index.index.num_free == 2
    commit_by_slots(index, 1, plan.slots, [[None, 3]])
    assert index.index.num_draining == 0 and index.index.num_free == 3
    assert index.checksums(1, removed) == [None] and index.lookup(1, removed) == 0


@pytest.mark.parametrize(("slots", "lists"), [
    ([0, 1], [[None, 1], None]),  # a failed store
    ([0, 1], [[None, 1], [7, 2]]),  # an xxh3 taken
    ([0, 1], [[None, 1], [None, None, 2, 3]]),  # two rank counts
    ([0, 1], [[None, 1], [None, None]]),  # a row sum missing: the daemon refuses it
    ([0], [[5]]),  # an xxh3 only
    ([0], [[]]),
    ([0], [[None, -1]]),  # not a uint64
    ([0], [[None, 1 << 64]]),
    ([0], [[None, True]]),
    ([0], [[None, 1.0]]),
    ([0, 1], [[None, None, 1, 2], [None, None, 3, "4"]]),
    ([0, 1], [[None, None, 5, 6]]),  # fewer lists than slots
    ([0], [[None, 5], [None, 6]]),  # more
    ([1 << 32], [[None, 5]])])  # a slot past a uint32
def test_any_other_commit_goes_by_keys(slots: list, lists: list) -> None:
    assert protocol.pack_row_sums_commit(slots, lists) is None


def test_a_commit_with_the_wrong_number_of_lists_is_refused() -> None:
    index = make()
    keys = A.keys([b"w0", b"w1"])
    index.prepare_store(1, keys)
    for lists in ([[None, None, 5, 6]], [[None, 5], [None, 6], [None, 7]]):
        with pytest.raises(ValueError, match="one ok flag and one checksum list per key"):
            index.complete_store(1, keys, [True, True], lists)
    with pytest.raises(ValueError, match="one ok flag and one checksum list per key"):
        index.complete_store(1, [], [], [5])
    assert all(index.index.is_being_stored(key) for key in keys) and index.unhashed == 0


def test_foreign_keys_and_oversized_blocks_are_refused() -> None:
    index = make()
    with pytest.raises(ValueError, match="not of a namespace this client declared"):
        index.lookup(1, B.keys([b"f"]))
    with pytest.raises(ValueError, match="a key: 17 to 256 bytes"):
        index.lookup(1, [A.digest + b"k" * 241])
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
