"""Tests for transfer/block_index.py: states, two-phase verbs, LRU/ARC orders, namespacing."""

from __future__ import annotations

import ast
import random
import sys
from pathlib import Path

import pytest

import transfer.block_index as block_index_module
import transfer.eviction as eviction_module
from transfer.block_index import BlockIndex, IndexStats, StorePlan
from transfer.eviction import ARCPolicy, EvictionPolicy, LRUPolicy
from transfer.keys import Namespace

NS = Namespace(model="m", dtype="bfloat16", block_size=16, block_layout="BLHNC")
OTHER_NS = Namespace(model="m", dtype="float16", block_size=16, block_layout="BLHNC")


def key(name: str) -> bytes:
    return NS.key(name.encode())


def keys(spaced_names: str) -> list[bytes]:
    return [key(name) for name in spaced_names.split()]


def names(some_keys: list[bytes]) -> str:
    return " ".join(k[16:].decode() for k in some_keys)


def store(index: BlockIndex, names_: str, ok: bool = True) -> StorePlan:
    plan = index.prepare_store(keys(names_))
    index.complete_store(plan.keys, ok)
    return plan


def load(index: BlockIndex, names_: str) -> None:
    plan = index.prepare_load(keys(names_))
    index.complete_load(plan.keys)


def snapshot(index: BlockIndex, names_: str) -> tuple:
    """Everything observable without side effects, for 'nothing changed' checks."""
    ks = keys(names_)
    return (len(index), index.num_free, index.num_draining, index.stats,
            [index.contains(k) for k in ks], [index.is_being_stored(k) for k in ks])


# ---- eviction orders -------------------------------------------------------------------------


def test_lru_evicts_least_recently_loaded_first() -> None:
    index = BlockIndex(NS, 3, "lru")
    for name in ["A", "B", "C"]:
        store(index, name)
    load(index, "A")  # order now B C A
    assert names(store(index, "D").evicted) == "B"
    assert names(store(index, "E").evicted) == "C"
    load(index, "D")  # order now A E D
    assert names(store(index, "F").evicted) == "A"
    assert [index.contains(k) for k in keys("A B C D E F")] == [False] * 3 + [True] * 3
    assert index.stats.evictions == 3


def test_lru_one_call_keeps_the_prefix_head_most_recent() -> None:
    index = BlockIndex(NS, 3, "lru")
    store(index, "A B C")
    # Evicting the tail first keeps the shortest prefixes usable.
    assert names(store(index, "X").evicted) == "C"
    assert names(store(index, "Y").evicted) == "B"
    load(index, "A X")  # loads touch tail first too: A most recent
    assert names(store(index, "Z").evicted) == "Y"
    assert names(store(index, "W").evicted) == "X"


def test_arc_scripted_trace_recency_frequency_and_ghost_hits() -> None:
    index = BlockIndex(NS, 4, "arc")
    arc = index.policy
    assert isinstance(arc, ARCPolicy)
    for name in ["A", "B"]:
        store(index, name)
    load(index, "A")
    load(index, "B")  # A, B read twice: frequency list t2
    store(index, "C")
    store(index, "D")  # recency list t1 = C D; pool full
    trace = []
    for name in ["E", "C", "D", "A", "F", "G", "E"]:
        plan = store(index, name)
        trace.append((name, names(plan.evicted), arc.target_t1_size))
    assert trace == [
        ("E", "C", 0.0),  # |t1| > p: the once-used C goes, not the older but frequent A
        ("C", "D", 1.0),  # C was in b1: p += max(|b2|/|b1|, 1) = 1; |t1| 2 > 1 evicts from t1
        ("D", "A", 2.0),  # D in b1: p = 2; |t1| 1 <= 2 so t2 yields its oldest, A
        ("A", "E", 1.0),  # A in b2: p -= 1; |t1| == p and A came from b2: evict from t1
        ("F", "B", 1.0),  # t1 empty: t2's oldest
        ("G", "C", 1.0),  # |t1| = 1 == p, G is new: t2's oldest
        ("E", "D", 3.0),  # E in b1 with |b2|/|b1| = 2/1: p += 2; |t1| 2 <= 3: from t2
    ]
    assert list(arc.t1) == keys("F G")
    assert list(arc.t2) == keys("A E")
    assert list(arc.b1) == []
    assert list(arc.b2) == keys("B C D")
    # LRU on the same start evicts the old frequent A where ARC kept it.
    lru = BlockIndex(NS, 4, "lru")
    for name in ["A", "B"]:
        store(lru, name)
    load(lru, "A")
    load(lru, "B")
    store(lru, "C")
    store(lru, "D")
    assert names(store(lru, "E").evicted) == "A"


