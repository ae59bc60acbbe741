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


@pytest.mark.parametrize("since", [-2, True, "0", 99, 1.5])
def test_a_bad_sequence_number_is_refused(since: object) -> None:
    with pytest.raises(ValueError, match="changes since"):
        make().changes(1, since)  # type: ignore[arg-type]
