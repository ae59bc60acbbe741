"""The connector's counter names (no vLLM imports): the core's, then each registered tier's."""

from __future__ import annotations

from kvconnector.offload.records import OffloadCounters
from transfer.registry import registered_tiers


def counter_names() -> dict[str, float]:
    """Every counter at 0: the core's, then each registered tier's as `<tier>_<name>`."""
    zeros = OffloadCounters().flat()
    for spec in registered_tiers():
        zeros.update({f"{spec.name}_{name}": 0 for name in spec.counters})
    return zeros