def test_arc_b2_hit_shrinks_p_by_the_ghost_ratio_and_busy_t2_falls_back_to_t1() -> None:
    index = BlockIndex(NS, 4, "arc")
    arc = index.policy
    assert isinstance(arc, ARCPolicy)
    store(index, "A")
    load(index, "A")
    for name in ["B", "C", "D"]:
        store(index, name)
    trace = [(name, names(store(index, name).evicted), arc.target_t1_size) for name in "EBC"]
    assert trace == [("E", "B", 0.0), ("B", "C", 1.0), ("C", "A", 2.0)]
    pinned = index.prepare_load(keys("B C"))  # all of t2 busy
    # |t1| 2 <= p 2 prefers t2, which has nothing evictable: t1's oldest goes instead.
    assert [names(store(index, name).evicted) for name in "FG"] == ["D", "E"]
    assert (list(arc.b1), list(arc.b2)) == (keys("D E"), keys("A"))
    index.complete_load(pinned.keys)
    # A in b2 with |b1|/|b2| = 2: p -= 2; |t1| 2 > 0 evicts from t1.
    assert names(store(index, "A").evicted) == "F"
    assert arc.target_t1_size == 0.0
    assert (list(arc.t1), list(arc.t2), list(arc.b1)) == (keys("G"), keys("C B A"), keys("D E F"))
    index.prepare_store(keys("E"))
    assert arc.target_t1_size == 1.0
    index.clear()
    assert arc.target_t1_size == 0.0
    assert not (arc.t1 or arc.t2 or arc.b1 or arc.b2)


def test_arc_ghost_lists_stay_bounded_under_a_scan() -> None:
    index = BlockIndex(NS, 3, "arc")
    arc = index.policy
    assert isinstance(arc, ARCPolicy)
    store(index, "A")
    load(index, "A")  # A in t2
    evicted = [names(store(index, f"s{i}").evicted) for i in range(20)]
    assert "A" not in evicted  # a one-pass scan never flushes the frequent key
    assert evicted[:4] == ["", "", "s0", "s1"]
    assert len(arc.t1) + len(arc.b1) <= 3
    assert len(arc.t1) + len(arc.t2) + len(arc.b1) + len(arc.b2) <= 6
    assert index.contains(key("A"))


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_busy_keys_are_skipped_in_policy_order(policy: str) -> None:
    index = BlockIndex(NS, 3, policy)
    for name in ["A", "B", "C"]:
        store(index, name)
    pinned = index.prepare_load(keys("A"))
    load(index, "B")
    load(index, "C")  # A is first in eviction order (LRU; ARC's t2) but pinned
    assert names(store(index, "D").evicted) == "B"
    index.complete_load(pinned.keys)
    assert index.contains(key("A"))


# ---- pins, busy keys, partial placement ------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_pool_full_of_pinned_places_nothing_and_overwrites_nothing(policy: str) -> None:
    index = BlockIndex(NS, 2, policy)
    store(index, "A B")
    pinned = index.prepare_load(keys("A B"))
    plan = index.prepare_store(keys("C D"))
    assert plan == StorePlan(keys=[], slots=[], not_placed=keys("C D"), evicted=[],
                             evicted_slots=[])
    assert index.prepare_load(keys("A B")).slots == pinned.slots  # still there, same slots
    index.complete_load(keys("A B"))
    index.complete_load(keys("A B"))  # two loads pinned twice: now idle
    plan = index.prepare_store(keys("C"))
    assert plan.slots[0] in pinned.slots
    assert len(plan.evicted) == 1


