"""The GPU side of the CPU vLLM engine in vllm_connector/vllm_harness.py: a worker with vLLM's cache
allocation and worker-side connector driver, and a fake, deterministic model forward.

The KV the fake model writes at position p (every layer, every rank) and the token it samples
after p are functions of the tokens up to p (a chained hash), so a block holds the same bytes
whoever computes it, and the worker can say, for every position a request reads, which bytes
must be there. Each rank writes bytes of its own, except under MLA, where the TP ranks of a
stage write the same latent, as in vLLM. When a request (re)starts with computed tokens (a local
prefix hit or a load), `Worker.execute` compares every byte of them in that first forward, after
the step's own KV is written (attention reads then).

Speculative decoding: positions scheduled with draft tokens get the KV of the drafts (a rejected
draft leaves KV that looks valid but belongs to a token vLLM did not keep, until a later step
rewrites it); sampling verifies the drafts as a greedy rejection sampler does.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
from vllm.v1.worker.utils import allocate_kv_cache

from transfer.copy.base import Gate, ThreadBackend

# vLLM 0.33's driver can take transfer results before the stores (see EngineSetup.speculator)
DEFERS_FINALIZE = "defer_finalize" in inspect.signature(ActiveKVConnector.post_forward).parameters
NUM_LAYERS = 4  # even: two pipeline stages of equal size share a block layout
NUM_KV_HEADS = 2
HEAD_SIZE = 16
DTYPE = torch.bfloat16
BLOCK_SIZE = 16
_PRIME = (1 << 61) - 1


# -- the fake model ----------------------------------------------------------------------------
def chain(previous: int | None, token: int) -> int:
    """The prefix hash after `token`, given the one before it (None at position 0)."""
    return ((7 if previous is None else previous) * 1_000_003 + token + 1) % _PRIME


class TokenSequence:
    """Tokens and prefix hashes of one prompt's continuation, extended on demand."""

    def __init__(self, prompt: list[int]) -> None:
        self.tokens = list(prompt)
        self.hashes: list[int] = []

    def hash_at(self, position: int) -> int:
        while len(self.hashes) <= position:
            p = len(self.hashes)
            if p == len(self.tokens):
                self.tokens.append(next_token(self.hashes[-1]))
            self.hashes.append(chain(self.hashes[-1] if self.hashes else None, self.tokens[p]))
        return self.hashes[position]

    def hashes_between(self, start: int, end: int) -> torch.Tensor:
        if end > start:
            self.hash_at(end - 1)
        return torch.tensor(self.hashes[start:end], dtype=torch.int64)

    def drafts(self, num_tokens: int, count: int, accepted: int) -> list[int]:
        """`count` draft tokens after the first `num_tokens`: the true continuation for the first
        `accepted`, a wrong token after that."""
        self.hash_at(num_tokens + count - 1)
        truth = self.tokens[num_tokens:num_tokens + count]
        return [t if i < accepted else 3 + (t - 2) % 997 for i, t in enumerate(truth)]


def next_token(prefix_hash: int) -> int:
    return 3 + prefix_hash % 997  # never EOS (2)


def kv_rows(prefix_hashes: torch.Tensor, layer: int, rank: int, row_bytes: int) -> torch.Tensor:
    """(positions, row_bytes) uint8: the KV the fake model writes for one layer on one rank."""
    h = prefix_hashes.unsqueeze(1)
    index = torch.arange(row_bytes, dtype=torch.int64).unsqueeze(0)
    return ((index * (h % 127 + 1) + h % 251 + layer * 31 + rank * 17) % 256).to(torch.uint8)


def rank_config(vllm_config: VllmConfig, rank: int) -> VllmConfig:
    """The config a worker process of `rank` sees."""
    config = copy.copy(vllm_config)
    config.parallel_config = copy.copy(vllm_config.parallel_config)
    config.parallel_config.rank = rank
    return config


# -- the worker ------------------------------------------------------------------------------------
@dataclass
class _RequestState:
    sequence: TokenSequence
    block_ids: list[list[int]]  # per KV cache group
    computed: int = 0  # tokens whose KV this worker wrote from accepted tokens
    proposals: list[int] = field(default_factory=list)  # its drafts for the next step
    proposed: int = 0  # proposals made so far


