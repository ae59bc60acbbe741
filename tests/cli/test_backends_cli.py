"""`kvconnector backends`: the registry as a table and as JSON; a bad compute capability."""

from __future__ import annotations

import json

import pytest
from registry_seeds import SEEDED

from kvconnector.cli import main
from kvconnector.layout.descriptor import BLOCK_MAJOR_ORDERS


def test_cli_table_lists_every_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines[1:len(SEEDED) + 1]]
    assert names == list(SEEDED)
    assert lines[0].split()[:3] == ["NAME", "VIEW", "LAYOUTS"]
    flex = next(line for line in lines if line.startswith("FLEX_ATTENTION "))
    assert flex.split()[2:5] == ["LBNHC", "-", "no"]
    # vLLM's CPU build's own backends: what they declare, and that none may read block-major.
    rows = {line.split()[0]: line.split()[2:5] for line in lines[1:len(SEEDED) + 1]}
    assert rows["CPU_ATTN"] == ["LBHNC", "-", "no"]
    assert rows["CPU_MLA"] == rows["AMX_MLA"] == ["any", "-", "no"]
    assert rows["REF_ATTN"] == ["BLNHC,BLHNC,BHLNC", "BLNHC,BLHNC,BHLNC", "yes"]


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--json", "--no-vllm", "--compute-capability", "10.0"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(SEEDED)
    assert rows["FLASHINFER"]["block_outermost"] == ["BLHNC"]
    assert rows["FLASHINFER"]["layouts_by_cc"] == {"10": ["LBHNC", "BLHNC"]}
    assert rows["FLASH_ATTN"]["block_outermost"] == list(BLOCK_MAJOR_ORDERS)
    assert rows["FLEX_ATTENTION"]["layouts"] == ["LBNHC"] and not rows["FLEX_ATTENTION"][
        "reads_strides"]
    assert [c["kind"] for c in rows["TRITON_ATTN"]["constraints"]] == ["per_token_head_scales"]
    assert not any(row["layouts_live"] for row in rows.values())
    assert rows["AMX_MLA"]["layouts"] is None and rows["AMX_MLA"]["block_outermost"] == []
    assert "amx_mla.py" in rows["AMX_MLA"]["evidence"]
    assert rows["CPU_ATTN"]["layouts"] == ["LBHNC"]
    assert main(["backends", "--json", "--no-vllm", "--compute-capability", "9.0"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["FLASHINFER"]["block_outermost"] == list(BLOCK_MAJOR_ORDERS)


def test_cli_bad_compute_capability(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["backends", "--compute-capability", "sm100"])
    assert exc.value.code == 2
    assert "'sm100'" in capsys.readouterr().err