def test_pins_are_counted_per_load() -> None:
    index = BlockIndex(NS, 1)
    store(index, "A")
    index.prepare_load(keys("A"))
    index.prepare_load(keys("A"))
    index.complete_load(keys("A"))
    assert index.prepare_store(keys("B")).not_placed == keys("B")  # one pin left
    index.complete_load(keys("A"))
    assert names(index.prepare_store(keys("B")).evicted) == "A"
    with pytest.raises(ValueError, match="no load in flight"):
        index.complete_load(keys("B"))


def test_full_pool_places_a_prefix_and_says_what_was_not_placed() -> None:
    index = BlockIndex(NS, 4)
    storing = index.prepare_store(keys("A B"))  # busy: may not be evicted
    plan = index.prepare_store(keys("C D E F"))
    assert names(plan.keys) == "C D"
    assert names(plan.not_placed) == "E F"
    assert plan.evicted == []
    assert sorted(plan.slots + storing.slots) == [0, 1, 2, 3]
    assert index.num_free == 0
    assert [index.is_being_stored(k) for k in keys("C D E F")] == [True, True, False, False]


def test_keys_of_the_call_are_skipped_and_never_evicted_by_it() -> None:
    index = BlockIndex(NS, 3)
    store(index, "A")
    store(index, "B")  # LRU order A B: A is the oldest
    plan = index.prepare_store(keys("A C D"))
    assert names(plan.keys) == "C D"
    assert plan.not_placed == []
    assert names(plan.evicted) == "B"  # not A, which this call is extending
    assert index.contains(key("A"))


def test_being_stored_keys_are_not_readable_and_end_the_prefix() -> None:
    index = BlockIndex(NS, 4)
    plan = index.prepare_store(keys("A B C"))
    index.complete_store(keys("A C"), True)
    assert index.lookup_prefix(keys("A B C")) == 1
    assert index.contains(key("C")) and not index.contains(key("B"))
    assert index.is_being_stored(key("B")) and not index.is_being_stored(key("A"))
    with pytest.raises(ValueError, match="still being stored"):
        index.prepare_load(keys("A B"))
    assert index.prepare_store(keys("B")).keys == []  # not stored twice
    index.complete_store(keys("B"), True)
    assert index.lookup_prefix(keys("A B C D")) == 3
    assert index.prepare_load(keys("A B C")).slots == plan.slots


def test_prefix_slots_are_the_stored_prefix_and_count_as_a_lookup() -> None:
    index = BlockIndex(NS, 4)
    plan = store(index, "A B C")
    index.prepare_store(keys("D"))  # being stored: ends a prefix
    assert index.prefix_slots(keys("A B D C")) == plan.slots[:2]
    assert index.prefix_slots(keys("C A")) == [plan.slots[2], plan.slots[0]]
    assert index.prefix_slots(keys("X A")) == []
    assert (index.stats.hits, index.stats.misses) == (4, 4)
    assert index.readable_slots(keys("C D X A")) == [plan.slots[2], None, None, plan.slots[0]]
    assert index.readable_slots(keys("A B")) == plan.slots[:2]


def test_a_commit_by_the_callers_slots_takes_them_and_frees_a_draining_keys() -> None:
    """commit_checked with the slots the caller's own records give (the shared pool's commit
    by slots): each live key is readable in its slot; a key removed while being stored frees
    its slot, whatever slot the caller names."""
    index = BlockIndex(NS, 4)
    plan = index.prepare_store(keys("A B C"))
    index.remove(keys("B"))  # drains until its store ends
    assert index.commit_checked(keys("A B C"), [True] * 3, plan.slots) == \
        [plan.slots[0], None, plan.slots[2]]
    assert (index.num_free, index.num_draining, index.stats.stores) == (2, 0, 3)
    assert index.prefix_slots(keys("A C")) == [plan.slots[0], plan.slots[2]]
    other = index.prepare_store(keys("D E"))
    assert index.commit_checked(keys("D E"), [True, True], other.slots) == other.slots
    assert index.prefix_slots(keys("D E")) == other.slots


