"""A small vLLM engine on CPU for connector tests: no weights, no GPU, vLLM's own parts.

Real: VllmConfig over a tiny local config.json (HF_HUB_OFFLINE=1); vLLM's layout resolution
(`resolve_kv_cache_layout`, which asks the connector class); its KV cache config builder and
`allocate_kv_cache`; its connector factory (both roles, from the module path); its `Scheduler`
or `AsyncScheduler`; its worker-side connector driver (`ActiveKVConnector`, the V2 model
runner's); its `KVOutputAggregator` across TP ranks. Stand-in: the model forward only.

The fake model is deterministic: the KV it writes at position p (every layer, every rank) and
the token it samples after p are functions of the prompt and tokens up to p (a chained hash), so
a block holds the same bytes whoever computes it, and the harness can say, for every position a
request reads, which bytes must be there. `Worker.execute` checks them in each forward of a
request that starts with computed tokens (a local prefix hit or a load).
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.utils import get_pp_indices  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from transfer.copy_backends import Gate, ThreadBackend  # noqa: E402

try:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
except ImportError:  # vLLM 0.33 moved the planner
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups

# vLLM 0.33's driver can take transfer results before the stores (see EngineSetup.speculator)
DEFERS_FINALIZE = "defer_finalize" in inspect.signature(ActiveKVConnector.post_forward).parameters
NUM_LAYERS = 4  # even: two pipeline stages of equal size share a block layout
NUM_KV_HEADS = 2
HEAD_SIZE = 16
DTYPE = torch.bfloat16
BLOCK_SIZE = 16
ALL_LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]  # vLLM's default order
_PRIME = (1 << 61) - 1


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


# -- the fake model ----------------------------------------------------------------------------
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
            previous = self.hashes[-1] if self.hashes else 7
            self.hashes.append((previous * 1_000_003 + self.tokens[p] + 1) % _PRIME)
        return self.hashes[position]

    def hashes_between(self, start: int, end: int) -> torch.Tensor:
        if end > start:
            self.hash_at(end - 1)
        return torch.tensor(self.hashes[start:end], dtype=torch.int64)


def next_token(prefix_hash: int) -> int:
    return 3 + prefix_hash % 997  # never EOS (2)


def kv_rows(prefix_hashes: torch.Tensor, layer: int, rank: int, row_bytes: int) -> torch.Tensor:
    """(positions, row_bytes) uint8: the KV the fake model writes for one layer on one rank."""
    h = prefix_hashes.unsqueeze(1)
    index = torch.arange(row_bytes, dtype=torch.int64).unsqueeze(0)
    return ((index * (h % 127 + 1) + h % 251 + layer * 31 + rank * 17) % 256).to(torch.uint8)


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
    connector: str = "CrossLayerOffloadConnector"
    module_path: str = "kvconnector.vllm"


def make_vllm_config(setup: EngineSetup) -> VllmConfig:
    model = ModelConfig(model=setup.model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                        seed=0, max_model_len=1024)
    return VllmConfig(
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
        attention_config=AttentionConfig(backend=AttentionBackendEnum.TRITON_ATTN),
        device_config=DeviceConfig("cpu"))


def layer_specs(tp_size: int, layers: range = range(NUM_LAYERS)) -> dict[str, FullAttentionSpec]:
    return {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS // tp_size, head_size=HEAD_SIZE,
        dtype=DTYPE) for i in layers}


def stage_layers(pp_size: int) -> list[range]:
    """Each pipeline stage's layers, as vLLM splits them."""
    return [range(*get_pp_indices(NUM_LAYERS, stage, pp_size)) for stage in range(pp_size)]


def rank_config(vllm_config: VllmConfig, rank: int) -> VllmConfig:
    """The config a worker process of `rank` sees."""
    config = copy.copy(vllm_config)
    config.parallel_config = copy.copy(vllm_config.parallel_config)
    config.parallel_config.rank = rank
    return config


