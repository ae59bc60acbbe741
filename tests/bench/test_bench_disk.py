"""`kvconnector bench --disk` end to end at a tiny size (needs fio). No timed assertions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_bench import exit_code

from kvconnector.cli import main


@pytest.mark.skipif(shutil.which("fio") is None, reason="needs fio (Debian package fio)")
def test_disk_bench_measures_both_block_sizes_against_fio(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "disk.json"
    argv = ["bench", "--preset", "llama-3.1-8b,llama-3.1-70b-tp8", "--disk", str(tmp_path),
            "--disk-bytes", "16M", "--disk-threads", "4", "--repeats", "1", "--json", str(js)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Disk tier" in out and "fio write GB/s" in out
    record = json.loads(js.read_text())
    rows = record["disk"]["rows"]
    # Requests of 16 MiB of blocks (the tier's runs), each block with its 4 KiB footer.
    assert [(r["block_bytes"], r["blocks_per_request"], r["request_bytes"], r["queue_depth"])
            for r in rows] == [(2 << 20, 8, 8 * ((2 << 20) + 4096), 4),
                               (640 << 10, 25, 25 * ((640 << 10) + 4096), 4)]
    assert [r["blocks"] for r in rows] == [64, 200]  # 2 requests per thread at least
    assert all(r["fio_memory"] in ("shmhuge", "malloc") for r in rows)
    for row in rows:
        for key in ("tier_write_GBps", "tier_write_carried_GBps", "tier_read_GBps",
                    "fio_write_GBps", "fio_read_GBps"):
            assert row[key] > 0
        for rw in ("write", "write_carried", "read"):  # one repeat: one pair, its ratio
            assert row[f"{rw}_ratio"] == pytest.approx(
                row[f"tier_{rw}_GBps"] / row[f"fio_{rw[:5]}_GBps"], rel=0.01)
            assert row[f"{rw}_ratio_range"] == [row[f"{rw}_ratio"]] * 2
        assert len(row["load_average"]) == 1
    assert record["meta"]["command"].startswith("kvconnector bench --preset llama-3.1-8b,")
    assert [p.name for p in tmp_path.iterdir()] == ["disk.json"]  # slab and fio file removed


def test_disk_bench_refuses_a_missing_directory(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--preset", "llama-3.1-8b", "--disk", str(tmp_path / "none"),
            "--repeats", "1"]
    assert exit_code(argv) == 2
    assert "is not a directory" in capsys.readouterr().err
