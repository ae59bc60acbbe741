"""What engine the vLLM harness (vllm_connector/vllm_harness.py) builds: the tiny model directory,
`EngineSetup` and the VllmConfig made from it, the layers' KV cache specs and pipeline stages, and
`Variant`, the engine shapes the scenarios run in.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm.config import (  # noqa: E402
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.utils import get_pp_indices  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm_fake_worker import (  # noqa: E402
    BLOCK_SIZE,
    DTYPE,
    HEAD_SIZE,
    NUM_KV_HEADS,
    NUM_LAYERS,
)

STATE_ROWS = 3  # a state of (3, n) bf16, as a short convolution's (kernel - 1, channels)
MLA_HEAD_SIZE = 48  # latent + rope, DeepSeek's 512 + 64 scaled down
ALL_LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]  # vLLM's default order


def write_model_dir(path: Path) -> str:
    """A Llama-shaped config.json: all ModelConfig needs (no weights, no tokenizer)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_SIZE, "num_hidden_layers": NUM_LAYERS, "vocab_size": 1000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2}))
    return str(path)


# -- configuration ----------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSetup:
    model_dir: str
    extra_config: dict[str, Any]
    async_scheduling: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages split the layers as vLLM's get_pp_indices does
    num_gpu_blocks: int = 64
    max_num_batched_tokens: int = 128
    max_num_seqs: int = 8
    kv_load_failure_policy: str = "recompute"
    # vLLM 0.33's V2 model runner with a speculator: transfer results are taken before the
    # drafter's forward, `wait_for_save` after it (`post_forward(defer_finalize=True)`, then
    # `finalize_step()`). The last layer stands for the drafter's, written in between.
    speculator: bool = False
    # Speculative decoding: after each step every request of the step is proposed this many
    # drafts; at the request's i-th proposal the first `draft_acceptance[i % len]` are right.
    # Scheduler: the engine proposes them (vLLM drops those for prefill chunks); AsyncScheduler:
    # each worker does, and puts them where the scheduler left placeholders.
    num_speculative_tokens: int = 0
    draft_acceptance: tuple[int, ...] = (2, 0, 3, 1)
    # MLA: vLLM's MLAAttentionSpec for every layer (one latent head a rank, no separate V) and
    # TRITON_MLA as the configured backend (the layout request's input; no MLA kernel runs).
    # The model config stays Llama-shaped, so vLLM's own MLA spec fields are left at defaults.
    mla: bool = False
    # The configured attention backend (an AttentionBackendEnum name; default TRITON_ATTN, or
    # TRITON_MLA with `mla`): the connector's layout request reads it, and vLLM resolves the
    # layout among the layouts its class declares. No kernel of it runs.
    backend: str | None = None
    # Hybrid: the odd layers are sliding window attention over this many tokens (vLLM's
    # SlidingWindowSpec), kept in a KV cache group of their own by vLLM's hybrid manager.
    sliding_window: int | None = None
    # Hybrid: the odd layers keep a state (vLLM's MambaSpec in "align" cache mode, as LFM2's
    # short convolutions: one state page a block, padded to the attention page), in a KV cache
    # group of their own.
    state: bool = False
    connector: str = "CrossLayerOffloadConnector"
    module_path: str = "kvconnector.vllm"


def make_vllm_config(setup: EngineSetup) -> VllmConfig:
    model = ModelConfig(model=setup.model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                        seed=0, max_model_len=1024)
    speculative = None
    if setup.num_speculative_tokens:
        # vLLM takes async scheduling with GPU-side drafters only: there the model runner
        # proposes (the harness's worker does) and the scheduler holds placeholders.
        speculative = SpeculativeConfig(method="ngram_gpu" if setup.async_scheduling else "ngram",
                                        num_speculative_tokens=setup.num_speculative_tokens,
                                        prompt_lookup_min=1, prompt_lookup_max=3)
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=setup.max_num_batched_tokens,
            max_model_len=1024, is_encoder_decoder=False,
            async_scheduling=setup.async_scheduling),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True,
                                 num_gpu_blocks_override=setup.num_gpu_blocks),
        parallel_config=ParallelConfig(tensor_parallel_size=setup.tensor_parallel_size,
                                       pipeline_parallel_size=setup.pipeline_parallel_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector=setup.connector, kv_connector_module_path=setup.module_path,
            kv_role="kv_both", kv_connector_extra_config=dict(setup.extra_config),
            kv_load_failure_policy=setup.kv_load_failure_policy),
        # The model forward is faked; the backend stands for the CUDA one a deployment would run
        # (left unset on a CPU platform, the connector keeps vLLM's default layout).
        attention_config=AttentionConfig(backend=AttentionBackendEnum[setup.backend]
                                         if setup.backend else AttentionBackendEnum.TRITON_MLA
                                         if setup.mla else AttentionBackendEnum.TRITON_ATTN),
        speculative_config=speculative,
        device_config=DeviceConfig("cpu"))
    if setup.state:
        config.cache_config.mamba_cache_mode = "align"  # a state per block boundary
    if setup.sliding_window is not None or setup.state:
        # This CUDA wheel on a CPU machine sees no platform, which turns the hybrid manager off
        # by itself; a CUDA machine or vLLM's CPU build keeps it on for a SupportsHMA connector.
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def layer_specs(tp_size: int, layers: range = range(NUM_LAYERS), mla: bool = False,
                sliding_window: int | None = None, state: bool = False
                ) -> dict[str, KVCacheSpec]:
    if state:  # odd layers keep a state: a page's bytes less some padding
        full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS // tp_size,
                                 head_size=HEAD_SIZE, dtype=DTYPE)
        page = full.page_size_bytes
        return {f"model.layers.{i}.self_attn.attn": MambaSpec(
            block_size=BLOCK_SIZE, shapes=((STATE_ROWS, (page - 64) // (2 * STATE_ROWS)),),
            dtypes=(DTYPE,), page_size_padded=page, mamba_cache_mode="align")
            if i % 2 else full for i in layers}
    if sliding_window is not None:  # odd layers slide
        return {f"model.layers.{i}.self_attn.attn": SlidingWindowSpec(
            block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS // tp_size, head_size=HEAD_SIZE,
            dtype=DTYPE, sliding_window=sliding_window) if i % 2 else FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS // tp_size, head_size=HEAD_SIZE,
            dtype=DTYPE) for i in layers}
    if mla:
        return {f"model.layers.{i}.self_attn.attn": MLAAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=MLA_HEAD_SIZE, dtype=DTYPE)
            for i in layers}
    return {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS // tp_size, head_size=HEAD_SIZE,
        dtype=DTYPE) for i in layers}


def stage_layers(pp_size: int) -> list[range]:
    """Each pipeline stage's layers, as vLLM splits them."""
    return [range(*get_pp_indices(NUM_LAYERS, stage, pp_size)) for stage in range(pp_size)]


class Variant(NamedTuple):
    """An engine shape a scenario runs in (see make_engine)."""

    layout: str  # BLNHC: the connector's own (block-major); else set as VLLM_KV_CACHE_LAYOUT
    tp: int = 1
    pp: int = 1
    async_scheduling: bool = False
    speculator: bool = False  # EngineSetup.speculator: vLLM 0.33's step order
    drafts: int = 0  # EngineSetup.num_speculative_tokens
    mla: bool = False  # EngineSetup.mla
    window: int | None = None  # EngineSetup.sliding_window
    state: bool = False  # EngineSetup.state

    @property
    def ranks(self) -> int:
        return self.tp * self.pp