# -- the engine -----------------------------------------------------------------------------------
@dataclass
class _RequestState:
    sequence: TokenSequence
    block_ids: list[int]


class Worker:
    """One GPU worker: vLLM's cache and worker-side connector driver, and the fake forward."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, rank: int,
                 requests: dict[str, Request], gate: Gate | None = None,
                 speculator: bool = False, last_stage: bool = True) -> None:
        self.rank = rank
        self.speculator = speculator
        self.last_stage = last_stage  # earlier stages sample nothing: connector output only
        self.vllm_config = rank_config(vllm_config, rank)
        self.connector = KVConnectorFactory.create_connector(self.vllm_config,
                                                             KVConnectorRole.WORKER,
                                                             kv_cache_config)
        if gate is not None:  # the connector's copy-backend seam: the same engine, held jobs
            self.connector.copy_backend = lambda device: ThreadBackend(gate)
        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        self.caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
        self.layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
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
        sampled = {req_id: self._forward(req_id, n, target)
                   for req_id, n in so.num_scheduled_tokens.items()}
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
                self._forward(req_id, n, drafter)
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
                                                     list(data.block_ids[0]))
            fresh.append(data.req_id)
        cached = so.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            state = self.states[req_id]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
                fresh.append(req_id)
            elif new_ids:
                state.block_ids.extend(new_ids[0])
        for req_id in so.num_scheduled_tokens:
            self.block_history.setdefault(req_id, set()).update(self.states[req_id].block_ids)
        self._starts = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        self._starts.update((d.req_id, d.num_computed_tokens) for d in so.scheduled_new_reqs)
        return fresh

    def _start(self, req_id: str) -> int:
        return self._starts[req_id]

    def _forward(self, req_id: str, num_tokens: int, layers: list[str]) -> list[int]:
        """Write `layers`' KV of the request's scheduled tokens; the token sampled, if any."""
        state = self.states[req_id]
        start = self._start(req_id)
        end = start + num_tokens
        positions = torch.arange(start, end)
        blocks = torch.tensor(state.block_ids)[positions // BLOCK_SIZE]
        hashes = state.sequence.hashes_between(start, end)
        for layer in layers:
            pages = self.pages(layer)
            rows = kv_rows(hashes, self.layer_names.index(layer), self.rank,
                           pages.shape[1] * pages.shape[3])
            pages[blocks, :, positions % BLOCK_SIZE, :] = rows.view(len(positions),
                                                                    pages.shape[1], -1)
        if end < self.scheduler_requests[req_id].num_tokens:
            return []  # a prefill chunk samples nothing
        return [next_token(state.sequence.hash_at(end - 1))]

    def check_prefix(self, req_id: str, num_tokens: int, layers: list[str] | None = None) -> None:
        """Every byte of positions [0, num_tokens) of `layers` (default: all) is what the fake
        model writes there."""
        if num_tokens == 0:
            return
        state = self.states[req_id]
        positions = torch.arange(num_tokens)
        blocks = torch.tensor(state.block_ids)[positions // BLOCK_SIZE]
        hashes = state.sequence.hashes_between(0, num_tokens)
        for layer in self.layer_names if layers is None else layers:
            pages = self.pages(layer)
            want = kv_rows(hashes, self.layer_names.index(layer), self.rank,
                           pages.shape[1] * pages.shape[3])
            got = pages[blocks, :, positions % BLOCK_SIZE, :].reshape(num_tokens, -1)
            bad = (got != want).any(dim=1).nonzero().flatten().tolist()
            if bad:
                raise AssertionError(f"rank {self.rank} request {req_id} layer {layer}: "
                                     f"{len(bad)} of {num_tokens} positions hold wrong KV, "
                                     f"first at position {bad[0]} (block "
                                     f"{int(blocks[bad[0]])})")
        if layers is None or layers[-1] == self.layer_names[-1]:  # each position counted once
            self.prefix_checks += num_tokens

    def drain(self) -> None:
        """Block until this worker's copies in flight are done (a quiet engine step)."""
        self.connector._worker.drain()


