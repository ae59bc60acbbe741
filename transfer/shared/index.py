"""The daemon's block index: every client's namespaces under one capacity, with leases.

One BlockIndex over all slots (keys carry their namespace digest, so LRU/ARC runs across models)
plus what each client holds: the keys it is storing and its pins. A client only names keys of the
namespaces it declared at hello (a key of another is refused: a foreign block is never served),
and completes only what it holds (a completion for anything else, e.g. of a connection that died
before a reconnect, is ignored). When a client goes (its socket closed: exit, SIGKILL), `release`
fails its stores (their slots were being written: never readable) and drops its pins.

Checksums: a writer commits each block with the xxh3-64 of every rank's part of its slot, seeded
by its key (transfer/slot_checker.py), then, from GPU ranks, each rank's row sum
(transfer.checksums.block_sums); the index keeps the values as they are and hands them out with the
slots a load pins, so every reader checks its part before the load is reported. The
daemon never hashes (its loop would cap commits near one core's hash rate).

A GPU writer commits as soon as its copy is done, with its row sums only (the xxh3s nil: the
GPU took the row sums on the way, host hashing would hold the commit; sent by the slots its plan
gave, `commit_row_sums`, so the daemon reads no key a block), and attaches the xxh3s later
(`add_sums`), hashed from the slot once its row sums matched the commit again. Until then the
block is readable only to a lease that checks by row sums (`reads`): to any other it is a
miss (`lookup`), and a load of it pins nothing (`prepare_load`). The index keeps, per block not
yet hashed, the lease that committed it and its slot: `add_sums` attaches (or, nil, drops) only
where the key is still not hashed, was committed by the same lease, in the slot named, with the
same row sums (a block evicted and stored again since, by another lease or in another slot,
keeps its own; a block is never given an xxh3 over one it has).

The xxh3s are taken only where a reader needs them: each lease declares whether it does (it
checks loads by xxh3, or keeps blocks in a tier below, which checks them by xxh3), every lease
needs them until it says otherwise, and `prepare_stores` tells the writer whether any lease of
its namespaces needs them now (`hash_later`). A block stored while none did, or whose writer
left before attaching them, is orphaned: nobody will hash it. It stays readable to row-sum
readers, a miss to any other, and the first lease needing xxh3s that stores the key (having
missed it) replaces it: the orphan leaves (its slot freed once no load pins it) and the new
commit takes its place, to be hashed as any other.

The change log (`changes`, for KV events) gives each lease what it can load: a commit by row
sums is a store to the leases that read by row sums at once, and to the others once its xxh3s
are attached; a block that leaves before it was hashed is a removal to the former only.

Any client may be hostile or buggy: every verb checks all it is given before it changes
anything (a bad key, a key named twice in a commit, a checksum that is not a uint64: nothing
changes, ValueError naming the value by a short prefix), a connection holds one lease (a second
`open` is refused), and what a lease may hold is bounded (its pins; its stores by the slots).
"""

from __future__ import annotations

from array import array
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import compress, count, islice, repeat
from operator import itemgetter, not_

import numpy as np

from transfer.block_index import BlockIndex, StorePlan
from transfer.keys import DIGEST_BYTES
from transfer.shared.protocol import (
    MAX_BLOCK_SUMS,
    MAX_KEY_BYTES,
    brief,
    every_stored,
    read_row_sums_commit,
    row_sums_only_commit,
)

MAX_NAMESPACES = 64  # per lease: an engine declares one (a test harness a few)
MAX_PINS = 1 << 20  # per lease (a load pins each of its keys once): far above any engine's
MAX_ANSWER_SUMS = 1 << 22  # checksums in one answer (~36 MiB packed, under MAX_MESSAGE_BYTES)
MAX_EVICTED_SUMS = 1 << 20  # victims' checksums in one prepare_stores answer (the rest: None)
MAX_LOG = 1 << 16  # commits and removals kept for `changes` (a reader further behind: the list)
MAX_ANSWER_CHANGES = 1 << 16  # changes in one answer (the rest: the next call)
# A block's checksums: its xxh3s (nil until hashed), then its row sums. Kept as a tuple: Python's
# collector stops tracking a tuple of ints once it has seen it, where a list per stored key was one
# more object for every full pass to walk (docs/pool.md).
Sums = tuple[int | None, ...]
# In a per-slot array of client ids: none (an id is below it; its complement, ~id, negative)
NO_CLIENT = (1 << 63) - 1
_DIGEST = itemgetter(slice(None, DIGEST_BYTES))  # a key's namespace digest