def test_failed_stores_free_their_slots() -> None:
    index = BlockIndex(NS, 3)
    plan = index.prepare_store(keys("A B C"))
    index.complete_store(plan.keys, [True, False, True])
    assert [index.contains(k) for k in keys("A B C")] == [True, False, True]
    assert (len(index), index.num_free) == (2, 1)
    freed = plan.slots[1]
    assert index.prepare_store(keys("D")).slots == [freed]
    index.complete_store(keys("D"), False)
    assert index.stats == IndexStats(stores=2, failed_stores=2)
    assert index.prepare_store(keys("B")).evicted == []  # a failed key is simply gone


# ---- namespaces ------------------------------------------------------------------------------


def test_keys_of_another_namespace_never_hit() -> None:
    index = BlockIndex(NS, 4)
    hashes = [b"h0", b"h1", 7]
    plan = index.prepare_store(NS.keys(hashes))
    index.complete_store(plan.keys, True)
    foreign = OTHER_NS.keys(hashes)
    before = snapshot(index, "h0 h1")
    for call in (lambda: index.lookup_prefix(foreign), lambda: index.contains(foreign[0]),
                 lambda: index.is_being_stored(foreign[0]), lambda: index.prepare_load(foreign),
                 lambda: index.prepare_store(foreign), lambda: index.remove(foreign)):
        with pytest.raises(ValueError, match=foreign[0].hex()):
            call()
    assert snapshot(index, "h0 h1") == before
    assert index.lookup_prefix(NS.keys(hashes)) == 3
    assert BlockIndex(OTHER_NS, 4).lookup_prefix(foreign) == 0


# ---- remove and clear ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_clear_frees_idle_slots_and_drains_busy_ones(policy: str) -> None:
    index = BlockIndex(NS, 4, policy)
    store(index, "A B C")
    index.prepare_load(keys("A"))
    index.prepare_store(keys("D"))
    index.clear()
    assert (len(index), index.num_free, index.num_draining) == (0, 2, 2)
    assert index.lookup_prefix(keys("A B C D")) == 0
    assert not index.is_being_stored(key("D"))
    # Draining keys cannot be stored again yet, and nothing after them is placed.
    plan = index.prepare_store(keys("E A F"))
    assert (names(plan.keys), names(plan.not_placed)) == ("E", "A F")
    index.complete_load(keys("A"))
    index.complete_store(keys("D"), True)  # finished, but the reset discarded it
    assert not index.contains(key("D"))
    assert (index.num_free, index.num_draining) == (3, 0)
    assert index.stats.stores == 4
    if policy == "arc":
        assert isinstance(index.policy, ARCPolicy)
        assert index.policy.target_t1_size == 0.0 and not index.policy.b1


def test_remove_drops_idle_now_and_busy_when_released() -> None:
    index = BlockIndex(NS, 3)
    store(index, "A B")
    index.prepare_load(keys("B"))
    index.remove(keys("A B"))
    assert (len(index), index.num_free, index.num_draining) == (0, 2, 1)
    with pytest.raises(ValueError, match=key("A").hex()):
        index.remove(keys("A"))
    index.complete_load(keys("B"))
    assert (index.num_free, index.num_draining) == (3, 0)
    assert store(index, "B").keys == keys("B")  # may be stored again once released


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("num_slots", [0, -1, True, 2.0])
def test_bad_num_slots(num_slots: object) -> None:
    with pytest.raises(ValueError, match=repr(num_slots)):
        BlockIndex(NS, num_slots)  # type: ignore[arg-type]


def test_bad_policy() -> None:
    with pytest.raises(ValueError, match="'mru'"):
        BlockIndex(NS, 4, "mru")


