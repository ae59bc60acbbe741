"""Admission and per-request control inside vLLM 0.32 and 0.33 (the fake-worker harness,
vllm_connector/vllm_harness.py): `store_threshold` through vLLM's Scheduler and AsyncScheduler,
a request's `kv_transfer_params` (`max_offload_tokens`, `max_load_tokens`) as vLLM hands them
to the connector, shedding under backpressure, the options' checks; and what vLLM's block
hashes carry into the offload keys (cache salt, LoRA adapter, multimodal inputs).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

import vllm_harness as h  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm_harness import (  # noqa: E402
    make_engine,
    make_prompt,
    run_to_completion,
    stored_tokens,
    total_stats,
)
from vllm_variants import VARIANTS, use_variant  # noqa: E402

from kvconnector.vllm.options import ERROR_PREFIX, ConnectorOptions  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("engines_shut_down")]

BS = h.BLOCK_SIZE
SHAPES = {"block-major-Scheduler", "block-major-AsyncScheduler", "per-layer-Scheduler",
          "tp2-AsyncScheduler", "pp2-Scheduler", "hybrid-Scheduler", "state-Scheduler"}


@pytest.fixture(params=[p for p in VARIANTS if p.id in SHAPES])
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> h.Variant:
    return use_variant(request.param, monkeypatch)


def engine_with(model_dir: str, variant: h.Variant, monkeypatch: pytest.MonkeyPatch,
                **extra: Any) -> h.Engine:
    """make_engine(...) whose kv_connector_extra_config also has `extra`."""
    setup = h.EngineSetup
    monkeypatch.setattr(h, "EngineSetup", lambda **kw: setup(
        **{**kw, "extra_config": {**kw["extra_config"], **extra}}))
    return make_engine(model_dir, variant)


def add(engine: h.Engine, req_id: str, prompt: list[int], max_tokens: int = 3,
        **fields: Any) -> Request:
    """Engine.add with the request's own fields (cache_salt, lora_request, ...) and, as
    `params`, its kv_transfer_params where vLLM's server puts them (the sampling extra_args)."""
    params = fields.pop("params", None)
    sampling = SamplingParams(max_tokens=max_tokens, extra_args=None if params is None else
                              {"kv_transfer_params": params})
    request = Request(req_id, prompt, sampling, None,
                      block_hasher=get_request_block_hasher(BS, sha256), **fields)
    engine.scheduler.add_request(request)
    engine.added.add(req_id)
    return request


def finish_all(engine: h.Engine, requests: dict[str, tuple[list[int], int]]) -> None:
    """run_to_completion for requests already added."""
    run_to_completion(engine, requests)


