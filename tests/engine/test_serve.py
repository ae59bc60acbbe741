"""`vllm serve` with the connector (vLLM's OpenAI server on CPU, engine core in its own process,
loopback only): a completion reloaded after `POST /reset_prefix_cache` is identical, `/metrics`
carries the connector's counters, and `vllm bench serve` with its prefix-repetition dataset runs
without a failed request, with prefixes reloaded from the CPU tier and the same texts as when
they were computed. Each of those ends with a negative control: the pool's slots zeroed, the
output must change. The launcher leaves the model's threads the cores vLLM gives them without a
connector, so serving with it keeps its time per output token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_support import BLOCK_SIZE, block_bytes, on_gpu
from serve_support import GPU_BLOCKS, LAUNCHER, ServeProcess
from tiny_llama import prompt_ids

from kvconnector.vllm.counters import counter_names

# vLLM's CPU build only: the server starts through examples/vllm_cpu.py, the CPU launcher
pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(on_gpu(), reason="vllm serve through the CPU launcher")]

POOL_BLOCKS = 256
BENCH_TIMEOUT_S = 600.0  # the bench client imports vLLM too: minutes on a busy 2-core CI
# prefix-repetition: 4 prefixes of 8 blocks, 4 requests each, one request at a time in the
# dataset's (seeded, shuffled) order: 32 prefix blocks do not fit in vLLM's GPU_BLOCKS, so a
# prefix seen again after the others has left vLLM's cache and is found in the CPU tier.
PREFIX_LEN, SUFFIX_LEN, NUM_PREFIXES, NUM_PROMPTS, OUTPUT_LEN = 256, 64, 4, 16, 8
assert NUM_PREFIXES * PREFIX_LEN // BLOCK_SIZE > GPU_BLOCKS


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with ServeProcess(tiny_model, {"cpu_bytes": POOL_BLOCKS * block_bytes()}, log) as process:
        yield process


def _tokens_and_logprobs(reply: dict) -> tuple[list[str], list[float], list[dict]]:
    logprobs = reply["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]


def test_a_completion_reloaded_after_reset_prefix_cache_is_identical_and_counted_in_metrics(
        server: ServeProcess) -> None:
    prompt = prompt_ids(31, 200)
    stored = (len(prompt) // BLOCK_SIZE) * BLOCK_SIZE  # 192: the last 8 tokens are computed
    server.settle(reset_external=True)
    at_start = server.counters()
    first = server.complete(prompt)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, first["usage"]
    server.settle()  # vLLM's prefix cache emptied once the stores are complete
    before = server.counters()
    again = server.complete(prompt)
    tokens, logprobs, top = _tokens_and_logprobs(again)
    assert len(tokens) == 16 and all(t.startswith("token_id:") for t in tokens), tokens
    assert (tokens, logprobs, top) == _tokens_and_logprobs(first)
    # proof of the load: the request's own count, vLLM's counters and the connector's bytes
    # (vLLM's external hits also count tokens whose load failed)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == stored, again["usage"]
    gained = server.counted(before)
    assert gained["prefix_cache_hits"] == 0, gained
    assert gained["external_prefix_cache_hits"] == stored, gained
    assert gained["kvconnector_hit_tokens"] == stored, gained
    assert gained["kvconnector_load_bytes"] == stored // BLOCK_SIZE * block_bytes(), gained
    assert gained["kvconnector_failed_loads"] == 0, gained
    # the first request's full blocks were stored, once
    stored_bytes = server.counted(at_start)["kvconnector_store_bytes"]
    assert stored_bytes == stored // BLOCK_SIZE * block_bytes()
    # /metrics carries every connector counter (as vllm:kvconnector_<name>_total)
    missing = {f"kvconnector_{name}" for name in counter_names()} - set(before)
    assert not missing, sorted(missing)

    # negative control: zero every pool slot, reload: the output must change
    server.settle()
    zeroed = server.post("/collective_rpc", {"method": "zero_kvconnector_pool"})["results"]
    assert [int(n) for n in zeroed] == [POOL_BLOCKS], zeroed
    corrupted = server.complete(prompt)
    assert corrupted["usage"]["prompt_tokens_details"]["cached_tokens"] == stored
    assert _tokens_and_logprobs(corrupted)[1] != logprobs, "zeroed KV blocks changed no logprob"
    server.settle(reset_external=True)


def test_the_model_runs_on_the_threads_vllm_gives_it_without_a_connector(
        server: ServeProcess) -> None:
    # vLLM's CPU build reserves one core per rank for its engine core's loop, and one more per
    # rank for any KV connector: on two cores, none at all, and the model's threads contended
    # with that loop (time per output token 3x). The launcher asks for the first reservation
    # only: the model keeps every core but one (TP 1), as without a connector.
    cores = len(os.sched_getaffinity(0))
    threads = server.post("/collective_rpc", {"method": "torch_threads"})["results"]
    assert [int(n) for n in threads] == [max(1, cores - 1)], (threads, cores)


def _bench_serve(server: ServeProcess, directory: Path, name: str) -> dict:
    """One `vllm bench serve` run of the prefix-repetition dataset (greedy, one request at a
    time, the same seed: the same requests in the same order every run); its result."""
    argv = [sys.executable, str(LAUNCHER), "bench", "serve", "--backend", "vllm",
            "--base-url", server.url, "--model", server.model_dir,
            "--tokenizer", server.model_dir, "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(PREFIX_LEN),
            "--prefix-repetition-suffix-len", str(SUFFIX_LEN),
            "--prefix-repetition-num-prefixes", str(NUM_PREFIXES),
            "--prefix-repetition-output-len", str(OUTPUT_LEN), "--ignore-eos",
            "--temperature", "0", "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "1",
            "--seed", "1", "--save-result", "--save-detailed", "--result-dir", str(directory),
            "--result-filename", f"{name}.json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S,
                          cwd=directory)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((directory / f"{name}.json").read_text())
    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0), result
    assert len(result["generated_texts"]) == NUM_PROMPTS
    return result


def _expect_every_hit_loaded(gained: dict[str, float]) -> int:
    """vLLM's external hits arrived: a block loaded for each 32 of them, none failed."""
    hits = gained["external_prefix_cache_hits"]
    assert hits > 0 and hits % BLOCK_SIZE == 0, gained
    assert gained["kvconnector_hit_tokens"] == hits, gained
    assert gained["kvconnector_load_bytes"] == hits // BLOCK_SIZE * block_bytes(), gained
    assert gained["kvconnector_failed_loads"] == 0, gained
    return int(hits)


