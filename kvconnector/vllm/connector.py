"""vLLM adapter: `CrossLayerOffloadConnector`, a KV connector with a CPU tier of whole blocks.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "CrossLayerOffloadConnector",
        "kv_connector_module_path": "kvconnector.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes": 68719476736}}'

A thin layer over two vLLM-free cores: kvconnector.offload.scheduler (role SCHEDULER: which
blocks to load and store) and kvconnector.offload.worker (role WORKER, one per GPU: the pinned
pool and the copies). Extra-config keys: see `ConnectorOptions` and examples/vllm_serve.md.

Below the pool, every registered tier (transfer/registry.py) whose options are given: the disk
(`disk_path`, transfer/disk), a remote store or a Redis Cluster (`remote_url`, transfer/remote).
The adapter makes each tier's scheduler and worker parts from its settings and hands them to
the cores, which drive them through one contract (transfer/tier.py); its hits are reported as
the CacheHitSource the tier names.

With `pool`, the host's shared pool (transfer.shared, `kvconnector pool serve`) replaces the
private one: the scheduler's index is the daemon's, each worker maps the daemon's segment and
copies into its rank's part of each slot; the tiers compose below it as below a private pool
(the disk tier stays each engine's, each rank writing its part of the slots).

Supported: KV cache groups of full attention (MLA included), sliding window attention and
align-mode state (Mamba, short convolutions, linear attention), any TP/PP size, vLLM 0.32 and
0.33. `SupportsHMA`: vLLM keeps its hybrid KV cache manager on. Its groups share one block pool
and one set of buffers, so a host slot holds one physical block whichever group owns it (a
state group's bytes lie over the attention pages, which are what the worker copies); a group's
keys carry its index; the disk tier and a shared pool serve them too. Chunked local attention
groups, RSWA, and a remote store with several groups are refused (ValueError at start): the
store answers a lookup with a count of leading keys, and a state group's blocks are kept only
where steps ended.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvconnector.offload.admission import RequestLimits
from kvconnector.offload.jobs import JobReport, StepJobs
from kvconnector.offload.scheduler import POOL, OffloadScheduler
from kvconnector.offload.worker import OffloadWorker
from kvconnector.vllm.events import ConnectorEvents, events_enabled
from kvconnector.vllm.groups import state_layers
from kvconnector.vllm.layout_choice import (
    advise_block_outermost,
    check_resolved,
    layout_line,
    layout_request,
    resolved_backends,
)
from kvconnector.vllm.options import ConnectorOptions
from kvconnector.vllm.stats import OffloadPromMetrics, OffloadStats
from kvconnector.vllm.tiers import plan_tiers
from transfer.copy.base import CopyBackend
from transfer.copy.factory import make_backend
from transfer.registry import tier_spec
from transfer.shared.client import SharedIndex
from transfer.shared.mapping import SharedPart

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.kvconnector")  # under vLLM's logger: its handler and level apply

@dataclass
class OffloadConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    jobs: StepJobs


@dataclass
class OffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step; vLLM sums the ranks with `aggregate`."""

    report: JobReport

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, OffloadWorkerMetadata):
            raise ValueError(f"cannot aggregate {type(other).__name__} into a "
                             f"{type(self).__name__}")
        return OffloadWorkerMetadata(self.report.merged(other.report))