def _bad_calls(index: BlockIndex) -> list[tuple[object, str]]:
    a, b, x = key("A"), key("B"), key("X")
    return [
        (lambda: index.prepare_store([x, x]), f"{x.hex()} appears twice"),
        (lambda: index.prepare_store([x, b"short"]), "b'short'"),
        (lambda: index.prepare_store(x), "one value"),
        (lambda: index.prepare_store(["A"]), "'A'"),
        (lambda: index.prepare_load([a, x]), f"{x.hex()} is not stored"),
        (lambda: index.prepare_load([a, a]), "twice"),
        (lambda: index.complete_store([b, a], True), f"{a.hex()} is not being stored"),
        (lambda: index.complete_store([b], [True, False]), "2 flags for 1 keys"),
        (lambda: index.complete_store([b], [1]), "got 1"),
        (lambda: index.complete_store([b], None), "None"),
        (lambda: index.complete_load([a]), f"{a.hex()} has no load in flight"),
        (lambda: index.remove([a, x]), f"{x.hex()} is not in the index"),
        (lambda: index.lookup_prefix([a, 5]), "got 5"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls(BlockIndex(NS, 1)))))
def test_bad_input_raises_before_anything_changes(case: int) -> None:
    index = BlockIndex(NS, 2)
    store(index, "A")
    index.prepare_store(keys("B"))  # B being stored; the pool is now full
    call, message = _bad_calls(index)[case]
    before = snapshot(index, "A B X")
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]
    assert snapshot(index, "A B X") == before
    # A is not pinned by a refused load: it is still evictable.
    index.complete_store(keys("B"), True)
    assert names(index.prepare_store(keys("Y")).evicted) == "A"


def test_stats_count_lookups_stores_evictions() -> None:
    index = BlockIndex(NS, 2)
    store(index, "A B")
    store(index, "C", ok=False)
    store(index, "D")
    # One call admits B then A, so A is the more recent: C's store evicted B, then failed.
    assert index.lookup_prefix(keys("A D C")) == 2
    assert index.lookup_prefix(keys("B")) == 0
    assert index.stats == IndexStats(hits=2, misses=2, stores=3, evictions=1, failed_stores=1)


def test_evicted_slots_are_the_victims_slots_now_given_to_placed_keys() -> None:
    index = BlockIndex(NS, 3, "lru")
    first = store(index, "A B C")
    slot_of = dict(zip(names(first.keys).split(), first.slots, strict=True))
    load(index, "B")  # LRU order: A C B (one call admits C, B, A: A is the most recent)
    plan = store(index, "D E")
    assert plan.evicted_slots == [slot_of[name] for name in names(plan.evicted).split()]
    assert sorted(plan.slots) == sorted(plan.evicted_slots)
    assert index.num_reclaimable == 3 and index.num_free == 0


def test_a_call_takes_free_slots_first_then_the_oldest_idle_keys_slots_in_turn() -> None:
    index = BlockIndex(NS, 5, "lru")
    assert store(index, "A B C").slots == [2, 1, 0]  # admitted C, B, A: slots 0, 1, 2
    pinned = index.prepare_load(keys("B"))  # LRU order now C A B; B may not go
    plan = index.prepare_store(keys("D E F G"))
    # Tail first: G and F take the free slots 3 and 4 as they are handed out; then E evicts the
    # oldest idle key (C, slot 0) and D the next (A, slot 2), skipping pinned B.
    assert plan == StorePlan(keys=keys("D E F G"), slots=[2, 0, 4, 3], not_placed=[],
                             evicted=keys("C A"), evicted_slots=[0, 2])
    assert list(index.policy.order) == keys("B G F E D")
    assert [index.contains(k) for k in keys("A B C")] == [False, True, False]
    index.complete_store(plan.keys, True)
    assert store(index, "H") == StorePlan(keys("H"), [3], [], keys("G"), [3])  # B still pinned
    index.complete_load(pinned.keys)
    assert index.num_free == 0 and index.num_reclaimable == 5 and len(index) == 5
    assert index.stats.evictions == 3


def test_removing_idle_and_busy_keys_at_once_frees_the_idle_slots_in_order() -> None:
    index = BlockIndex(NS, 4, "lru")
    plan = store(index, "A B C D")
    slot_of = dict(zip(names(plan.keys).split(), plan.slots, strict=True))
    pinned = index.prepare_load(keys("B"))
    index.remove(keys("A B C"))
    assert index.num_free == 2 and index.num_draining == 1 and list(index.policy.order) == \
        keys("D")
    # A's then C's slot were freed; the tail F takes the last freed. B drains: not placed.
    assert index.prepare_store(keys("E F B")) == StorePlan(
        keys("E F"), [slot_of["A"], slot_of["C"]], keys("B"), [], [])
    index.complete_load(pinned.keys)
    assert index.num_draining == 0 and index.num_free == 1


