"""Which computed blocks the scheduler core offers to the pool, and how much a request may load:
the engine-wide admission rules and each request's own limits (no vLLM imports).

Engine-wide (`AdmissionRules`, from the connector's options), each off by default so every
full block of every request is stored, as without them:
- `store_threshold`: a block is stored only once it has been offered `store_threshold` times
  (by as many requests, or by one request again after a preemption). A block's key is its
  prefix's chained hash, so this counts how often the whole prefix up to it recurred. 0 and 1
  store at the first offer. The counts live in a `CountTable` of at most `max_tracker_size`
  keys, the least recently offered forgotten first: memory is bounded whatever the traffic, and
  a forgotten prefix starts counting again. Names and semantics as vLLM 0.33's native
  offloading (`store_threshold`, `max_tracker_size`).
- `min_prefix_tokens`: a request's blocks are stored only once its computed full blocks hold
  this many tokens; a shorter prompt stores nothing (a short prefix is cheap to recompute).
- `max_store_blocks_in_flight`: stores planned but not yet reported by every worker, in
  blocks; past it a step's new stores are skipped and counted (shed), never waited for.

Per request (`RequestLimits`, from the request's `kv_transfer_params`, vLLM 0.33's names):
`max_offload_tokens` caps the tokens of the request that are stored (0: store nothing);
`max_load_tokens` caps the tokens loaded for it (0: load nothing, recompute everything).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from transfer.block_index import PoolIndex, StorePlan

DEFAULT_MAX_TRACKER_SIZE = 64_000  # vLLM 0.33's default: ~10 MB of counts at most


class CountTable:
    """How many times each key was offered, for at most `capacity` keys: the least recently
    offered key is forgotten to make room (its count starts again at its next offer). Keys of
    the offer being counted are never forgotten to make room for each other."""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"a count table needs a positive int capacity, got {capacity!r}")
        self.capacity = capacity
        self._counts: OrderedDict[bytes, int] = OrderedDict()  # oldest offer first

    def __len__(self) -> int:
        return len(self._counts)

    def count(self, key: bytes) -> int:
        """The key's count (0: never offered, or forgotten)."""
        return self._counts.get(key, 0)

    def offer(self, keys: Sequence[bytes]) -> list[int]:
        """Count one offer of each key; returns each key's count after it (a key past the
        capacity, every older one belonging to this offer, is not tracked: 1)."""
        counts = self._counts
        mine = set(keys)
        out = []
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                counts[key] += 1
            else:
                if len(counts) >= self.capacity:
                    oldest = next(iter(counts))
                    if oldest in mine:  # the table is all this offer: count it, keep none
                        out.append(1)
                        continue
                    counts.popitem(last=False)
                counts[key] = 1
            out.append(counts[key])
        return out


@dataclass(frozen=True)
class AdmissionRules:
    """The engine-wide rules (module doc); the defaults admit every block."""

    store_threshold: int = 0
    max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE
    min_prefix_tokens: int = 0
    max_store_blocks_in_flight: int | None = None

    def __post_init__(self) -> None:
        for name in ("store_threshold", "max_tracker_size", "min_prefix_tokens",
                     "max_store_blocks_in_flight"):
            value = getattr(self, name)
            if value is None and name == "max_store_blocks_in_flight":
                continue
            low = 1 if name == "max_tracker_size" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class RequestLimits:
    """One request's limits (None: no limit), from its `kv_transfer_params`."""

    max_offload_tokens: int | None = None
    max_load_tokens: int | None = None

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> tuple[RequestLimits, list[str]]:
        """The limits in `params` (a request's kv_transfer_params), and a line for each value
        ignored because it is not a non-negative int (as vLLM does: a client's bad value must
        not stop the engine)."""
        if not isinstance(params, Mapping):
            return cls(), []
        values: dict[str, int] = {}
        ignored = []
        for name in ("max_offload_tokens", "max_load_tokens"):
            value = params.get(name)
            if value is None:
                continue
            if type(value) is int and value >= 0:
                values[name] = value
            else:
                ignored.append(f"{name} must be a non-negative int, got {value!r}; ignored")
        return cls(**values), ignored


class Admission:
    """The rules and every live request's limits, applied to block counts and keys."""

    def __init__(self, rules: AdmissionRules, block_size: int) -> None:
        self.rules = rules
        self.block_size = block_size
        self._limits: dict[str, RequestLimits] = {}
        self.counts = CountTable(rules.max_tracker_size) if rules.store_threshold >= 2 else None

    def set_limits(self, req_id: str, limits: RequestLimits) -> None:
        if limits == RequestLimits():
            self._limits.pop(req_id, None)
        else:
            self._limits[req_id] = limits

    def forget(self, req_id: str) -> None:
        self._limits.pop(req_id, None)

    def limits(self, req_id: str) -> RequestLimits:
        return self._limits.get(req_id, RequestLimits())

    def store_upto(self, req_id: str, ready_blocks: int) -> int:
        """Blocks of the request's first `ready_blocks` that may be stored: none while they
        are shorter than `min_prefix_tokens`, at most `max_offload_tokens` worth."""
        if ready_blocks * self.block_size < self.rules.min_prefix_tokens:
            return 0
        cap = self.limits(req_id).max_offload_tokens
        return ready_blocks if cap is None else min(ready_blocks, cap // self.block_size)

    def load_end(self, req_id: str, start: int, end: int) -> int:
        """The end (in blocks) of a lookup from block `start` to `end` within the request's
        `max_load_tokens`."""
        cap = self.limits(req_id).max_load_tokens
        return end if cap is None else max(start, min(end, start + cap // self.block_size))

    def admitted(self, keys: Sequence[bytes]) -> list[bool]:
        """Count one offer of each key; whether each has now been offered `store_threshold`
        times."""
        if self.counts is None:
            return [True] * len(keys)
        return [count >= self.rules.store_threshold for count in self.counts.offer(keys)]

    def store_room(self, blocks_in_flight: Callable[[], int]) -> int | None:
        """Blocks that may still be planned for storing now (None: no bound, and
        `blocks_in_flight` is not counted: the scheduler's step pays nothing for the option)."""
        bound = self.rules.max_store_blocks_in_flight
        return None if bound is None else max(0, bound - blocks_in_flight())


def shed(index: PoolIndex, plan: StorePlan, room: int | None) -> tuple[StorePlan, int]:
    """`plan` within `room` blocks (None: all of it): the stores past it are given back to the
    index unwritten (their slots free again) and counted; returns (the plan kept, blocks shed).
    The leading blocks are kept: a prefix is only worth its first blocks."""
    if room is None or len(plan.keys) <= room:
        return plan, 0
    dropped = plan.keys[room:]
    index.complete_store(dropped, False)
    return replace(plan, keys=plan.keys[:room], slots=plan.slots[:room]), len(dropped)
