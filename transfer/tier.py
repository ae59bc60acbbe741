"""The contract of a tier below the host pool (the disk, a remote store, a Redis Cluster, ...).

A tier keeps whole blocks under their keys and never touches the GPU: blocks reach it from the
host pool's slots and come back into them. So a tier is two parts that exchange `TierOp`s:
- `TierPlanner`, on the scheduler side: what the tier holds (lookups, which may answer "not
  yet"), plans of fetches into pool slots and of writes out of them, their completion, counters;
- `TierWorker`, on every worker: the I/O between this worker's part of the pool's slots and the
  tier's storage, with the engine's two-phase verbs (bind, submit, get_finished, wait, close).

The offload core (kvconnector.offload) drives any list of tiers through these and names none;
`TierSpec` is what a tier registers (kvconnector.tiers): its name, its options and how to make
its two parts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transfer.keys import Namespace
from transfer.options import Option

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TierOp:
    """Move `keys` between pool `slots` and tier `tier`, one block each: a fetch fills the slots,
    a write reads them out.

    `op_id`: a fetch's is its load job's id; a write has its own. `places`: where the tier keeps
    each block, when its planner chooses (the disk's slots); empty: the tier finds them by key.
    `segment`: the pool segment the slots belong to ("" for each worker's own pool). `sums`: per
    block, the per-rank checksums a checked pool committed it with, which a write may keep
    instead of hashing the bytes again.
    """

    tier: str
    op_id: int
    is_write: bool
    keys: tuple[bytes, ...]
    slots: tuple[int, ...]
    places: tuple[int, ...] = ()
    segment: str = ""
    sums: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class OpResult:
    """An op finished on one worker: `ok` per block; `sums` per block, the checksum of this rank's
    part that the tier verified on a fetch (None: not verified there), empty when none was."""

    tier: str
    op_id: int
    ok: tuple[bool, ...]
    sums: tuple[int | None, ...] = ()

    @property
    def leading_ok(self) -> int:
        return next((i for i, flag in enumerate(self.ok) if not flag), len(self.ok))


@dataclass(frozen=True)
class PlannerContext:
    """What a tier's scheduler part knows of its engine.

    `namespace`: the engine's keys (those the pool's index uses); `rank_namespaces`: each worker
    rank's own keys (its bytes differ from other ranks'); `slot_bytes`: one block of one rank;
    `policy`: the eviction policy the engine chose ("lru", "arc").
    """

    namespace: Namespace
    num_workers: int
    slot_bytes: int
    policy: str = "lru"
    rank_namespaces: tuple[Namespace, ...] = ()


@dataclass(frozen=True)
class WorkerContext:
    """What a tier's worker part knows of its worker.

    `own_namespace`: this rank's own keys; `common_namespace`: the keys of bytes every TP rank of
    its stage holds alike (MLA's latent cache: TP rank 0's keys), where `writes_common` says
    whether this rank writes them (one copy instead of one per rank); else its own keys.
    """

    rank: int
    part_bytes: int  # this worker's part of a slot (its block of every layer)
    slot_bytes: int  # one block of one rank as the engine sizes tiers (the largest stage's)
    own_namespace: Namespace
    common_namespace: Namespace
    writes_common: bool = True


class TierPlanner(ABC):
    """A tier's scheduler side: its index and its plans (see module doc).

    `answers_per_key`: whether `present` can say for each key whether the tier holds it (needed
    with several KV cache groups, whose prefixes are read block by block); `pool_stages`: the pool
    above only stages this tier's blocks (a block leaves the pool once written here, and a fetched
    one is not kept); `writes_stored`: every block stored in the pool is written here (else only
    those the pool evicts, if any).
    """

    name: str = ""
    answers_per_key: bool = False
    pool_stages: bool = False
    writes_stored: bool = True
    track_drops: bool = False  # set by the engine when it publishes KV events

    @abstractmethod
    def lookup(self, req_id: str, keys: Sequence[bytes]) -> int | None:
        """How many leading `keys` the tier holds; None while the answer is not in yet (the
        engine asks again with the same keys). Never slow: a remote answer is asynchronous."""

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the tier holds it (only where `answers_per_key`)."""
        raise NotImplementedError(f"tier {self.name!r} answers leading counts only")

    def forget(self, req_id: str) -> None:
        """The request is gone: drop what its lookups left."""
        return  # nothing to do for a tier that keeps nothing of it

    @abstractmethod
    def plan_fetch(self, op_id: int, keys: Sequence[bytes], slots: Sequence[int],
                   segment: str = "") -> TierOp | None:
        """A fetch of `keys` into pool `slots`, each pinned here until `complete_fetch`; None
        when a key is gone since the lookup (the load then fails, pinning nothing)."""

    @abstractmethod
    def complete_fetch(self, op_id: int, keys: Sequence[bytes], bad: Sequence[bytes]) -> None:
        """The fetch ended: its keys are unpinned; `bad` ones (a failed read, a bad checksum)
        leave the tier."""

    @abstractmethod
    def plan_write(self, op_id: int, keys: Sequence[bytes], slots: Sequence[int], *,
                   evicted: bool, segment: str = "",
                   sums: Sequence[Sequence[int]] | None = None) -> TierOp | None:
        """A write of pool `slots` holding `keys` (`evicted`: the pool is dropping them; else
        they were just stored), for the keys the tier takes; None when it takes none."""

    @abstractmethod
    def complete_write(self, op_id: int, bad: Sequence[bytes]) -> None:
        """The write ended on every worker: its keys but `bad` ones are readable now."""

    def reset(self) -> bool:
        """Forget every block; True when the workers must erase what they stored too."""
        return False

    def take_dropped(self) -> list[bytes]:
        """Keys that stopped being loadable here by the tier's own doing (evicted for room,
        lost) since the last call; kept only while `track_drops` is set (the engine publishes
        KV events). A fetch's bad keys are not among them: the engine knows those."""
        return []

    def take_counters(self) -> dict[str, float]:
        """The tier's own counters since the last call (names in its TierSpec's `counters`)."""
        return {}

    def close(self) -> None:
        """Release connections and threads."""
        return  # nothing to do for a tier that keeps nothing of it


