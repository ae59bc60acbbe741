"""A small vLLM engine on CPU for connector tests: no weights, no GPU, vLLM's own parts.

Real: VllmConfig over a tiny local config.json (HF_HUB_OFFLINE=1); vLLM's layout resolution
(`resolve_kv_cache_layout`, which asks the connector class); its KV cache config builder and
`allocate_kv_cache`; its connector factory (both roles, from the module path); its `Scheduler`
or `AsyncScheduler`, with n-gram speculative decoding when asked (the drafts are the harness's);
its worker-side connector driver (`ActiveKVConnector`, the V2 model runner's); its
`KVOutputAggregator` across TP ranks. Stand-in: the model forward only
(vllm_connector/vllm_fake_worker.py: a deterministic fake model, and the byte checks it allows).
"""

from __future__ import annotations

import copy
import os
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.utils.gc_utils import freeze_gc_heap  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm_engine_config import (  # noqa: E402
    ALL_LAYOUTS,
    MLA_HEAD_SIZE,
    EngineSetup,
    Variant,
    layer_specs,
    make_vllm_config,
    stage_layers,
)
from vllm_fake_worker import (  # noqa: E402
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_KV_HEADS,
    NUM_LAYERS,
    TokenSequence,
    Worker,
)

from kvconnector.layout.descriptor import HOST_ALIGNMENT, round_up  # noqa: E402
from kvconnector.offload.worker import BLOCK_MAJOR, PER_LAYER  # noqa: E402
from kvconnector.vllm.connector import CrossLayerOffloadConnector  # noqa: E402
from kvconnector.vllm.stats import OffloadStats  # noqa: E402

try:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
except ImportError:  # vLLM 0.33 moved the planner
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups


