"""The backends the registry is seeded with, in its order (shared by the registry and CLI tests)."""

OPTED_IN = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA",
            "CUTLASS_MLA", "FLASHINFER_MLA")
DSV4_INDEXERS = ("DEEPSEEK_V4_INDEXER", "DEEPSEEK_V41_INDEXER", "DEEPSEEK_V41_SPARSE_INDEXER")
CPU = ("CPU_ATTN", "CPU_MLA", "AMX_MLA")  # vLLM's CPU build picks one of these by itself
OPTED_OUT = ("FLEX_ATTENTION", *CPU, "ROCM_ATTN", "ROCM_SEGMENTED_ATTN", "ROCM_AITER_FA",
             "ROCM_AITER_UNIFIED_ATTN", "ROCM_AITER_MLA", "ROCM_AITER_TRITON_MLA",
             "ROCM_AITER_MLA_SPARSE")
REFERENCE = ("REF_ATTN",)  # the engine tier's reference backend (tests/engine/ref_attention.py)
SEEDED = OPTED_IN + DSV4_INDEXERS + OPTED_OUT + REFERENCE
