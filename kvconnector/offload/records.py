"""What the scheduler core (scheduler.py, loads.py) keeps per job, put, lookup and request,
and the counters it hands the adapter."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OffloadCounters:
    """What happened since the last `take_counters` (tokens, bytes, seconds, jobs)."""

    hit_tokens: int = 0
    miss_tokens: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    store_bytes: int = 0
    store_seconds: float = 0.0
    failed_loads: int = 0
    failed_stores: int = 0
    evictions: int = 0
    unplaced_blocks: int = 0  # blocks not stored: every slot busy
    threshold_skipped_blocks: int = 0  # not stored: prefix offered under store_threshold times
    shed_blocks: int = 0  # not stored: max_store_blocks_in_flight reached (backpressure)
    prefetched_blocks: int = 0  # fetched from a tier into the pool ahead of a waiting request
    checksum_failures: int = 0  # loads refused: a checked pool's block checksum differed
    # blocks committed by row sums whose slot no longer matched them when hashed after: dropped
    late_hash_mismatches: int = 0
    unhashed_spills_dropped: int = 0  # evicted before their xxh3s came: not written below
    jobs_in_flight: int = 0  # a gauge: planned or running, not yet reported by every worker
    # per tier below the pool: its hit_tokens (of hit_tokens, served from it) and its own counts
    tiers: dict[str, dict[str, float]] = field(default_factory=dict)

    def flat(self) -> dict[str, float]:
        """One name per counter: a tier's as `<tier>_<name>`."""
        out: dict[str, float] = {k: v for k, v in vars(self).items() if k != "tiers"}
        for tier, counts in self.tiers.items():
            out.update({f"{tier}_{name}": value for name, value in counts.items()})
        return out

    def __getattr__(self, name: str) -> float:
        """A tier's counter by its flat name (`disk_read_bytes`); 0 if the tier counted none."""
        tier, _, counter = name.partition("_")
        counts = self.__dict__.get("tiers", {}).get(tier)
        if counts is None or not counter:
            raise AttributeError(f"{type(self).__name__} has no counter {name!r}")
        return counts.get(counter, 0)

    def add(self, tier: str, counts: dict[str, float]) -> None:
        mine = self.tiers.setdefault(tier, {})
        for name, value in counts.items():
            mine[name] = mine.get(name, 0) + value


@dataclass
class Job:
    req_id: str
    is_store: bool
    keys: list[bytes]
    start_block: int  # index in the request's block table of the first block
    pending: int  # workers yet to report
    epoch: int  # the index's epoch when planned
    resets: int  # the scheduler's reset count when planned
    failed: bool = False
    fetches: list[tuple[str, list[bytes]]] = field(default_factory=list)  # load: per tier
    # a checked pool's store (or fetch): rank -> checksums of the blocks it wrote
    sums: dict[int, list[int | None]] = field(default_factory=dict)
    # a store committed by row sums: rank -> its blocks' xxh3s, taken after (None: no match)
    hashed: dict[int, list[int | None]] = field(default_factory=dict)
    # store of sliding window blocks: vLLM frees one of them once the request's computed
    # tokens reach this; the job must be flushed before a forward may write the block again
    leaves_at: int | None = None
    slots: list[int] = field(default_factory=list)  # a store's pool slots, in key order
    hash_later: bool = True  # a store committed by row sums gets its xxh3s after


@dataclass
class LateHash:
    """A store committed by its row sums, waiting for every rank's xxh3s (`Job.hashed`)."""

    keys: list[bytes]
    committed: list[list[int | None]]  # per block what it was committed with
    hashed: dict[int, list[int | None]]  # rank -> per block its xxh3 (None: the slot changed)
    epoch: int
    resets: int
    slots: list[int]  # where each block was committed (the daemon matches its record)


@dataclass
class Write:
    """A tier's write in flight: `pinned` pool keys stay pinned until every worker is done."""

    tier: str
    pinned: list[bytes]
    pending: int  # workers yet to report
    epoch: int  # the pool index's connection the pins belong to


@dataclass
class Lookup:
    start: int  # first block asked about
    asked: int  # blocks asked about
    pool_hits: int  # leading blocks the pool holds
    rest: list[bytes]  # keys of the blocks after those
    tier_hits: list[int] = field(default_factory=list)  # per tier in order, leading `rest` next


@dataclass
class RequestState:
    stored_upto: int = 0  # blocks [0, stored_upto) are stored, being stored or not to be stored
    jobs: set[int] = field(default_factory=set)
    finished: bool = False
