"""`benchmarks/bench_shared_pool.py --gpus` on the CPU path: two stand-in processes, each its own
"device", one pool daemon, tiny sizes. Counts and bytes, no timed assertions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from kvconnector.bench import shared_pool_gpus
from kvconnector.bench.ceilings import RAW_COPY_BYTES
from kvconnector.bench.shared_pool_gpus import POISON, block_pattern, mismatched_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_shared_pool  # noqa: E402

BLOCK = 64 << 10


def test_two_stand_ins_store_and_load_at_once_and_every_byte_matches(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path on any machine
    monkeypatch.setitem(shared_pool_gpus.SET_MAX_BYTES, "cpu", 40 * BLOCK)  # 40 blocks a set
    monkeypatch.setitem(RAW_COPY_BYTES, "cpu", 4 << 20)
    js = tmp_path / "gpus.json"
    argv = ["--gpus", "0,1", "--block-sizes", "64KiB", "--repeats", "1", "--json", str(js)]
    assert bench_shared_pool.main(argv) == 0
    out = capsys.readouterr().out
    # The tables come last: the ceilings, then the block size's engines and aggregate.
    assert "Raw pinned copies (4 MiB per GPU)" in out
    assert out.rstrip().splitlines()[-1].endswith(f"{2 * 2 * 2 * 2 * 40 * BLOCK}: "
                                                  f"0 mismatched blocks")
    record = json.loads(js.read_text())
    assert record["command"] == "python benchmarks/bench_shared_pool.py " + " ".join(argv)
    assert record["hardware"]["gpus"] == [0, 1]
    assert record["hardware"]["device_names"] and len(record["hardware"]["device_names"]) == 2
    assert record["hardware"]["cpu_count"] >= 1
    assert record["block_sizes"] == [BLOCK] and record["date"]

    ceilings = record["ceilings"]
    assert ceilings["copy_bytes"] == 4 << 20 and len(ceilings["alone"]) == 2
    for key in ("h2d_gbps", "d2h_gbps", "bidir_gbps"):
        assert all(one[key] > 0 for one in ceilings["alone"])
        assert ceilings["sum_of_alone"][key] == pytest.approx(
            sum(one[key] for one in ceilings["alone"]))
        assert ceilings["aggregate_of_sum"][key] == pytest.approx(
            ceilings["aggregate"][key] / ceilings["sum_of_alone"][key])

    (row,) = record["rows"]
    n = 40
    rounds = 2  # one warm-up and one timed round per phase
    assert (row["block_bytes"], row["blocks"], row["gpus"]) == (BLOCK, n, [0, 1])
    engines = row["engines"]
    assert [e["gpu"] for e in engines] == [0, 1]
    # The two raced for the common set: every block stored once, by one of them.
    assert sum(e["common_stored"] for e in engines) == n
    for e in engines:
        assert e["own_stored"] == n
        assert e["raw_copy_bytes"] == 4 << 20  # the size the raw rates are divided by
        # A third of the common set, of its own, of the other engine's (stored by that one).
        assert e["load_sources"] == {"common": 13, "own": 13, "next": 14}
        # Stores: its share of the common set, its own set, n a round in "store" and "both".
        assert e["blocks_stored"] == e["common_stored"] + n + 2 * rounds * n
        assert e["blocks_loaded"] == 2 * rounds * n  # "load" and "both"
        assert e["load_bytes_compared"] == 2 * rounds * n * BLOCK
        assert e["store_bytes_compared"] == 2 * rounds * n * BLOCK
        assert (e["load_mismatches"], e["store_mismatches"]) == (0, 0)
        # A GPU fleet with no tier below: no lease needs xxh3s, none is taken.
        assert (e["hashed_stores"], e["late_hash_s"]) == (0, None)
        for key in ("load_load_gbps", "store_store_gbps", "both_load_gbps", "both_store_gbps"):
            assert e[key] > 0
    # Each phase's raw copies, every stand-in at once, taken in turns with its rounds.
    aggregate, raw = row["aggregate"], row["raw"]
    assert set(raw) == {"h2d_gbps", "d2h_gbps", "bidir_gbps"} and min(raw.values()) > 0
    assert "raw, in turns" in out
    assert row["ratios"]["load"] == pytest.approx(aggregate["load_load_gbps"] / raw["h2d_gbps"])
    assert row["ratios"]["store"] == pytest.approx(
        aggregate["store_store_gbps"] / raw["d2h_gbps"])
    assert row["ratios"]["both"] == pytest.approx(aggregate["both_gbps"] / raw["bidir_gbps"])
    # A store's round up to its last copy's end, without the wait for its last commit: every
    # round's span is a part of its store span from the same start, so never a lower rate.
    assert row["ratios"]["store_copies"] == pytest.approx(
        aggregate["store_copied_gbps"] / raw["d2h_gbps"])
    assert aggregate["store_copied_gbps"] >= aggregate["store_store_gbps"]
    assert "stores to last copy" in out


def test_the_comparison_finds_a_flipped_byte_and_a_block_left_poisoned() -> None:
    rows = torch.full((6, 4096), POISON, dtype=torch.uint8)
    numbers = [7, 8, 9, 10]
    ids = [5, 1, 3, 0]
    rows[ids] = block_pattern(numbers, 4096, rows.device)
    assert mismatched_blocks(rows, ids, numbers) == []
    assert not torch.equal(rows[5], rows[1])  # each key its own bytes
    rows[1, 4095] ^= 1
    rows[0] = POISON  # a load that never landed
    assert mismatched_blocks(rows, ids, numbers) == [1, 3]
    assert mismatched_blocks(rows, [5, 3], [7, 10]) == [1]  # block 3 holds key 9's bytes


@pytest.mark.parametrize(("gpus", "message"), [
    ("all", "--gpus all needs CUDA GPUs"),
    ("0,0", "distinct indices"),
    ("0,x", "'all' or indices"),
])
def test_bad_gpu_lists_exit_2_with_one_line(gpus: str, message: str,
                                            capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        bench_shared_pool.main(["--gpus", gpus])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("repeats", ["0", "-1"])
def test_no_timed_rounds_exit_2_before_any_work(repeats: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_shared_pool.main(["--repeats", repeats])
    assert exc.value.code == 2
    assert f"--repeats must be a positive integer, got {repeats}" in capsys.readouterr().err
