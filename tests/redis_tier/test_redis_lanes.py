"""redis_lanes: how many threads a backend gets, and how a call's pipelines are dealt to them."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("redis")

from transfer.remote.redis import lanes as redis_lanes  # noqa: E402
from transfer.remote.redis.backend import DEFAULT_WORKERS  # noqa: E402
from transfer.remote.redis.lanes import deal_lanes, default_workers  # noqa: E402


def test_default_workers_one_lane_per_master_only_where_no_core_is_spare(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_workers(1) == default_workers(2) == 3  # 3 masters: one lane each
    assert default_workers(3) == default_workers(16) == 8  # two lanes each
    assert default_workers(len(os.sched_getaffinity(0))) == DEFAULT_WORKERS
    # the cores this process may run on, not the machine's
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert redis_lanes.default_workers() == 3
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert redis_lanes.default_workers() == 8  # where there is no affinity: cpu_count


def test_lanes_deal_each_nodes_pipelines_round_robin() -> None:
    a, b, c = object(), object(), object()  # node clients: only passed through
    nodes = [(a, [[0], [1], [2], [3], [4]]), (b, [[5], [6]]), (c, [])]
    lanes = deal_lanes(nodes, 6)  # 6 // 3 nodes = 2 lanes per node
    assert lanes == [(a, [[0], [2], [4]]), (b, [[5]]), (a, [[1], [3]]), (b, [[6]])]
    assert deal_lanes(nodes, 3) == [(a, [[0], [1], [2], [3], [4]]), (b, [[5], [6]])]
    assert deal_lanes(nodes, 1) == deal_lanes(nodes, 3)  # at least one lane per node
    every = sorted(i for _, pipelines in deal_lanes(nodes, 8) for p in pipelines for i in p)
    assert every == list(range(7))  # each pipeline in exactly one lane
