"""Eviction policies of the block index (transfer/block_index.py): LRU and ARC.

A policy only orders keys and picks victims; the index decides which keys may go (`can_evict`:
stored and idle) and owns the slots.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat

CanEvict = Callable[[bytes], bool]


class EvictionPolicy(ABC):
    """Orders the keys that hold slots and picks eviction victims.

    The index reports every key that takes a slot (`admit`), is read (`access`) or leaves without
    being evicted (`discard`). Eviction happens inside `admit` so that a policy can learn from the
    incoming key before it chooses a victim (ARC does).
    """

    @abstractmethod
    def admit(self, key: bytes, need_room: bool, can_evict: CanEvict) -> bytes | None:
        """Track `key`, which takes a slot. When `need_room`, first evict and return one tracked key
        for which `can_evict` is true; the index only asks when such a key exists."""

    def admit_all(self, keys: Sequence[bytes], room: int, can_evict: CanEvict) -> list[bytes]:
        """`admit` each key in turn: the first `room` into free slots, each later one evicting a
        key; the victims in order. `can_evict` refuses the keys of the call (the index never lets
        a store evict its own keys), so a policy may pick every victim first (LRU does)."""
        return [victim for i, key in enumerate(keys)
                if (victim := self.admit(key, i >= room, can_evict)) is not None]

    @abstractmethod
    def access(self, key: bytes) -> None:
        """A tracked key was read."""

    def access_all(self, keys: Iterable[bytes]) -> None:
        """Tracked keys were read, in this order."""
        for key in keys:
            self.access(key)

    @abstractmethod
    def discard(self, key: bytes) -> None:
        """Stop tracking a key that leaves without eviction (failed store, remove)."""

    def discard_all(self, keys: Iterable[bytes]) -> None:
        """`discard` each key."""
        for key in keys:
            self.discard(key)

    @abstractmethod
    def clear(self) -> None:
        """Forget every key and all history."""


def _evict_first(entries: OrderedDict[bytes, None], can_evict: CanEvict) -> bytes | None:
    """Remove and return the oldest evictable key of `entries`, or None."""
    for key in entries:
        if can_evict(key):
            del entries[key]
            return key
    return None


class LRUPolicy(EvictionPolicy):
    """Least recently used: admitted or read keys go to the back, victims come from the front."""

    def __init__(self) -> None:
        self.order: OrderedDict[bytes, None] = OrderedDict()

    def admit(self, key: bytes, need_room: bool, can_evict: CanEvict) -> bytes | None:
        victim = None
        if need_room:
            victim = _evict_first(self.order, can_evict)
            if victim is None:
                raise AssertionError("admit asked for room with no idle key")
        self.order[key] = None
        return victim

    def admit_all(self, keys: Sequence[bytes], room: int, can_evict: CanEvict) -> list[bytes]:
        # The victims are the oldest evictable keys before the call: a key admitted by it goes
        # to the back, and the index never lets a call evict its own keys. So they are picked
        # first, in one pass, and the keys are admitted in C (a full pool evicts one for every
        # key a store places, so this is the daemon's busiest loop with `discard`).
        wanted = len(keys) - room
        victims: list[bytes] = []
        if wanted > 0:
            for key in self.order:
                if can_evict(key):
                    victims.append(key)
                    if len(victims) == wanted:
                        break
            else:
                raise AssertionError("admit asked for room with no idle key")
            deque(map(self.order.pop, victims), maxlen=0)
        self.order.update(zip(keys, repeat(None)))
        return victims

    def access(self, key: bytes) -> None:
        self.order.move_to_end(key)

    def access_all(self, keys: Iterable[bytes]) -> None:
        deque(map(self.order.move_to_end, keys), maxlen=0)  # a loop in C: a load's every key

    def discard(self, key: bytes) -> None:
        del self.order[key]

    def discard_all(self, keys: Iterable[bytes]) -> None:
        deque(map(self.order.pop, keys), maxlen=0)

    def clear(self) -> None:
        self.order.clear()


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) over `capacity` slots.

    `t1` holds keys used once since admission, `t2` keys read again (or readmitted from a ghost
    list); ghost lists `b1`/`b2` hold only the keys lately evicted from each. Readmitting a key from
    b1 means recency was under-served, so the target size of t1 (`target_t1_size`, the paper's p)
    grows by max(|b2|/|b1|, 1); from b2 it shrinks by max(|b1|/|b2|, 1). Victims come from t1 when
    |t1| > p (or |t1| == p and the incoming key was in b2), else from t2; the paper's rule,
    generalised to busy keys: the oldest evictable key of that list, else of the other one. Ghost
    lists are trimmed as in the paper, to |t1| + |b1| <= c and |t1| + |t2| + |b1| + |b2| <= 2c.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target_t1_size = 0.0
        self.t1: OrderedDict[bytes, None] = OrderedDict()
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def admit(self, key: bytes, need_room: bool, can_evict: CanEvict) -> bytes | None:
        in_b1, in_b2 = key in self.b1, key in self.b2
        if in_b1:
            step = max(len(self.b2) / len(self.b1), 1.0)
            self.target_t1_size = min(float(self.capacity), self.target_t1_size + step)
            del self.b1[key]
        elif in_b2:
            step = max(len(self.b1) / len(self.b2), 1.0)
            self.target_t1_size = max(0.0, self.target_t1_size - step)
            del self.b2[key]
        victim = self._replace(in_b2, can_evict) if need_room else None
        # A ghost hit is the key's second use within the history: it goes straight to t2.
        (self.t2 if in_b1 or in_b2 else self.t1)[key] = None
        while len(self.t1) + len(self.b1) > self.capacity:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.capacity:
            self.b2.popitem(last=False)
        return victim

    def _replace(self, incoming_in_b2: bool, can_evict: CanEvict) -> bytes:
        t1_size = len(self.t1)
        prefer_t1 = t1_size > 0 and (
            t1_size > self.target_t1_size
            or (incoming_in_b2 and t1_size == self.target_t1_size)
        )
        lists = [(self.t1, self.b1), (self.t2, self.b2)]
        if not prefer_t1:
            lists.reverse()
        for live, ghost in lists:
            victim = _evict_first(live, can_evict)
            if victim is not None:
                ghost[victim] = None
                return victim
        raise AssertionError("admit asked for room with no idle key")

    def access(self, key: bytes) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        else:
            self.t2.move_to_end(key)

    def discard(self, key: bytes) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            del self.t2[key]

    def clear(self) -> None:
        for entries in (self.t1, self.t2, self.b1, self.b2):
            entries.clear()
        self.target_t1_size = 0.0