# What a change log entry says, and to whom: (to a lease reading by row sums, to any other),
# each True (stored), False (removed) or None (no change to it).
REMOVED, STORED = 0, 1  # a hashed block (or one committed with its xxh3s): to every lease
ROW_SUMS_STORED = 2  # committed by row sums only: loadable by row-sum readers from now on
HASHED = 3  # its xxh3s attached: loadable by every lease from now on
ROW_SUMS_REMOVED = 4  # a block never hashed left: row-sum readers only ever had it
_MEANING = {REMOVED: (False, False), STORED: (True, True), ROW_SUMS_STORED: (True, None),
            HASHED: (None, True), ROW_SUMS_REMOVED: (False, None)}


class ChangeLog:
    """The last MAX_LOG commits and removals of blocks, numbered in order, for the engines that
    publish KV events (each reads what changed since its last read, once a step): a block
    another engine stored or evicted is in every reader's stream, without a round trip per
    block; each entry says what it means to a lease that reads by row sums and to any other
    (`_MEANING`)."""

    def __init__(self, size: int = MAX_LOG) -> None:
        # Entry i is (_kinds[i], _keys[i]): two deques of one bound drop their oldest together,
        # and a commit's keys go in as they are, with no (kind, key) pair made per key (those
        # pairs were about a tenth of a GPU writer's commit in the daemon, and slowed the rest).
        self._kinds: deque[int] = deque(maxlen=size)
        self._keys: deque[bytes] = deque(maxlen=size)
        self.next_seq = 0  # the number the next entry gets

    def add(self, kind: int, keys: Sequence[bytes]) -> None:
        self._kinds.extend(repeat(kind, len(keys)))
        self._keys.extend(keys)
        self.next_seq += len(keys)

    def since(self, seq: int, namespaces: frozenset[bytes], row_sums: bool = False,
              limit: int = MAX_ANSWER_CHANGES) -> tuple[int, list[list[object]]] | None:
        """(the number to ask from next, [[stored, key], ...] of `namespaces` from `seq` on, as
        a lease reading by row sums or not sees them); None when entries from `seq` on are gone
        (the reader fell behind by over MAX_LOG)."""
        first = self.next_seq - len(self._keys)
        if seq < first:
            return None
        side = 0 if row_sums else 1
        out: list[list[object]] = []
        at = seq
        start, stop = seq - first, seq - first + limit
        for kind, key in zip(islice(self._kinds, start, stop), islice(self._keys, start, stop),
                             strict=True):
            at += 1
            stored = _MEANING[kind][side]
            if stored is not None and key[:DIGEST_BYTES] in namespaces:
                out.append([stored, key])
        return at, out


@dataclass
class Lease:
    """What one client holds: its namespaces, the slot bytes its blocks use, and its pins (the
    blocks it is storing are kept by slot, in the index's `_storer`)."""

    namespaces: frozenset[bytes]
    entry_bytes: int
    pins: Counter[bytes] = field(default_factory=Counter)
    row_sum_reader: bool = False  # checks loads by row sums: loads blocks not yet hashed
    needs_xxh3: bool = True  # reads by xxh3 or keeps blocks below: stored blocks get hashed
    whole_changes: bool = False  # it changed how it reads: its next `changes` is the whole list


