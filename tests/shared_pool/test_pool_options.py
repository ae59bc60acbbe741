"""The connector's `pool` key: exactly one host tier, a plain name, not with remote_only."""

from __future__ import annotations

import pytest

from kvconnector.vllm.options import ConnectorOptions


def test_pool_replaces_cpu_bytes() -> None:
    options = ConnectorOptions.parse({"pool": "node0", "remote_url": "tcp://127.0.0.1:5555"})
    assert (options.pool, options.cpu_bytes) == ("node0", None)


def test_pool_takes_a_disk_tier_under_it() -> None:
    options = ConnectorOptions.parse({"pool": "node0", "disk_path": "/tmp/x",
                                      "disk_bytes": 1 << 30, "disk_write_policy": "through"})
    assert options.tier_settings()["disk"].write_policy == "through"


@pytest.mark.parametrize(("extra", "match"), [
    ({}, "exactly one of 'cpu_bytes' .* and 'pool'"),
    ({"pool": "node0", "cpu_bytes": 1 << 30}, "exactly one of 'cpu_bytes'"),
    ({"pool": "../etc"}, "pool name must be"),
    ({"pool": "node0", "remote_url": "tcp://127.0.0.1:5555", "remote_only": True},
     "remote_only drops the host tier"),
])
def test_bad_pool_options_are_refused(extra: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ConnectorOptions.parse(extra)
