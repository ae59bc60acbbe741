"""Floods of malformed traffic against a real store process: while one client floods
(tests/store_flood.py, its own process), another client's puts and gets keep succeeding with
the right bytes, stats keeps answering, the store's memory stays within its capacity plus the
bound docs/protocol.md states, and the flooding peer is dropped.

Deadlines here are liveness bounds for a loaded 2-core machine, not speed checks.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from store_bystander import Bystander, memory

from kvconnector.servers.store import StoreProcess
from transfer.remote.store.client import StoreClient
from transfer.remote.store.security import Security

MiB = 1 << 20
CAPACITY = 256 * MiB
# docs/protocol.md, "Memory bound": the store's default budget for what zmq holds (261 MiB with
# the default limits), plus what arrives between two checks and zmq's own per-connection memory.
# (It was 1 GiB for part of 2026-11-24: a check that waited for a core postponed the next one
# five-fold, and fresh-clone CI runs peaked at 799-947 MiB under big_frames.)
BUFFER_BOUND = 512 * MiB
DEADLINE_S = 30.0  # each call of the well-behaved clients
MIN_ROUNDS = 3  # the bystander's rounds completed while the flood runs
MAX_FLOOD_S = 60.0
NONE = Security.none()
FLOOD = Path(__file__).with_name("store_flood.py")
KINDS = ("garbage", "wrong_sizes", "big_frames", "truncated", "half_sent")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StoreProcess]:
    with StoreProcess(tmp_path / "store.log", capacity=f"{CAPACITY}B") as proc:
        yield proc


def _flood(kind: str, store: StoreProcess, bystander: Bystander) -> dict[str, int]:
    """Run the flood until it has reached its target, the bystander has done MIN_ROUNDS rounds
    under it and the store has dropped a peer (or MAX_FLOOD_S has passed); its summary."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]),
                                         os.environ.get("PYTHONPATH")]))
    flood = subprocess.Popen([sys.executable, str(FLOOD), kind, store.url, str(3 * MAX_FLOOD_S)],
                             stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": path})
    try:
        first = bystander.rounds
        reached, _, _ = select.select([flood.stdout], [], [], MAX_FLOOD_S)
        assert reached and flood.stdout.readline() == b"reached\n", "the flood fell short"
        deadline = time.monotonic() + MAX_FLOOD_S
        with StoreClient(store.url, NONE, timeout_s=DEADLINE_S) as observer:
            while flood.poll() is None and not bystander.failures and (
                    bystander.rounds < first + MIN_ROUNDS
                    or observer.stats().get("dropped_peers", 0) == 0) \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
        assert flood.poll() is None, "the flood ended on its own (MAX_FLOOD_S)"
        flood.terminate()
        out, _ = flood.communicate(timeout=60)
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait()
    return json.loads(out)


@pytest.mark.parametrize("kind", KINDS)
def test_a_flood_leaves_the_store_serving_in_boundedmemory(kind: str,
                                                            store: StoreProcess) -> None:
    pid = store.process.pid
    idle = memory(pid)["VmRSS"]
    bystander = Bystander(store.url)
    try:
        summary = _flood(kind, store, bystander)
    finally:
        bystander.stop()
    assert bystander.failures == []
    with StoreClient(store.url, NONE, timeout_s=DEADLINE_S) as client:
        stats = client.stats()  # right after the flood
    peak = memory(pid)["VmHWM"] - idle
    assert peak <= CAPACITY + BUFFER_BOUND, (
        f"the store grew by {peak / MiB:.0f} MiB under the {kind} flood; capacity and the "
        f"buffer bound are {(CAPACITY + BUFFER_BOUND) / MiB:.0f} MiB ({summary})")
    assert stats.get("dropped_peers", 0) >= 1 and summary["hung_up"] >= 1, (stats, summary)
    assert stats["buffer_budget_bytes"] <= BUFFER_BOUND
    assert stats["internal_errors"] == 0
    assert store.process.poll() is None
