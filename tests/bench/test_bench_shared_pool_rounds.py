"""The one-GPU shared-pool bench's rounds and raw copies in turns: a raw copy of a round's
direction right before each round, the warm-up's left out of the medians; and the script's
record and lines on the CPU path (tiny sizes, no timed assertions)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvconnector.bench import ceilings
from kvconnector.bench.shared_pool import _store_rounds

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_shared_pool  # noqa: E402


class _Raw:
    """Stands in for RawCopies: hands out the given rates, logs each copy."""

    def __init__(self, rates: list[float], log: list[Any]) -> None:
        self.rates, self.log = iter(rates), log

    def gbps(self, direction: str) -> float:
        self.log.append(("raw", direction))
        return next(self.rates)


class _Index:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def discard(self, keys: list[bytes]) -> None:
        self.log.append(("discard", keys))

    def pool_stats(self) -> dict[str, Any]:
        return {}


def test_each_store_round_follows_a_raw_copy_and_the_warm_up_is_left_out() -> None:
    log: list[Any] = []

    def prepared(batch: int) -> Any:
        log.append(("prepared", batch))
        return type("Plan", (), {"keys": [batch]})()

    def store(plan: Any, job_base: int, committed: Any) -> None:
        log.append(("store", job_base))
        committed()

    # the warm-up's raw copy reads 100 GB/s: a median that kept it would read 3, not 2
    out = _store_rounds(prepared, store, _Index(log), 3, _Raw([100.0, 1.0, 2.0, 3.0], log))
    assert log == [entry for r in range(4) for entry in (
        ("prepared", 10 + r), ("raw", "d2h"), ("store", (2 + r) * 8), ("discard", [10 + r]))]
    assert len(out) == 4 and out[3] == 2.0
    assert all(seconds >= 0 for seconds in out[:3])


def test_the_script_records_both_references_and_says_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path on any machine
    monkeypatch.setitem(ceilings.RAW_COPY_BYTES, "cpu", 1 << 20)
    js = tmp_path / "pool.json"
    assert bench_shared_pool.main(["--block-sizes", "64KiB", "--repeats", "1",
                                   "--json", str(js)]) == 0
    out = capsys.readouterr().out
    (row,) = json.loads(js.read_text())["rows"]
    raw = row["raw"]
    assert set(raw) == {"h2d_gbps", "d2h_gbps", "bidir_gbps"} and min(raw.values()) > 0
    # a set (64 KiB x 1024 = 64 MiB here) is larger than the raw copies' bound: 1 MiB each
    assert row["raw_method"].startswith(f"one copy of {1 << 20} B in the phase's direction")
    assert row["load_ratio"] == pytest.approx(row["load_gbps"] / raw["h2d_gbps"])
    assert row["store_ratio"] == pytest.approx(row["store_gbps"] / raw["d2h_gbps"])
    assert row["bidir_ratio"] == pytest.approx(row["bidir_gbps"] / raw["bidir_gbps"])
    assert set(row["ceiling_ratios"]) == {"load", "xxh3_load", "store", "both"}
    assert (f"block 64 KiB x {row['blocks']}: raw copies in turns with the rounds: load "
            f"{raw['h2d_gbps']:.2f}, store {raw['d2h_gbps']:.2f}, both {raw['bidir_gbps']:.2f} "
            f"GB/s; of those (of the ceilings above): load {row['load_ratio']:.3f} "
            f"({row['ceiling_ratios']['load']:.3f})") in out
