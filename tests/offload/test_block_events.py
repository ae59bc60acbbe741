"""The scheduler core's event log (kvconnector/offload/events.py) on its own: announced once,
removed only when announced, descriptions taken at planning, a fed source's own order, a cleared
tier's writes in flight."""

from __future__ import annotations

from kvconnector.offload.events import BlockChange, BlockLog


def test_a_block_is_announced_once_and_removed_only_when_announced() -> None:
    described: list[tuple[str, list[bytes]]] = []

    def describe(req_id: str, keys: list[bytes]) -> list[str]:
        described.append((req_id, list(keys)))
        return [f"{req_id}:{key.decode()}" for key in keys]

    log = BlockLog(["pool", "disk"], describe)
    log.planned("r", [b"a", b"b"])
    log.planned("r", [b"b", b"c"])  # b is described already
    assert described == [("r", [b"a", b"b"]), ("r", [b"c"])]
    log.stored("pool", [b"a", b"b"])
    log.stored("pool", [b"b", b"c"])  # b again: no change
    log.stored("remote", [b"a"])  # a source not published
    log.removed("pool", [b"a", b"x"])  # x was never announced
    log.removed("disk", [b"a"])
    assert log.take() == [BlockChange("pool", True, (b"a", b"b"), ("r:a", "r:b")),
                          BlockChange("pool", True, (b"c",), ("r:c",)),
                          BlockChange("pool", False, (b"a",))]
    assert log.take() == [] and log.held == {"pool": {b"b", b"c"}, "disk": set()}
    assert log.described == 2  # a's description went with its last source


def test_a_tier_write_counts_once_done_and_not_after_its_tier_was_cleared() -> None:
    log = BlockLog(["pool", "disk"])
    log.write_planned(7, "disk", [b"a", b"b"])
    log.write_planned(8, "disk", [b"c"])
    log.write_done(7, [b"b"])  # b failed its write
    log.cleared("disk")
    log.write_done(8, [])  # planned before the reset: never loadable
    assert [(c.source, c.stored, c.keys) for c in log.take()] == [
        ("disk", True, (b"a",)), ("disk", False, (b"a",))]
    assert log.held["disk"] == set()


def test_a_fed_source_follows_its_own_changes_only() -> None:
    log = BlockLog(["pool"], fed=["pool"])
    log.stored("pool", [b"a"])  # what the core sees of a shared pool is ignored
    log.feed("pool", False, [(True, b"a"), (True, b"b"), (False, b"a"), (True, b"c")])
    log.feed("pool", True, [(True, b"c"), (True, b"d")])  # the whole list now
    assert [(c.stored, c.keys) for c in log.take()] == [
        (True, (b"a", b"b")), (False, (b"a",)), (True, (b"c",)), (False, (b"b",)),
        (True, (b"d",))]
    assert log.held["pool"] == {b"c", b"d"}
