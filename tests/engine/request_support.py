"""Requests with the fields a tenant or a client sets: `cache_salt` (the prompt's) and
`kv_transfer_params` (the sampling parameters' `extra_args`, where vLLM's OpenAI server puts
the API field), for the engine tier's admission and isolation tests."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine_support import Generation

if TYPE_CHECKING:
    from vllm import LLM


def generate_for(llm: LLM, prompt: list[int], *, cache_salt: str | None = None,
                 kv_transfer_params: dict[str, Any] | None = None,
                 max_tokens: int = 16) -> Generation:
    """engine_support.generate, with the request's cache salt and kv_transfer_params."""
    (out,) = generate_together(llm, [(prompt, cache_salt, kv_transfer_params)], max_tokens)
    return out


def generate_together(llm: LLM, requests: list[tuple[list[int], str | None,
                                                     dict[str, Any] | None]],
                      max_tokens: int = 16) -> list[Generation]:
    """Greedy completions of (prompt ids, cache salt, kv_transfer_params) requests submitted
    together (vLLM schedules them in the same steps), with the top 5 logprobs of every step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, params = [], []
    for prompt, cache_salt, kv_transfer_params in requests:
        extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5,
                                     ignore_eos=True, extra_args=extra))
        request = TokensPrompt(prompt_token_ids=prompt)
        if cache_salt is not None:
            request["cache_salt"] = cache_salt
        prompts.append(request)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [Generation.of(output) for output in outputs]
