"""Lanes: how one call's Redis pipelines are spread over the pool's threads and connections.

A node's pipelines are dealt into lanes; a lane is one pool task that runs its pipelines in turn
on one connection, checked out once for the whole call. The gate stops lanes that outlive their
call (the caller's deadline passed) from writing into pool slots the caller has taken back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import redis

from transfer.remote.redis.wire import checked_out

# A node's client and pipelines (lists of key indices): all of the node's, or a lane's, which
# one pool thread runs in turn on one connection
Lane = tuple[redis.Redis, list[list[int]]]


class Gate:
    """Lets node threads write into pool slots only until their call has returned."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._writers = 0

    @property
    def is_open(self) -> bool:
        return self._open

    def enter(self) -> bool:
        with self._cond:
            if self._open:
                self._writers += 1
            return self._open

    def leave(self) -> None:
        with self._cond:
            self._writers -= 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._open = False
            self._cond.wait_for(lambda: self._writers == 0)  # at most one block's copy


def default_workers(cores: int | None = None) -> int:
    """Pool threads (so lanes) per backend for `cores` cores (default: those this process may
    run on, its CPU affinity).

    8 (2 lanes per master of 3) where cores are spare: measured best on 16 cores, where 12 and
    16 lost 4-client puts and 3 lost 1-client ones. 3 (one lane per master) on 2 cores or
    fewer: there a second lane has no core to checksum on and only doubles the bytes in flight;
    four clients' puts on a 2-core VM went from 0.75-0.77 to 0.80-0.83 of redis-benchmark
    (docs/benchmarks.md, "Redis Cluster tier").
    """
    if cores is None:
        affinity = getattr(os, "sched_getaffinity", None)
        cores = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    return 8 if cores > 2 else 3


def deal_lanes(nodes: list[Lane], workers: int) -> list[Lane]:
    """Each node's pipelines dealt into `workers // nodes` lanes (at least one; with more
    nodes than workers, some lanes wait for a free thread), each run on one connection.
    A lane costs one task and one connection checkout, not one per pipeline (a future and
    redis-py's pool cost more Python per 2 MB value than the rest of a put)."""
    per_node = max(1, workers // max(1, len(nodes)))
    # round-robin over the nodes, so the pool's threads load every master at once
    return [(client, pipelines[turn::per_node]) for turn in range(per_node)
            for client, pipelines in nodes if pipelines[turn::per_node]]


def run_lane(work: Callable[[Any, list[int], Gate], None], client: redis.Redis,
             pipelines: list[list[int]], gate: Gate) -> None:
    """A lane: its pipelines in turn on one connection, until its call has returned."""
    with checked_out(client) as conn:
        for indices in pipelines:
            if not gate.is_open:
                return
            work(conn, indices, gate)
