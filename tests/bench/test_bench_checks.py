"""`kvconnector bench`: outputs checked before anything is measured, `--disk` without `--preset`,
a plot that leaves nothing behind when it cannot be written, and the verdicts each figure gets.

No run measures here: the measuring entry points are replaced by ones that fail the test if
reached (a check must come first), or by a fixed result where the code after them is tested.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from test_bench import TINY, exit_code

from kvconnector.bench import disk, runner
from kvconnector.bench.report import copy_verdicts, print_report, standing, write_plot


def never_measure(*args: object, **kwargs: object) -> None:
    raise AssertionError("measured before the outputs were checked")


@pytest.fixture
def no_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runner, "allocate_arenas", never_measure)
    monkeypatch.setattr(disk, "measure_disk", never_measure)


def bad_outputs(tmp_path: Path) -> list[tuple[str, str]]:
    """(path, what the one line must say) for outputs no run can write."""
    return [(str(tmp_path), "is a directory: give a file path in it"),
            ("/proc", "is a directory"),
            ("/proc/bench.out", "cannot create a file in '/proc'"),
            (str(tmp_path / "missing" / "bench.out"), f"no directory '{tmp_path / 'missing'}'")]


# (--disk refuses --plot whatever its path: test_disk_mode_refuses_what_it_would_not_measure)
@pytest.mark.parametrize(("mode", "flag"), [("copies", "--json"), ("copies", "--plot"),
                                            ("disk", "--json")])
def test_an_output_no_run_can_write_fails_before_measuring(
        flag: str, mode: str, tmp_path: Path, no_measuring: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    first = TINY if mode == "copies" else ["bench", "--disk", str(tmp_path), "--repeats", "1"]
    for path, said in bad_outputs(tmp_path):
        assert exit_code([*first, flag, path]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "Traceback" not in err
        assert err.startswith(f"kvconnector bench: error: {flag} '{path}'") and said in err
    assert list(tmp_path.iterdir()) == []  # no probe or temporary file left


def test_the_same_file_for_json_and_plot_is_refused(tmp_path: Path, no_measuring: None,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.out"
    assert exit_code([*TINY, "--json", str(out), "--plot", str(out)]) == 2
    assert "--json and --plot both name" in capsys.readouterr().err


def test_disk_mode_refuses_what_it_would_not_measure(tmp_path: Path, no_measuring: None,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    for extra in (["--plot", str(tmp_path / "disk.png")],
                  ["--redis-url", "redis://127.0.0.1:7000"], ["--gpus", "0,1"]):
        assert exit_code(["bench", "--disk", str(tmp_path), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{extra[0]} is not measured with --disk" in err


def disk_row(case: str, block_bytes: int, ratio: float) -> dict[str, Any]:
    """A disk record row as measure_disk makes one (figures made up)."""
    row: dict[str, Any] = {"case": case, "block_bytes": block_bytes,
                           "request_bytes": 8 * (block_bytes + 4096), "blocks_per_request": 8,
                           "blocks": 64, "fio_memory": "shmhuge", "queue_depth": 4,
                           "load_average": [0.5]}
    for key in ("tier_write", "tier_write_carried", "tier_read", "fio_write", "fio_read"):
        row[f"{key}_GBps"], row[f"{key}_GBps_range"] = 2.0, [2.0, 2.0]
    for rw in ("write", "write_carried", "read"):
        row[f"{rw}_ratio"], row[f"{rw}_ratio_range"] = ratio, [ratio, ratio]
    return row


def test_disk_without_preset_measures_the_default_and_records_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The README's `kvconnector bench --disk DIR`: it once measured, then crashed on the
    record's command line (no --preset given)."""
    asked = []

    def measured(cases: list[Any], path: Path, total: int, threads: int,
                 repeats: int) -> dict[str, Any]:
        asked.append([case.name for case in cases])
        return {"path": str(path), "filesystem": "test", "threads": threads,
                "rows": [disk_row(cases[0].name, cases[0].layout.block_bytes, 1.12)]}

    monkeypatch.setattr(disk, "measure_disk", measured)
    js = tmp_path / "out" / "disk.json"
    js.parent.mkdir()
    assert exit_code(["bench", "--disk", str(tmp_path), "--json", str(js)]) == 0
    assert asked == [["llama-3.1-8b bf16"]]
    record = json.loads(js.read_text())
    assert record["meta"]["command"].startswith(
        f"kvconnector bench --preset llama-3.1-8b --kv-dtype bf16 --disk {tmp_path} ")
    out = capsys.readouterr().out
    assert "verdicts against fio on the same file system" in out
    assert "llama-3.1-8b bf16: write 1.12 above, carried write 1.12 above, read 1.12 above" in out
    assert "above 1: the tier moved its blocks faster than fio" in out


