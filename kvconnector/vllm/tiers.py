"""An engine's tiers as the connector sizes them, alike on the scheduler and every worker: the
slot of one block, the host pool's slot count, the key namespace and the KV cache groups, worked
out from vLLM's config and the connector's options, and each registered tier's settings and the
contexts its two parts are made with. Configurations the tiers cannot serve are refused here
(ValueError at start).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvconnector.layout.descriptor import HOST_ALIGNMENT, round_up
from kvconnector.offload.groups import CacheGroup
from kvconnector.vllm.groups import cache_groups, offloaded_spec
from kvconnector.vllm.namespace import (
    engine_namespace,
    own_namespace,
    rank_namespace,
    with_groups,
)
from kvconnector.vllm.options import ConnectorOptions
from transfer.keys import Namespace
from transfer.registry import tier_spec
from transfer.tier import PlannerContext, TierPlanner, TierSpec, TierWorker, WorkerContext

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class EngineTiers:
    """What every tier of one engine holds and how its blocks are keyed."""

    block_size: int  # tokens of a block
    slot_bytes: int  # one block of one rank, every layer of the largest stage
    num_slots: int  # of the private host pool; 0 with a shared pool (the daemon's count)
    namespace: Namespace
    groups: list[CacheGroup]
    settings: dict[str, Any]  # each tier below the pool that is on -> its settings, in order
    # groups whose blocks vLLM frees while the request runs (stores reading them: flushed)
    windowed: bool

    def planners(self, vllm_config: VllmConfig, eviction: str) -> list[TierPlanner]:
        """The scheduler's part of every tier that is on (closed again if one fails)."""
        parallel = vllm_config.parallel_config
        context = PlannerContext(
            self.namespace, parallel.world_size, self.slot_bytes, eviction,
            tuple(own_namespace(self.namespace, rank, parallel.tensor_parallel_size)
                  for rank in range(parallel.world_size)))
        return self._made(lambda spec, settings: spec.make_planner(settings, context))

    def workers(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                part_bytes: int) -> list[TierWorker]:
        """This worker's part of every tier that is on; `part_bytes`: its block's bytes."""
        parallel = vllm_config.parallel_config
        common, writes = rank_namespace(self.namespace, offloaded_spec(kv_cache_config),
                                        parallel)
        context = WorkerContext(parallel.rank, part_bytes, self.slot_bytes,
                                own_namespace(self.namespace, parallel.rank,
                                              parallel.tensor_parallel_size), common, writes)
        return self._made(lambda spec, settings: spec.make_worker(settings, context))

    def _made(self, make: Callable[[TierSpec, Any], Any]) -> list[Any]:
        """`make(spec, settings)` for every tier that is on, in order; those made are closed
        again if one fails."""
        made: list[Any] = []
        try:
            for name, settings in self.settings.items():
                made.append(make(tier_spec(name), settings))
        except BaseException:
            for part in made:
                part.close()
            raise
        return made


def plan_tiers(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
               options: ConnectorOptions) -> EngineTiers:
    """The engine's tiers (see module doc)."""
    spec = offloaded_spec(kv_cache_config)
    groups = kv_cache_config.kv_cache_groups
    # Groups share the buffers: a physical block holds the largest group's layers.
    num_layers = max(len(g.layer_names) for g in groups)
    # The scheduler counts slots for every worker but sees stage 0's layers only; under PP
    # stages differ (62 layers / 4 -> 15, 16, 16, 15), so size slots by the largest stage.
    slot_layers = max(num_layers, largest_pp_stage(vllm_config))
    slot_bytes = round_up(spec.page_size_bytes * slot_layers, HOST_ALIGNMENT)
    num_slots = 0 if options.pool else options.cpu_bytes // slot_bytes
    if num_slots == 0 and not options.pool:
        raise ValueError(f"cpu_bytes {options.cpu_bytes} holds no block of {slot_bytes} B")
    settings = options.tier_settings()
    for name in settings:
        tier = tier_spec(name)
        if len(groups) > 1 and not tier.per_key_lookups:
            # A tier answering a count of leading keys cannot serve several groups: a state
            # group keeps states only where steps ended, so they need an answer per key.
            raise ValueError(f"{tier.enabled_by} with {len(groups)} KV cache groups is not "
                             f"supported (one group only)")
    cached = cache_groups(kv_cache_config)
    parallel = vllm_config.parallel_config
    namespace = with_groups(
        engine_namespace(vllm_config, spec, num_layers, parallel.tensor_parallel_size),
        [(g.kv_cache_spec, g.layer_names) for g in groups])
    if options.pool:
        # A shared slot holds one block of every rank, rank r's at r x slot_bytes: engines
        # with other PP sizes place ranks differently, so they get keys of their own.
        namespace = dataclasses.replace(
            namespace, salt=f"{namespace.salt}/pool:{parallel.world_size}x{slot_bytes}")
    return EngineTiers(spec.block_size, slot_bytes, num_slots, namespace, cached, settings,
                       any(g.window is not None or g.state for g in cached))


def largest_pp_stage(vllm_config: VllmConfig) -> int:
    """Layers of the largest pipeline stage (0 without PP)."""
    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    if pp_size == 1:
        return 0
    from vllm.distributed.utils import get_pp_indices

    total = vllm_config.model_config.get_total_num_hidden_layers()
    return max(end - start for start, end in
               (get_pp_indices(total, rank, pp_size) for rank in range(pp_size)))
