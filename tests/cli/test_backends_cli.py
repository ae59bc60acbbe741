"""`kvconnector backends`: the registry as a table and as JSON; a bad compute capability."""

from __future__ import annotations

import json

import pytest
from registry_seeds import REFERENCE, SEEDED

from kvconnector.cli import main
from kvconnector.cli.backends import WIDTH
from kvconnector.layout import registry
from kvconnector.layout.descriptor import BLOCK_MAJOR_ORDERS

LISTED = [name for name in SEEDED if name not in REFERENCE]  # test support is never listed


def table_rows(lines: list[str]) -> dict[str, list[str]]:
    """The table's backend rows (not the continuation lines of a multi-line cell), by name."""
    end = lines.index("")
    return {line.split()[0]: line.split()[1:] for line in lines[1:end] if not line[0].isspace()}


def test_cli_table_lists_every_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "STRIDES", "LAYOUTS", "BLOCK-OUTERMOST", "CONSTRAINTS"]
    rows = table_rows(lines)
    assert list(rows) == LISTED
    assert rows["FLEX_ATTENTION"] == ["no", "LBNHC", "-", "-"]
    # vLLM's CPU build's own backends: what they declare, and that none may read block-major.
    assert rows["CPU_ATTN"] == ["no", "LBHNC", "-", "-"]
    assert rows["CPU_MLA"] == rows["AMX_MLA"] == ["no", "any", "-", "-"]
    assert rows["FLASH_ATTN"] == ["yes", "any", "BLNHC,BLHNC,BHLNC", "tma_alignment"]


def test_the_table_fits_100_columns_and_says_each_thing_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--no-vllm"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert WIDTH == 100 and max(map(len, lines)) <= 100
    # FLASHINFER's second layout rule and second constraint on lines of their own
    at = next(i for i, line in enumerate(lines) if line.startswith("FLASHINFER "))
    assert lines[at].split()[1:] == ["yes", "LBHNC,BLHNC", "BLHNC", "tma_alignment"]
    assert lines[at + 1].split() == ["cc", "10:", "LBHNC,BLHNC", "fp8_dequant_contiguous"]
    # Every backend's layouts came from the record: that reason once, not once per backend
    # (twice: FLASHINFER's layouts also depend on the compute capability).
    assert " ".join(out.split()).count("(vLLM not consulted)") == 2
    assert "LAYOUTS: 0 of 22 from the installed vLLM's supported_kv_cache_layouts()" in out
    # The three DeepSeek indexers share their evidence: printed once, naming all three.
    assert out.count("indexer_k_quant_and_cache addresses blocks") == 1
    assert ("  DEEPSEEK_V4_INDEXER, DEEPSEEK_V41_INDEXER, DEEPSEEK_V41_SPARSE_INDEXER:"
            in lines)
    assert "REF_ATTN" not in out and "ref_attention" not in out


def test_the_reference_backend_stays_known_to_the_connector() -> None:
    # The engine tier's REF_ATTN is not listed, but engines started by tests still find it.
    entry = registry.lookup("REF_ATTN")
    assert entry is not None and entry.test_only and entry.reads_strides
    assert entry.vllm_class == registry.REF_ATTN_CLASS
    assert "REF_ATTN" in {e.name for e in registry.registered_backends()}
    assert "REF_ATTN" not in {e.name for e in registry.registered_backends(listed=True)}
    assert registry.decide(["REF_ATTN"], use_vllm=False).layout == "BLNHC"


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--json", "--no-vllm", "--compute-capability", "10.0"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert list(rows) == LISTED
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
