"""`vllm serve` with the connector (vLLM's OpenAI server on CPU, engine core in its own process,
loopback only): a completion reloaded after `POST /reset_prefix_cache` is identical, `/metrics`
carries the connector's counters, and `vllm bench serve` with its prefix-repetition dataset runs
without a failed request and with prefixes reloaded from the CPU tier."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest
from engine_support import BLOCK_SIZE, block_bytes
from serve_support import GPU_BLOCKS, LAUNCHER, ServeProcess
from tiny_llama import prompt_ids

from kvconnector.offload.scheduler import OffloadCounters

pytestmark = pytest.mark.engine

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


def test_a_completion_reloaded_after_reset_prefix_cache_is_identical(
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

    # negative control: zero every pool slot, reload: the output must change
    server.settle()
    zeroed = server.post("/collective_rpc", {"method": "zero_kvconnector_pool"})["results"]
    assert [int(n) for n in zeroed] == [POOL_BLOCKS], zeroed
    corrupted = server.complete(prompt)
    assert corrupted["usage"]["prompt_tokens_details"]["cached_tokens"] == stored
    assert _tokens_and_logprobs(corrupted)[1] != logprobs, "zeroed KV blocks changed no logprob"
    server.settle(reset_external=True)


def test_metrics_carry_every_connector_counter(server: ServeProcess) -> None:
    # counters as vllm:kvconnector_<name>_total, jobs_in_flight as a gauge (see counters())
    expected = {f"kvconnector_{f.name}" for f in fields(OffloadCounters)}
    missing = expected - set(server.counters())
    assert not missing, sorted(missing)


def test_vllm_bench_serve_prefix_repetition_has_no_failure_and_reloads_prefixes(
        server: ServeProcess, tmp_path: Path) -> None:
    server.settle(reset_external=True)
    before = server.counters()
    argv = [sys.executable, str(LAUNCHER), "bench", "serve", "--backend", "vllm",
            "--base-url", server.url, "--model", server.model_dir,
            "--tokenizer", server.model_dir, "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(PREFIX_LEN),
            "--prefix-repetition-suffix-len", str(SUFFIX_LEN),
            "--prefix-repetition-num-prefixes", str(NUM_PREFIXES),
            "--prefix-repetition-output-len", str(OUTPUT_LEN),
            "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "1", "--seed", "1",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0), result
    gained = server.counted(before)
    hits = gained["external_prefix_cache_hits"]
    assert hits > 0, gained
    assert hits % BLOCK_SIZE == 0, gained
    # every hit token arrived: the connector loaded a block for each 32 of them, none failed
    assert gained["kvconnector_hit_tokens"] == hits, gained
    assert gained["kvconnector_load_bytes"] == hits // BLOCK_SIZE * block_bytes(), gained
    assert gained["kvconnector_failed_loads"] == 0, gained
