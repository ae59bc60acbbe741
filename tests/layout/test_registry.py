"""Backend registry: seeds, decisions, user registration, and vLLM agreement."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from registry_seeds import CPU, DSV4_INDEXERS, OPTED_IN, OPTED_OUT, REFERENCE, SEEDED

from kvconnector.layout import registry
from kvconnector.layout.descriptor import BLOCK_MAJOR_ORDERS
from kvconnector.layout.registry import BackendEntry, ConstraintKind, decide
from kvconnector.layout.views import ViewKind

# Backends whose modules need CUDA (or a CUDA-only extension) to import: vLLM 0.32's, and in 0.33
# also ROCM_AITER_UNIFIED_ATTN (its module reads the GPU's architecture name at import).
GPU_ONLY_032 = {"FLASHINFER", "FLASH_ATTN_MLA", "CUTLASS_MLA"}


def gpu_only() -> set[str]:
    from vllm import __version__

    later = tuple(int(part) for part in __version__.split(".")[:2]) >= (0, 33)
    return GPU_ONLY_032 | ({"ROCM_AITER_UNIFIED_ATTN"} if later else set())
HOPPER, BLACKWELL = (9, 0), (10, 0)


def recorded(names: list[str], cc: tuple[int, int] | None = HOPPER, kv_dtype: str | None = None
             ) -> registry.LayoutDecision:
    """A decision from the record alone, so it holds with or without vLLM installed."""
    return decide(names, compute_capability=cc, kv_dtype=kv_dtype, use_vllm=False)


@pytest.fixture
def own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations in a test stay in that test."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


# -- seeds ---------------------------------------------------------------------------------------
def test_seeded_names_and_opt_in() -> None:
    entries = {e.name: e for e in registry.registered_backends()}
    assert set(entries) == set(SEEDED)
    assert {n for n, e in entries.items() if e.reads_strides} == set(
        OPTED_IN + DSV4_INDEXERS + REFERENCE)
    for entry in entries.values():
        assert entry.view is ViewKind.VLLM  # vLLM >= 0.32: every layer reads [B, H, N, C]
        assert entry.evidence and (entry.vllm_class.startswith("vllm.")
                                   or entry.vllm_class == registry.REF_ATTN_CLASS)


def test_cpu_backends_are_recorded_with_what_they_declare() -> None:
    # vLLM's CPU build: CPU_ATTN declares LBHNC; the MLA ones declare nothing but flatten the
    # layer's cache with a dense .view, so a block-major view would fail or be misread.
    declared = {name: recorded([name]).refusals[0].evidence for name in CPU}
    assert "LBHNC only" in declared["CPU_ATTN"] and registry.lookup("CPU_ATTN").layouts == (
        "LBHNC",)
    for name, source in (("CPU_MLA", "cpu_mla.py"), ("AMX_MLA", "amx_mla.py")):
        assert registry.lookup(name).layouts is None and source in declared[name]
        assert ".view(-1" in declared[name]


def test_refusal_for_one_backend_and_layout() -> None:
    assert registry.refusal_for("CPU_ATTN", "LBHNC") is None  # layer-major: any backend's own
    assert "opted out" in registry.refusal_for("AMX_MLA", "BLNHC", use_vllm=False).reason
    assert registry.refusal_for("FLASH_ATTN", "BHLNC", use_vllm=False) is None
    refusal = registry.refusal_for("FLASHINFER", "BLNHC", kv_dtype="fp8", use_vllm=False)
    # Compute capability unknown: what every device accepts (cc 10 declares BLHNC alone).
    assert refusal.reason == "accepts BLHNC of the block-outermost layouts, not BLNHC (KV dtype " \
        "'fp8')"
    assert "unknown backend" in registry.refusal_for("MY_ATTN", "BLNHC").reason
    with pytest.raises(ValueError, match="unknown layout 'NHD'"):
        registry.refusal_for("FLASH_ATTN", "NHD")


def test_evidence_cites_sources() -> None:
    for name in ("TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "CUTLASS_MLA", "FLASHINFER_MLA"):
        assert "#45111" in registry.lookup(name).evidence
    assert "#34158" in registry.lookup("FLASHINFER").evidence
    assert "flex_attention.py::" in registry.lookup("FLEX_ATTENTION").evidence
    kinds = {c.kind for c in registry.lookup("FLASHINFER").constraints}
    assert kinds == {ConstraintKind.TMA_ALIGNMENT, ConstraintKind.FP8_DEQUANT_CONTIGUOUS}


@pytest.mark.parametrize("name", OPTED_IN)
def test_each_opted_in_backend_gets_a_block_major_layout(name: str) -> None:
    decision = recorded([name])
    assert decision.layout == "BLNHC", decision.explain()
    assert decision.refusals == ()


@pytest.mark.parametrize("name", OPTED_OUT)
def test_each_opted_out_backend_is_refused_with_its_evidence(name: str) -> None:
    decision = recorded([name])
    assert decision.layout is None
    assert [r.backend for r in decision.refusals] == [name]
    assert "opted out" in decision.refusals[0].reason
    assert decision.refusals[0].evidence == registry.lookup(name).evidence


def test_flashinfer_blhnc_only_on_compute_capability_10() -> None:
    assert recorded(["FLASHINFER"], HOPPER).layout == "BLNHC"
    assert recorded(["FLASHINFER"], BLACKWELL).layout == "BLHNC"
    assert recorded(["FLASHINFER"], (12, 0)).layout == "BLNHC"
    unknown = recorded(["FLASHINFER"], None)  # what every device accepts
    assert unknown.layout == "BLHNC"
    assert "compute capability unknown" in dict(unknown.layout_sources)["FLASHINFER"]
    entry = registry.lookup("FLASHINFER")
    assert entry.layouts_for(HOPPER) is None
    assert entry.layouts_for(BLACKWELL) == ("LBHNC", "BLHNC")


def test_flex_declares_only_lbnhc_so_no_block_major() -> None:
    declared = registry.declared_layouts(registry.lookup("FLEX_ATTENTION"), use_vllm=False)
    assert declared.layouts == ("LBNHC",)
    assert declared.block_outermost == ()


def test_layer_major_only_backend_is_refused_even_if_it_reads_strides(own_registry: None) -> None:
    registry.register_backend(BackendEntry("FLEX_READS", ViewKind.VLLM, True, "test", ("LBNHC",)))
    decision = recorded(["FLEX_READS"])
    assert decision.layout is None
    assert "accepts no block-outermost layout (declares LBNHC" in decision.refusals[0].reason


def test_dsv4_indexers_require_block_outermost() -> None:
    for name in DSV4_INDEXERS:
        layouts = registry.lookup(name).layouts
        assert layouts == ("BLHNC", "BLNHC")
        assert set(layouts) <= set(BLOCK_MAJOR_ORDERS)
    assert recorded(list(DSV4_INDEXERS) + ["FLASH_ATTN"]).layout == "BLNHC"
    assert recorded(["DEEPSEEK_V4_INDEXER", "FLASHINFER"], BLACKWELL).layout == "BLHNC"


@pytest.mark.parametrize("name", ["SOME_NEW_BACKEND", "flash_attn", "TORCH_SDPA", "NO_ATTENTION"])
def test_unknown_names_are_opted_out(name: str) -> None:
    decision = recorded([name])
    assert decision.layout is None
    assert decision.refusals == (registry.Refusal(
        name, "unknown backend: no evidence its kernels read strides (register it with "
        "register_backend)", "none"),)


def test_mixed_sets() -> None:
    assert recorded(["FLASH_ATTN", "TRITON_MLA", "FLASH_ATTN"]).backends == ("FLASH_ATTN",
                                                                             "TRITON_MLA")
    assert recorded(["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"], HOPPER).layout == "BLNHC"
    assert recorded(["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"], BLACKWELL).layout == "BLHNC"
    mixed = recorded(["FLASH_ATTN", "FLEX_ATTENTION", "MYSTERY", "CPU_ATTN"])
    assert mixed.layout is None
    assert [r.backend for r in mixed.refusals] == ["FLEX_ATTENTION", "MYSTERY", "CPU_ATTN"]
    assert "FLEX_ATTENTION" in mixed.explain() and "MYSTERY" in mixed.explain()


def test_no_common_block_major_layout(own_registry: None) -> None:
    registry.register_backend(BackendEntry("NHD_ONLY", "vllm", True, "test", ("BLNHC",)))
    decision = recorded(["NHD_ONLY", "FLASHINFER"], BLACKWELL)
    assert decision.layout is None
    (refusal,) = decision.refusals
    assert refusal.backend == "NHD_ONLY, FLASHINFER"
    assert "NHD_ONLY BLNHC; FLASHINFER BLHNC" in refusal.reason


def test_kv_dtype_constraints() -> None:
    refused = recorded(["TRITON_ATTN"], kv_dtype="int8_per_token_head")
    assert refused.layout is None
    assert "'int8_per_token_head'" in refused.refusals[0].reason
    assert "customize_spec" in refused.refusals[0].evidence
    assert recorded(["TRITON_ATTN"], kv_dtype="fp8").layout == "BLNHC"
    # FlashInfer's fp8 dequant needs dense (N, D) rows per head: head-major interiors only.
    assert recorded(["FLASHINFER"], HOPPER, kv_dtype="auto").layout == "BLNHC"
    fp8 = recorded(["FLASHINFER"], HOPPER, kv_dtype="fp8_e4m3")
    assert fp8.layout == "BLHNC"
    assert any("fp8" in need for need in fp8.requirements)


def test_requirements_name_tma_alignment() -> None:
    decision = recorded(["FLASH_ATTN", "TRITON_MLA", "FLASH_ATTN_MLA"])
    assert len(decision.requirements) == 2
    assert [r.split(":")[0] for r in decision.requirements] == ["FLASH_ATTN", "FLASH_ATTN_MLA"]
    assert all("16 B" in r for r in decision.requirements)
    assert recorded(["TRITON_MLA"]).requirements == ()


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"backend_names": "FLASH_ATTN"}, "'FLASH_ATTN'"),
    ({"backend_names": []}, "()"),
    ({"backend_names": ["FLASH_ATTN", 3]}, "3"),
    ({"backend_names": ["FLASH_ATTN"], "compute_capability": (10,)}, "(10,)"),
    ({"backend_names": ["FLASH_ATTN"], "compute_capability": "10.0"}, "'10.0'"),
    ({"backend_names": ["FLASH_ATTN"], "kv_dtype": 8}, "8"),
])
def test_bad_decide_input(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match="got .*" + re.escape(named)):
        decide(**kwargs, use_vllm=False)


def test_parse_compute_capability() -> None:
    assert registry.parse_compute_capability("10.0") == (10, 0)
    assert registry.parse_compute_capability(" 9.0") == (9, 0)
    for bad in ("10", "sm_100", "10.x", ""):
        with pytest.raises(ValueError, match=repr(bad)):
            registry.parse_compute_capability(bad)


# -- registration --------------------------------------------------------------------------------
def test_register_a_backend(own_registry: None) -> None:
    entry = BackendEntry("MY_KERNEL", ViewKind.FLASH_ATTN, True,
                         "our own kernel check: tests/layout/test_gpu_kernels.py", ("BLHNC",))
    assert recorded(["MY_KERNEL"]).layout is None
    registry.register_backend(entry)
    assert registry.lookup("MY_KERNEL") is entry
    assert recorded(["MY_KERNEL", "FLASH_ATTN"]).layout == "BLHNC"
    assert len(registry.registered_backends()) == len(SEEDED) + 1


def test_duplicate_registration_is_refused_unless_replace(own_registry: None) -> None:
    opted_in_flex = BackendEntry("FLEX_ATTENTION", ViewKind.VLLM, True, "test")
    with pytest.raises(ValueError, match="'FLEX_ATTENTION' is already registered"):
        registry.register_backend(opted_in_flex)
    assert registry.lookup("FLEX_ATTENTION").reads_strides is False
    registry.register_backend(opted_in_flex, replace=True)
    assert recorded(["FLEX_ATTENTION"]).layout == "BLNHC"


@pytest.mark.parametrize(("fields", "named"), [
    ({"name": ""}, "''"),
    ({"layouts": ("BLNHC", "XYZ")}, "'XYZ'"),
    ({"layouts": "BLNHC"}, "'BLNHC'"),
    ({"layouts_by_cc": ((10, ("NOPE",)),)}, "'NOPE'"),
    ({"view": "paged"}, "'paged'"),
    ({"evidence": ""}, "''"),
    ({"reads_strides": "yes"}, "'yes'"),
])
def test_bad_entries(fields: dict, named: str) -> None:
    base = {"name": "X", "view": ViewKind.VLLM, "reads_strides": True, "evidence": "test"}
    with pytest.raises(ValueError, match=re.escape(named)):
        BackendEntry(**{**base, **fields})


def test_register_needs_an_entry(own_registry: None) -> None:
    with pytest.raises(ValueError, match="BackendEntry, got 'FLASH_ATTN'"):
        registry.register_backend("FLASH_ATTN")  # type: ignore[arg-type]
    assert len(registry.registered_backends()) == len(SEEDED)


def test_backend_name_goes_by_class_path_not_get_name() -> None:
    def stand_in(module: str, name: str) -> type:  # a class at vLLM's path, without vLLM
        return type(name, (), {"__module__": "vllm.v1.attention.backends." + module})

    # vLLM 0.32's AiterFlashAttentionBackend.get_name() returns "FLASH_ATTN".
    assert registry.backend_name(stand_in("rocm_aiter_fa", "AiterFlashAttentionBackend")) == \
        "ROCM_AITER_FA"
    assert registry.backend_name(stand_in("flash_attn", "FlashAttentionBackend")) == "FLASH_ATTN"
    assert registry.backend_name(dict) == "builtins.dict"  # unknown: decide refuses it


# -- without vLLM --------------------------------------------------------------------------------
def test_import_does_not_import_vllm() -> None:
    code = ("import sys; from kvconnector.layout import registry; "
            "d = registry.decide(['FLASH_ATTN', 'FLASHINFER'], use_vllm=False); "
            "print(d.layout, sys.modules.get('vllm') is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["BLHNC", "False"]


def test_vllm_absent_uses_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    registry._vllm_backend_class.cache_clear()
    monkeypatch.setitem(sys.modules, "vllm", None)  # find_spec("vllm") -> None
    try:
        decision = decide(["FLASH_ATTN", "FLASHINFER"])
    finally:
        registry._vllm_backend_class.cache_clear()
    assert decision.layout == "BLHNC"
    sources = dict(decision.layout_sources)
    assert sources["FLASH_ATTN"] == "recorded from vLLM 0.32.0 (vLLM not installed)"
    assert "vLLM not installed" in sources["FLASHINFER"]


# -- against vLLM 0.32 / 0.33 ---------------------------------------------------------------------
VLLM_ENTRIES = [e.name for e in registry.registered_backends()
                if e.vllm_class and e.vllm_class.startswith("vllm.")]


@pytest.mark.vllm
@pytest.mark.parametrize("name", VLLM_ENTRIES)
def test_recorded_layouts_equal_vllm(name: str) -> None:
    import torch

    entry = registry.lookup(name)
    cls, why = registry._vllm_backend_class(entry.vllm_class)
    if cls is None:  # the record stands in, and says why
        assert name in gpu_only() and not torch.cuda.is_available(), why
        declared = registry.declared_layouts(entry)
        assert not declared.live and why in declared.source
        return
    vllm_layouts = cls.supported_kv_cache_layouts()
    vllm_names = None if vllm_layouts is None else tuple(lay.name for lay in vllm_layouts)
    if not entry.layouts_by_cc:  # a device-dependent answer is compared on its device only
        assert entry.layouts == vllm_names
    declared = registry.declared_layouts(entry)
    assert declared.live and declared.layouts == vllm_names
    assert cls.get_name() == name or name in {"ROCM_AITER_FA", "ROCM_AITER_TRITON_MLA"}


@pytest.mark.vllm
def test_class_paths_match_vllm_enum() -> None:
    import torch
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for entry in registry.registered_backends():
        if entry.name in AttentionBackendEnum.__members__:
            assert AttentionBackendEnum[entry.name].value == entry.vllm_class, entry.name
    if not torch.cuda.is_available():
        importable = {n for n in VLLM_ENTRIES
                      if registry._vllm_backend_class(registry.lookup(n).vllm_class)[0]}
        # Which of those import on a CPU depends on the torch build (a CUDA build of torch 2.14
        # imports FLASHINFER without a GPU); no other entry may fall back to its record.
        assert set(VLLM_ENTRIES) - importable <= gpu_only()


@pytest.mark.vllm
def test_decisions_are_among_vllm_candidates() -> None:
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    for names in (["FLASH_ATTN", "TRITON_MLA"], ["TRITON_ATTN"], ["FLASHMLA", "FLASHINFER_MLA"],
                  ["DEEPSEEK_V4_INDEXER", "FLASHMLA"]):
        classes = [registry._vllm_backend_class(registry.lookup(n).vllm_class)[0] for n in names]
        candidates = [lay.name for lay in get_supported_kv_cache_layouts(classes)]
        decision = decide(names)
        assert decision.layout in candidates, (names, candidates)
        assert all(source.startswith("vLLM ") for _, source in decision.layout_sources)
