"""Scheduler-side block index: namespaced keys -> host pool slot ids, with LRU or ARC eviction.

Plain Python (no torch) so the vLLM scheduler process can own it; workers only ever receive the
slot ids it hands out.

Keys. The index takes full keys (`Namespace.key(block_hash)`: 16-byte namespace digest + hash
bytes), not raw hashes, so the same bytes go on to the remote store and evicted keys can be handed
on unchanged. Every method refuses a key of another namespace with ValueError: it can never hit.

States of a key that holds a slot:
- being stored: slot reserved by prepare_store; not readable and never a hit until
  complete_store(ok=True); a failed store frees the slot and forgets the key;
- stored: readable, and idle while no load pins it;
- pinned: stored and read by in-flight loads (a count: two loads of a key pin it twice).
Only stored, idle keys are evicted. Only loads count as use for the eviction policy, and within one
call keys reach the policy tail first, so the head of a prefix is the most recent: evicting a tail
block leaves a shorter prefix usable, evicting the head would strand the whole chain.

Removal (remove, clear). Idle keys go at once and free their slots. Busy keys (pinned or being
stored) start draining: they vanish at once (not readable, not being stored, never a hit) and
their slot is freed when their last load or their store completes; until then the key cannot be
stored again (prepare_store lists it as not placed). So no slot that a copy is still using is
handed out again, and data that a reset meant to discard is never revived.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from typing import Protocol

from transfer.eviction import ARCPolicy, EvictionPolicy, LRUPolicy
from transfer.keys import DIGEST_BYTES, Namespace


@dataclass(frozen=True)
class StorePlan:
    """What prepare_store did.

    `keys` got `slots` (same order, request order) and are now being stored: the worker copies
    them, then the caller reports complete_store. `not_placed` needed a slot and got none (every
    other slot busy, or a removed key still draining); placed keys are always a prefix of the keys
    that needed a slot. Keys already stored or being stored are in neither list. `evicted` are the
    stored keys evicted to make room, in eviction order, and `evicted_slots` the slots they held
    (now some placed key's: a tier below may still copy the old bytes out first).
    """

    keys: list[bytes]
    slots: list[int]
    not_placed: list[bytes]
    evicted: list[bytes]
    evicted_slots: list[int]
    # A checked pool's: whether blocks committed by their row sums must get their xxh3s after
    # (some reader or tier below checks by xxh3; transfer/shared/index.py)
    hash_later: bool = True


@dataclass(frozen=True)
class LoadPlan:
    """Slots to read `keys` from (same order); the keys stay pinned until complete_load.
    `sums`: a shared pool's checksums of each key's block, per rank (None: a private pool)."""

    keys: list[bytes]
    slots: list[int]
    sums: list[list[int]] | None = None


@dataclass
class IndexStats:
    """Counters since construction, in keys (clear does not reset them)."""

    hits: int = 0  # keys inside the prefixes lookup_prefix returned
    misses: int = 0  # keys lookup_prefix was asked about past those prefixes
    stores: int = 0  # stores completed ok
    evictions: int = 0
    failed_stores: int = 0



class BlockIndex:
    """Maps keys of one namespace to slots of a pool of `num_slots` blocks (see module doc).

    `namespace` None: keys of any namespace (the shared host pool's daemon, which holds several
    under one capacity and checks each client's namespaces itself).

    `policy` names the eviction policy, "lru" or "arc"; the instance is the `policy` attribute
    (read it, e.g. ARC's target_t1_size; only the index drives it). Verbs that change state refuse
    duplicate keys; every bad input raises ValueError naming the value before anything changes.
    """

    def __init__(self, namespace: Namespace | None, num_slots: int, policy: str = "lru") -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        if policy not in ("lru", "arc"):
            raise ValueError(f"policy must be 'lru' or 'arc', got {policy!r}")
        self.namespace = namespace
        self.num_slots = num_slots
        self.policy: EvictionPolicy = LRUPolicy() if policy == "lru" else ARCPolicy(num_slots)
        self._digest = None if namespace is None else namespace.digest
        # A key's state in containers of keys and ints, no object a key: Python's collector walks
        # none per stored key (a pool's index holds hundreds of thousands; docs/pool.md).
        self._slots: dict[bytes, int] = {}  # live keys (stored or being stored) -> slot
        self._draining: dict[bytes, int] = {}  # removed while busy -> slot, freed when released
        self._storing: set[bytes] = set()  # keys being stored, live or draining
        self._pins: dict[bytes, int] = {}  # pinned keys, live or draining -> loads in flight
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._num_idle = 0  # live keys stored and unpinned: the eviction candidates
        self._stats = IndexStats()

    # ---- queries -------------------------------------------------------------------------

    def __len__(self) -> int:
        """Keys stored or being stored (draining keys excluded)."""
        return len(self._slots)

    def __contains__(self, key: bytes) -> bool:
        return self.contains(key)

    # A private index lives as long as its pools: its slots always name the workers' own pools.
    # The shared pool's client (transfer/shared/client.py) changes both when it reconnects.
    epoch = 0  # bumped when the slots handed out before belong to an index that is gone
    segment = ""  # the shared-memory segment the slots live in; "" for each worker's own pool
    checked = False  # a private pool's blocks are written by its own workers only

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_reclaimable(self) -> int:
        """Slots a store could take now: free ones and those of stored, idle keys."""
        return len(self._free) + self._num_idle

    @property
    def num_draining(self) -> int:
        """Removed keys whose slots wait for their in-flight loads or store."""
        return len(self._draining)

    @property
    def stats(self) -> IndexStats:
        """A snapshot of the counters."""
        return replace(self._stats)

    def contains(self, key: bytes) -> bool:
        """True when `key` is stored and readable."""
        return self._checked(key) in self._slots and key not in self._storing

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """`contains` for each of `keys` (a shared pool's index answers in one round trip)."""
        return [slot is not None
                for slot in self.readable_slots(self._checked_keys(keys, unique=False))]

    def held_keys(self) -> list[bytes]:
        """Keys stored or being stored (draining keys excluded)."""
        return list(self._slots)

    def slot_of(self, key: bytes) -> int:
        """The slot a key holds (stored, being stored or draining)."""
        slot = self._slots.get(self._checked(key))
        if slot is None:
            slot = self._draining.get(key)
        if slot is None:
            raise ValueError(f"key {key.hex()} holds no slot")
        return slot

    def readable_slots(self, keys: Sequence[bytes]) -> list[int | None]:
        """The slot each key is stored and readable in (None: not stored, or being stored),
        unchecked: the shared pool's index asks of keys it has checked."""
        slots = list(map(self._slots.get, keys))
        if self._storing.isdisjoint(keys):
            return slots
        storing = self._storing
        return [None if key in storing else slot for key, slot in zip(keys, slots, strict=True)]

    def slots_held(self, keys: Sequence[bytes]) -> list[int | None]:
        """The slot each key holds (stored, being stored or draining; None: none), unchecked:
        the shared pool's index asks of keys it took from its own records."""
        slots = list(map(self._slots.get, keys))
        if None in slots and self._draining:
            slots = [self._draining.get(key) if slot is None else slot
                     for key, slot in zip(keys, slots, strict=True)]
        return slots

    def is_idle(self, key: bytes) -> bool:
        """Stored, and neither being stored nor pinned (removing it frees its slot at once)."""
        return self._checked(key) in self._slots and self._idle(key)

    def _idle(self, key: bytes) -> bool:
        """Of a key that holds a slot: neither being stored nor pinned."""
        return key not in self._storing and key not in self._pins

    def is_being_stored(self, key: bytes) -> bool:
        """True while a store of `key` is in flight (a load of it must wait for complete_store)."""
        return self._checked(key) in self._slots and key in self._storing

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of `keys` stored now; a key being stored ends it."""
        return len(self.prefix_slots(keys))

    def prefix_slots(self, keys: Sequence[bytes]) -> list[int]:
        """`lookup_prefix`, as the slots of that prefix (the shared pool's index reads its
        blocks' state by slot), each key's looked up once."""
        keys = self._checked_keys(keys, unique=False)
        slots, storing = self._slots, self._storing
        found = []
        for key in keys:
            slot = slots.get(key)
            if slot is None or key in storing:
                break
            found.append(slot)
        self._stats.hits += len(found)
        self._stats.misses += len(keys) - len(found)
        return found

    # ---- two-phase verbs -----------------------------------------------------------------

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan:
        """Reserve slots for the keys not yet stored or being stored, evicting idle stored keys
        in policy order as needed; keys of this call are never evicted by it. Places as many as
        fit, as a prefix (see StorePlan)."""
        keys = self._checked_keys(keys)
        live = self._slots
        draining = self._draining
        needed: list[bytes] = []
        blocked: list[bytes] = []  # a draining key and every key after it: placed stays a prefix
        idle_in_call = 0
        if not live.keys().isdisjoint(keys) or (draining and not draining.keys().isdisjoint(keys)):
            for key in keys:
                if key in live:
                    idle_in_call += self._idle(key)
                elif blocked or key in draining:
                    blocked.append(key)
                else:
                    needed.append(key)
        else:  # the usual store: every key new
            needed = keys
        room = len(self._free) + self._num_idle - idle_in_call
        placed, not_placed = needed[:room], needed[room:] + blocked

        in_call = set(keys)

        def can_evict(key: bytes) -> bool:  # the call's own first: those admitted hold no slot
            return key not in in_call and self._idle(key)

        # Tail first: the head of the prefix ends most recent. The first keys take free slots as
        # pop() hands them out; each later one takes its victim's slot.
        order = placed[::-1]
        free = self._free
        taken = min(len(free), len(order))
        evicted = self.policy.admit_all(order, len(free), can_evict)
        slots = free[len(free) - taken:][::-1]
        del free[len(free) - taken:]
        evicted_slots = list(map(live.pop, evicted))
        self._num_idle -= len(evicted)
        slots += evicted_slots
        live.update(zip(order, slots, strict=True))
        self._storing.update(order)
        self._stats.evictions += len(evicted)
        return StorePlan(placed, slots[::-1], not_placed, evicted, evicted_slots)

    def prepare_stores(self, key_lists: Sequence[Sequence[bytes]]) -> list[StorePlan]:
        """`prepare_store` of each list in turn (one call per engine step)."""
        return [self.prepare_store(keys) for keys in key_lists]

    def complete_store(self, keys: Sequence[bytes], ok: bool | Sequence[bool]
                       ) -> list[int | None]:
        """Finish stores begun by prepare_store: ok keys become readable, failed ones free their
        slot and are forgotten. `ok` is one flag for all keys or one per key. Returns, per key,
        the slot it is readable in now (None: failed, or removed while it was being stored)."""
        keys = self._checked_keys(keys)
        if isinstance(ok, bool):
            flags = [ok] * len(keys)
        elif isinstance(ok, Sequence):
            flags = list(ok)
        else:
            raise ValueError(f"ok must be a bool or a sequence of bools, got {ok!r}")
        if len(flags) != len(keys):
            raise ValueError(f"ok has {len(flags)} flags for {len(keys)} keys: {ok!r}")
        if not set(map(type, flags)) <= {bool}:
            bad = next(flag for flag in flags if type(flag) is not bool)
            raise ValueError(f"ok flags must be bool, got {bad!r}")
        return self.commit_checked(keys, flags)

    def commit_checked(self, keys: Sequence[bytes], flags: Sequence[bool],
                       slots: Sequence[int] | None = None) -> list[int | None]:
        """`complete_store` of keys and flags its caller has checked as `complete_store` does
        (well-formed keys, each named once; one bool per key): the shared pool's index checks
        every commit whole before it calls this, and a GPU writer's commits are the daemon's
        busiest request. `slots`: the slot each key holds, from the caller's own records (the
        shared pool's index keeps a block's state by slot), taken as they are (the caller
        vouches for them), which saves a lookup a key in a map of every stored key (a cache
        miss each while copies stream through the host)."""
        # Checked whole before anything changes; a commit of keys all stored ok and none
        # draining (the usual one) is then applied in passes in C. A key being stored is never
        # pinned (a load waits for its commit): each one stored ok is idle now.
        storing, draining = self._storing, self._draining
        if not storing.issuperset(keys):
            for key in keys:
                if key not in storing:
                    raise ValueError(f"key {key.hex()} is not being stored")
        stores = flags.count(True)
        storing.difference_update(keys)
        if stores == len(keys) and (not draining or draining.keys().isdisjoint(keys)):
            self._num_idle += stores
            readable: list[int | None] = list(map(self._slots.__getitem__, keys)) \
                if slots is None else list(slots)
        else:
            readable = []
            for key, stored in zip(keys, flags, strict=True):
                slot = None
                if key in draining:
                    self._free.append(draining.pop(key))
                elif stored:
                    self._num_idle += 1
                    slot = self._slots[key]
                else:
                    self._free.append(self._slots.pop(key))
                    self.policy.discard(key)
                readable.append(slot)
        self._stats.stores += stores
        self._stats.failed_stores += len(flags) - stores
        return readable

    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan:
        """Slots of stored keys, pinned (never evicted) until complete_load."""
        keys = self._checked_keys(keys)
        slots, pins = list(map(self._slots.get, keys)), self._pins
        if None in slots or not self._storing.isdisjoint(keys):
            for key in keys:
                if key not in self._slots:
                    raise ValueError(f"key {key.hex()} is not stored")
                if key in self._storing:
                    raise ValueError(f"key {key.hex()} is still being stored")
        loads = list(map(pins.get, keys, repeat(0)))
        self._num_idle -= loads.count(0)  # stored, none storing: idle where unpinned
        pins.update(zip(keys, map((1).__add__, loads), strict=True))  # keys are unique
        self.policy.access_all(reversed(keys))  # tail first: the prefix's head ends most recent
        return LoadPlan(keys, slots)  # type: ignore[arg-type]  # no None: checked above

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Unpin keys read by a finished load (once per prepare_load that named them)."""
        keys = self._checked_keys(keys)
        pins, draining = self._pins, self._draining
        if not all(map(pins.__contains__, keys)):  # a pinned key is stored (live or draining)
            for key in keys:
                if key not in pins:
                    raise ValueError(f"key {key.hex()} has no load in flight")
        # A pinned key is never being stored: one whose last load ends is idle (live), or
        # frees its slot (draining).
        loads = list(map(pins.__getitem__, keys))
        if loads.count(1) == len(loads):  # the usual unpin: each key's one load, in C
            done = keys
        else:
            done = [key for key, count in zip(keys, loads, strict=True) if count == 1]
            pins.update((key, count - 1) for key, count in zip(keys, loads, strict=True)
                        if count > 1)
        deque(map(pins.pop, done), 0)
        if draining and not draining.keys().isdisjoint(done):
            self._free.extend(draining.pop(key) for key in done if key in draining)
            self._num_idle += sum(key in self._slots for key in done)
        else:  # the usual unpin: none draining
            self._num_idle += len(done)

    def restore(self, stored: Mapping[bytes, int]) -> None:
        """Adopt keys found stored in given slots (a persistent tier after a restart) into an
        empty index, as stored and idle, each slot's key most recent in slot order."""
        if self._slots or self._draining or len(self._free) != self.num_slots:
            raise ValueError("restore needs an empty index")
        keys = self._checked_keys(list(stored))
        slots = list(stored.values())
        for slot in slots:
            if isinstance(slot, bool) or not isinstance(slot, int) \
                    or not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot!r} out of range [0, {self.num_slots})")
        if len(set(slots)) != len(slots):
            raise ValueError("two keys restored into one slot")
        for key, slot in sorted(zip(keys, slots, strict=True), key=lambda pair: pair[1]):
            self.policy.admit(key, False, lambda _: False)
            self._slots[key] = slot
        taken = set(slots)
        self._free = [slot for slot in self._free if slot not in taken]
        self._num_idle = len(keys)

    # ---- removal -------------------------------------------------------------------------

    def remove(self, keys: Sequence[bytes]) -> None:
        """Drop stored or being-stored keys: idle ones free their slot now, busy ones drain."""
        keys = self._checked_keys(keys)
        live = self._slots
        if not all(map(live.__contains__, keys)):
            for key in keys:
                if key not in live:
                    raise ValueError(f"key {key.hex()} is not in the index")
        self.policy.discard_all(keys)
        dropped = list(map(live.pop, keys))
        if not self._storing.isdisjoint(keys) or not self._pins.keys().isdisjoint(keys):
            for key, slot in zip(keys, dropped, strict=True):
                self._release(key, slot)
        else:  # the usual removal: every key idle, its slot free at once
            self._free.extend(dropped)
            self._num_idle -= len(dropped)

    def discard(self, keys: Sequence[bytes]) -> None:
        """`remove` the keys that are stored or being stored; the others are ignored."""
        self.remove(list(filter(self._slots.__contains__,
                                dict.fromkeys(self._checked_keys(keys, unique=False)))))

    def clear(self) -> None:
        """Drop every key (reset_cache): idle slots are freed now, busy keys drain; the policy
        forgets its history. Counters are kept."""
        for key in list(self._slots):
            self._release(key, self._slots.pop(key))
        self.policy.clear()

    def _release(self, key: bytes, slot: int) -> None:
        """A removed key's slot: free now when idle, else once its load or store ends."""
        if self._idle(key):
            self._free.append(slot)
            self._num_idle -= 1
        else:
            self._draining[key] = slot

    # ---- validation ----------------------------------------------------------------------

    def _checked(self, key: bytes) -> bytes:
        if not isinstance(key, bytes) or len(key) <= DIGEST_BYTES:
            raise ValueError(
                f"a key is bytes: a {DIGEST_BYTES}-byte namespace digest + a block hash, "
                f"got {key!r}"
            )
        if self._digest is not None and key[:DIGEST_BYTES] != self._digest:
            raise ValueError(f"key {key.hex()} is not of this index's namespace {self.namespace}")
        return key

    def _checked_keys(self, keys: Sequence[bytes], unique: bool = True) -> list[bytes]:
        if isinstance(keys, bytes | str):
            raise ValueError(f"expected a sequence of keys, got one value {keys!r}")
        checked = list(keys)
        digest = self._digest
        # passes in C over the keys; on a failure, a pass that names the bad key
        if not (set(map(type, checked)) == {bytes} and min(map(len, checked)) > DIGEST_BYTES
                and (digest is None or all(map(bytes.startswith, checked, repeat(digest))))):
            for key in checked:
                self._checked(key)
        if unique and len(set(checked)) != len(checked):
            seen: set[bytes] = set()
            for key in checked:
                if key in seen:
                    raise ValueError(f"key {key.hex()} appears twice in one call")
                seen.add(key)
        return checked


class PoolIndex(Protocol):
    """The index verbs the scheduler core uses, served by a private `BlockIndex` or by a shared
    pool's daemon (transfer/shared/client.py `SharedIndex`), whose plans may come back None
    (a key another engine evicted) and whose blocks carry checksums (`checked`)."""

    epoch: int
    segment: str
    checked: bool

    @property
    def num_reclaimable(self) -> int: ...

    @property
    def stats(self) -> IndexStats: ...

    def present(self, keys: Sequence[bytes]) -> list[bool]: ...

    def lookup_prefix(self, keys: Sequence[bytes]) -> int: ...

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan: ...

    def prepare_stores(self, key_lists: Sequence[Sequence[bytes]]) -> list[StorePlan]: ...

    def complete_store(self, keys: Sequence[bytes], ok: bool | Sequence[bool],
                       sums: Sequence[Sequence[int]] | None = None) -> None: ...

    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan | None: ...

    def complete_load(self, keys: Sequence[bytes]) -> None: ...

    def discard(self, keys: Sequence[bytes]) -> None: ...

    def clear(self) -> None: ...
