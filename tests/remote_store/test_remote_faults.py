"""SIGKILL of the store mid-put and mid-get: per-block errors, no slot valid with wrong bytes,
and the same clients recover once the store is back on its port."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvconnector.servers.store import StoreProcess
from transfer.keys import Namespace
from transfer.remote.async_client import AsyncRemoteClient
from transfer.remote.backend import BlockStatus
from transfer.remote.store.client import StoreClient
from transfer.remote.store.security import Security

BLOCK = 64 << 10
COUNT = 2000  # 500 requests of 4 blocks: the kill lands well inside the transfer
KILL_AFTER = 200  # blocks the store has handled when it is killed
NONE = Security.none()
NS = Namespace("model-a", "bfloat16", 16, "BLNHC")
KEYS = NS.keys([b"fault-%d" % i for i in range(COUNT)])
POISON = 0xA5
# one connection: its blocks succeed in order up to the cut (test_remote_lanes: several)
OPTIONS = {"namespace": NS, "timeout_s": 3.0, "put_batch_bytes": 4 * BLOCK,
           "get_batch_bytes": 4 * BLOCK, "max_in_flight": 2, "connections": 1}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StoreProcess]:
    with StoreProcess(tmp_path / "store.log", capacity="512MiB") as proc:
        yield proc


@pytest.fixture(scope="module")
def source() -> torch.Tensor:
    generator = torch.Generator().manual_seed(11)
    return torch.randint(0, 256, (COUNT, BLOCK), dtype=torch.uint8, generator=generator)


def _kill_after(store: StoreProcess, counter: str) -> None:
    """SIGKILL the store once its `counter` reaches KILL_AFTER (bounded wait)."""
    with StoreClient(store.url, NONE) as observer:
        for _ in range(2000):
            if observer.stats()[counter] >= KILL_AFTER:
                store.kill()
                return
            time.sleep(0.005)
    pytest.fail(f"the store's {counter} never reached {KILL_AFTER}")


def _split(statuses: tuple[BlockStatus, ...]) -> tuple[int, int]:
    ok = sum(status is BlockStatus.OK for status in statuses)
    failed = sum(status is BlockStatus.FAILED for status in statuses)
    assert ok + failed == len(statuses), statuses  # nothing else can happen here
    return ok, failed


def test_sigkill_mid_put(store: StoreProcess, source: torch.Tensor) -> None:
    with AsyncRemoteClient(store.url, NONE, pool=source, **OPTIONS) as writer:
        pending = writer.put(KEYS, range(COUNT))
        _kill_after(store, "put_blocks")
        result = pending.result(timeout=60)
        ok, failed = _split(result.statuses)
        assert ok >= KILL_AFTER and failed > 0
        assert result.ok == tuple([True] * ok + [False] * failed)  # in order, then the cut
        assert result.pinned_slots == ()
        reasons = {result.errors[i] for i in range(ok, COUNT)}
        assert reasons <= {f"lost the connection to the store at {store.url}",
                           f"no reply from the store at {store.url} within the timeout",
                           f"no connection to the store at {store.url} within the timeout"}

        store.start()  # same port, empty store: the same client finds it again
        assert writer.put(KEYS[:8], range(8)).result(timeout=60).all_ok
    with StoreClient(store.url, NONE, namespace=NS) as check:
        assert check.lookup(KEYS) == 8


def test_sigkill_mid_get(store: StoreProcess, source: torch.Tensor) -> None:
    with StoreClient(store.url, NONE, pool=source, **OPTIONS) as writer:
        assert writer.put(KEYS, range(COUNT)).all_ok
    target = torch.full((COUNT, BLOCK), POISON, dtype=torch.uint8)
    slots = list(reversed(range(COUNT)))
    with AsyncRemoteClient(store.url, NONE, pool=target, **OPTIONS) as reader:
        pending = reader.get(KEYS, slots)
        _kill_after(store, "get_blocks")
        result = pending.result(timeout=60)
        ok, failed = _split(result.statuses)
        assert ok >= KILL_AFTER - 2 * 4 and failed > 0  # replies in flight may be lost
        landed = [index for index in range(COUNT) if result.ok[index]]
        failed_slots = [slots[index] for index in range(COUNT) if not result.ok[index]]
        assert torch.equal(target[[slots[i] for i in landed]], source[landed])
        assert bool((target[failed_slots] == POISON).all())  # a failed block's slot: unwritten

        store.start()
        refetch = reader.get(KEYS[:4], slots[:4]).result(timeout=60)
        assert refetch.statuses == (BlockStatus.MISSING,) * 4  # a new, empty store answers
    with StoreClient(store.url, NONE, pool=source, **OPTIONS) as writer:
        assert writer.put(KEYS[:4], range(4)).all_ok
    with StoreClient(store.url, NONE, pool=target, **OPTIONS) as reader:
        target[slots[:4]] = POISON
        assert reader.get(KEYS[:4], slots[:4]).all_ok
        assert torch.equal(target[slots[:4]], source[:4])


def test_closing_with_a_dead_store_cancels_the_queued_lookups(store: StoreProcess) -> None:
    """A scheduler shutting down while its store is gone: the lookup in flight ends by its
    deadline, those queued behind it are cancelled instead of each waiting out its own."""
    store.kill()
    client = AsyncRemoteClient(store.url, NONE, namespace=NS, timeout_s=1.0)
    lookups = [client.lookup(KEYS[:4], deadline_s=1.0) for _ in range(5)]
    client.close(drop_queued=True)
    cancelled = [future.cancelled() for future in lookups]
    assert cancelled.count(False) <= 1 and cancelled.count(True) >= 4, cancelled
    for future in lookups:
        if not future.cancelled():  # the one that ran: failed, no connection
            assert future.exception() is not None
