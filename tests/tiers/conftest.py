"""Fixtures of the tier tests: the memory tier registered for one test, a store server for a
module (the Redis Cluster is tests/conftest.py's `redis_cluster`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from memory_tier import MEMORY_TIER

from kvconnector.servers.store import StoreProcess
from transfer.registry import register_tier, registered_tiers, unregister_tier
from transfer.tier import TierSpec


@pytest.fixture
def memory_tier() -> Iterator[TierSpec]:
    """The memory tier, registered as any tier is (a TierSpec), and unregistered after."""
    registered_tiers()  # the library's own first: a clash of names or keys shows here
    register_tier(MEMORY_TIER)
    try:
        yield MEMORY_TIER
    finally:
        unregister_tier(MEMORY_TIER.name)


@pytest.fixture(scope="module")
def store_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    """A `kvconnector store serve` process on loopback (security none), shared by a module's
    tests: each test uses keys of its own."""
    log = tmp_path_factory.mktemp("store") / "store.log"
    with StoreProcess(log, capacity="64MiB") as process:
        yield process