@pytest.mark.parametrize("seed", range(20))
def test_lru_admits_and_discards_a_call_at_once_as_key_by_key(seed: int) -> None:
    """LRU's one-pass admit_all and discard_all leave the order and pick the victims that
    admitting (and discarding) each key in turn does."""
    rng = random.Random(seed)
    fast, slow = LRUPolicy(), LRUPolicy()
    live = [NS.key(i) for i in range(rng.randint(0, 12))]
    for policy in (fast, slow):
        policy.admit_all(live, len(live), lambda _: False)
    busy = set(rng.sample(live, rng.randint(0, len(live))))
    touched = rng.sample(live, rng.randint(0, len(live)))
    gone = rng.sample(live, rng.randint(0, len(live)))
    for policy in (fast, slow):
        policy.access_all(touched)
    fast.discard_all(gone)
    EvictionPolicy.discard_all(slow, gone)
    idle = [k for k in fast.order if k not in busy]
    new = [NS.key(100 + i) for i in range(rng.randint(0, 8))]
    room = max(0, len(new) - len(idle)) + rng.randint(0, 2)
    can_evict = (lambda k: k not in busy and k not in set(new))
    assert fast.admit_all(new, room, can_evict) == \
        EvictionPolicy.admit_all(slow, new, room, can_evict)
    assert list(fast.order) == list(slow.order)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_restore_adopts_stored_keys_in_their_slots(policy: str) -> None:
    index = BlockIndex(NS, 5, policy)
    index.restore({key("A"): 3, key("B"): 0})
    assert index.lookup_prefix(keys("B A")) == 2
    assert index.num_free == 3 and index.num_reclaimable == 5
    plan = store(index, "C D E")
    assert sorted(plan.slots) == [1, 2, 4] and not plan.evicted
    # Restored keys are the oldest (slot order: B then A) and evictable.
    assert store(index, "F").evicted == keys("B") and store(index, "G").evicted == keys("A")
    assert index.prepare_load(keys("C")).slots == plan.slots[:1]


def test_restore_refuses_bad_input_and_a_used_index() -> None:
    index = BlockIndex(NS, 4)
    with pytest.raises(ValueError, match="out of range"):
        index.restore({key("A"): 4})
    with pytest.raises(ValueError, match="one slot"):
        index.restore({key("A"): 1, key("B"): 1})
    with pytest.raises(ValueError, match="namespace"):
        index.restore({OTHER_NS.key(b"A"): 1})
    assert index.num_free == 4 and len(index) == 0
    store(index, "A")
    with pytest.raises(ValueError, match="empty index"):
        index.restore({key("B"): 2})


@pytest.mark.parametrize("module", [block_index_module, eviction_module])
def test_module_imports_no_torch(module: object) -> None:
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= set(sys.stdlib_module_names) | {"transfer"}, imported


# ---- randomized invariants against a model ---------------------------------------------------