class SharedBlockIndex:
    """Keys of several namespaces -> slots of one pool, with the checksums of their blocks."""

    def __init__(self, num_slots: int, slot_bytes: int, policy: str) -> None:
        self.index = BlockIndex(None, num_slots, policy)
        self.slot_bytes = slot_bytes
        # What the index keeps of a block besides its key's slot, by that slot, in lists and
        # arrays made with the index (the daemon freezes them, docs/pool.md): a commit by slots
        # (a GPU writer's) reads and changes them a slot at a time, in C, and hashes no key; a
        # key's other verbs find its slot in the BlockIndex. A slot's entries but its key are
        # reset when its store ends or its block leaves (evicted, discarded); its key is read
        # only where those say the slot is in use.
        self._key_at: list[bytes | None] = [None] * num_slots  # the key last placed in it
        self._sums_at: list[Sums | None] = [None] * num_slots  # a stored block's checksums
        # The client storing into it; ~id where its plan asked no xxh3s (hash_later False).
        self._storer = array("q", [NO_CLIENT]) * num_slots
        # Stored by row sums only (its xxh3s not attached yet): the client that committed it;
        # ~id where nobody is going to hash it (an orphan: its plan asked none, or the client
        # left). A commit moves each slot's storer here as it is.
        self._unhashed_by = array("q", [NO_CLIENT]) * num_slots
        self._num_unhashed = 0
        self._num_orphans = 0
        # the last request's victims of the requester's namespaces, hashed: their checksums
        self.evicted_sums: dict[bytes, Sums] = {}
        self._evicted_count = 0  # checksums in evicted_sums (bounded: MAX_EVICTED_SUMS)
        self.leases: dict[int, Lease] = {}  # client id -> its lease
        self.log = ChangeLog()  # readable blocks committed and removed, for `changes`

    @property
    def unhashed(self) -> int:
        """Blocks stored with row sums only (their xxh3s not attached yet)."""
        return self._num_unhashed

    @property
    def orphans(self) -> int:
        """Of those, blocks nobody is going to hash (see module doc)."""
        return self._num_orphans

    @property
    def storing(self) -> int:
        """Blocks being stored."""
        return int(np.count_nonzero(np.frombuffer(self._storer, np.int64) != NO_CLIENT))

    def held(self) -> dict[int, dict[str, int]]:
        """What each client holds now (the daemon's stats, per client), from one pass over
        the slots however many clients there are."""
        storer = np.frombuffer(self._storer, np.int64)
        writers = storer[storer != NO_CLIENT]
        ids, counts = np.unique(np.where(writers < 0, ~writers, writers), return_counts=True)
        storing = dict(zip(ids.tolist(), counts.tolist(), strict=True))
        return {client: {"storing": storing.get(client, 0), "pinned": sum(lease.pins.values()),
                         "pinned_keys": len(lease.pins)}
                for client, lease in self.leases.items()}

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
        """The client is gone: its stores fail, its pins drop, the blocks it committed and did
        not hash yet are orphans."""
        lease = self.leases.pop(client, None)
        if lease is None:
            return
        if self._num_unhashed > self._num_orphans:  # some to be hashed by a client
            unhashed_by = np.frombuffer(self._unhashed_by, np.int64)  # its array, in place
            hashing = unhashed_by == client  # to be hashed by this client: nobody will now
            self._num_orphans += int(np.count_nonzero(hashing))
            unhashed_by[hashing] = ~client
        storer = np.frombuffer(self._storer, np.int64)
        storing = np.flatnonzero((storer == client) | (storer == ~client))
        self.index.complete_store(list(map(self._key_at.__getitem__, storing.tolist())), False)
        storer[storing] = NO_CLIENT
        pins = Counter(lease.pins)
        while pins:  # complete_load takes each key once per call
            once = list(pins)
            self.index.complete_load(once)
            pins.subtract(once)
            pins = +pins  # the keys still pinned

    # ---- requests ------------------------------------------------------------------------

    def lookup(self, client: int, keys: Sequence[bytes]) -> int:
        """The stored prefix of `keys` this client can check: to a lease that does not read row
        sums, a block not yet hashed ends it."""
        slots = self.index.prefix_slots(self._own(client, keys))
        found = len(slots)
        if not self._num_unhashed or found == 0:
            return found
        # A row-sum reader checks a load by xxh3 when one of its blocks lacks row sums (a
        # commit by xxh3 only, fewer checksums): a block not yet hashed would fail that check,
        # so it ends there. Where every block has as many checksums, none does.
        row_sum_reader = self.leases[client].row_sum_reader
        lengths = None
        if row_sum_reader:
            lengths = list(map(len, map(self._sums_at.__getitem__, slots)))  # type: ignore
            if min(lengths) == max(lengths):
                return found
        # the first block not yet hashed, found in C
        unhashed = map(NO_CLIENT.__ne__, map(self._unhashed_by.__getitem__, slots))
        first = next(compress(count(), unhashed), found)
        if first == found or lengths is not None and min(lengths) == lengths[first]:
            return found
        return first

    def reads(self, client: int, row_sums: bool, needs_xxh3: bool) -> None:
        """How the client reads from now on: whether it checks its loads by row sums (blocks
        not yet hashed are its hits too), and whether it needs blocks' xxh3s (it checks some
        loads by xxh3, or keeps blocks in a tier below). A lease that reads by xxh3 needs them."""
        if type(row_sums) is not bool or type(needs_xxh3) is not bool:
            raise ValueError(f"reads takes two bools (by row sums, needs xxh3s), got "
                             f"{brief(row_sums)}, {brief(needs_xxh3)}")
        if not row_sums and not needs_xxh3:
            raise ValueError("a lease that checks its loads by xxh3 needs the blocks' xxh3s")
        lease = self.leases[client]
        lease.whole_changes |= lease.row_sum_reader != row_sums  # it sees other blocks now
        lease.row_sum_reader, lease.needs_xxh3 = row_sums, needs_xxh3

    def hash_later(self, client: int) -> bool:
        """Whether a block this client commits by row sums must get its xxh3s: some lease of
        its namespaces (its own included) needs them."""
        namespaces = self.leases[client].namespaces
        return any(lease.needs_xxh3 and not lease.namespaces.isdisjoint(namespaces)
                   for lease in self.leases.values())

    def prepare_stores(self, client: int, key_lists: Sequence[Sequence[bytes]]
                       ) -> list[StorePlan]:
        """`prepare_store` of each list, every list checked before any is placed."""
        if not isinstance(key_lists, list | tuple):
            raise ValueError(f"expected a list of key lists, got {brief(key_lists)}")
        checked = [self._own(client, keys, unique=True) for keys in key_lists]
        self.evicted_sums, self._evicted_count = {}, 0
        hash_later = self.hash_later(client)
        return [self._place(client, keys, hash_later) for keys in checked]

    def prepare_store(self, client: int, keys: Sequence[bytes]) -> StorePlan:
        keys = self._own(client, keys, unique=True)
        self.evicted_sums, self._evicted_count = {}, 0
        return self._place(client, keys, self.hash_later(client))

    def _place(self, client: int, keys: list[bytes], hash_later: bool) -> StorePlan:
        lease = self.leases[client]
        if lease.needs_xxh3 and self._num_orphans:
            # A lease that needs xxh3s names an orphan to store it hashed: replaced. A pinned
            # one drains and holds back every key after it (placed keys stay a prefix), so the
            # orphans after it stay, hits to row-sum readers, until a later store.
            orphans = []
            for key, slot in zip(keys, self.index.slots_held(keys), strict=True):
                if slot is not None and self._unhashed_by[slot] < 0:
                    orphans.append(key)
                    if not self.index.is_idle(key):
                        break
            self.discard(client, orphans)  # a pinned one drains: placed once unpinned
        plan = replace(self.index.prepare_store(keys), hash_later=hash_later)
        namespaces = lease.namespaces
        for key, sums in zip(plan.evicted, self._leave(plan.evicted, plan.evicted_slots),
                             strict=True):
            # the requester's: what its tier below needs to check them
            if key[:DIGEST_BYTES] not in namespaces or not sums or sums[0] is None \
                    or self._evicted_count + len(sums) > MAX_EVICTED_SUMS:
                continue  # another's, not hashed (never written below) or past the bound
            self.evicted_sums[key] = sums
            self._evicted_count += len(sums)
        deque(map(self._key_at.__setitem__, plan.slots, plan.keys), maxlen=0)
        writer = client if hash_later else ~client
        deque(map(self._storer.__setitem__, plan.slots, repeat(writer)), maxlen=0)
        return plan

    def prepare_load(self, client: int, keys: Sequence[bytes]) -> tuple[list[int],
                                                                        list[Sums]] | None:
        """Pin every key and return their slots and checksums, or pin nothing and return None
        when one is not stored (evicted or removed since the client's lookup: its load fails)
        or, to a lease that does not read row sums, not yet hashed."""
        keys = self._own(client, keys)  # a key named twice: None (BlockIndex refuses it)
        lease = self.leases[client]
        if sum(lease.pins.values()) + len(keys) > MAX_PINS:
            raise ValueError(f"a client holds at most {MAX_PINS} pins: complete its loads first")
        if not lease.row_sum_reader and self._num_unhashed:
            # a block not yet hashed, or one not stored (its load fails too): None
            slots = self.index.slots_held(keys)
            if None in slots or not all(map(NO_CLIENT.__eq__,
                                            map(self._unhashed_by.__getitem__, slots))):
                return None
        try:
            plan = self.index.prepare_load(keys)  # checks every key before it pins any
        except ValueError:
            return None
        lease.pins.update(keys)
        return plan.slots, list(map(self._sums_at.__getitem__, plan.slots))  # type: ignore

    def checksums(self, client: int, keys: Sequence[bytes]) -> list[Sums | None]:
        sums_at = self._sums_at  # a block being stored or gone has none
        answer = [None if slot is None else sums_at[slot]
                  for slot in self.index.slots_held(self._own(client, keys))]
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
        keys = self._own(client, keys, unique=True)
        if not isinstance(flags, list | tuple) or not isinstance(sums, list | tuple) \
                or not len(flags) == len(sums) == len(keys):
            raise ValueError(f"a commit needs one ok flag and one checksum list per key: "
                             f"{len(keys)} keys, flags {brief(flags)}, checksums {brief(sums)}")
        row_sums_only = every_stored(flags) and row_sums_only_commit(sums)
        if not row_sums_only:
            for key, ok, block_sums in zip(keys, flags, sums, strict=True):
                if ok is True:
                    _check_sums(key, block_sums, unhashed=True)
                elif ok is not False:
                    raise ValueError(f"key {brief(key)}: its ok flag is {brief(ok)}, not a bool")
        slots, storer = self.index.slots_held(keys), self._storer
        writers = [None if slot is None else storer[slot] for slot in slots]
        self._commit(client, keys, slots, writers, flags, sums, row_sums_only)

    def commit_row_sums(self, client: int, slots: object, row_sums: object,
                        ranks: object) -> None:
        """A GPU writer's usual commit by the slots its plan gave (protocol.COMMIT_ROW_SUMS):
        every block stored ok, each by its `ranks` row sums only. Checked whole first (ValueError,
        nothing changes); a slot this client is not storing into is ignored, as complete_store
        ignores a key it is not storing. The daemon applies every engine's commits on one
        thread: this one reads no key and no int a block, and finds and changes the blocks'
        state by slot, a pass in C over each of its lists (docs/pool.md)."""
        at, rows, ranks = read_row_sums_commit(slots, row_sums, ranks, self.index.num_slots)
        nils = (None,) * ranks
        sums = list(zip(repeat(None), rows)) if ranks == 1 else \
            list(map(nils.__add__, zip(*[iter(rows)] * ranks, strict=True)))
        keys = list(map(self._key_at.__getitem__, at))  # the key last placed in each slot
        writers = list(map(self._storer.__getitem__, at))
        self._commit(client, keys, list(at), writers, [True] * len(keys), sums,  # type: ignore
                     True)

    def _commit(self, client: int, keys: list[bytes], slots: list[int | None],
                writers: list[int | None], flags: Sequence[bool],
                sums: Sequence[Sequence[int | None]], row_sums_only: bool) -> None:
        """Apply a checked commit of keys, the slots they hold and each slot's storer
        (`row_sums_only`: every key ok, each by row sums only). A key whose slot this client is
        not storing into (another client's, a free one, one whose store ended, or no slot) is
        skipped."""
        mine = {client, ~client}
        if not mine.issuperset(writers):  # some slot this client is not storing into
            held = [i for i, writer in enumerate(writers) if writer in mine]
            keys, slots = [keys[i] for i in held], [slots[i] for i in held]
            flags, sums = [flags[i] for i in held], [sums[i] for i in held]
            writers = [writers[i] for i in held]
        readable = self.index.commit_checked(keys, flags, slots)
        deque(map(self._storer.__setitem__, slots, repeat(NO_CLIENT)), maxlen=0)
        sums_at, unhashed_by = self._sums_at, self._unhashed_by
        if row_sums_only and None not in readable:  # a GPU writer's usual commit, in bulk
            deque(map(sums_at.__setitem__, slots, map(tuple, sums)), maxlen=0)
            deque(map(unhashed_by.__setitem__, slots, writers), maxlen=0)
            self._num_unhashed += len(slots)
            self._num_orphans += writers.count(~client)
            committed, by_row_sums = [], keys
        else:
            committed, by_row_sums = [], []
            for key, block_sums, slot, writer in zip(keys, sums, readable, writers, strict=True):
                if slot is None:  # failed, or removed while it was being stored
                    continue
                sums_at[slot] = tuple(block_sums)  # type: ignore[arg-type]
                if block_sums[0] is None:  # readable to xxh3 readers once hashed
                    unhashed_by[slot] = writer
                    self._num_unhashed += 1
                    self._num_orphans += int(writer < 0)
                    by_row_sums.append(key)
                else:
                    committed.append(key)
        self.log.add(STORED, committed)
        self.log.add(ROW_SUMS_STORED, by_row_sums)

    def add_sums(self, client: int, keys: Sequence[bytes], sums: Sequence[Sequence[int | None]],
                 slots: Sequence[int]) -> list[bool]:
        """The xxh3s of blocks committed with row sums only, hashed later by their writer: each
        key's full list (its xxh3s, then the row sums the writer checked the slot against), or
        its xxh3s nil where the slot no longer matched them (the block is dropped: its bytes are
        not what was committed), and the slot it was committed in. Per key, whether it was
        applied: only where the key is still not hashed, was committed by this client, in that
        slot, with those row sums; else (gone, hashed already: never overwritten; evicted and
        committed again since, by another client or in another slot) nothing changes for it.
        The whole request is checked first (a foreign key, a key named twice, a value that is
        not a uint64, lists of another length than the commit's, a slot that is not an int:
        ValueError, nothing changes)."""
        keys = self._own(client, keys, unique=True)
        if not isinstance(sums, list | tuple) or not isinstance(slots, list | tuple) \
                or not len(sums) == len(slots) == len(keys):
            raise ValueError(f"add_sums needs one checksum list and one slot per key: "
                             f"{len(keys)} keys, checksums {brief(sums)}, slots {brief(slots)}")
        for slot in slots:
            if isinstance(slot, bool) or not isinstance(slot, int):
                raise ValueError(f"add_sums needs slots as ints, got {brief(slot)}")
        for key, block_sums in zip(keys, sums, strict=True):
            _check_sums(key, block_sums, unhashed=True)
            if len(block_sums) % 2 or block_sums[-1] is None:
                raise ValueError(f"key {brief(key)}: add_sums needs its xxh3s (or nils) and the "
                                 f"row sums it was committed with, got {brief(block_sums)}")
        applied, attached, dropped = [], [], []
        sums_at, unhashed_by = self._sums_at, self._unhashed_by
        for key, block_sums, slot, held_slot in zip(keys, sums, slots,
                                                    self.index.slots_held(keys), strict=True):
            if slot != held_slot or held_slot is None:  # the slot named is not the key's
                applied.append(False)
                continue
            held, writer = sums_at[held_slot], unhashed_by[held_slot]
            match = held is not None and writer in (client, ~client) and \
                len(held) == len(block_sums) and \
                held[len(held) // 2:] == tuple(block_sums[len(block_sums) // 2:])
            applied.append(match)
            if match and block_sums[0] is None:
                dropped.append(key)
            elif match:
                sums_at[held_slot] = tuple(block_sums)
                unhashed_by[held_slot] = NO_CLIENT
                self._num_unhashed -= 1
                self._num_orphans -= int(writer < 0)
                attached.append(key)
        self.log.add(HASHED, attached)  # readable to every reader from now on
        if dropped:
            self.discard(client, dropped)
        return applied

    def complete_load(self, client: int, keys: Sequence[bytes]) -> None:
        pins = self.leases[client].pins
        try:
            usual = isinstance(keys, list | tuple) and set(map(pins.get, keys)) == {1} \
                and len(set(keys)) == len(keys)
        except TypeError:  # an unhashable value: _own names it
            usual = False
        if usual:
            # the usual unpin: each key named once and pinned once by this lease, so checked
            # when it was pinned; dropped in C (a Counter's own __delitem__ is Python)
            deque(map(pins.pop, keys), maxlen=0)
            self.index.complete_load(keys)
            return
        held = [key for key in dict.fromkeys(self._own(client, keys)) if pins[key] > 0]
        for key in held:
            pins[key] -= 1
            if not pins[key]:
                del pins[key]
        self.index.complete_load(held)

    def discard(self, client: int, keys: Sequence[bytes]) -> None:
        keys = list(dict.fromkeys(self._own(client, keys)))  # a key named twice goes once
        slots = self.index.readable_slots(keys)
        stored = [slot is not None for slot in slots]  # committed: the index keeps more of them
        self._leave(list(compress(keys, stored)), list(compress(slots, stored)))  # type: ignore
        self.index.discard(keys)

    def _leave(self, keys: list[bytes], slots: list[int]) -> list[Sums | None]:
        """Committed blocks leaving the index, each in its slot: a removal in the change log (to
        every lease, or to the row-sum readers only where never hashed: no other lease ever had
        them), and what the index keeps of them forgotten; returns their checksums."""
        sums_at = self._sums_at
        sums = list(map(sums_at.__getitem__, slots))
        deque(map(sums_at.__setitem__, slots, repeat(None)), maxlen=0)
        if not self._num_unhashed:
            self.log.add(REMOVED, keys)
            return sums
        unhashed_by = self._unhashed_by
        writers = list(map(unhashed_by.__getitem__, slots))
        unhashed = list(map(NO_CLIENT.__ne__, writers))
        self.log.add(REMOVED, list(compress(keys, map(not_, unhashed))))
        self.log.add(ROW_SUMS_REMOVED, list(compress(keys, unhashed)))
        self._num_unhashed -= unhashed.count(True)
        if self._num_orphans:
            self._num_orphans -= sum(map((0).__gt__, writers))  # ~id: negative
        deque(map(unhashed_by.__setitem__, slots, repeat(NO_CLIENT)), maxlen=0)
        return sums

    def clear(self, client: int) -> None:
        """Drop every key of the client's namespaces (another model's keys stay)."""
        namespaces = self.leases[client].namespaces
        mine = [key for key in self.index.held_keys() if key[:DIGEST_BYTES] in namespaces]
        self.discard(client, mine)

    def changes(self, client: int, since: int) -> list[object]:
        """[next number, whole, [[stored, key], ...]]: the commits and removals of the client's
        namespaces' blocks it can load (ChangeLog: a block committed by row sums is stored to a
        row-sum reader at its commit, to any other once its xxh3s are attached) from number
        `since` on; or, for `since` -1, one the log no longer holds, or the first call since
        the client changed how it reads, every block of them it can load now (`whole` True:
        the reader replaces what it knew)."""
        if isinstance(since, bool) or not isinstance(since, int) or since < -1 \
                or since > self.log.next_seq:
            raise ValueError(f"changes since {brief(since)}: a number from -1 to "
                             f"{self.log.next_seq}")
        lease = self.leases[client]
        namespaces, row_sums = lease.namespaces, lease.row_sum_reader
        found = None if since < 0 or lease.whole_changes else \
            self.log.since(since, namespaces, row_sums)
        if found is not None:
            return [found[0], False, found[1]]
        lease.whole_changes = False
        # A store places its keys last first (a prefix's tail is evicted first): reversed, each
        # store's blocks come in their order, so an event can carry a chain of them whole.
        unhashed = set() if row_sums else set(map(self._key_at.__getitem__, np.flatnonzero(
            np.frombuffer(self._unhashed_by, np.int64) != NO_CLIENT).tolist()))
        held = [[True, key] for key in reversed(self.index.held_keys())
                if key[:DIGEST_BYTES] in namespaces and self.index.contains(key)
                and key not in unhashed]
        return [self.log.next_seq, True, held]

    def _own(self, client: int, keys: Sequence[bytes], unique: bool = False) -> list[bytes]:
        """The keys, each checked: bytes of a namespace this client declared, of a sane size;
        with `unique`, none named twice."""
        if not isinstance(keys, list | tuple):
            raise ValueError(f"expected a list of keys, got {brief(keys)}")
        namespaces = self.leases[client].namespaces
        # passes in C over the keys; on a failure, a pass that names the bad key
        # (its keys' lengths as a set: one pass for their least and their most)
        if not (keys and set(map(type, keys)) == {bytes}
                and min(lengths := set(map(len, keys))) > DIGEST_BYTES
                and max(lengths) <= MAX_KEY_BYTES
                and namespaces.issuperset(map(_DIGEST, keys))):
            self._name_foreign_key(namespaces, keys)
        if unique and len(set(keys)) != len(keys):
            twice = next(key for key, count in Counter(keys).items() if count > 1)
            raise ValueError(f"key {brief(twice)} is named twice in one request")
        return list(keys)

    @staticmethod
    def _name_foreign_key(namespaces: frozenset[bytes], keys: Sequence[object]) -> None:
        for key in keys:
            if not isinstance(key, bytes) or not DIGEST_BYTES < len(key) <= MAX_KEY_BYTES \
                    or key[:DIGEST_BYTES] not in namespaces:
                raise ValueError(f"key {brief(key)} is not of a namespace this client declared "
                                 f"(a key: {DIGEST_BYTES + 1} to {MAX_KEY_BYTES} bytes, the "
                                 f"namespace's digest + a block hash)")


_UINT64_END = 1 << 64


def _check_sums(key: bytes, sums: object, unhashed: bool = False) -> None:
    """ValueError unless `sums` is a block's checksum list: 1 to MAX_BLOCK_SUMS uint64s; with
    `unhashed`, also its xxh3s nil and then as many row sums (a commit by row sums only). Runs
    per block of every commit: the message is built only for a list that fails."""
    kind = type(sums)
    if (kind is not list and kind is not tuple) or not 0 < len(sums) <= MAX_BLOCK_SUMS:
        raise ValueError(f"{_unsummed(key)} (1 to {MAX_BLOCK_SUMS} uint64s): got {brief(sums)}")
    values = sums
    if unhashed and sums[0] is None:  # row sums only: [nil per rank..., row sum per rank...]
        nils = len(sums) // 2
        if len(sums) % 2 or sums[:nils].count(None) != nils:
            raise ValueError(f"{_unsummed(key)}: a commit by row sums has a nil per rank, then "
                             f"a row sum per rank, got {brief(sums)}")
        values = sums[nils:]
    for value in values:
        if type(value) is not int or not 0 <= value < _UINT64_END:  # an exact int: not a bool
            raise ValueError(f"{_unsummed(key)}: {brief(value)} is not a uint64")


def _unsummed(key: bytes) -> str:
    return f"key {brief(key)} committed without its per-rank xxh3-64 checksums"