# -- the engine -----------------------------------------------------------------------------------
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
        stages = [layer_specs(tp, layers, setup.mla, setup.sliding_window, setup.state)
                  for layers in stage_layers(pp)]
        declared = self.vllm_config.attention_config.backend.get_class() \
            .supported_kv_cache_layouts()
        supported = ALL_LAYOUTS if declared is None else [layout.name for layout in declared]
        self.layout = resolve_kv_cache_layout(
            self.vllm_config, [supported] * world,
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
        worker_drafts = ((setup.num_speculative_tokens, setup.draft_acceptance)
                         if setup.num_speculative_tokens else None)
        self.workers = [Worker(self.vllm_config, configs[rank], rank, self.scheduler.requests,
                               gates[rank] if gates else None, setup.speculator,
                               last_stage=rank // tp == pp - 1, drafting=worker_drafts)
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
        self.spec_counts = [0, 0]  # drafts scheduled, drafts accepted (from vLLM's stats)
        self.drain_when_idle = True  # off while a test holds a copy in flight
        Engine.live.append(self)
        # As EngineCore does once it is built: with vLLM's import heap frozen a full collection
        # takes milliseconds, not the ~0.4 s that would stall a step past a lookup's deadline.
        freeze_gc_heap()

    @classmethod
    def shutdown_all(cls) -> None:
        """Shut the scheduler-side connectors down (remote lookups, shared pool connections),
        release every held copy, then shut the workers' connectors down (lanes, pools)."""
        while cls.live:
            engine = cls.live.pop()
            engine.connector.shutdown()  # remote lookups, shared pool connection
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

    def abort(self, req_id: str) -> None:
        """What EngineCore does when the client goes away."""
        assert self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

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
            if self.setup.num_speculative_tokens and so.total_num_scheduled_tokens:
                self._propose_drafts(list(so.num_scheduled_tokens))
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
            stats = eco.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.stats.append(stats.kv_connector_stats)
            if stats is not None and stats.spec_decoding_stats is not None:
                self.spec_counts[0] += stats.spec_decoding_stats.num_draft_tokens
                self.spec_counts[1] += stats.spec_decoding_stats.num_accepted_tokens

    def _propose_drafts(self, req_ids: list[str]) -> None:
        """What EngineCore.post_step does: the output rank's proposals to the scheduler (which
        ignores them for finished requests and prefill chunks)."""
        states = self.workers[self.output_rank].states
        self.scheduler.update_draft_token_ids(
            DraftTokenIds(req_ids, [states[req_id].proposals for req_id in req_ids]))

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
        assert core.index.segment or core.index.num_draining == 0  # a shared pool's: daemon's
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

    def reached(self, job_id: int, timeout_s: float = 10.0) -> bool:
        """Whether the copy thread has brought `job_id` to the gate (within `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while job_id not in self.seen:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True


# -- helpers shared by the scenarios (tests/test_vllm*.py) -----------------------------------------
POISON = 0x5A
# A step bound, not a time bound: an idle step takes 0.1-0.2 ms, so a store killed under a load
# (about 190,000 steps on the dev VM, 32 s) came within 3% of a 200,000 bound, and a faster
# machine failed it. A hang still fails, after a few minutes.
REMOTE_MAX_STEPS = 1_000_000


def page_bytes(tp: int, mla: bool = False) -> int:
    """One layer's bytes of one block on one rank."""
    if mla:  # one latent vector a token, no separate V
        return BLOCK_SIZE * MLA_HEAD_SIZE * 2
    return (NUM_KV_HEADS // tp) * BLOCK_SIZE * 2 * HEAD_SIZE * 2


def block_bytes(tp: int, mla: bool = False) -> int:
    """A whole block's bytes on one rank (every layer, one pipeline stage)."""
    return NUM_LAYERS * page_bytes(tp, mla)


def make_engine(model_dir: str, variant: Variant, gates: list[HeldGate] | None = None,
                cpu_slots: int = 256, **setup: Any) -> Engine:
    """An engine of `variant` whose pool holds `cpu_slots` blocks; checks that the connector
    moves blocks the way the layout calls for."""
    layer_bytes = page_bytes(variant.tp, variant.mla)
    largest_stage = max(map(len, stage_layers(variant.pp)))
    if variant.window is not None or variant.state:  # two groups share each tensor
        largest_stage //= 2
    slot_bytes = round_up(largest_stage * layer_bytes, HOST_ALIGNMENT)  # as the connector sizes
    engine = Engine(EngineSetup(model_dir=model_dir, async_scheduling=variant.async_scheduling,
                                tensor_parallel_size=variant.tp, pipeline_parallel_size=variant.pp,
                                speculator=variant.speculator,
                                num_speculative_tokens=variant.drafts, mla=variant.mla,
                                sliding_window=variant.window, state=variant.state,
                                extra_config={"cpu_bytes": cpu_slots * slot_bytes},
                                **setup), gates=gates)
    assert engine.layout == variant.layout
    assert engine.connector._tiers.num_slots == cpu_slots
    mode = BLOCK_MAJOR if variant.layout == "BLNHC" else PER_LAYER
    for worker in engine.workers:
        assert worker.connector._worker.mode == mode
        # a slot holds its stage's layers only (the largest group's: groups share tensors)
        tensors = max(len(group) for group in worker.groups)
        assert worker.connector._worker.block_bytes == tensors * layer_bytes
    return engine


def prompt_keys(engine: Engine, prompt: list[int]) -> list[bytes]:
    """The rank-0 keys of the prompt's full blocks (what the engine stores and looks up)."""
    request = Request("probe", prompt, SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    core = engine.connector._scheduler
    return core._keys(core.groups[0], request.block_hashes)


def stored_tokens(engine: Engine, prompt: list[int]) -> int:
    """Tokens of the longest prefix of `prompt` the CPU tier holds now, as every group can load
    it (the probe asks one token past the prompt: a lookup never answers the block holding a
    request's last token)."""
    core = engine.connector._scheduler
    request = Request("probe", prompt, SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    tokens = core.lookup("probe", request.block_hashes, 0, len(prompt) + 1)
    core._lookups.pop("probe")  # a probe, not an admission
    return tokens


def reload_blocks(engine: Engine, blocks: int) -> int:
    """Blocks a reload of a `blocks`-block prefix moves, over every KV cache group."""
    core = engine.connector._scheduler
    return sum(len(core._needed(group, 0, blocks)) for group in core.groups)


def total_stats(engine: Engine) -> OffloadStats:
    """The connector stats of every step so far, aggregated."""
    total = OffloadStats()
    for data in engine.stats:
        total.aggregate(CrossLayerOffloadConnector.build_kv_connector_stats(data))
    return total


def abort_while_loading(engine: Engine, req_id: str, other: tuple[str, list[int]],
                        steps: int) -> None:
    """Abort `req_id`, whose load is in flight, add `other` (id, prompt), which fits only in
    the aborted request's blocks, and step: the load may still write those blocks, so they stay
    held and `other` waits."""
    blocks = set(engine.scheduler.kv_cache_manager.get_block_ids(req_id)[0])
    engine.abort(req_id)
    engine.add(other[0], other[1], max_tokens=2)
    for _ in range(steps):
        engine.step()
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert all(pool.blocks[block].ref_cnt > 0 for block in blocks)
    assert not any(other[0] in w.states for w in engine.workers)


def on_planned_load(engine: Engine, action: Callable[[], None]) -> None:
    """Run `action` each time the engine's scheduler plans a load from a lookup hit: what it
    does to the remote tier lands between the lookup and the get."""
    core = engine.connector._scheduler
    plan_load = core.plan_load

    def plan_then_act(*args: object, **kwargs: object) -> dict[str, int]:
        planned = plan_load(*args, **kwargs)
        if planned.get("remote"):
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