class _Model:
    """The expected state: per key (storing, pins), the slot it holds, and draining keys."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.live: dict[bytes, list] = {}  # key -> [storing, pins, slot]
        self.draining: dict[bytes, list] = {}

    def slot_owners(self) -> dict[int, bytes]:
        owners: dict[int, bytes] = {}
        for k, (_, _, slot) in [*self.live.items(), *self.draining.items()]:
            assert slot not in owners, f"slot {slot} held twice"
            owners[slot] = k
        return owners

    def idle(self, k: bytes) -> bool:
        return k in self.live and not self.live[k][0] and self.live[k][1] == 0


def _check_against_model(index: BlockIndex, model: _Model, universe: list[bytes]) -> None:
    held = len(model.slot_owners())
    assert index.num_free + held == index.num_slots
    assert (len(index), index.num_draining) == (len(model.live), len(model.draining))
    for k in universe:
        state = model.live.get(k)
        assert index.contains(k) == (state is not None and not state[0])
        assert index.is_being_stored(k) == (state is not None and state[0])
    policy = index.policy
    if isinstance(policy, ARCPolicy):
        assert set(policy.t1) | set(policy.t2) == set(model.live)
        assert len(policy.t1) + len(policy.b1) <= index.num_slots
        assert len(policy.t1) + len(policy.t2) + len(policy.b1) + len(policy.b2) <= \
            2 * index.num_slots
        assert not (set(policy.b1) | set(policy.b2)) & set(model.live)
    else:
        assert set(policy.order) == set(model.live)


def _random_step(
    index: BlockIndex, model: _Model, universe: list[bytes], rng: random.Random
) -> None:
    op = rng.choices(["store", "complete_store", "load", "complete_load", "remove", "clear",
                      "lookup"], weights=[6, 5, 4, 4, 1, 0.2, 2])[0]
    if op == "store":
        call = rng.sample(universe, rng.randint(1, 4))
        free_before = index.num_free
        idle_outside = sum(model.idle(k) for k in model.live if k not in call)
        plan = index.prepare_store(call)
        needed = [k for k in call if k not in model.live]
        first_blocked = next((i for i, k in enumerate(needed) if k in model.draining), len(needed))
        fits = min(first_blocked, free_before + idle_outside)
        assert plan.keys == needed[:fits] and plan.not_placed == needed[fits:]
        owners = model.slot_owners()
        for k in plan.evicted:
            assert model.idle(k) and k not in call, "evicted a busy key or a key of the call"
            del owners[model.live.pop(k)[2]]
        for k, slot in zip(plan.keys, plan.slots, strict=True):
            assert 0 <= slot < index.num_slots and slot not in owners, f"slot {slot} reused"
            owners[slot] = k
            model.live[k] = [True, 0, slot]
    elif op == "complete_store":
        storing = [k for k, s in [*model.live.items(), *model.draining.items()] if s[0]]
        done = rng.sample(storing, rng.randint(0, len(storing)))
        flags = [rng.random() < 0.8 for _ in done]
        index.complete_store(done, flags)
        for k, ok in zip(done, flags, strict=True):
            if k in model.draining:
                del model.draining[k]
            elif ok:
                model.live[k][0] = False
            else:
                del model.live[k]
    elif op == "load":
        stored = [k for k, s in model.live.items() if not s[0]]
        wanted = rng.sample(stored, rng.randint(0, min(3, len(stored))))
        plan = index.prepare_load(wanted)
        assert plan.slots == [model.live[k][2] for k in wanted]  # the slot it was stored in
        for k in wanted:
            model.live[k][1] += 1
    elif op == "complete_load":
        pinned = [k for k, s in [*model.live.items(), *model.draining.items()] if s[1]]
        done = rng.sample(pinned, rng.randint(0, len(pinned)))
        index.complete_load(done)
        for k in done:
            state = model.live.get(k) or model.draining[k]
            state[1] -= 1
            if k in model.draining and state[1] == 0:
                del model.draining[k]
    elif op in ("remove", "clear"):
        gone = (list(model.live) if op == "clear"
                else rng.sample(list(model.live), rng.randint(0, min(2, len(model.live)))))
        if op == "clear":
            index.clear()
        else:
            index.remove(gone)
        for k in gone:
            state = model.live.pop(k)
            if state[0] or state[1]:
                model.draining[k] = state
    else:
        probe = rng.sample(universe, rng.randint(0, 5))
        expected = next((i for i, k in enumerate(probe)
                         if k not in model.live or model.live[k][0]), len(probe))
        assert index.lookup_prefix(probe) == expected


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_the_invariants(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    num_slots = rng.randint(1, 8)
    universe = [NS.key(i) for i in range(num_slots * 2 + 3)]
    index = BlockIndex(NS, num_slots, policy)
    model = _Model(num_slots)
    for _ in range(600):
        _random_step(index, model, universe, rng)
        _check_against_model(index, model, universe)
    assert index.stats.stores > 0 and index.stats.evictions > 0