class TierWorker(ABC):
    """A tier's worker side: the I/O of TierOps over this worker's part of the pool's slots."""

    name: str = ""

    @abstractmethod
    def bind(self, rows: torch.Tensor, room: int | None) -> None:
        """Move blocks from and to `rows` (this worker's part of every pool slot, a (num_slots,
        part_bytes) uint8 tensor) from now on; `room`: bytes of each row from its start that a
        fetch may fill (None: the row)."""

    def release(self) -> None:
        """The rows bound last are going away (everything in flight is done): let go of them."""
        return  # nothing to do for a tier that keeps nothing of it

    @abstractmethod
    def submit(self, op: TierOp) -> None:
        """Start `op` (returns at once; its result comes from get_finished). Bad input raises
        before anything starts."""

    @abstractmethod
    def get_finished(self) -> list[OpResult]:
        """Ops that ended since the last call (never blocks). An op whose slots the transport
        may still read (a timed-out write) is reported only once it no longer can."""

    @abstractmethod
    def wait(self, op_ids: Sequence[int] | None = None) -> None:
        """Block until the ops `op_ids` (None: all) are done; results still come from
        get_finished."""

    def erase(self) -> None:
        """Forget every block this worker stored (after the writes in flight)."""
        return  # nothing to do for a tier that keeps nothing of it

    def take_counters(self) -> dict[str, float]:
        """Bytes and busy seconds since the last call (summed over workers)."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Finish what is in flight and release connections, threads and files."""


@dataclass(frozen=True)
class TierSpec:
    """What a tier registers (transfer/registry.py).

    `name`: also the prefix of its option keys and of its counters in the engine's metrics;
    `options`: every key it accepts (transfer.options.Option: default and value check);
    `enabled_by`: the key that turns it on; `settings`: its checked settings from those keys
    (ValueError naming a bad one); `make_planner` and `make_worker`: its two parts; `counters`:
    what its parts' take_counters report, and `hit_tokens`; `hit_source`: how the engine labels
    its hits (a member name of vLLM's CacheHitSource); `order`: tiers are asked from the lowest
    order on, after the pool; `per_key_lookups`: its planner answers per key (several KV cache
    groups need it).

    Across tiers: `stages_pool`, the flag option with which the pool only stages this tier's
    blocks (it then evicts none, so another tier must write every stored block, and a shared
    pool cannot stage); `stored_writes`, the option and value with which this tier writes every
    stored block. Settings say `writes_stored` where a tier may write evicted blocks only.

    KV events (docs/events.md): `event_medium`, the medium an engine publishes this tier's
    blocks under (vLLM's "CPU" or "STORAGE"; None: the engine publishes none of them, as for a
    tier whose blocks other engines evict unseen), with `event_locality` ("LOCAL", "REMOTE").
    """

    name: str
    options: Mapping[str, Option]
    enabled_by: str
    settings: Callable[[Mapping[str, Any]], Any]
    make_planner: Callable[[Any, PlannerContext], TierPlanner]
    make_worker: Callable[[Any, WorkerContext], TierWorker]
    counters: tuple[str, ...] = ("hit_tokens",)
    hit_source: str = "EXTERNAL_UNSPECIFIED"
    order: int = 100
    per_key_lookups: bool = False
    stages_pool: str | None = None
    stored_writes: tuple[str, Any] | None = None
    event_medium: str | None = None
    event_locality: str = "LOCAL"