def test_a_plot_that_cannot_be_written_leaves_nothing_behind(tmp_path: Path) -> None:
    target = tmp_path / "bench.png"
    target.mkdir()  # os.replace onto a directory fails after the PNG is drawn
    with pytest.raises(OSError):
        write_plot(record(device_type="cpu"), target)
    assert [p.name for p in tmp_path.iterdir()] == ["bench.png"]
    assert list(target.iterdir()) == []
    ok = tmp_path / "ok.png"
    write_plot(record(device_type="cpu"), ok)
    assert ok.read_bytes().startswith(b"\x89PNG") and len(list(tmp_path.iterdir())) == 2


def rate(gbps: float, ratio: float) -> dict[str, Any]:
    return {"gbps": gbps, "ratio": ratio, "seconds": [1.0]}


def record(device_type: str, both: float = 0.95) -> dict[str, Any]:
    """A bench record as the run makes one, one case (figures made up)."""
    layout = {"row_bytes": 2 << 20, "copies_per_job": 8, "h2d": rate(50, 0.91),
              "d2h": rate(40, 0.72), "bidir": rate(90, both), "host_us_per_block": 2.0,
              "host_ratio": 1.0, "prefix_tokens": 64, "prefix_blocks": 4, "prefix_ms": 1.0,
              "prefix_ratio": 0.5}
    return {
        "meta": {"device_type": device_type, "device": "test", "date": "today",
                 "mover": "test mover", "baseline": "test baseline"},
        "ceilings": {"copy_bytes": 2 << 30, "h2d_gbps": 55.0, "d2h_gbps": 55.0,
                     "bidir_gbps": 50.0, "plain_call_us": 2.0, "plain_call": "test call",
                     "method": "test"},
        "cases": [{"case": {"name": "case-a bf16", "block_bytes": 2 << 20}, "blocks": 8,
                   "layouts": {"block_major": layout, "layer_major": layout}}],
        "shared_pool": {"rows": [{"case": "case-a bf16", "block_bytes": 2 << 20, "blocks": 8,
                                  "store_gbps": 0.1, "store_ratio": 0.002, "load_gbps": 0.1,
                                  "load_ratio": 0.02,
                                  "xxh3_load_gbps": 2.0, "xxh3_load_ratio": 0.4,
                                  "bidir_gbps": 0.2, "bidir_ratio": 0.03,
                                  "load_meta_us": 30.0, "store_meta_us": 80.0}]},
        "remote": {"rows": [{"case": "case-a bf16", "security": "secret",
                             "block_bytes": 2 << 20, "blocks": 8, "put": rate(1.0, 0.95),
                             "get": rate(1.0, 0.5), "baseline_put_gbps": 1.05,
                             "baseline_get_gbps": 2.0}]},
    }


def printed(rec: dict[str, Any]) -> str:
    console = Console(width=400, record=True)
    print_report(rec, console)
    return console.export_text()


def test_standing_bands() -> None:
    assert [standing(r) for r in (1.2, 1.05, 0.9, 0.89, 0.7, 0.69, 0.01)] == [
        "above", "at", "at", "near", "near", "well below", "well below"]


def test_cpu_verdicts_say_memory_bandwidth_and_what_is_not_meaningful() -> None:
    out = printed(record("cpu", both=1.23))
    assert ("verdicts against the same-run memory copies: no GPU here, so every copy is host to "
            "host, bounded by memory bandwidth, not PCIe") in out
    assert ("  case-a bf16 block-major: load 0.91 at, store 0.72 near, both 1.23 above, prefix "
            "load 0.50 well below; host time 1.0 plain copy calls a block") in out
    # the both-ways ceiling (50) under the one-way ones (55): why a ratio goes above 1
    assert "above 1 on a CPU: the ceilings are large Tensor.copy_ calls" in out
    assert "here the both-ways one, two such copies at once, is below the one-way ones" in out
    assert "the shared pool's writer store, load and both are not meaningful" in out
    assert "  case-a bf16: load by xxh3 0.40 well below" in out
    assert "PCIe limit" not in out
    assert "  case-a bf16 secret: put 0.95 at, get 0.50 well below" in out


def test_gpu_verdicts_say_the_pcie_limit() -> None:
    out = printed(record("cuda"))
    assert "verdicts against the same-run pinned copies, the PCIe limit" in out
    assert "load 0.91 at, store 0.72 near, both 0.95 at" in out
    assert ("verdicts against raw pinned copies taken in turns with the rounds, the PCIe limit "
            "of the moment") in out
    assert ("  case-a bf16: load 0.02 well below, writer store 0.00 well below, load by xxh3 0.40 "
            "well below, both 0.03 well below") in out
    assert "above 1" not in out and "not meaningful" not in out and "memory bandwidth" not in out
    lines = copy_verdicts(record("cuda", both=1.10))
    assert lines[-1].startswith("  above 1: the ceiling read low in every round")
