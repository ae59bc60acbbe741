"""`kvconnector bench` end to end on the CPU path, at tiny sizes. No timed assertions."""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

import pytest
import torch

from kvconnector.bench import runner
from kvconnector.bench.presets import PRESETS, build_cases
from kvconnector.bench.progress import clock
from kvconnector.bench.sizing import cgroup_memory_left, disjoint_id_sets
from kvconnector.cli import main
from kvconnector.cli.units import parse_size

# One small preset, few blocks, one repeat: seconds, not minutes.
TINY = ["bench", "--preset", "llama-3.1-70b-tp8", "--blocks", "8", "--budget", "64M",
        "--prefix-tokens", "64", "--repeats", "1"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse type errors exit through the parser
        return int(exc.code or 0)


def test_cpu_run_prints_table_and_writes_json_and_plot(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path on any machine
    js, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main([*TINY, "--kv-dtype", "bf16,fp8", "--remote-security", "none,secret",
                 "--json", str(js), "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    assert "No CUDA device" in out.splitlines()[0]
    assert "ceilings" in out and "block-major" in out and "layer-major" in out
    assert "llama-3.1-70b-tp8 bf16" in out and "llama-3.1-70b-tp8 fp8" in out
    assert "best of 5 rounds" in out  # how the ceilings were taken, printed
    # each figure judged against its ceiling, and on a CPU, what that ceiling is
    assert "verdicts against the same-run memory copies: no GPU here" in out
    assert "llama-3.1-70b-tp8 fp8 block-major: load " in out
    assert "the shared pool's writer store, load and both are not meaningful" in out

    # not a terminal: a line per unit (2 cases x 2 layouts, the last ceiling round, 2 cases of
    # the shared pool, 2 cases x 2 remote modes), numbered, with the time so far and an estimate
    # of the time left
    lines = err.splitlines()
    units = [re.fullmatch(r"\[(\d+)/11\] (.+) \((\d+:\d\d) so far, "
                          r"(estimating|about \d+:\d\d left)\)", line) for line in lines[:-1]]
    assert all(units), lines
    assert [int(m.group(1)) for m in units] == list(range(1, 12))
    assert [m.group(2) for m in units][:7] == [
        "llama-3.1-70b-tp8 bf16 block-major", "llama-3.1-70b-tp8 bf16 layer-major",
        "llama-3.1-70b-tp8 fp8 block-major", "llama-3.1-70b-tp8 fp8 layer-major",
        "ceilings: last round", "llama-3.1-70b-tp8 bf16: shared pool",
        "llama-3.1-70b-tp8 fp8: shared pool"]
    assert units[0].group(4) == "estimating" and units[1].group(4).startswith("about")
    assert re.fullmatch(r"done in \d+:\d\d", lines[-1])

    record = json.loads(js.read_text())
    ceil = record["ceilings"]
    for key in ("h2d_gbps", "d2h_gbps", "bidir_gbps", "plain_call_us"):
        assert ceil[key] > 0
    # one round before each case's layout and one after the last; each figure its best round
    assert len(ceil["rounds"]) == 5 and "best of 5 rounds" in ceil["method"]
    for key in ("h2d_gbps", "d2h_gbps", "bidir_gbps"):
        assert ceil[key] == max(r[key] for r in ceil["rounds"])
    assert ceil["plain_call_us"] == min(r["plain_call_us"] for r in ceil["rounds"])
    assert len(record["cases"]) == 2
    for case in record["cases"]:
        assert case["blocks"] == 8
        assert set(case["layouts"]) == {"block_major", "layer_major"}
        for r in case["layouts"].values():
            for key, ceiling in (("h2d", "h2d_gbps"), ("d2h", "d2h_gbps"),
                                 ("bidir", "bidir_gbps"), ("bidir_pair", "bidir_gbps")):
                assert r[key]["gbps"] > 0
                assert r[key]["ratio"] == pytest.approx(r[key]["gbps"] / ceil[ceiling])
                assert len(r[key]["seconds"]) == 1
            assert r["host_us_per_block"] > 0 and r["prefix_ms"] > 0
            assert r["host_ratio"] == pytest.approx(r["host_us_per_block"] / ceil["plain_call_us"])
            assert r["prefix_blocks"] == 4  # 64 tokens of 16
            ideal_s = 4 * case["case"]["block_bytes"] / (ceil["h2d_gbps"] * 1e9)
            assert r["prefix_ratio"] == pytest.approx(ideal_s / (r["prefix_ms"] / 1e3))
    assert case["layouts"]["layer_major"]["copies_per_job"] == 80 * 8  # one per layer per block
    assert case["layouts"]["block_major"]["copies_per_job"] == 8
    assert record["meta"]["device_type"] == "cpu"
    assert record["meta"]["both_ways"].startswith("bidir: 4 jobs each way")
    assert record["meta"]["command"].startswith("kvconnector bench --preset llama-3.1-70b-tp8")
    shared = record["shared_pool"]["rows"]
    assert [row["case"] for row in shared] == [c["case"]["name"] for c in record["cases"]]
    for row in shared:  # a writer process's blocks, loaded here and compared byte for byte
        assert "error" not in row, row
        assert row["blocks"] >= 1 and row["load_gbps"] > 0 and row["bidir_gbps"] > 0
        assert row["xxh3_load_gbps"] > 0  # loaded again, checked by xxh3
        assert row["load_ratio"] > 0 and row["load_meta_us"] > 0 and row["store_meta_us"] > 0
        assert row["store_gbps"] > 0 and row["store_ratio"] > 0 and row["late_hash_s"] >= 0
        # each phase against raw copies of its direction taken in turns with its rounds, and
        # against the ceilings taken before
        raw, ceil = row["raw"], record["ceilings"]
        assert min(raw.values()) > 0 and set(raw) == {"h2d_gbps", "d2h_gbps", "bidir_gbps"}
        assert row["load_ratio"] == pytest.approx(row["load_gbps"] / raw["h2d_gbps"])
        assert row["store_ratio"] == pytest.approx(row["store_gbps"] / raw["d2h_gbps"])
        assert row["bidir_ratio"] == pytest.approx(row["bidir_gbps"] / raw["bidir_gbps"])
        assert row["ceiling_ratios"] == pytest.approx({
            "load": row["load_gbps"] / ceil["h2d_gbps"],
            "xxh3_load": row["xxh3_load_gbps"] / ceil["h2d_gbps"],
            "store": row["store_gbps"] / ceil["d2h_gbps"],
            "both": row["bidir_gbps"] / ceil["bidir_gbps"]})
    assert "shared host pool" in out
    remote = record["remote"]
    assert [(row["case"], row["security"]) for row in remote["rows"]] == [
        (f"llama-3.1-70b-tp8 {d}", mode) for d in ("bf16", "fp8") for mode in ("none", "secret")]
    for row in remote["rows"]:
        assert row["put"]["gbps"] > 0 and row["get"]["gbps"] > 0
        assert row["baseline_put_gbps"] > 0 and row["baseline_get_gbps"] > 0

    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000


def test_gpus_adds_the_shared_pool_on_every_gpu_at_once(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from kvconnector.bench import ceilings, shared_pool_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # two stand-in processes
    block = 640 << 10  # llama-3.1-70b-tp8, bf16
    monkeypatch.setitem(shared_pool_gpus.SET_MAX_BYTES, "cpu", 6 * block)  # 6 blocks a set
    monkeypatch.setitem(ceilings.RAW_COPY_BYTES, "cpu", 4 << 20)
    js = tmp_path / "bench.json"
    assert main([*TINY, "--remote-security", "none", "--gpus", "0,1", "--json", str(js)]) == 0
    out, err = capsys.readouterr()
    assert "shared host pool on 2 GPUs at once" in out
    assert "Raw pinned copies (4 MiB per GPU)" in out
    assert "stand-in processes' rates are summing and hashing" in out
    # two more units, last (the run's own buffers are freed first): the raw copies, the size
    units = [line.split("] ")[1].split(" (")[0] for line in err.splitlines()
             if line.startswith("[")]
    assert units[-2:] == ["2 GPUs: raw copies", f"2 GPUs: shared pool, {block} B blocks"], units
    assert {line.split("]")[0] for line in err.splitlines() if line.startswith("[")} == {
        f"[{k}/{len(units)}" for k in range(1, len(units) + 1)}  # counted among the units
    record = json.loads(js.read_text())
    assert "--gpus 0,1" in record["meta"]["command"]
    every = record["shared_pool"]["every_gpu"]
    assert every["gpus"] == [0, 1] and len(every["ceilings"]["alone"]) == 2
    (row,) = every["rows"]
    assert (row["block_bytes"], row["blocks"], row["gpus"]) == (block, 6, [0, 1])
    rounds = 2  # one warm-up and one timed round per phase
    for engine in row["engines"]:
        assert engine["load_bytes_compared"] == 2 * rounds * 6 * block
        assert engine["store_bytes_compared"] == 2 * rounds * 6 * block
        assert (engine["load_mismatches"], engine["store_mismatches"]) == (0, 0)
    assert set(row["ratios"]) == {"load", "store", "both", "both_load", "both_store",
                                  "store_copies"}


def test_a_failure_on_every_gpu_is_reported_and_the_rest_still_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvconnector.bench import shared_pool_gpus

    def fails(*_: object) -> None:
        raise RuntimeError("engine 1 failed: blocks gone from the pool")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(shared_pool_gpus, "measure_every_gpu", fails)
    js = tmp_path / "bench.json"
    assert main([*TINY, "--remote-security", "none", "--gpus", "0,1", "--json", str(js)]) == 1
    out = capsys.readouterr().out
    assert "failed: RuntimeError: engine 1 failed: blocks gone from the pool" in out
    record = json.loads(js.read_text())
    assert record["shared_pool"]["every_gpu"] == {
        "gpus": [0, 1], "error": "RuntimeError: engine 1 failed: blocks gone from the pool"}
    assert record["cases"] and record["remote"]  # what was measured before is kept


def test_gpus_refuses_blocks_a_set_cannot_hold_three_of(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # sets of 16 MiB
    argv = ["bench", "--preset", "qwen3-32b", "--block-size", "128", "--gpus", "0,1"]
    assert exit_code(argv) == 2  # 32 MiB blocks
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "blocks of 33554432 B: a set holds at most 16777216 B" in err


def test_the_default_is_one_preset_both_layouts_and_one_remote_mode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    js = tmp_path / "bench.json"
    assert main(["bench", "--budget", "64M", "--repeats", "1", "--json", str(js)]) == 0
    record = json.loads(js.read_text())
    assert [case["case"]["name"] for case in record["cases"]] == ["llama-3.1-8b bf16"]
    assert set(record["cases"][0]["layouts"]) == {"block_major", "layer_major"}
    assert [row["security"] for row in record["remote"]["rows"]] == ["secret"]
    assert record["meta"]["command"].startswith(
        "kvconnector bench --preset llama-3.1-8b --kv-dtype bf16 --remote-security secret ")
    assert record["meta"]["wall_s"] > 0


def test_preset_all_is_every_preset_and_every_security_mode() -> None:
    from kvconnector.bench import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--preset", "all"])
    assert [case.name for case in cli._cases(args)] == [f"{p} bf16" for p in PRESETS]
    assert cli._securities(args) == ["none", "secret", "curve"]
    args = parser.parse_args(["bench", "--preset", "all", "--remote-security", "none"])
    assert cli._securities(args) == ["none"]


@pytest.mark.parametrize(("argv", "module", "extra"), [
    (["--plot", "bench.png"], "matplotlib", "bench"),
    (["--redis-url", "redis://127.0.0.1:7000"], "redis", "bench"),
    ([], "rich", "bench"),
])
def test_a_missing_extra_fails_at_once_naming_it(argv: list[str], module: str, extra: str,
                                                 tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError

    def no_measuring(*args: object) -> None:
        raise AssertionError("measured before checking the extras")

    monkeypatch.setattr(runner, "allocate_arenas", no_measuring)
    monkeypatch.chdir(tmp_path)
    assert exit_code([*TINY, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("kvconnector bench: error:") and f"needs {module}," in err
    assert err.rstrip().endswith(f"pip install 'kvconnector[{extra}]'")
    assert not (tmp_path / "bench.png").exists()


def test_the_gpu_path_without_the_gpu_extra_fails_at_once(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setattr(runner, "allocate_arenas", None)  # never reached
    assert exit_code(TINY) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the GPU path needs" in err
    assert err.rstrip().endswith("pip install 'kvconnector[gpu]'")


def test_progress_clock() -> None:
    assert [clock(s) for s in (0, 7.4, 92, 3723)] == ["0:00", "0:07", "1:32", "1:02:03"]


def test_explicit_shape_and_block_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--layers", "4", "--kv-heads", "1", "--head-size", "64", "--mla",
            "--block-size", "16,64", "--blocks", "4", "--budget", "16M", "--repeats", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "mla L4 H1 D64 N16 bf16" in out and "mla L4 H1 D64 N64 bf16" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--preset", "llama-9000"], "unknown preset 'llama-9000'"),
    (["--kv-dtype", "int3"], "unknown KV dtype 'int3'"),
    (["--blocks", "0"], "--blocks must be a positive integer"),
    (["--blocks", "many"], "invalid int value"),
    (["--budget", "1P"], "cannot allocate"),  # mmap refuses; the cgroup check may say it first
    (["--budget", "lots"], "not a size"),
    (["--preset", "qwen3-32b", "--budget", "4M"], "holds no two"),
    (["--preset", "qwen3-32b", "--budget", "64M", "--blocks", "100"], "raise --budget"),
    (["--layers", "4"], "needs --layers, --kv-heads and --head-size"),
    (["--block-size", "0"], "--block-size must be a positive integer"),
    (["--remote-security", "tls"], "unknown --remote-security 'tls'"),
    (["--gpus", "0,0"], "distinct indices"),
    (["--gpus", "5"], "--gpus 5 names one GPU"),
    (["--preset", "qwen3-32b", "--layers", "4", "--kv-heads", "1", "--head-size", "64"],
     "not both"),
])
def test_bad_flags_exit_2_with_one_line(argv: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    if argv == ["--budget", "1P"] and cgroup_memory_left() is not None:
        message = "cgroup"  # a cgroup limit is checked before allocating
    assert exit_code(["bench", *argv, "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvconnector bench: error:")
    assert message in err
    assert "Traceback" not in err


def test_presets_match_design_page_and_block_sizes() -> None:
    # Per-layer page and block-major block of each preset, as docs/benchmarks.md quotes them.
    expect = {"llama-3.1-8b": (64 << 10, 2 << 20), "llama-3.1-70b-tp8": (8 << 10, 640 << 10),
              "qwen3-32b": (64 << 10, 4 << 20), "deepseek-v3": (72 << 10, 61 * (72 << 10)),
              "gpt-oss-120b-hma": (32 << 10, 18 * (32 << 10))}
    for case in build_cases(list(PRESETS), ["bf16", "fp8"], None, None, False):
        page, block = expect[case.name.split()[0]]
        per_byte = 1 if case.name.endswith("bf16") else 2  # fp8 halves every size
        assert case.layout.page_bytes * per_byte == page
        assert case.layout.block_bytes * per_byte == block
    assert build_cases(["deepseek-v3"], ["bf16"], None, None, False)[0].layout.block_size == 64


def test_id_sets_are_disjoint_and_non_adjacent() -> None:
    a, b = disjoint_id_sets(random.Random(1), 50, 130)
    assert not set(a) & set(b)
    for ids in (a, b):
        s = sorted(ids)
        assert len(set(ids)) == 50 and all(y - x >= 2 for x, y in zip(s, s[1:], strict=False))
        assert ids != s  # random order, not ascending


def test_parse_size() -> None:
    assert parse_size("512M") == 512 << 20 and parse_size("1.5G") == 3 << 29
    assert parse_size("4096") == 4096 and parse_size("2GiB") == 2 << 30
    with pytest.raises(ValueError):
        parse_size("0")


def test_raw_remote_baseline_gets_more_blocks_than_the_high_water_mark(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The raw ROUTER once dropped every block past its 1000-message HWM, so a get of a large
    case's blocks waited out the timeout (the GPU machine's run hung on its block-size sweep).
    Now over three connections, as the store client's lanes: every block put comes back."""
    from kvconnector.bench import remote
    from transfer.remote.store.security import Security

    monkeypatch.setattr(remote, "_TIMEOUT_S", 10.0)
    n, block = 3000, 16 << 10
    pool = torch.full((2 * n, block), 0xA5, dtype=torch.uint8)  # odd rows: where gets land
    pool[0::2, :4] = torch.arange(n, dtype=torch.int32).view(n, 1).view(torch.uint8)
    puts, gets = remote._raw_baseline(pool, n, Security.none(), Security.none(), repeats=2,
                                      connections=3)
    assert len(puts) == len(gets) == 2 and min(puts + gets) > 0
    got = pool[1::2, :4].contiguous().view(torch.int32).flatten()
    assert sorted(got.tolist()) == list(range(n))  # each block once, whichever lane brought it
    assert torch.equal(pool[1::2], pool[0::2][got.long()])