# -- store_threshold ------------------------------------------------------------------------
def test_threshold_two_stores_a_prompt_the_second_time_it_is_seen(
        model_dir: str, variant: h.Variant, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_with(model_dir, variant, monkeypatch, store_threshold=2)
    prompt = make_prompt(3, 4 * BS + 6)
    run_to_completion(engine, {"first": (prompt, 3)})
    stats = total_stats(engine).data
    assert (stats["store_bytes"], stored_tokens(engine, prompt)) == (0, 0)
    groups = engine.connector._scheduler.groups
    assert stats["threshold_skipped_blocks"] > 0
    assert engine.scheduler.reset_prefix_cache()
    run_to_completion(engine, {"second": (prompt, 3)})
    assert stored_tokens(engine, prompt) == 4 * BS  # every full block now
    assert total_stats(engine).data["store_bytes"] > 0
    assert engine.scheduler.reset_prefix_cache()
    run_to_completion(engine, {"third": (prompt, 3)})  # loads them back, byte-checked
    assert total_stats(engine).data["hit_tokens"] == 4 * BS
    assert len(groups) in (1, 2)


# -- a request's kv_transfer_params ---------------------------------------------------------
def test_a_request_that_skips_offloading_stores_nothing_while_its_neighbour_does(
        model_dir: str, variant: h.Variant, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_with(model_dir, variant, monkeypatch)
    quiet, loud = make_prompt(4, 4 * BS + 3), make_prompt(5, 4 * BS + 3)
    add(engine, "quiet", quiet, params={"max_offload_tokens": 0})
    add(engine, "loud", loud)
    finish_all(engine, {"quiet": (quiet, 3), "loud": (loud, 3)})  # scheduled together
    assert (stored_tokens(engine, quiet), stored_tokens(engine, loud)) == (0, 4 * BS)


def test_max_offload_tokens_caps_what_a_request_stores(
        model_dir: str, variant: h.Variant, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_with(model_dir, variant, monkeypatch)
    prompt = make_prompt(6, 4 * BS + 3)
    add(engine, "capped", prompt, params={"max_offload_tokens": 2 * BS + 5})
    finish_all(engine, {"capped": (prompt, 3)})
    assert stored_tokens(engine, prompt) == partial_prefix(variant, 2)


def partial_prefix(variant: h.Variant, blocks: int) -> int:
    """Tokens of a `blocks`-block prefix of a 4-block prompt computed in one step that the
    tiers can serve: a state group keeps a state only where a step ended (at 4 blocks), so a
    shorter prefix of it cannot be resumed."""
    return 0 if variant.state else blocks * BS


def test_a_request_that_skips_loading_recomputes_what_is_stored(
        model_dir: str, variant: h.Variant, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_with(model_dir, variant, monkeypatch)
    prompt = make_prompt(7, 4 * BS + 3)
    run_to_completion(engine, {"writer": (prompt, 3)})
    assert stored_tokens(engine, prompt) == 4 * BS
    assert engine.scheduler.reset_prefix_cache()
    add(engine, "recompute", prompt, params={"max_load_tokens": 0})
    finish_all(engine, {"recompute": (prompt, 3)})
    assert all(w.starts["recompute"] == [0] for w in engine.workers)  # nothing loaded
    assert total_stats(engine).data["hit_tokens"] == 0
    assert engine.scheduler.reset_prefix_cache()
    add(engine, "some", prompt, params={"max_load_tokens": 2 * BS})
    finish_all(engine, {"some": (prompt, 3)})
    assert all(w.starts["some"] == [partial_prefix(variant, 2)] for w in engine.workers)
    assert total_stats(engine).data["hit_tokens"] == partial_prefix(variant, 2)


def test_a_bad_kv_transfer_params_value_is_ignored_with_a_warning(
        model_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    engine = engine_with(model_dir, h.Variant("BLNHC"), monkeypatch)
    prompt = make_prompt(8, 2 * BS + 3)
    with caplog.at_level("WARNING"):
        add(engine, "odd", prompt, params={"max_offload_tokens": "none"})
    finish_all(engine, {"odd": (prompt, 3)})
    assert stored_tokens(engine, prompt) == 2 * BS  # stored as without the field
    assert "request odd: kv_transfer_params max_offload_tokens must be a non-negative int, " \
           "got 'none'; ignored" in caplog.text


# -- shedding under backpressure ------------------------------------------------------------
def test_stores_past_the_bound_are_shed_counted_and_the_engine_goes_on(
        model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_with(model_dir, h.Variant("BLNHC"), monkeypatch,
                         max_store_blocks_in_flight=2)
    prompts = {f"r{i}": (make_prompt(20 + i, 4 * BS + 1), 3) for i in range(3)}
    run_to_completion(engine, prompts)  # every request finishes, its tokens right
    stats = total_stats(engine).data
    stored = sum(stored_tokens(engine, prompt) // BS for prompt, _ in prompts.values())
    assert stats["shed_blocks"] > 0
    assert stored + stats["shed_blocks"] == 3 * 4  # each block stored or shed, never lost


# -- options ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("extra", "message"), [
    ({"store_threshold": -2}, "store_threshold must be an integer >= 0, got -2"),
    ({"store_threshold": "2"}, "store_threshold must be an integer >= 0, got '2'"),
    ({"store_threshold": 2, "max_tracker_size": 0},
     "max_tracker_size must be an integer >= 1, got 0"),
    ({"max_tracker_size": 1000}, "max_tracker_size given without store_threshold >= 2 (it "
                                 "counts offers for the threshold), got store_threshold 0"),
    ({"min_prefix_tokens": 1.5}, "min_prefix_tokens must be an integer >= 0, got 1.5"),
    ({"max_store_blocks_in_flight": 0}, "max_store_blocks_in_flight must be an integer >= 1, "
                                        "got 0"),
    ({"store_treshold": 2}, "unknown key 'store_treshold' (did you mean 'store_threshold'?)"),
    ({"prefetch_blocks": -1}, "prefetch_blocks must be an integer >= 0, got -1"),
    ({"prefetch_deadline_s": 0}, "prefetch_deadline_s must be a positive number of seconds, "
                                 "got 0"),
    ({"prefetch_blocks": 8, "cpu_bytes": None, "pool": "p"},
     "prefetch_blocks 8 with 'pool': a shared pool's blocks are committed with checksums taken "
     "on a load, so it is not prefetched into; set prefetch_blocks 0"),
])
def test_admission_options_are_checked(extra: dict, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        ConnectorOptions.parse({"cpu_bytes": 1 << 30, **extra})
    assert str(caught.value).startswith(f"{ERROR_PREFIX}{message}"), str(caught.value)


def test_admission_options_default_to_storing_everything_and_no_prefetch() -> None:
    options = ConnectorOptions.parse({"cpu_bytes": 1 << 30})
    rules = options.admission()
    assert (rules.store_threshold, rules.min_prefix_tokens, rules.max_store_blocks_in_flight) \
        == (0, 0, None)
    assert (options.prefetch().max_blocks, options.prefetch().deadline_s) == (0, 1.0)
    rules = ConnectorOptions.parse({"cpu_bytes": 1 << 30, "store_threshold": 3,
                                    "max_tracker_size": 10}).admission()
    assert (rules.store_threshold, rules.max_tracker_size) == (3, 10)


# -- what the keys carry ---------------------------------------------------------------------
def test_keys_carry_the_cache_salt_the_lora_adapter_and_multimodal_hashes(
        model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tokens under another salt, adapter or image: another key for every block
    (vLLM chains its block hashes, so the first block's difference reaches every later one);
    the same fields again: the same keys."""
    engine = engine_with(model_dir, h.Variant("BLNHC"), monkeypatch)
    core = engine.connector._scheduler
    prompt = make_prompt(9, 4 * BS)

    def keys(**fields: Any) -> list[bytes]:
        request = Request("probe", prompt, SamplingParams(max_tokens=1), None,
                          block_hasher=get_request_block_hasher(BS, sha256), **fields)
        return core._keys(core.groups[0], request.block_hashes)

    def image(identifier: str) -> list[MultiModalFeatureSpec]:
        return [MultiModalFeatureSpec(None, "image", identifier, PlaceholderRange(2, 8))]

    variants = {
        "plain": keys(),
        "salt a": keys(cache_salt="a"), "salt b": keys(cache_salt="b"),
        "lora 1": keys(lora_request=LoRARequest("one", 1, "/adapters/one")),
        "lora 2": keys(lora_request=LoRARequest("two", 2, "/adapters/two")),
        "image x": keys(mm_features=image("x")), "image y": keys(mm_features=image("y")),
    }
    assert all(len(k) == 4 for k in variants.values())
    for name, these in variants.items():
        for other, those in variants.items():
            if name != other:
                assert not set(these) & set(those), (name, other)
    assert keys(cache_salt="a") == variants["salt a"]
    assert keys(lora_request=LoRARequest("one", 1, "/adapters/one")) == variants["lora 1"]
    assert keys(mm_features=image("x")) == variants["image x"]
