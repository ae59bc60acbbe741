"""The connector's counters as vLLM stats (OffloadStats) and Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvconnector.vllm.counters import counter_names

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_GAUGES = ("jobs_in_flight",)


@dataclass
class OffloadStats(KVConnectorStats):
    """OffloadCounters as vLLM stats: counters add up, the in-flight gauge keeps the latest and
    goes out with the next counter change."""

    def __post_init__(self) -> None:
        self.data = {**counter_names(), **self.data}

    def reset(self) -> None:
        self.data = counter_names()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = value if key in _GAUGES else self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        asked = d["hit_tokens"] + d["miss_tokens"]
        rates = {f"{name[:-6]}_GBps": round(d[name] / d[f"{name[:-6]}_seconds"] / 1e9, 2)
                 if d.get(f"{name[:-6]}_seconds") else 0.0
                 for name in d if name.endswith("_bytes") and f"{name[:-6]}_seconds" in d}
        return {
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()},
            "hit_rate": round(d["hit_tokens"] / asked, 4) if asked else 0.0,
            **rates,
        }

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if k not in _GAUGES)


class OffloadPromMetrics(KVConnectorPromMetrics):
    """Prometheus: one counter per OffloadCounters field (vllm:kvconnector_<name>), one gauge."""

    def __init__(self, vllm_config: VllmConfig,
                 metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, dict[int, PromMetric]] = {}
        for name in counter_names():
            kind = self._gauge_cls if name in _GAUGES else self._counter_cls
            metric = kind(name=f"vllm:kvconnector_{name}", labelnames=labelnames,
                          documentation=f"CrossLayerOffloadConnector tiers: {name}")
            self._metrics[name] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            metric = self._metrics[name][engine_idx]
            if name in _GAUGES:
                metric.set(value)
            elif value:
                metric.inc(value)
