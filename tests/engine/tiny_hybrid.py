"""Tiny hybrid models the engine tier writes for itself, as tests/engine/tiny_llama.py writes its
Llama: random real weights (seeded), the same word-level tokenizer, nothing from a hub.

- `write_tiny_gemma3(path)`: Gemma3ForCausalLM (text only), 6 layers in Gemma's pattern of
  sliding-window and full-attention layers (S S F S S F), window GEMMA3_WINDOW tokens. vLLM's
  hybrid manager makes a full-attention KV cache group and sliding-window ones of 2 layers each.
- `write_tiny_lfm2(path)`: Lfm2ForCausalLM, 4 layers: short convolutions (a state group) and
  full attention.
- `write_tiny_qwen3_next(path)`: Qwen3NextForCausalLM, 4 layers: Gated DeltaNet linear attention
  (a state group) and full attention, a small MoE. vLLM's CPU GDN kernel takes head dims of 128
  only; one linear-attention head keeps the state page small (vLLM raises the attention block
  size to make the attention page as large; the size it picks depends on the machine's CPU
  kernels, so tests read it back from the engine).
"""

from __future__ import annotations

from pathlib import Path

from tiny_llama import INIT_STD, MAX_MODEL_LEN, VOCAB_SIZE, _write_tokenizer

GEMMA3_LAYERS = ("sliding_attention", "sliding_attention", "full_attention") * 2
GEMMA3_WINDOW = 64  # tokens: two 32-token blocks before a prefix end
LFM2_LAYERS = ("conv", "full_attention", "conv", "full_attention")
QWEN3_NEXT_LAYERS = ("linear_attention", "full_attention") * 2


def _randomize_and_save(model: object, path: str | Path, seed: int) -> str:
    import torch

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.no_grad():  # transformers' init leaves norms at 1 and some tensors at 0
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, INIT_STD)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path)
    return str(path)


def write_tiny_gemma3(path: str | Path, seed: int = 0) -> str:
    """Write the Gemma-3 text model directory at `path`; returns it as a str."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256,
        num_hidden_layers=len(GEMMA3_LAYERS), layer_types=list(GEMMA3_LAYERS),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=GEMMA3_WINDOW, max_position_embeddings=MAX_MODEL_LEN,
        initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return _randomize_and_save(Gemma3ForCausalLM(config).to(torch.bfloat16), path, seed)


def write_tiny_lfm2(path: str | Path, seed: int = 0) -> str:
    """Write the LFM2 model directory at `path`; returns it as a str."""
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256,
        num_hidden_layers=len(LFM2_LAYERS), layer_types=list(LFM2_LAYERS),
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN,
        initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    # vLLM's Lfm2 reads these (LFM2's own configs carry them; transformers 5 does not)
    config.conv_dim = config.block_dim = config.hidden_size
    torch.manual_seed(seed)
    return _randomize_and_save(Lfm2ForCausalLM(config).to(torch.bfloat16), path, seed)


def write_tiny_qwen3_next(path: str | Path, seed: int = 0) -> str:
    """Write the Qwen3-Next model directory at `path`; returns it as a str."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256,
        num_hidden_layers=len(QWEN3_NEXT_LAYERS), layer_types=list(QWEN3_NEXT_LAYERS),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=MAX_MODEL_LEN,
        initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return _randomize_and_save(Qwen3NextForCausalLM(config).to(torch.bfloat16), path, seed)
