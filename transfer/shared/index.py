"""The daemon's block index: every client's namespaces under one capacity, with leases.

One BlockIndex over all slots (keys carry their namespace digest, so LRU/ARC runs across models)
plus what each client holds: the keys it is storing and its pins. A client only names keys of the
namespaces it declared at hello (a key of another is refused: a foreign block is never served),
and completes only what it holds (a completion for anything else, e.g. of a connection that died
before a reconnect, is ignored). When a client goes (its socket closed: exit, SIGKILL), `release`
fails its stores (their slots were being written: never readable) and drops its pins.

Checksums: a writer commits each block with the xxh3-64 of every rank's part of its slot, seeded
by its key as the remote tier does (transfer/shared/checks.py), then, from GPU ranks, each
rank's row sum (protocol.block_sums); the index keeps the list as it is and hands it out with
the slots a load pins, so every reader checks its part before the load is reported. The
daemon never hashes (its loop would cap commits near one core's hash rate).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from transfer.block_index import BlockIndex, StorePlan
from transfer.keys import DIGEST_BYTES


@dataclass
class Lease:
    """What one client holds: its namespaces, the slot bytes its blocks use, keys being stored
    and pins."""

    namespaces: frozenset[bytes]
    entry_bytes: int
    storing: set[bytes] = field(default_factory=set)
    pins: Counter[bytes] = field(default_factory=Counter)


class SharedBlockIndex:
    """Keys of several namespaces -> slots of one pool, with the checksums of their blocks."""

    def __init__(self, num_slots: int, slot_bytes: int, policy: str) -> None:
        self.index = BlockIndex(None, num_slots, policy)
        self.slot_bytes = slot_bytes
        self._sums: dict[bytes, list[int]] = {}  # stored keys -> per-rank checksums at commit
        self.leases: dict[int, Lease] = {}  # client id -> its lease

    def open(self, client: int, namespaces: Sequence[bytes], entry_bytes: int) -> None:
        """A new client whose blocks, of the given namespaces, use `entry_bytes` of a slot."""
        digests = frozenset(namespaces)
        if not digests or any(not isinstance(d, bytes) or len(d) != DIGEST_BYTES
                              for d in digests):
            raise ValueError(f"hello needs namespace digests of {DIGEST_BYTES} B, got "
                             f"{list(namespaces)!r}")
        if isinstance(entry_bytes, bool) or not isinstance(entry_bytes, int) \
                or not 0 < entry_bytes <= self.slot_bytes:
            raise ValueError(f"a block of {entry_bytes!r} B does not fit this pool's slots of "
                             f"{self.slot_bytes} B: serve the pool with --slot-bytes "
                             f"{entry_bytes} or more")
        self.leases[client] = Lease(digests, entry_bytes)

    def release(self, client: int) -> None:
        """The client is gone: its stores fail, its pins drop."""
        lease = self.leases.pop(client, None)
        if lease is None:
            return
        self.index.complete_store(list(lease.storing), False)
        pins = list(lease.pins.elements())
        while pins:  # complete_load takes each key once per call
            once = list(dict.fromkeys(pins))
            self.index.complete_load(once)
            for key in once:
                pins.remove(key)

    # ---- requests ------------------------------------------------------------------------

    def lookup(self, client: int, keys: Sequence[bytes]) -> int:
        return self.index.lookup_prefix(self._own(client, keys))

    def prepare_store(self, client: int, keys: Sequence[bytes]) -> StorePlan:
        plan = self.index.prepare_store(self._own(client, keys))
        for key in plan.evicted:
            self._sums.pop(key, None)
        self.leases[client].storing.update(plan.keys)
        return plan

    def prepare_load(self, client: int, keys: Sequence[bytes]) -> tuple[list[int],
                                                                        list[list[int]]] | None:
        """Pin every key and return their slots and checksums, or pin nothing and return None
        when one is not stored (evicted or removed since the client's lookup: its load fails)."""
        keys = self._own(client, keys)
        try:
            plan = self.index.prepare_load(keys)  # checks every key before it pins any
        except ValueError:
            return None
        self.leases[client].pins.update(keys)
        return plan.slots, [self._sums[key] for key in keys]

    def checksums(self, client: int, keys: Sequence[bytes]) -> list[list[int] | None]:
        return [self._sums.get(key) for key in self._own(client, keys)]

    # ---- notices -------------------------------------------------------------------------

    def complete_store(self, client: int, keys: Sequence[bytes], flags: Sequence[bool],
                       sums: Sequence[Sequence[int] | None]) -> None:
        """Commit (or fail) the client's stores; each ok key with its per-rank checksums."""
        lease = self.leases[client]
        if not len(flags) == len(sums) == len(keys):
            raise ValueError(f"{len(flags)} ok flags and {len(sums)} checksum lists for "
                             f"{len(keys)} keys")
        held = []
        for key, ok, block_sums in zip(self._own(client, keys), flags, sums, strict=True):
            if ok:
                _check_sums(key, block_sums)  # before anything changes: a bad notice drops it
            if key in lease.storing:
                held.append((key, bool(ok), block_sums))
        for key, ok, block_sums in held:
            lease.storing.discard(key)
            if ok:
                self._sums[key] = list(block_sums)
        self.index.complete_store([k for k, *_ in held], [ok for _, ok, _ in held])

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
        self.index.discard(keys)
        for key in keys:
            self._sums.pop(key, None)

    def clear(self, client: int) -> None:
        """Drop every key of the client's namespaces (another model's keys stay)."""
        namespaces = self.leases[client].namespaces
        mine = [key for key in self.index.held_keys() if key[:DIGEST_BYTES] in namespaces]
        self.discard(client, mine)

    def _own(self, client: int, keys: Sequence[bytes]) -> list[bytes]:
        namespaces = self.leases[client].namespaces
        out = []
        for key in keys:
            if not isinstance(key, bytes) or key[:DIGEST_BYTES] not in namespaces:
                raise ValueError(f"key {key!r} is not of a namespace this client declared")
            out.append(key)
        return out


def _check_sums(key: bytes, sums: object) -> None:
    if not isinstance(sums, list | tuple) or not sums or any(
            isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 1 << 64 for s in sums):
        raise ValueError(f"key {key!r} committed without its per-rank xxh3-64 checksums: "
                         f"{sums!r:.80}")
