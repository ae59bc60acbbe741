"""The disk tier as the connector registers it (transfer/registry.py): its option keys, its
settings, its size and its two parts."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transfer.disk.io import DiskIO
from transfer.disk.planner import WRITE_POLICIES, DiskPlanner, restored_blocks
from transfer.disk.slab import SlabFile, slot_bytes
from transfer.disk.worker import DiskWorker
from transfer.options import Option, check_choice
from transfer.tier import PlannerContext, TierSpec, WorkerContext

logger = logging.getLogger("vllm.kvconnector")  # an engine's log: vLLM's handler and level


@dataclass(frozen=True)
class DiskSettings:
    """disk_path: a directory on a local drive (O_DIRECT), one slab file per rank; disk_bytes:
    its size per worker; disk_write_policy: "evict" (blocks go to disk as the pool evicts them)
    or "through" (every block stored in the pool also goes to disk)."""

    path: str
    num_bytes: int
    write_policy: str

    @property
    def writes_stored(self) -> bool:
        return self.write_policy == "through"

    def num_slots(self, block_bytes: int) -> int:
        """Disk slots of `block_bytes` blocks (each rounded to 4 KiB, plus its footer)."""
        return self.num_bytes // slot_bytes(block_bytes)

    def sized(self, block_bytes: int) -> int:
        """`num_slots`, or ValueError when not one block fits."""
        num_slots = self.num_slots(block_bytes)
        if num_slots == 0:
            raise ValueError(f"disk_bytes {self.num_bytes} holds no block of {block_bytes} B "
                             f"(and its 4 KiB footer)")
        return num_slots


def disk_settings(values: Mapping[str, Any]) -> DiskSettings:
    path, num_bytes = values["disk_path"], values["disk_bytes"]
    if not isinstance(path, str) or not path:
        raise ValueError(f"disk_path must be a directory path, got {path!r}")
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes <= 0:
        raise ValueError(f"disk_path needs disk_bytes, a positive integer of bytes per "
                         f"worker; got {num_bytes!r}")
    return DiskSettings(path, num_bytes, values["disk_write_policy"])


def disk_planner(settings: DiskSettings, context: PlannerContext) -> DiskPlanner:
    """The disk tier's index, with the blocks every rank's slab still holds."""
    num_slots = settings.sized(context.slot_bytes)
    stored = restored_blocks(settings.path, context.namespace.digest,
                             [ns.digest for ns in context.rank_namespaces], num_slots)
    logger.info("CrossLayerOffloadConnector disk tier %s: %d slots, %d blocks found",
                settings.path, num_slots, len(stored))
    return DiskPlanner(context.namespace, num_slots, context.policy, settings.write_policy,
                       stored)


def disk_worker(settings: DiskSettings, context: WorkerContext) -> DiskWorker:
    """This rank's slab (its own keys: every rank writes its own file, even where the bytes are
    the same) and its I/O threads, bound to the pool's rows by the worker."""
    slab = SlabFile(settings.path, context.own_namespace.digest, context.part_bytes,
                    settings.sized(context.slot_bytes))
    return DiskWorker(DiskIO(slab, None), context.rank)


DISK_TIER = TierSpec(
    name="disk",
    # disk_path and disk_bytes are checked by disk_settings, with messages of their own
    options={"disk_path": Option(None), "disk_bytes": Option(None),
             "disk_write_policy": Option("evict", lambda key, value: check_choice(
                 key, value, WRITE_POLICIES))},
    enabled_by="disk_path",
    settings=disk_settings,
    make_planner=disk_planner,
    make_worker=disk_worker,
    counters=("hit_tokens", "read_bytes", "read_seconds", "write_bytes", "write_seconds",
              "failed_reads", "failed_writes", "evictions"),
    hit_source="DISK",
    order=10,
    per_key_lookups=True,
    stored_writes=("disk_write_policy", "through"),
    event_medium="STORAGE",
)
