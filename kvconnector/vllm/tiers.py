"""An engine's tiers as the connector sizes them, alike on the scheduler and every worker: the
slot of one block, the host pool's and the disk's slot counts, the key namespace and the KV
cache groups, worked out from vLLM's config and the connector's options; configurations the
tiers cannot serve are refused here (ValueError at start). And the disk tier's index, with the
blocks its slabs still hold.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from kvconnector.layout.descriptor import HOST_ALIGNMENT, round_up
from kvconnector.offload.disk_tier import DiskPlanner, DiskSettings, restored_blocks
from kvconnector.offload.groups import CacheGroup
from kvconnector.offload.remote_tier import RemoteSettings
from kvconnector.vllm.groups import cache_groups, offloaded_spec
from kvconnector.vllm.namespace import disk_namespace, engine_namespace, with_groups
from kvconnector.vllm.options import ConnectorOptions
from transfer.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger("vllm.kvconnector")  # under vLLM's logger: its handler and level apply


@dataclass(frozen=True)
class EngineTiers:
    """What every tier of one engine holds and how its blocks are keyed."""

    block_size: int  # tokens of a block
    slot_bytes: int  # one block of one rank, every layer of the largest stage
    num_slots: int  # of the private host pool; 0 with a shared pool (the daemon's count)
    namespace: Namespace
    groups: list[CacheGroup]
    remote: RemoteSettings | None
    disk: DiskSettings | None
    num_disk_slots: int  # per rank; 0 without a disk tier
    # groups whose blocks vLLM frees while the request runs (stores reading them: flushed)
    windowed: bool


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
    remote = options.remote()
    if remote is not None and len(groups) > 1:
        # The store answers a lookup with a count of leading keys; a state group keeps states
        # only where steps ended, so several groups need an answer per key.
        raise ValueError(f"remote_url with {len(groups)} KV cache groups is not supported "
                         f"(one group only)")
    cached = cache_groups(kv_cache_config)
    parallel = vllm_config.parallel_config
    namespace = with_groups(
        engine_namespace(vllm_config, spec, num_layers, parallel.tensor_parallel_size),
        [(g.kv_cache_spec, g.layer_names) for g in groups])
    disk = options.disk()
    num_disk_slots = 0
    if disk is not None:
        num_disk_slots = disk.num_slots(slot_bytes)
        if num_disk_slots == 0:
            raise ValueError(f"disk_bytes {disk.num_bytes} holds no block of "
                             f"{slot_bytes} B (and its 4 KiB footer)")
    if options.pool:
        # A shared slot holds one block of every rank, rank r's at r x slot_bytes: engines
        # with other PP sizes place ranks differently, so they get keys of their own.
        namespace = dataclasses.replace(
            namespace, salt=f"{namespace.salt}/pool:{parallel.world_size}x{slot_bytes}")
    return EngineTiers(spec.block_size, slot_bytes, num_slots, namespace, cached, remote, disk,
                       num_disk_slots, any(g.window is not None or g.state for g in cached))


def disk_planner(tiers: EngineTiers, vllm_config: VllmConfig,
                 eviction: str) -> DiskPlanner | None:
    """The disk tier's index, with the blocks every rank's slab still holds."""
    if tiers.disk is None:
        return None
    parallel = vllm_config.parallel_config
    digests = [disk_namespace(tiers.namespace, rank, parallel.tensor_parallel_size).digest
               for rank in range(parallel.world_size)]
    stored = restored_blocks(tiers.disk.path, tiers.namespace.digest, digests,
                             tiers.num_disk_slots)
    logger.info("CrossLayerOffloadConnector disk tier %s: %d slots, %d blocks found",
                tiers.disk.path, tiers.num_disk_slots, len(stored))
    return DiskPlanner(tiers.namespace, tiers.num_disk_slots, eviction,
                       tiers.disk.write_policy, parallel.world_size, stored)


def largest_pp_stage(vllm_config: VllmConfig) -> int:
    """Layers of the largest pipeline stage (0 without PP)."""
    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    if pp_size == 1:
        return 0
    from vllm.distributed.utils import get_pp_indices

    total = vllm_config.model_config.get_total_num_hidden_layers()
    return max(end - start for start, end in
               (get_pp_indices(total, rank, pp_size) for rank in range(pp_size)))
