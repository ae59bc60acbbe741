"""Clients of the shared pool's daemon.

`PoolClient`: one connection (its lease: what it stores and pins is released when it closes or
its process dies). `SharedIndex`: the block index the scheduler core uses in place of a private
BlockIndex: the same verbs, answered by the daemon; when the daemon is gone it answers "nothing
stored, no room" (requests are recomputed, stores skipped) and reconnects to a restarted daemon,
at most once per `retry_s`. A dead daemon is seen at once (the socket closes); `timeout_s` only
bounds a hung one, generously: a busy host must not turn a slow answer into a lost lease.

A block committed with row sums only (its xxh3s attached later, `add_sums`) is a hit to a
`row_sum_reader` index (its workers check loads by row sums) and a miss to any other until
its xxh3s are attached, if ever: the daemon answers each lease as it declared (`reads`). Its
xxh3s are taken only where some lease needs them (`needs_xxh3`: it reads by xxh3, or keeps
blocks in a tier below): each StorePlan says so (`hash_later`). A block stored while none did
stays without them (an orphan): a lease that needs them later misses it, and its store of the
key replaces it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from itertools import repeat
from pathlib import Path
from typing import Any

import msgpack

from transfer.block_index import IndexStats, LoadPlan, StorePlan
from transfer.keys import Namespace
from transfer.shared import protocol as p


class PoolError(ConnectionError):
    """The daemon is unreachable, refused us, or the connection broke."""


class PoolClient:
    """One connection to pool `name`'s daemon for the given namespaces, whose blocks use
    `entry_bytes` of a slot (a lease)."""

    def __init__(self, name: str, namespaces: Sequence[Namespace | bytes], entry_bytes: int, *,
                 timeout_s: float = 30.0, directory: Path | None = None) -> None:
        self.path = p.socket_path(name, directory)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        self._unpacker = msgpack.Unpacker(max_buffer_size=p.MAX_MESSAGE_BYTES)
        try:
            self._sock.connect(str(self.path))
        except OSError as exc:
            self._sock.close()
            raise PoolError(f"no pool daemon for {name!r} at {self.path}: {exc}") from exc
        digests = [ns.digest if isinstance(ns, Namespace) else ns for ns in namespaces]
        try:
            self.info = p.PoolInfo(*self.request(p.HELLO, digests, entry_bytes))
        except (PoolError, ValueError) as exc:  # e.g. refused: another uid
            self._sock.close()
            raise PoolError(f"pool {name!r} at {self.path}: {exc}") from exc

    def request(self, verb: str, *args: Any) -> Any:
        """Send a request and return its answer; PoolError when the connection fails, ValueError
        when the daemon refuses the request."""
        try:
            self._send(verb, args)
        except PoolError as exc:
            failed: PoolError | None = exc  # a refusal may be waiting to be read: read it first
        else:
            failed = None
        try:
            while True:
                for ok, result in self._unpacker:
                    if not ok:
                        raise ValueError(f"pool daemon: {result}")
                    return result
                data = self._sock.recv(1 << 20)
                if not data:
                    raise failed or PoolError("the pool daemon closed the connection")
                self._unpacker.feed(data)
        except PoolError:
            raise
        except OSError as exc:
            raise failed or PoolError(f"pool daemon at {self.path}: {exc}") from exc

    def notify(self, verb: str, *args: Any) -> None:
        """Send a notice (no answer; applied before our next request)."""
        self._send(verb, args)

    def _send(self, verb: str, args: tuple[Any, ...]) -> None:
        try:
            self._sock.sendall(msgpack.packb([verb, *args]))
        except OSError as exc:
            raise PoolError(f"pool daemon at {self.path}: {exc}") from exc

    def close(self) -> None:
        self._sock.close()


class SharedIndex:
    """BlockIndex's verbs for one namespace, served by the pool daemon (see module doc);
    `entry_bytes`: the bytes of a slot one block (of every rank) uses.

    `segment` names the shared memory the slots live in and `epoch` counts connections: a job
    planned under an older epoch belongs to a lease that is gone, and its completion must not
    reach the index (OffloadScheduler checks). How it reads (`reads`, also later): with
    `row_sum_reader` every worker checks loads by row sums (GPU workers whose copy engine sums
    rows), so blocks not yet hashed are hits; `needs_xxh3`: it needs blocks' xxh3s (it reads by
    xxh3, or keeps blocks in a tier below).
    """

    def __init__(self, name: str, namespace: Namespace, entry_bytes: int, *,
                 timeout_s: float = 30.0, retry_s: float = 1.0,
                 directory: Path | None = None, row_sum_reader: bool = False,
                 needs_xxh3: bool = True) -> None:
        _check_reads(row_sum_reader, needs_xxh3)
        self.name = name
        self.row_sum_reader, self.needs_xxh3 = row_sum_reader, needs_xxh3
        # the checksums of the keys the last prepare_stores evicted (a tier below keeps them)
        self.evicted_sums: dict[bytes, list[int | None] | None] = {}
        self.namespace = namespace
        self.entry_bytes = entry_bytes
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.directory = directory
        self.epoch = 0
        self.segment = ""
        self.checked = True  # other engines' workers write the same slots: blocks are checked
        self.num_slots = 0
        self.slot_bytes = 0
        self.failures = 0  # connections lost or refused
        self._client: PoolClient | None = None
        self._next_try = 0.0
        self._stats = IndexStats()
        self._since = -1  # the daemon's change log: the next number to read (-1: all)
        self._since_epoch = 0  # the connection `_since` belongs to
        self._placed: dict[bytes, int] = {}  # this lease's keys being stored -> their slots
        self._connect(raise_errors=True)

    # ---- connection ------------------------------------------------------------------------

    def _connect(self, raise_errors: bool = False) -> PoolClient | None:
        if self._client is not None:
            return self._client
        now = time.monotonic()
        if now < self._next_try and not raise_errors:
            return None
        self._next_try = now + self.retry_s
        try:
            client = PoolClient(self.name, [self.namespace], self.entry_bytes,
                                timeout_s=self.timeout_s, directory=self.directory)
        except PoolError:
            if raise_errors:
                raise
            return None
        self._client = client
        self.epoch += 1
        if self.row_sum_reader or not self.needs_xxh3:  # else as a new lease is
            self._notice(p.READS, self.row_sum_reader, self.needs_xxh3)
        self.segment, self.num_slots, self.slot_bytes = (client.info.segment,
                                                         client.info.num_slots,
                                                         client.info.slot_bytes)
        return client

    def _lost(self) -> None:
        self.failures += 1
        self._drop_lease()

    def _call(self, verb: str, *args: Any, default: Any) -> Any:
        for _ in range(2):  # a broken connection is found by using it: then one fresh try
            client = self._connect()
            if client is None:
                return default
            try:
                return client.request(verb, *args)
            except PoolError:
                self._lost()
        return default

    def _notice(self, verb: str, *args: Any) -> None:
        if self._client is None:
            return  # what it would complete went with the lost lease
        try:
            self._client.notify(verb, *args)
        except PoolError:
            self._lost()

    def reads(self, row_sum_reader: bool, needs_xxh3: bool) -> None:
        """Read from now on as declared (see the class doc), on this lease and later ones."""
        _check_reads(row_sum_reader, needs_xxh3)
        if (row_sum_reader, needs_xxh3) != (self.row_sum_reader, self.needs_xxh3):
            self.row_sum_reader, self.needs_xxh3 = row_sum_reader, needs_xxh3
            self._notice(p.READS, row_sum_reader, needs_xxh3)

    @property
    def connected(self) -> bool:
        return self._client is not None

    # ---- BlockIndex's verbs ----------------------------------------------------------------

    @property
    def num_reclaimable(self) -> int:
        """The pool's slots: what other engines hold now is not known here without a round
        trip, so a disk tier's hits are capped by the pool's size only (a load that finds less
        room fails, and vLLM recomputes)."""
        return self.num_slots

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        hits = int(self._call(p.LOOKUP, list(keys), default=0)) if keys else 0
        self._stats.hits += hits
        self._stats.misses += len(keys) - hits
        return hits

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan:
        return self.prepare_stores([keys])[0]

    def prepare_stores(self, key_lists: Sequence[Sequence[bytes]]) -> list[StorePlan]:
        """`prepare_store` of each list, in one round trip; with no daemon nothing is placed."""
        lists = [list(keys) for keys in key_lists]
        answer = self._call(p.PREPARE_STORES, lists, default=None) if any(lists) else None
        self.evicted_sums = {}
        if answer is None:
            return [StorePlan([], [], keys, [], []) for keys in lists]
        plans = [StorePlan(*fields[:5], hash_later=bool(fields[6]) if len(fields) > 6 else True)
                 for fields in answer]
        for fields in answer:
            self.evicted_sums.update(zip(fields[3], fields[5], strict=True))
            self._placed.update(zip(fields[0], fields[1], strict=True))
        self._stats.evictions += sum(len(plan.evicted) for plan in plans)
        return plans

    def complete_store(self, keys: Sequence[bytes], ok: bool | Sequence[bool],
                       sums: Sequence[Sequence[int | None] | None] | None = None) -> None:
        """Commit the stores; every ok key needs its block's per-rank checksums in `sums`
        (transfer/slot_checker.py; its xxh3s nil where committed with row sums only): the
        daemon drops a client that commits one without."""
        flags = [ok] * len(keys) if isinstance(ok, bool) else list(ok)
        stored = sum(flags)
        self._stats.stores += stored
        self._stats.failed_stores += len(flags) - stored
        slots = list(map(self._placed.pop, keys, repeat(None)))  # no longer being stored
        if not keys:
            return
        if sums is not None and (ok is True or p.every_stored(flags)) and None not in slots:
            by_slots = p.pack_row_sums_commit(slots, sums)  # type: ignore[arg-type]
            if by_slots is not None:  # a GPU writer's usual commit
                self._notice(p.COMMIT_ROW_SUMS, *by_slots)
                return
        self._notice(p.COMPLETE_STORE, list(keys), flags,
                     [None] * len(keys) if sums is None else list(sums))

    def add_sums(self, keys: Sequence[bytes], sums: Sequence[Sequence[int | None]],
                 slots: Sequence[int]) -> list[bool]:
        """Attach the xxh3s of blocks this client committed with row sums only (each key's
        list: its xxh3s, then the row sums it was committed with; nil xxh3s drop a block whose
        slot changed since its commit; `slots`: where each was committed); per key whether it
        was applied (all False without a daemon)."""
        if not keys:
            return []
        return self._call(p.ADD_SUMS, list(keys), [list(s) for s in sums], list(slots),
                          default=[False] * len(keys))

    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan | None:
        """Slots of the keys, pinned, with their per-rank checksums; None when one of them is
        gone (evicted by another engine since the lookup) or the daemon is: the caller's load
        fails, vLLM recomputes."""
        if not keys:
            return LoadPlan([], [], [])
        answer = self._call(p.PREPARE_LOAD, list(keys), default=None)
        return None if answer is None else LoadPlan(list(keys), answer[0], answer[1])

    def complete_load(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._notice(p.COMPLETE_LOAD, list(keys))

    def discard(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._notice(p.DISCARD, list(keys))

    def clear(self) -> None:
        """Drop this namespace's keys from the pool (other models' stay)."""
        self._notice(p.CLEAR)

    def checksums(self, keys: Sequence[bytes]) -> list[list[int | None] | None]:
        """The per-rank checksums each block was committed with (None: not stored, or no
        daemon; its xxh3s nil until attached)."""
        return self._call(p.CHECKSUMS, list(keys), default=[None] * len(keys))

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether it is stored and readable now (committed: the daemon keeps a
        committed block's checksums as long as the block); one round trip."""
        return [sums is not None for sums in self.checksums(keys)]

    def take_changes(self) -> tuple[bool, list[tuple[bool, bytes]]]:
        """What changed among this namespace's readable blocks since the last call, in the
        daemon's order, in one round trip: (whole, [(stored, key), ...]). `whole`: the list is
        every block readable now, replacing what was known (the first call on a connection, or
        a reader the daemon's log left behind, or one that changed how it reads); no daemon: an
        empty whole list (nothing is readable)."""
        if self._since_epoch != self.epoch:
            self._since, self._since_epoch = -1, self.epoch
        epoch = self.epoch
        answer = self._call(p.CHANGES, self._since, default=None)
        if answer is None or self.epoch != epoch:  # no daemon, or a new one: all again next
            self._since_epoch = -1
            return True, []
        self._since = answer[0]
        return bool(answer[1]), [(bool(stored), bytes(key)) for stored, key in answer[2]]

    def pool_stats(self) -> dict[str, Any] | None:
        """The daemon's counters (None without a daemon); answered after every notice sent
        before it is applied."""
        return self._call(p.STATS, default=None)

    @property
    def stats(self) -> IndexStats:
        """This client's counters (the daemon's own: `pool_stats`)."""
        return IndexStats(**vars(self._stats))

    def close(self) -> None:
        self._drop_lease()

    def _drop_lease(self) -> None:
        """Close the connection: the daemon drops its lease (our stores fail, our pins go), and
        the slots our stores were given are no longer ours to commit."""
        if self._client is not None:
            self._client.close()
            self._client = None
        self._placed.clear()


def _check_reads(row_sum_reader: bool, needs_xxh3: bool) -> None:
    if not row_sum_reader and not needs_xxh3:
        raise ValueError("an index whose workers check loads by xxh3 needs the blocks' xxh3s: "
                         "needs_xxh3=False takes row_sum_reader=True")