def _cores_warning(vllm_config: VllmConfig) -> str | None:
    """On vLLM's CPU build: a warning when its automatic thread binding gave this worker's
    OpenMP threads every core. For any KV connector it reserves one more core per rank (room for
    NIXL's threads) than without; where that is every core it reserves none, and the model's
    threads contend with the engine core's loop (time per output token in serving: 1.7-3x). This
    connector needs no core of its own: VLLM_CPU_NUM_OF_RESERVED_CPU set to the ranks gives
    back what vLLM reserves without a connector (examples/vllm_cpu.py sets it)."""
    parallel = vllm_config.parallel_config
    if os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") or parallel.distributed_executor_backend \
            != "mp" or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return None  # set by hand, or no engine core process of its own (its loop in this one)
    ranks = parallel.local_world_size
    if torch.get_num_threads() * ranks < (os.cpu_count() or 1):
        return None
    return (f"vLLM's CPU build reserved no core for its engine core with a KV connector: the "
            f"model's threads take all {os.cpu_count()} and contend with the engine core's "
            f"loop; this connector needs no core of its own: set "
            f"VLLM_CPU_NUM_OF_RESERVED_CPU={ranks} (as without a connector)")


class CrossLayerOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """KV connector with a CPU tier of whole blocks (see module doc)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.options = ConnectorOptions.parse(self._kv_transfer_config.kv_connector_extra_config)
        self._tiers = plan_tiers(vllm_config, kv_cache_config, self.options)
        self._layout_request = layout_request(vllm_config, self.options)
        self._scheduler: OffloadScheduler | None = None
        self._worker: OffloadWorker | None = None
        self._requests: dict[str, Request] = {}
        self._load_errors: set[int] = set()
        self._pool_index: SharedIndex | None = None
        self._hit_split: dict[str, dict[str, int]] = {}  # request -> tokens per source
        self._events: ConnectorEvents | None = None  # with vLLM's kv_events_config only
        if role == KVConnectorRole.SCHEDULER:
            tiers, world_size = self._tiers, vllm_config.parallel_config.world_size
            index = self._pool_index = None
            if self.options.pool:
                index = self._pool_index = SharedIndex(self.options.pool, tiers.namespace,
                                                       tiers.slot_bytes * world_size)
            try:
                planners = tiers.planners(vllm_config, self.options.eviction)
            except BaseException:
                if index is not None:
                    index.close()
                raise
            try:
                self._scheduler = OffloadScheduler(
                    tiers.namespace, index.num_slots if index else tiers.num_slots,
                    tiers.block_size, world_size, self.options.eviction, tiers=planners,
                    index=index, groups=tiers.groups, admission=self.options.admission(),
                    prefetch=self.options.prefetch())
            except BaseException:
                for planner in planners:
                    planner.close()
                if index is not None:
                    index.close()
                raise
            if index is not None and current_platform.is_cuda():
                # GPU workers check loads by row sums on the way: read the pool so from the
                # first request (a restarted engine is served blocks nobody hashed); a worker
                # that does not says so, and the core reads by xxh3 from then on.
                self._scheduler.read_by_row_sums()
            if events_enabled(vllm_config):
                self._events = ConnectorEvents(vllm_config, kv_cache_config, self._scheduler,
                                               list(tiers.settings), self.options.pool)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a store skipped is a later miss, nothing more

    # vLLM calls these two before any connector exists, and both check the options, so a bad key
    # stops vLLM at its first call into the connector with one line (ConnectorOptions.parse):
    # with full CUDA graphs (vLLM's default on CUDA) `requires_piecewise_for_cudagraph`, while it
    # builds its config in the launching process, before any engine process starts; otherwise
    # `get_required_kvcache_layout`, the engine core's first call, once the workers have loaded
    # the model (on a CPU examples/vllm_cpu.py checks the options before vLLM starts).

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        ConnectorOptions.parse(extra_config)
        return False  # blocks move before and after the forward, never inside a captured graph

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        return layout_request(vllm_config, ConnectorOptions.parse(extra))[0]

    # ---- worker side -------------------------------------------------------------------------

    def copy_backend(self, device: torch.device) -> CopyBackend:
        """The copy backend the worker uses (tests override it to hold or fail jobs)."""
        return make_backend(self.options.copy_backend, device)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        config = self._kv_cache_config
        asked, why = self._layout_request
        resolved = self._vllm_config.cache_config.kv_cache_layout
        kv_dtype = str(self._vllm_config.cache_config.cache_dtype)
        state = state_layers(config)  # a state layer's entry is a list of state views
        # A state layer's backend (Mamba, short convolutions, GDN) reads its own state tensors,
        # never the attention layout: only the attention layers' backends must read the views.
        backends = resolved_backends(self._vllm_config, [
            name for group in config.kv_cache_groups for name in group.layer_names
            if name not in state])
        check_resolved(asked, why, resolved, backends, kv_dtype)  # before any pool is made
        kv_caches = {name: tensor for name, tensor in kv_caches.items() if name not in state}
        device = next(iter(kv_caches.values())).device
        tiers = self._tiers
        self._worker = OffloadWorker(
            kv_caches, tiers.num_slots, cache_groups=[
                g.layer_names for g in config.kv_cache_groups
                if not isinstance(g.kv_cache_spec, MambaSpec)],
            num_blocks=config.num_blocks, backend=self.copy_backend(device),
            max_store_bytes=self.options.max_store_bytes,
            mapping=None if not self.options.pool else SharedPart(
                self.options.pool, self._vllm_config.parallel_config.rank * tiers.slot_bytes,
                self._vllm_config.parallel_config.rank, tiers.slot_bytes))
        for part in tiers.workers(self._vllm_config, config, self._worker.block_bytes):
            self._worker.attach(part)  # bound to the pool's rows there
        advise = advise_block_outermost(asked, backends, kv_dtype)
        how = self._worker.describe(advise)
        if len(config.kv_cache_groups) > 1:  # they share the buffers: one decision for all
            how = (f"KV cache groups ["
                   f"{', '.join(type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups)}"
                   f"] share each block; {how}")
        logger.info("%s", layout_line(self._vllm_config.parallel_config.rank, asked, why, resolved,
                                      backends, how))
        if device.type == "cpu" and (warning := _cores_warning(self._vllm_config)):
            logger.warning("%s", warning)

    def _jobs(self) -> StepJobs:
        if not isinstance(self._connector_metadata, OffloadConnectorMetadata):
            raise RuntimeError(f"no CrossLayerOffloadConnector metadata bound, got "
                               f"{type(self._connector_metadata).__name__}")
        return self._connector_metadata.jobs

    def _running_worker(self) -> OffloadWorker:
        if self._worker is None:
            raise RuntimeError("register_kv_caches has not been called on this worker")
        return self._worker

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(kv_connector_metadata, OffloadConnectorMetadata):
            raise ValueError(f"expected OffloadConnectorMetadata, got "
                             f"{type(kv_connector_metadata).__name__}")
        self._running_worker().flush(kv_connector_metadata.jobs)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._running_worker().start_loads(self._jobs())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: requests wait for them between steps

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # whole blocks are stored after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        self._running_worker().submit_stores(self._jobs())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        events = self._running_worker().poll()
        if len(self._tiers.groups) == 1:
            self._load_errors |= events.failed_block_ids
        # (several groups: block ids repeat across groups, so vLLM takes failed requests only,
        # and recomputes them whole, or fails them under the "fail" policy)
        return KVConnectorTransferResults(finished_sending=events.finished_sending,
                                          finished_recving=events.finished_loads,
                                          failed_recving=events.failed_loads)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> OffloadWorkerMetadata | None:
        if self._worker is None:
            return None
        report = self._worker.take_report()
        return None if report.is_empty() else OffloadWorkerMetadata(report)

    # Sleep mode (vLLM >= 0.33, whose `supports_sleep_mode` defaults to True, which holds here).
    # `restore_kv_caches` keeps the base class's no-op: the cumem allocator maps the KV cache
    # back at the same addresses, which the registered views still point at.
    def unregister_kv_caches(self) -> None:
        """Sleep: no copy may touch the KV cache while its memory is released."""
        if self._worker is not None:
            self._worker.drain()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._scheduler is not None:
            self._scheduler.close()  # the tiers' connections and threads
        if self._pool_index is not None:
            self._pool_index.close()  # the daemon releases what this engine still holds
            self._pool_index = None

    # ---- scheduler side ----------------------------------------------------------------------

    def _core(self) -> OffloadScheduler:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side method called on a worker-side connector")
        return self._scheduler

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request
        if self._events is not None:
            self._events.track(request)
        # The request's own limits (max_offload_tokens, max_load_tokens in kv_transfer_params)
        limits, ignored = RequestLimits.from_params(request.kv_transfer_params)
        for line in ignored:  # a client's bad value must not stop the engine
            logger.warning("request %s: kv_transfer_params %s", request.request_id, line)
        self._core().set_request_limits(request.request_id, limits)
        # its blocks below the pool start moving into it while it waits (when prefetch is on)
        self._core().prefetch(request.request_id, request.block_hashes, request.num_tokens)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        core = self._core()
        # None = "ask again later": a tier's answer is in flight (a late or failed one is 0).
        hits = core.lookup(request.request_id, request.block_hashes, num_computed_tokens,
                           request.num_tokens)
        return hits, bool(hits)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        split = self._core().plan_load(request.request_id, request.block_hashes,
                                       blocks.get_block_ids(), num_external_tokens)
        if set(split) - {POOL}:  # for get_external_cache_hit_sources, which vLLM calls next
            self._hit_split[request.request_id] = {
                source: blocks * self._tiers.block_size for source, blocks in split.items()}
        elif num_external_tokens:  # a new plan from the host pool alone (the 0-token call
            self._hit_split.pop(request.request_id, None)  # after a load keeps the last)

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        split = self._hit_split.get(request.request_id)
        if split is None or sum(split.values()) != num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        out: dict[CacheHitSource, int] = {}
        for name, tokens in split.items():
            source = CacheHitSource.HOST if name == POOL else \
                CacheHitSource[tier_spec(name).hit_source]
            out[source] = out.get(source, 0) + tokens
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        core = self._core()
        for req_id in scheduler_output.preempted_req_ids or ():
            core.request_preempted(req_id)
        scheduled = scheduler_output.num_scheduled_tokens
        if self._tiers.windowed:  # before this step's stores: only jobs already sent can be flushed
            core.flush_windows({req_id: r.num_computed_tokens + scheduled.get(req_id, 0)
                                for req_id, r in self._requests.items()})
        stores = []
        for req_id, num_new in scheduled.items():
            request = self._requests[req_id]
            stores.append((req_id, request.block_hashes,
                           self._kv_cache_manager.get_block_ids(req_id),
                           request.num_computed_tokens + num_new))
        core.plan_step_stores(stores)  # one call to the index for the whole step
        return OffloadConnectorMetadata(core.build_step())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, OffloadWorkerMetadata):
            self._core().complete(meta.report)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once a request finished in every group, with the blocks vLLM still holds
        (a sliding window group's freed ones are its null block)."""
        self._requests.pop(request.request_id, None)
        self._hit_split.pop(request.request_id, None)
        # The last sampled token's KV is never computed; positions before it all are.
        ready = min(request.num_computed_tokens, request.num_tokens - 1)
        held = self._core().request_finished(request.request_id, request.block_hashes,
                                             block_ids, ready)
        if self._events is not None:
            self._events.forget(request.request_id)
        return held, None

    def has_pending_push_work(self) -> bool:
        return self._core().has_jobs()  # keep stepping until every job is reported

    def take_events(self) -> Iterable[KVCacheEvent]:
        """This step's KV events of the connector's tiers (kvconnector/vllm/events.py)."""
        return () if self._events is None else self._events.take_events()

    def reset_cache(self) -> bool:
        self._core().reset()
        return True

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._scheduler is None:
            return None
        stats = OffloadStats(self._scheduler.take_counters().flat())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return OffloadStats() if data is None else OffloadStats(dict(data))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics:
        return OffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

