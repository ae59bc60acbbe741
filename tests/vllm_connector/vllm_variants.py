"""The engine shapes the vLLM scenarios run in (test_vllm_scenarios.py and
test_vllm_hybrid_scenarios.py): `VARIANTS`, and what their `variant` fixtures do with one
(`use_variant`: VLLM_KV_CACHE_LAYOUT for the per-layer ones).
"""

from __future__ import annotations

import pytest
import vllm_harness as h
from vllm import __version__ as VLLM_VERSION
from vllm_fake_worker import DEFERS_FINALIZE

NEEDS_DEFERRED_FINALIZE = pytest.mark.skipif(
    not DEFERS_FINALIZE, reason="a speculator's step order needs vLLM 0.33's driver")
V = h.Variant
WINDOW = 40
VARIANTS = [
    pytest.param(V("BLNHC"), id="block-major-Scheduler"),
    pytest.param(V("BLNHC", async_scheduling=True), id="block-major-AsyncScheduler"),
    pytest.param(V("LBNHC"), id="per-layer-Scheduler"),
    pytest.param(V("LBNHC", async_scheduling=True), id="per-layer-AsyncScheduler"),
    pytest.param(V("BLNHC", tp=2), id="tp2-Scheduler"),
    pytest.param(V("BLNHC", tp=2, async_scheduling=True), id="tp2-AsyncScheduler"),
    pytest.param(V("BLNHC", pp=2), id="pp2-Scheduler"),
    # (vLLM's config refuses PP with async scheduling under Model Runner V1)
    pytest.param(V("BLNHC", tp=2, pp=2), id="tp2-pp2-Scheduler"),
    # speculative decoding: 3 drafts a step, some rejected (their KV written, then rewritten)
    pytest.param(V("BLNHC", drafts=3), id="drafts-Scheduler"),
    pytest.param(V("LBNHC", tp=2, drafts=3), id="drafts-per-layer-tp2-Scheduler"),
    # (AsyncScheduler: vLLM's n-gram GPU config; the workers draft, the scheduler holds
    # placeholders and counts them accepted until the step's output says otherwise)
    pytest.param(V("BLNHC", tp=2, async_scheduling=True, drafts=3),
                 id="drafts-tp2-AsyncScheduler", marks=pytest.mark.skipif(
                     VLLM_VERSION.startswith("0.33"),
                     reason="the harness does not follow vLLM 0.33 resuming a preempted request "
                            "whose drafted step was in flight (its tokens diverge)")),
    pytest.param(V("BLNHC", speculator=True, drafts=3), id="speculator-drafts-Scheduler",
                 marks=NEEDS_DEFERRED_FINALIZE),
    pytest.param(V("BLNHC", tp=2, async_scheduling=True, speculator=True),
                 id="speculator-tp2-AsyncScheduler", marks=NEEDS_DEFERRED_FINALIZE),
    # MLA: vLLM's MLA cache specs, one latent head a rank, TRITON_MLA configured
    pytest.param(V("BLNHC", mla=True), id="mla-Scheduler"),
    pytest.param(V("LBNHC", tp=2, async_scheduling=True, mla=True),
                 id="mla-per-layer-tp2-AsyncScheduler"),
    # hybrid: vLLM's hybrid manager on, a full attention and a sliding window group (window
    # of 40 tokens: a reload keeps 3 of the sliding group's blocks before its end)
    pytest.param(V("BLNHC", window=WINDOW), id="hybrid-Scheduler"),
    pytest.param(V("BLNHC", async_scheduling=True, window=WINDOW), id="hybrid-AsyncScheduler"),
    pytest.param(V("LBNHC", tp=2, window=WINDOW), id="hybrid-per-layer-tp2-Scheduler"),
    pytest.param(V("BLNHC", tp=2, async_scheduling=True, window=WINDOW),
                 id="hybrid-tp2-AsyncScheduler"),
    pytest.param(V("BLNHC", drafts=3, window=WINDOW), id="hybrid-drafts-Scheduler"),
    # state hybrid: a full attention and an align-mode state group (vLLM's MambaSpec, as LFM2's
    # short convolutions): a reload restores the state group's block at the prefix end
    pytest.param(V("BLNHC", state=True), id="state-Scheduler"),
    pytest.param(V("BLNHC", async_scheduling=True, state=True), id="state-AsyncScheduler"),
    pytest.param(V("LBNHC", tp=2, state=True), id="state-per-layer-tp2-Scheduler"),
    pytest.param(V("BLNHC", tp=2, async_scheduling=True, state=True),
                 id="state-tp2-AsyncScheduler"),
    pytest.param(V("BLNHC", drafts=3, state=True), id="state-drafts-Scheduler"),
]


def skip_one_group_pool(variant: h.Variant) -> None:
    """Scenarios that hold a store in flight while a pool counted for one KV cache group fills
    up: no hybrid count yet (two groups draw from one pool), and with a sliding window group
    (or a state group, whose blocks leave as a window of two) the held store reads blocks vLLM
    frees as they leave the window, so the connector rightly waits for it before the next
    forward (flush_windows) and the held copy would stall it."""
    if variant.window is not None or variant.state:
        pytest.skip("holds a store of sliding window or state blocks across steps; pool "
                    "counted for one KV cache group")


def use_variant(variant: h.Variant, monkeypatch: pytest.MonkeyPatch) -> h.Variant:
    """What a scenario's `variant` fixture does with its parameter: the per-layer layouts are
    set as VLLM_KV_CACHE_LAYOUT (the engine override wins)."""
    if variant.layout != "BLNHC":
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", variant.layout)
    return variant