class Engine:
    """A scheduler, its workers and vLLM's aggregation, stepped like EngineCore does (with a
    batch queue of depth 2 under async scheduling)."""

    live: list[Engine] = []  # engines not shut down yet (see shutdown_all)

    def __init__(self, setup: EngineSetup, gates: list[HeldGate] | None = None,
                 available_memory: int = 1 << 30) -> None:
        """`gates`: one copy gate per rank (see HeldGate), or None for ungated copies."""
        init_none_hash(sha256)
        self.setup = setup
        self.gates = gates or []
        self.vllm_config = make_vllm_config(setup)
        tp, pp = setup.tensor_parallel_size, setup.pipeline_parallel_size
        world = tp * pp
        # A stage's workers hold its layers only; vLLM numbers ranks with TP fastest.
        stages = [layer_specs(tp, layers) for layers in stage_layers(pp)]
        self.layout = resolve_kv_cache_layout(
            self.vllm_config, [ALL_LAYOUTS] * world,
            [spec for specs in stages for spec in specs.values()]).name
        groups = [get_kv_cache_groups(self.vllm_config, specs) for specs in stages]
        configs = [get_kv_cache_config_from_groups(self.vllm_config,
                                                   copy.deepcopy(groups[rank // tp]),
                                                   available_memory) for rank in range(world)]
        for config in configs:
            config.kv_cache_layout = self.layout
        self.kv_cache_config = generate_scheduler_kv_cache_config(configs)
        self.vllm_config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        scheduler_cls = AsyncScheduler if setup.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(
            vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BLOCK_SIZE, log_stats=True)
        self.workers = [Worker(self.vllm_config, configs[rank], rank, self.scheduler.requests,
                               gates[rank] if gates else None, setup.speculator,
                               last_stage=rank // tp == pp - 1)
                        for rank in range(world)]
        self.output_rank = (pp - 1) * tp  # the executor's: the last stage's first worker
        self.aggregator = KVOutputAggregator(world)
        self._queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.added: set[str] = set()
        self.finished: dict[str, list[int]] = {}  # request -> its output tokens
        self.outputs: dict[str, list[int]] = {}
        self.stats: list[dict[str, Any]] = []  # the connector stats of every step
        self.steps = 0
        self.preemptions = 0
        self.drain_when_idle = True  # off while a test holds a copy in flight
        Engine.live.append(self)

    @classmethod
    def shutdown_all(cls) -> None:
        """Release every held copy, then shut the workers' connectors down (lanes, pools)."""
        while cls.live:
            engine = cls.live.pop()
            for gate in engine.gates:
                for event in gate.hold.values():
                    event.set()
            for worker in engine.workers:
                worker.connector.shutdown()

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
        request = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), None,
                          block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
        self.scheduler.add_request(request)
        self.added.add(req_id)
        return request

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.preemptions += len(so.preempted_req_ids or ())
        # A copy per worker, as the executor's process boundary gives: the driver may return
        # vLLM's shared EMPTY_MODEL_RUNNER_OUTPUT, which the aggregator writes into.
        outputs = [copy.copy(worker.execute(so)) for worker in self.workers]
        if so.total_num_scheduled_tokens == 0 and self.drain_when_idle:
            for worker in self.workers:
                worker.drain()  # nothing to compute: let copies finish before the next step
        merged = self.aggregator.aggregate(outputs, output_rank=self.output_rank)
        assert merged is not None
        return merged

    def step(self) -> None:
        self.steps += 1
        if not self.setup.async_scheduling:
            so = self.scheduler.schedule()
            self._update(so, self._execute(so))
            return
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            self._queue.appendleft((so, self._execute(so)))
            if len(self._queue) < 2:
                return
        if self._queue:
            self._update(*self._queue.pop())

    def _update(self, so: SchedulerOutput, output: ModelRunnerOutput) -> None:
        for eco in self.scheduler.update_from_output(so, output).values():
            for out in eco.outputs:
                self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    self.finished[out.request_id] = self.outputs[out.request_id]
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                self.stats.append(eco.scheduler_stats.kv_connector_stats)

    def run(self, until: Callable[[], bool] | None = None, max_steps: int = 2000) -> None:
        """Step until `until()` (default: the scheduler has nothing left, queue empty)."""
        done = until or (lambda: not self.scheduler.has_requests() and not self._queue)
        for _ in range(max_steps):
            if done():
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def expected_tokens(self, prompt: list[int], max_tokens: int) -> list[int]:
        sequence = TokenSequence(prompt)
        sequence.hash_at(len(prompt) + max_tokens - 1)
        return sequence.tokens[len(prompt):len(prompt) + max_tokens]

    def assert_no_leaks(self) -> None:
        """Every GPU block free, no request, job or copy left anywhere."""
        pool = self.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # block 0 is the null block
        assert all(block.ref_cnt == 0 for block in pool.blocks[1:])
        assert not self.scheduler.requests and not self.scheduler.running
        core = self.connector._scheduler
        assert not core.has_jobs() and not core._requests
        assert not self.connector._requests
        assert core.index.num_draining == 0
        for worker in self.workers:
            assert worker.connector._worker.jobs_in_flight == 0


@dataclass
class HeldGate:
    """A copy gate: jobs named in `hold` wait for their event; jobs in `fail` fail."""

    hold: dict[int, Any] = field(default_factory=dict)
    fail: set[int] = field(default_factory=set)
    seen: list[int] = field(default_factory=list)

    def __call__(self, job_id: int) -> None:
        self.seen.append(job_id)
        if job_id in self.fail:
            raise RuntimeError(f"injected copy failure of job {job_id}")
        event = self.hold.get(job_id)
        if event is not None:
            event.wait()


# Shared by the remote-tier scenarios (tests/test_vllm_remote.py, tests/test_vllm_redis.py).
POISON = 0x5A
REMOTE_MAX_STEPS = 200_000


def shutdown_remote_engines() -> None:
    """Close the live engines' remote lookup clients, then shut the engines down."""
    for engine in list(Engine.live):
        lookups = engine.connector._remote_lookups
        if lookups is not None:
            lookups.close()
    Engine.shutdown_all()


def on_planned_load(engine: Engine, action: Callable[[], None]) -> None:
    """Run `action` each time the engine's scheduler plans a load from a lookup hit: what it
    does to the remote tier lands between the lookup and the get."""
    core = engine.connector._scheduler
    plan_load = core.plan_load

    def plan_then_act(*args: object, **kwargs: object) -> tuple[int, int]:
        planned = plan_load(*args, **kwargs)
        if planned[1]:
            action()
        return planned

    core.plan_load = plan_then_act


def make_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50, 950) for _ in range(length)]


def poison_gpu(engine: Engine) -> None:
    """Every byte of every worker's KV cache set to POISON, so a load that never lands shows."""
    for worker in engine.workers:
        for view in worker.caches.values():
            view.view(torch.uint8).fill_(POISON)


def run_to_completion(engine: Engine, requests: dict[str, tuple[list[int], int]]) -> None:
    """Add the requests not added yet, run until all finish, check their tokens and leaks."""
    for req_id, (prompt, max_tokens) in requests.items():
        if req_id not in engine.added:
            engine.add(req_id, prompt, max_tokens)
    # While a lookup is in flight vLLM skips the request: idle steps take ~0.1 ms each, so a
    # lookup deadline spans thousands of them.
    engine.run(max_steps=REMOTE_MAX_STEPS)
    for req_id, (prompt, max_tokens) in requests.items():
        assert engine.finished[req_id] == engine.expected_tokens(prompt, max_tokens), req_id
    engine.assert_no_leaks()
