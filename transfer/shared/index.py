"""The daemon's block index: every client's namespaces under one capacity, with leases.

One BlockIndex over all slots (keys carry their namespace digest, so LRU/ARC runs across models)
plus what each client holds: the keys it is storing and its pins. A client only names keys of the
namespaces it declared at hello (a key of another is refused: a foreign block is never served),
and completes only what it holds (a completion for anything else, e.g. of a connection that died
before a reconnect, is ignored). When a client goes (its socket closed: exit, SIGKILL), `release`
fails its stores (their slots were being written: never readable) and drops its pins.

Checksums: a writer commits each block with the xxh3-64 of every rank's part of its slot, seeded
by its key (transfer/slot_checker.py), then, from GPU ranks, each rank's row sum
(transfer.checksums.block_sums); the index keeps the list as it is and hands it out with the
slots a load pins, so every reader checks its part before the load is reported. The
daemon never hashes (its loop would cap commits near one core's hash rate).

Any client may be hostile or buggy: every verb checks all it is given before it changes
anything (a bad key, a key named twice in a commit, a checksum that is not a uint64: nothing
changes, ValueError naming the value by a short prefix), a connection holds one lease (a second
`open` is refused), and what a lease may hold is bounded (its pins; its stores by the slots).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from transfer.block_index import BlockIndex, StorePlan
from transfer.keys import DIGEST_BYTES
from transfer.shared.protocol import MAX_KEY_BYTES, brief

MAX_NAMESPACES = 64  # per lease: an engine declares one (a test harness a few)
MAX_BLOCK_SUMS = 128  # per block: an xxh3-64 and a row sum for each of up to 64 ranks
MAX_PINS = 1 << 20  # per lease (a load pins each of its keys once): far above any engine's
MAX_ANSWER_SUMS = 1 << 22  # checksums in one answer (~36 MiB packed, under MAX_MESSAGE_BYTES)
MAX_LOG = 1 << 16  # commits and removals kept for `changes` (a reader further behind: the list)
MAX_ANSWER_CHANGES = 1 << 16  # changes in one answer (the rest: the next call)


class ChangeLog:
    """The last MAX_LOG commits and removals of readable blocks, numbered in order, for the
    engines that publish KV events (each reads what changed since its last read, once a step):
    a block another engine stored or evicted is in every reader's stream, without a round trip
    per block."""

    def __init__(self, size: int = MAX_LOG) -> None:
        self._entries: deque[tuple[bool, bytes]] = deque(maxlen=size)
        self.next_seq = 0  # the number the next entry gets

    def add(self, stored: bool, keys: Sequence[bytes]) -> None:
        self._entries.extend((stored, key) for key in keys)
        self.next_seq += len(keys)

    def since(self, seq: int, namespaces: frozenset[bytes],
              limit: int = MAX_ANSWER_CHANGES) -> tuple[int, list[list[object]]] | None:
        """(the number to ask from next, [[stored, key], ...] of `namespaces` from `seq` on);
        None when entries from `seq` on are gone (the reader fell behind by over MAX_LOG)."""
        first = self.next_seq - len(self._entries)
        if seq < first:
            return None
        out: list[list[object]] = []
        at = seq
        for stored, key in list(self._entries)[seq - first:seq - first + limit]:
            at += 1
            if key[:DIGEST_BYTES] in namespaces:
                out.append([stored, key])
        return at, out


@dataclass
class Lease:
    """What one client holds: its namespaces, the slot bytes its blocks use, keys being stored
    and pins."""

    namespaces: frozenset[bytes]
    entry_bytes: int
    storing: set[bytes] = field(default_factory=set)
    pins: Counter[bytes] = field(default_factory=Counter)

    def held(self) -> dict[str, int]:
        """What it holds now (the daemon's stats, per client)."""
        return {"storing": len(self.storing), "pinned": sum(self.pins.values()),
                "pinned_keys": len(self.pins)}


class SharedBlockIndex:
    """Keys of several namespaces -> slots of one pool, with the checksums of their blocks."""

    def __init__(self, num_slots: int, slot_bytes: int, policy: str) -> None:
        self.index = BlockIndex(None, num_slots, policy)
        self.slot_bytes = slot_bytes
        self._sums: dict[bytes, list[int]] = {}  # stored keys -> per-rank checksums at commit
        self.leases: dict[int, Lease] = {}  # client id -> its lease
        self.log = ChangeLog()  # readable blocks committed and removed, for `changes`

    def open(self, client: int, namespaces: Sequence[bytes], entry_bytes: int) -> None:
        """A new client whose blocks, of the given namespaces, use `entry_bytes` of a slot. One
        lease per client: a second is refused (replacing the first would leak what it holds)."""
        if client in self.leases:
            raise ValueError("this connection already said hello: its lease stays as it is "
                             "(a new lease needs a new connection)")
        if not isinstance(namespaces, list | tuple) or not 0 < len(namespaces) <= MAX_NAMESPACES:
            raise ValueError(f"hello needs 1 to {MAX_NAMESPACES} namespace digests of "
                             f"{DIGEST_BYTES} B, got {brief(namespaces)}")
        for digest in namespaces:
            if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
                raise ValueError(f"hello needs namespace digests of {DIGEST_BYTES} B, got "
                                 f"{brief(digest)}")
        if isinstance(entry_bytes, bool) or not isinstance(entry_bytes, int) or entry_bytes <= 0:
            raise ValueError(f"a block's bytes must be a positive int, got {brief(entry_bytes)}")
        if entry_bytes > self.slot_bytes:
            raise ValueError(f"a block of {entry_bytes} B does not fit this pool's slots of "
                             f"{self.slot_bytes} B: serve the pool with --slot-bytes "
                             f"{entry_bytes} or more")
        self.leases[client] = Lease(frozenset(namespaces), entry_bytes)

    def release(self, client: int) -> None:
        """The client is gone: its stores fail, its pins drop."""
        lease = self.leases.pop(client, None)
        if lease is None:
            return
        self.index.complete_store(list(lease.storing), False)
        pins = Counter(lease.pins)
        while pins:  # complete_load takes each key once per call
            once = list(pins)
            self.index.complete_load(once)
            pins.subtract(once)
            pins = +pins  # the keys still pinned

    # ---- requests ------------------------------------------------------------------------

    def lookup(self, client: int, keys: Sequence[bytes]) -> int:
        return self.index.lookup_prefix(self._own(client, keys))

    def prepare_stores(self, client: int, key_lists: Sequence[Sequence[bytes]]
                       ) -> list[StorePlan]:
        """`prepare_store` of each list, every list checked before any is placed."""
        if not isinstance(key_lists, list | tuple):
            raise ValueError(f"expected a list of key lists, got {brief(key_lists)}")
        checked = [self._own(client, keys, unique=True) for keys in key_lists]
        return [self._place(client, keys) for keys in checked]

    def prepare_store(self, client: int, keys: Sequence[bytes]) -> StorePlan:
        return self._place(client, self._own(client, keys, unique=True))

    def _place(self, client: int, keys: list[bytes]) -> StorePlan:
        plan = self.index.prepare_store(keys)
        for key in plan.evicted:
            self._sums.pop(key, None)
        self.log.add(False, plan.evicted)
        self.leases[client].storing.update(plan.keys)
        return plan

    def prepare_load(self, client: int, keys: Sequence[bytes]) -> tuple[list[int],
                                                                        list[list[int]]] | None:
        """Pin every key and return their slots and checksums, or pin nothing and return None
        when one is not stored (evicted or removed since the client's lookup: its load fails)."""
        keys = self._own(client, keys)  # a key named twice: None (BlockIndex refuses it)
        lease = self.leases[client]
        if sum(lease.pins.values()) + len(keys) > MAX_PINS:
            raise ValueError(f"a client holds at most {MAX_PINS} pins: complete its loads first")
        try:
            plan = self.index.prepare_load(keys)  # checks every key before it pins any
        except ValueError:
            return None
        lease.pins.update(keys)
        return plan.slots, [self._sums[key] for key in keys]

    def checksums(self, client: int, keys: Sequence[bytes]) -> list[list[int] | None]:
        answer = [self._sums.get(key) for key in self._own(client, keys)]
        if sum(len(sums) for sums in answer if sums) > MAX_ANSWER_SUMS:
            raise ValueError(f"an answer of over {MAX_ANSWER_SUMS} checksums: ask for fewer "
                             f"keys at a time")
        return answer

    # ---- notices -------------------------------------------------------------------------

    def complete_store(self, client: int, keys: Sequence[bytes], flags: Sequence[bool],
                       sums: Sequence[Sequence[int] | None]) -> None:
        """Commit (or fail) the client's stores; each ok key with its per-rank checksums. The
        whole commit is checked first (a key named twice, a flag that is not a bool, a missing
        checksum: ValueError, nothing changes); keys the client is not storing are ignored."""
        lease = self.leases[client]
        keys = self._own(client, keys, unique=True)
        if not isinstance(flags, list | tuple) or not isinstance(sums, list | tuple) \
                or not len(flags) == len(sums) == len(keys):
            raise ValueError(f"a commit needs one ok flag and one checksum list per key: "
                             f"{len(keys)} keys, flags {brief(flags)}, checksums {brief(sums)}")
        for key, ok, block_sums in zip(keys, flags, sums, strict=True):
            if not isinstance(ok, bool):
                raise ValueError(f"key {brief(key)}: its ok flag is {brief(ok)}, not a bool")
            if ok:
                _check_sums(key, block_sums)
        held = [(key, ok, block_sums) for key, ok, block_sums in zip(keys, flags, sums,
                                                                     strict=True)
                if key in lease.storing]
        self.index.complete_store([key for key, *_ in held], [ok for _, ok, _ in held])
        committed = []
        for key, ok, block_sums in held:
            lease.storing.discard(key)
            if ok and self.index.contains(key):  # not if removed while it was being stored
                self._sums[key] = list(block_sums)
                committed.append(key)
        self.log.add(True, committed)

    def complete_load(self, client: int, keys: Sequence[bytes]) -> None:
        lease = self.leases[client]
        held = [key for key in dict.fromkeys(self._own(client, keys)) if lease.pins[key] > 0]
        for key in held:
            lease.pins[key] -= 1
            if not lease.pins[key]:
                del lease.pins[key]
        self.index.complete_load(held)

    def discard(self, client: int, keys: Sequence[bytes]) -> None:
        keys = self._own(client, keys)
        self.log.add(False, [key for key in keys if self.index.contains(key)])
        self.index.discard(keys)
        for key in keys:
            self._sums.pop(key, None)

    def clear(self, client: int) -> None:
        """Drop every key of the client's namespaces (another model's keys stay)."""
        namespaces = self.leases[client].namespaces
        mine = [key for key in self.index.held_keys() if key[:DIGEST_BYTES] in namespaces]
        self.discard(client, mine)

    def changes(self, client: int, since: int) -> list[object]:
        """[next number, whole, [[stored, key], ...]]: the commits and removals of the client's
        namespaces' readable blocks from number `since` on; or, for `since` -1 or one the log
        no longer holds, every readable block of them now (`whole` True: the reader replaces
        what it knew)."""
        if isinstance(since, bool) or not isinstance(since, int) or since < -1 \
                or since > self.log.next_seq:
            raise ValueError(f"changes since {brief(since)}: a number from -1 to "
                             f"{self.log.next_seq}")
        namespaces = self.leases[client].namespaces
        found = None if since < 0 else self.log.since(since, namespaces)
        if found is not None:
            return [found[0], False, found[1]]
        held = [[True, key] for key in self.index.held_keys()
                if key[:DIGEST_BYTES] in namespaces and self.index.contains(key)]
        return [self.log.next_seq, True, held]

    def _own(self, client: int, keys: Sequence[bytes], unique: bool = False) -> list[bytes]:
        """The keys, each checked: bytes of a namespace this client declared, of a sane size;
        with `unique`, none named twice."""
        if not isinstance(keys, list | tuple):
            raise ValueError(f"expected a list of keys, got {brief(keys)}")
        namespaces = self.leases[client].namespaces
        for key in keys:
            if not isinstance(key, bytes) or not DIGEST_BYTES < len(key) <= MAX_KEY_BYTES \
                    or key[:DIGEST_BYTES] not in namespaces:
                raise ValueError(f"key {brief(key)} is not of a namespace this client declared "
                                 f"(a key: {DIGEST_BYTES + 1} to {MAX_KEY_BYTES} bytes, the "
                                 f"namespace's digest + a block hash)")
        if unique and len(set(keys)) != len(keys):
            twice = next(key for key, count in Counter(keys).items() if count > 1)
            raise ValueError(f"key {brief(twice)} is named twice in one request")
        return list(keys)


def _check_sums(key: bytes, sums: object) -> None:
    why = f"key {brief(key)} committed without its per-rank xxh3-64 checksums"
    if not isinstance(sums, list | tuple) or not 0 < len(sums) <= MAX_BLOCK_SUMS:
        raise ValueError(f"{why} (1 to {MAX_BLOCK_SUMS} uint64s): got {brief(sums)}")
    for value in sums:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
            raise ValueError(f"{why}: {brief(value)} is not a uint64")