class Worker:
    """One GPU worker: vLLM's cache and worker-side connector driver, and the fake forward."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, rank: int,
                 requests: dict[str, Request], gate: Gate | None = None,
                 speculator: bool = False, last_stage: bool = True,
                 drafting: tuple[int, tuple[int, ...]] | None = None) -> None:
        """`drafting`: (count, acceptance) when speculative decoding is on: this worker proposes
        the drafts (see EngineSetup.num_speculative_tokens)."""
        self.rank = rank
        tp = vllm_config.parallel_config.tensor_parallel_size
        mla = isinstance(kv_cache_config.kv_cache_groups[0].kv_cache_spec, MLAAttentionSpec)
        self.kv_rank = rank - rank % tp if mla else rank  # whose bytes this rank writes
        self.speculator = speculator
        self.drafting = drafting
        self.last_stage = last_stage  # earlier stages sample nothing: connector output only
        self.vllm_config = rank_config(vllm_config, rank)
        self.connector = KVConnectorFactory.create_connector(self.vllm_config,
                                                             KVConnectorRole.WORKER,
                                                             kv_cache_config)
        if gate is not None:  # the connector's copy-backend seam: the same engine, held jobs
            self.connector.copy_backend = lambda device: ThreadBackend(gate)
        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        self.caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
        # Layers in model order; each reads its KV cache group's block table (a sliding window
        # group's freed blocks are vLLM's null block there, never read).
        self.groups = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
        self.group_of = {name: i for i, group in enumerate(self.groups) for name in group}
        self.layer_names = sorted(self.group_of, key=lambda name: int(name.split(".")[2]))
        self.windows = [g.kv_cache_spec.sliding_window
                        if isinstance(g.kv_cache_spec, SlidingWindowSpec) else None
                        for g in kv_cache_config.kv_cache_groups]
        # A state group's layers (align mode) keep, in the block of position p, the state after
        # p: a state content's bytes (the page's padding is never written).
        self.state_bytes = [g.kv_cache_spec.state_content_size_bytes
                            if isinstance(g.kv_cache_spec, MambaSpec) else None
                            for g in kv_cache_config.kv_cache_groups]
        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector  # what the driver looks up
        try:
            self.driver = ActiveKVConnector(self.vllm_config, self.caches)  # registers the caches
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
        self.scheduler_requests = requests  # the scheduler's view, to know a prefill chunk
        self.states: dict[str, _RequestState] = {}
        self.starts: dict[str, list[int]] = {}  # request -> computed tokens at each (re)start
        self.block_history: dict[str, set[int]] = {}  # request -> every block it was given
        self.prefix_checks = 0  # prefix positions verified where a forward reads them

    def pages(self, layer: str) -> torch.Tensor:
        """(blocks, H, N, C bytes) uint8 view of one layer."""
        return self.caches[layer].view(torch.uint8)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        fresh = self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return self.driver.no_forward(so)
        self.driver.pre_forward(so)
        drafter = self.layer_names[-1:] if self.speculator else []
        target = self.layer_names[:len(self.layer_names) - len(drafter)]
        drafts = {req_id: self._drafts(req_id, placeholders)
                  for req_id, placeholders in so.scheduled_spec_decode_tokens.items()}
        sampled = {req_id: self._forward(req_id, n, target, drafts.get(req_id, []))
                   for req_id, n in so.num_scheduled_tokens.items()}
        for req_id, tokens in sampled.items():
            self._after_sampling(req_id, so.num_scheduled_tokens[req_id],
                                 len(drafts.get(req_id, [])), tokens)
        # Attention reads after every request's KV of this step is written (a model writes the
        # KV of a layer before attending): a prefix hit on blocks another request of the same
        # step computes is legitimate.
        for req_id in fresh:
            self.starts.setdefault(req_id, []).append(self._start(req_id))
            self.check_prefix(req_id, self._start(req_id), target)
        self.driver.finish_forward()
        if drafter:  # stores submitted before the drafter's forward would copy stale bytes
            kv_output = self.driver.post_forward(so.finished_req_ids, defer_finalize=True)
            for req_id, n in so.num_scheduled_tokens.items():
                self._forward(req_id, n, drafter, drafts.get(req_id, []))
            for req_id in fresh:  # the drafter attends after its layer of this step is written
                self.check_prefix(req_id, self._start(req_id), drafter)
            self.driver.finalize_step()
        else:
            kv_output = self.driver.post_forward(so.finished_req_ids)
        if not self.last_stage:
            return ModelRunnerOutput.with_kv_conn_output_only(kv_output)
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=[sampled[r] for r in req_ids],
                                 kv_connector_output=kv_output)

    def _update_states(self, so: SchedulerOutput) -> list[str]:
        """Track block tables as a model runner does; returns requests (re)starting now."""
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
        fresh = []
        for data in so.scheduled_new_reqs:
            self.states[data.req_id] = _RequestState(TokenSequence(data.prompt_token_ids),
                                                     [list(ids) for ids in data.block_ids])
            fresh.append(data.req_id)
        cached = so.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            state = self.states[req_id]
            if req_id in cached.resumed_req_ids:
                state.block_ids = ([list(ids) for ids in new_ids] if new_ids
                                   else [[] for _ in self.groups])
                fresh.append(req_id)
            elif new_ids:
                for table, ids in zip(state.block_ids, new_ids, strict=True):
                    table.extend(ids)
        for req_id in so.num_scheduled_tokens:
            history = self.block_history.setdefault(req_id, set())
            for table in self.states[req_id].block_ids:
                history.update(table)
        self._starts = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        self._starts.update((d.req_id, d.num_computed_tokens) for d in so.scheduled_new_reqs)
        if self.drafting is not None and self.vllm_config.scheduler_config.async_scheduling:
            # The async scheduler counted last step's drafts as accepted; the model runner
            # starts from what was (vLLM corrects it on the GPU from the accepted counts).
            for req_id in cached.req_ids:
                if req_id not in cached.resumed_req_ids:
                    self._starts[req_id] = self.states[req_id].computed
        return fresh

    def _start(self, req_id: str) -> int:
        return self._starts[req_id]

    def _drafts(self, req_id: str, scheduled: list[int]) -> list[int]:
        """The draft tokens of a step: the scheduler's (this worker's proposals, sent back), or
        under async scheduling its own proposals where the scheduler left placeholders."""
        if not self.vllm_config.scheduler_config.async_scheduling:
            return scheduled
        return self.states[req_id].proposals[:len(scheduled)]

    def _after_sampling(self, req_id: str, num_tokens: int, num_drafts: int,
                        sampled: list[int]) -> None:
        """Count the tokens whose KV is now right and, when this worker drafts, propose."""
        state = self.states[req_id]
        last_real = self._start(req_id) + num_tokens - num_drafts
        if not sampled:  # a prefill chunk: nothing to draft from
            state.computed, state.proposals = last_real, []
            return
        state.computed = last_real + len(sampled) - 1  # the accepted drafts; not the new token
        if self.drafting is not None:
            count, acceptance = self.drafting
            accepted = acceptance[state.proposed % len(acceptance)]
            state.proposed += 1
            state.proposals = state.sequence.drafts(last_real + len(sampled), count, accepted)

    def _forward(self, req_id: str, num_tokens: int, layers: list[str],
                 drafts: list[int]) -> list[int]:
        """Write `layers`' KV of the request's scheduled tokens (the last `len(drafts)` of them
        draft tokens); the tokens sampled: none for a prefill chunk, else the drafts that match
        what the model predicts, then its own next token."""
        state = self.states[req_id]
        start = self._start(req_id)
        end = start + num_tokens
        last_real = end - len(drafts)
        hashes = state.sequence.hashes_between(start, last_real).tolist()
        previous = state.sequence.hash_at(last_real - 1)  # decode: the last real token is input
        for token in drafts:
            previous = chain(previous, token)
            hashes.append(previous)
        positions = torch.arange(start, end)
        for layer in layers:
            if self.state_bytes[self.group_of[layer]] is not None:
                continue  # after sampling: a state is kept at accepted positions only
            table = state.block_ids[self.group_of[layer]]
            blocks = torch.tensor(table)[positions // BLOCK_SIZE]
            pages = self.pages(layer)
            rows = kv_rows(torch.tensor(hashes, dtype=torch.int64), self.layer_names.index(layer),
                           self.kv_rank, pages.shape[1] * pages.shape[3])
            pages[blocks, :, positions % BLOCK_SIZE, :] = rows.view(len(positions),
                                                                    pages.shape[1], -1)
        sampled: list[int] = []
        if last_real >= self.scheduler_requests[req_id].num_tokens:  # else a prefill chunk
            sampled = [next_token(state.sequence.hash_at(last_real - 1))]
            for i, draft in enumerate(drafts):  # greedy verification: kept up to a mismatch
                if draft != sampled[-1]:
                    break
                sampled.append(next_token(hashes[last_real - start + i]))
        self._advance_states(req_id, start, last_real + max(len(sampled) - 1, 0), layers)
        return sampled

    def _advance_states(self, req_id: str, start: int, end: int, layers: list[str]) -> None:
        """A state layer's step over accepted positions [start, end): it reads the state after
        start - 1 from that position's block (checked: a load or a prefix hit put it there), and
        keeps the state after each block's last position and after end - 1 in their blocks
        (where vLLM's align mode gave the request one: a prefill chunk's skipped blocks are its
        null block, block 0)."""
        state = self.states[req_id]
        for layer in layers:
            group = self.group_of[layer]
            if self.state_bytes[group] is None:
                continue
            table = state.block_ids[group]
            if start > 0:
                self._check_state(req_id, layer, start)
            kept = [p for p in range(start, end)
                    if (p + 1) % BLOCK_SIZE == 0 or p == end - 1]
            kept = [p for p in kept if p // BLOCK_SIZE < len(table) and table[p // BLOCK_SIZE]]
            if kept:
                rows = self._state_rows(req_id, layer, torch.tensor(kept))
                self.pages(layer).view(len(self.pages(layer)), -1)[
                    [table[p // BLOCK_SIZE] for p in kept], :rows.shape[1]] = rows

    def _state_rows(self, req_id: str, layer: str, positions: torch.Tensor) -> torch.Tensor:
        """(positions, state bytes): the state a state layer keeps after each position."""
        hashes = torch.stack([torch.tensor(self.states[req_id].sequence.hash_at(int(p)))
                              for p in positions])
        return kv_rows(hashes, self.layer_names.index(layer), self.kv_rank,
                       self.state_bytes[self.group_of[layer]])

    def _check_state(self, req_id: str, layer: str, num_tokens: int) -> None:
        """The state after position num_tokens - 1 is in that position's block."""
        table = self.states[req_id].block_ids[self.group_of[layer]]
        position = num_tokens - 1
        block = table[position // BLOCK_SIZE]
        want = self._state_rows(req_id, layer, torch.tensor([position]))[0]
        got = self.pages(layer).view(len(self.pages(layer)), -1)[block, :len(want)]
        if block == 0 or not torch.equal(got, want):
            raise AssertionError(f"rank {self.rank} request {req_id} layer {layer}: block "
                                 f"{block} does not hold the state after position {position}")

    def check_prefix(self, req_id: str, num_tokens: int, layers: list[str] | None = None) -> None:
        """Every byte of positions [0, num_tokens) of `layers` (default: all) that attention at
        position `num_tokens` reads (a sliding window layer: the window's) is what the fake
        model writes there."""
        if num_tokens == 0:
            return
        state = self.states[req_id]
        hashes = state.sequence.hashes_between(0, num_tokens)
        for layer in self.layer_names if layers is None else layers:
            group = self.group_of[layer]
            if self.state_bytes[group] is not None:  # a state: the one after num_tokens - 1
                self._check_state(req_id, layer, num_tokens)
                continue
            window = self.windows[group]
            first = 0 if window is None else max(0, num_tokens - window + 1)
            positions = torch.arange(first, num_tokens)
            blocks = torch.tensor(state.block_ids[group])[positions // BLOCK_SIZE]
            pages = self.pages(layer)
            want = kv_rows(hashes[first:], self.layer_names.index(layer), self.kv_rank,
                           pages.shape[1] * pages.shape[3])
            got = pages[blocks, :, positions % BLOCK_SIZE, :].reshape(len(positions), -1)
            bad = (got != want).any(dim=1).nonzero().flatten().tolist()
            if bad:
                raise AssertionError(f"rank {self.rank} request {req_id} layer {layer}: "
                                     f"{len(bad)} of {len(positions)} positions hold wrong KV, "
                                     f"first at position {first + bad[0]} (block "
                                     f"{int(blocks[bad[0]])})")
        if layers is None or layers[-1] == self.layer_names[-1]:  # each position counted once
            self.prefix_checks += num_tokens

    def slot(self, req_id: str, position: int, layer: int = 0) -> torch.Tensor:
        """The bytes one layer holds for one position of a running request's block table."""
        name = self.layer_names[layer]
        pages = self.pages(name)
        block = self.states[req_id].block_ids[self.group_of[name]][position // BLOCK_SIZE]
        return pages[block, :, position % BLOCK_SIZE, :].reshape(-1)

    def drain(self) -> None:
        """Block until this worker's copies in flight are done (a quiet engine step)."""
        self.connector._worker.drain()