def test_vllm_bench_serve_prefix_repetition_has_no_failure_and_reloads_prefixes(
        server: ServeProcess, tmp_path: Path) -> None:
    # 1. every tier empty: each prefix is computed once, later repeats load from the CPU tier
    server.settle(reset_external=True)
    before = server.counters()
    computed = _bench_serve(server, tmp_path, "computed")
    first_hits = _expect_every_hit_loaded(server.counted(before))
    # 2. vLLM's prefix cache emptied, the CPU tier kept: now every prompt's blocks reload,
    # the first requests of each prefix too; the generated texts are the same
    server.settle()
    before = server.counters()
    reloaded = _bench_serve(server, tmp_path, "reloaded")
    assert _expect_every_hit_loaded(server.counted(before)) > first_hits
    assert reloaded["generated_texts"] == computed["generated_texts"]
    # 3. negative control: the same run from zeroed pool slots must change the texts
    server.settle()
    zeroed = server.post("/collective_rpc", {"method": "zero_kvconnector_pool"})["results"]
    assert [int(n) for n in zeroed] == [POOL_BLOCKS], zeroed
    corrupted = _bench_serve(server, tmp_path, "corrupted")
    assert corrupted["generated_texts"] != computed["generated_texts"], \
        "zeroed KV blocks changed no generated text"
    server.settle(reset_external=True)
