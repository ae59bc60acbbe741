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
    remote_hit_tokens: int = 0  # of hit_tokens, fetched from the remote store
    disk_hit_tokens: int = 0  # of hit_tokens, read from the disk tier
    disk_read_bytes: int = 0  # disk_*: see DiskCounters
    disk_read_seconds: float = 0.0
    disk_write_bytes: int = 0
    disk_write_seconds: float = 0.0
    checksum_failures: int = 0  # loads refused: a shared pool block's checksum differed
    disk_failed_reads: int = 0
    disk_failed_writes: int = 0
    disk_evictions: int = 0
    remote_lookup_failures: int = 0  # store lookups late or failed (answered from the CPU tier)
    jobs_in_flight: int = 0  # a gauge: planned or running, not yet reported by every worker


@dataclass
class Job:
    req_id: str
    is_store: bool
    keys: list[bytes]
    start_block: int  # index in the request's block table of the first block
    pending: int  # workers yet to report
    epoch: int  # the index's epoch when planned
    failed: bool = False
    fetch_keys: list[bytes] = field(default_factory=list)  # load: reserved for a read or get
    disk_keys: list[bytes] = field(default_factory=list)  # load: read from disk (pinned there)
    # a shared pool's store (or fetch): rank -> checksums of the blocks it wrote
    sums: dict[int, list[int]] = field(default_factory=dict)
    # store of sliding window blocks: vLLM frees one of them once the request's computed
    # tokens reach this; the job must be flushed before a forward may write the block again
    leaves_at: int | None = None


@dataclass
class Put:
    keys: list[bytes]
    pending: int  # workers yet to report the put
    epoch: int
    finished: bool = False  # the store job is done
    pinned: bool = False  # the keys are pinned (the store succeeded)


@dataclass
class Lookup:
    start: int  # first block asked about
    asked: int  # blocks asked about
    cpu_hits: int  # leading blocks the CPU tier holds
    rest: list[bytes]  # keys of the blocks after those
    disk_hits: int = 0  # leading `rest` on disk
    remote_hits: int = 0  # `rest` after the disk hits in the remote store
    disk_capped: bool = False  # more were on disk than the pool could take: no remote hits


@dataclass
class RequestState:
    stored_upto: int = 0  # blocks [0, stored_upto) are stored, being stored or not to be stored
    jobs: set[int] = field(default_factory=set)
    finished: bool = False
