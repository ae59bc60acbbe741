"""The layout the connector asks for, the start-up refusal of one a backend cannot read, and the
log line saying what vLLM did (kvconnector/vllm/layout_choice.py): the functions alone, then
through the harness's engine (vllm_harness.py), where vLLM resolves among the configured
backend's declared layouts."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

import vllm_harness as h  # noqa: E402

from kvconnector.layout.recognize import BLOCK_MAJOR_HINT  # noqa: E402
from kvconnector.offload.worker import BLOCK_MAJOR, PER_LAYER  # noqa: E402
from kvconnector.vllm.layout_choice import (  # noqa: E402
    CUDA_AUTO_BACKENDS,
    ResolvedBackend,
    advise_block_outermost,
    check_resolved,
    layout_line,
    required_layout,
)
from kvconnector.vllm.options import ConnectorOptions  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engines_shut_down")]

CPU_ATTN = ResolvedBackend("CPU_ATTN", ("LBHNC",), "cpu_attn.CPUAttentionBackend.declared()")
AMX_MLA = ResolvedBackend("AMX_MLA", None, "amx_mla.AMXMLABackend.declared()")
TRITON = ResolvedBackend("TRITON_ATTN", None, "triton_attn.TritonAttentionBackend.declared()")
SET = "set in kv_connector_extra_config"


def test_required_layout_choices() -> None:
    auto = ConnectorOptions(cpu_bytes=1)
    # No backend configured on CUDA: every backend vLLM may pick must accept the layout.
    assert required_layout(auto, CUDA_AUTO_BACKENDS, "auto", (9, 0))[0] == "BLNHC"
    assert required_layout(auto, CUDA_AUTO_BACKENDS, "auto", (10, 0))[0] == "BLHNC"  # FlashInfer
    assert required_layout(auto, CUDA_AUTO_BACKENDS, "fp8", (9, 0))[0] == "BLHNC"
    # ... and elsewhere the set is unknown (ROCm/XPU backends lack stride evidence): opt out.
    layout, why = required_layout(auto, None, "auto")
    assert layout is None and "non-CUDA platform" in why
    assert required_layout(auto, ["FLASH_ATTN"], "auto")[0] == "BLNHC"
    assert required_layout(auto, ["TRITON_MLA"], "auto")[0] == "BLNHC"
    for name in ("FLEX_ATTENTION", "ROCM_AITER_MLA", "CPU_ATTN", "CPU_MLA", "AMX_MLA"):
        layout, why = required_layout(auto, [name], "auto")
        assert layout is None and name in why
    assert required_layout(ConnectorOptions(cpu_bytes=1, layout="BHLNC"), None, "auto")[0] \
        == "BHLNC"
    assert required_layout(ConnectorOptions(cpu_bytes=1, layout="engine"), ["FLASH_ATTN"],
                           "auto")[0] is None


# -- the start-up check --------------------------------------------------------------------------
@pytest.mark.parametrize("backend", [AMX_MLA, CPU_ATTN, ResolvedBackend("MY_ATTN", None, "x")])
def test_a_resolved_layout_the_backend_is_not_known_to_read_is_refused(
        backend: ResolvedBackend) -> None:
    with pytest.raises(ValueError, match=rf"asked for KV cache layout BLNHC \({SET}\) and vLLM "
                       rf"resolved it, but attention backend {backend.name} reads the cache"):
        check_resolved("BLNHC", SET, "BLNHC", [TRITON, backend], "auto")


def test_what_the_start_up_check_lets_through() -> None:
    check_resolved("BLNHC", SET, "BLNHC", [TRITON], "auto")  # opted in, by evidence
    check_resolved("BLNHC", SET, "LBHNC", [CPU_ATTN], "auto")  # vLLM refused: nothing to read
    check_resolved(None, "opted out", "BLNHC", [AMX_MLA], "auto")  # vLLM's own choice
    # A constraint narrows the set: FlashInfer with fp8 KV reads head-major interiors only.
    check_resolved("BLHNC", SET, "BLHNC", [ResolvedBackend("FLASHINFER", None, "x")], "fp8")
    with pytest.raises(ValueError, match="FLASHINFER reads the cache .* not BLNHC"):
        check_resolved("BLNHC", SET, "BLNHC", [ResolvedBackend("FLASHINFER", None, "x")], "fp8")


# -- the log line --------------------------------------------------------------------------------
def test_line_when_vllm_refused_names_the_declaration_that_decided(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    line = layout_line(0, "BLNHC", SET, "LBHNC", [CPU_ATTN], "per-layer: 4 copies per block")
    assert line == (f"CrossLayerOffloadConnector rank 0: asked for BLNHC ({SET}), vLLM refused "
                    f"it (CPU_ATTN declares LBHNC only ({CPU_ATTN.source})) and resolved LBHNC "
                    f"for CPU_ATTN; per-layer: 4 copies per block")
    assert "ask for a block-outermost" not in line
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBHNC")  # not a refusal: an override
    assert "VLLM_KV_CACHE_LAYOUT=LBHNC overrode it: vLLM resolved LBHNC for TRITON_ATTN" in \
        layout_line(0, "BLNHC", SET, "LBHNC", [TRITON], "per-layer")


def test_line_names_the_backend_vllm_picked() -> None:
    ref = ResolvedBackend("REF_ATTN", ("BLNHC", "BLHNC", "BHLNC"), "ref")
    why = "no attention backend configured on a non-CUDA platform"
    assert layout_line(1, None, why, "BLNHC", [ref], "block-major: 1 copy per block") == (
        f"CrossLayerOffloadConnector rank 1: asked for vLLM's default ({why}), vLLM resolved "
        f"BLNHC for REF_ATTN; block-major: 1 copy per block")
    assert "for an attention backend not known here;" in layout_line(0, None, why, "LBNHC", [],
                                                                       "per-layer")


def test_advice_only_where_asking_would_help() -> None:
    assert advise_block_outermost(None, [TRITON], "auto")  # opted out by the user
    assert not advise_block_outermost(None, [CPU_ATTN], "auto")  # the backend refuses them
    assert not advise_block_outermost("BLNHC", [TRITON], "auto")  # asked already
    assert not advise_block_outermost(None, [], "auto")  # nothing known


# -- through the harness's engine ----------------------------------------------------------------
def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vllm.kvconnector"]


def test_explicit_layout_the_backend_cannot_read_fails_at_start_up(model_dir: str) -> None:
    # vLLM's AMX_MLA declares no layout, so vLLM takes BLNHC; its kernel would then fail on the
    # first forward (a dense .view of the cache). The worker refuses at registration instead.
    setup = h.EngineSetup(model_dir=model_dir, mla=True, backend="AMX_MLA",
                          extra_config={"cpu_bytes": 1 << 20, "layout": "BLNHC"})
    with pytest.raises(ValueError, match="attention backend AMX_MLA reads the cache and is not "
                       "known to read per-layer views of a block-major buffer"):
        h.Engine(setup)


def test_refused_request_is_logged_with_the_declaration_and_moves_per_layer(
        model_dir: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    caplog.set_level(logging.INFO, logger="vllm.kvconnector")
    engine = h.Engine(h.EngineSetup(model_dir=model_dir, backend="CPU_ATTN",
                                    extra_config={"cpu_bytes": 1 << 20, "layout": "BLNHC"}))
    assert engine.layout == "LBHNC"  # CPU_ATTN's only layout
    worker = engine.workers[0].connector._worker
    assert worker.mode == PER_LAYER and worker.copies_per_block == h.NUM_LAYERS
    assert worker.describe().endswith(f"; {BLOCK_MAJOR_HINT})")  # the advice, taken out below
    source = ("vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend."
              "supported_kv_cache_layouts()")
    assert _lines(caplog) == [
        f"CrossLayerOffloadConnector rank 0: asked for BLNHC ({SET}), vLLM refused it (CPU_ATTN "
        f"declares LBHNC only ({source})) and resolved LBHNC for CPU_ATTN; "
        f"{worker.describe(advise=False)}"]


def test_accepted_request_is_logged_with_the_backend(
        model_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vllm.kvconnector")
    engine = h.Engine(h.EngineSetup(model_dir=model_dir,
                                    extra_config={"cpu_bytes": 1 << 20, "layout": "BHLNC"}))
    worker = engine.workers[0].connector._worker
    assert engine.layout == "BHLNC" and worker.mode == BLOCK_MAJOR
    assert _lines(caplog) == [f"CrossLayerOffloadConnector rank 0: asked for BHLNC ({SET}), vLLM "
                              f"resolved BHLNC for TRITON_ATTN; {worker.describe()}"]
