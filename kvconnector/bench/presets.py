"""Model presets and benchmark cases: the KV shapes, block sizes and dtypes vLLM really uses.

Shapes are per TP rank (what one worker's cache holds). Block sizes are vLLM's defaults on CUDA:
16 tokens for the FlashAttention/FlashInfer backends, 64 for FlashMLA. fp8 is vLLM's
`--kv-cache-dtype fp8` (e4m3, per-tensor scales, no inline scales), offered by these backends.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconnector.layout.descriptor import KVForm, KVLayout, dtype_name, parse_dtype

# The block-major order we allocate and the layer-major order vLLM 0.33's OffloadingConnector asks
# for (one page per layer per block moves in its batched copies).
BLOCK_MAJOR = "BLNHC"
LAYER_MAJOR = "LBHNC"
KV_DTYPES = ("bf16", "fp8")


@dataclass(frozen=True)
class Preset:
    """One model's KV cache as a single TP rank sees it."""

    name: str
    model: str
    num_layers: int
    num_kv_heads: int  # per rank
    head_size: int  # MLA: latent + rope
    block_size: int
    form: KVForm = KVForm.PACKED
    tp: int = 1


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", 32, 8, 128, 16),
    # 8 kv heads over TP 8: one head per rank, 8 KB pages.
    Preset("llama-3.1-70b-tp8", "meta-llama/Llama-3.1-70B-Instruct", 80, 1, 128, 16, tp=8),
    Preset("qwen3-32b", "Qwen/Qwen3-32B", 64, 8, 128, 16),
    # MLA: kv_lora_rank 512 + qk_rope_head_dim 64, FlashMLA's 64-token blocks; replicated per rank.
    Preset("deepseek-v3", "deepseek-ai/DeepSeek-V3", 61, 1, 576, 64, KVForm.MLA),
    # Hybrid (vLLM's hybrid manager on): 36 layers, sliding window (128) and full alternating,
    # in 2 KV cache groups of 18 sharing the buffers: a physical block is a page of 18 layers.
    Preset("gpt-oss-120b-hma", "openai/gpt-oss-120b", 18, 8, 64, 16),
)}


@dataclass(frozen=True)
class Case:
    """One shape to measure: the same block bytes in the block-major and layer-major orders."""

    name: str
    model: str
    layout: KVLayout  # block-major

    @property
    def layer_major(self) -> KVLayout:
        return self.layout.with_order(LAYER_MAJOR)

    def describe(self) -> dict[str, object]:
        lay = self.layout
        return {"name": self.name, "model": self.model, "num_layers": lay.num_layers,
                "num_kv_heads": lay.num_kv_heads, "head_size": lay.head_size,
                "block_tokens": lay.block_size, "dtype": dtype_name(lay.dtype),
                "form": lay.form.value, "page_bytes": lay.page_bytes,
                "block_bytes": lay.block_bytes}


def build_cases(presets: list[str], kv_dtypes: list[str], block_sizes: list[int] | None,
                shape: tuple[int, int, int] | None, mla: bool) -> list[Case]:
    """Cases for presets x dtypes x block sizes, or for one explicit (layers, heads, head) shape.

    ValueError (one line) on an unknown preset or dtype.
    """
    for d in kv_dtypes:
        if d not in KV_DTYPES:
            raise ValueError(f"unknown KV dtype {d!r}; choose from {', '.join(KV_DTYPES)}")
    if shape is not None:
        layers, heads, head = shape
        form = KVForm.MLA if mla else KVForm.PACKED
        bases = [Preset(f"{'mla ' if mla else ''}L{layers} H{heads} D{head}", "custom", layers,
                        heads, head, 16, form)]
    else:
        unknown = [p for p in presets if p not in PRESETS]
        if unknown:
            raise ValueError(f"unknown preset {unknown[0]!r}; choose from "
                             f"{', '.join(PRESETS)} or 'all'")
        bases = [PRESETS[p] for p in presets]
    cases = []
    for base in bases:
        for d in kv_dtypes:
            for n in block_sizes or [base.block_size]:
                layout = KVLayout(base.num_layers, base.num_kv_heads, base.head_size, n,
                                  parse_dtype(d), base.form, BLOCK_MAJOR)
                # A preset at its own block size keeps its plain name.
                tokens = "" if shape is None and n == base.block_size else f" N{n}"
                cases.append(Case(f"{base.name}{tokens} {d}", base.model, layout))
    return cases
