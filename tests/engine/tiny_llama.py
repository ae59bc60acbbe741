"""A tiny Llama-style model the engine tier writes for itself: nothing comes from a hub.

`write_tiny_llama(path)` writes, into `path`:
- config.json: LlamaForCausalLM, 4 layers, hidden 128, 4 query heads over 2 KV heads of 32,
  vocabulary VOCAB_SIZE, bfloat16;
- model.safetensors: random weights from transformers (normal, std INIT_STD, seeded), real enough
  that a corrupt KV block changes the output (vLLM's `load_format="dummy"` weights are not:
  zeroing every reloaded block changed no logprob);
- tokenizer.json + tokenizer_config.json: a word-level tokenizer built with the `tokenizers`
  library: the words "w0" .. "w{N}" split on whitespace, so any token id sequence (bar the
  specials) decodes to text that encodes back to the same ids.

Deterministic: the same call writes the same bytes. `prompt_ids(seed, length)` makes prompts
of ordinary (non-special) token ids. The serve tests and examples reuse both.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NUM_LAYERS = 4
HIDDEN_SIZE = 128
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_SIZE = 32  # CPU_ATTN runs head sizes 32, 64, 80, ...
VOCAB_SIZE = 1024
MAX_MODEL_LEN = 2048
INIT_STD = 0.1
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
FIRST_WORD_ID = len(SPECIAL_TOKENS)


def write_tiny_llama(path: str | Path, seed: int = 0) -> str:
    """Write the model directory (config, weights, tokenizer) at `path`; returns it as a str."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_SIZE,
        max_position_embeddings=MAX_MODEL_LEN, rms_norm_eps=1e-5, initializer_range=INIT_STD,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # transformers' init leaves norms at 1 and some tensors at 0: all random
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, INIT_STD)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path)
    return str(path)


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD_ID, VOCAB_SIZE)})
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
        "eos_token": "</s>", "pad_token": "<unk>", "model_max_length": MAX_MODEL_LEN,
        "add_bos_token": False, "clean_up_tokenization_spaces": False}))


def prompt_ids(seed: int, length: int) -> list[int]:
    """`length` random ordinary token ids (no special token), the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(length)]


def prompt_text(ids: list[int]) -> str:
    """The text that the tokenizer encodes to exactly `ids` (ordinary ids only)."""
    return " ".join(f"w{i}" for i in ids)
