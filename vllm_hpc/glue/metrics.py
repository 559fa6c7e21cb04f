"""The cache's metrics in vLLM's stats pipeline: log lines and Prometheus (`/metrics`).

vLLM carries a KV connector's stats from the engine core to the front end every step and hands
them to the connector class's Prometheus recorder; the hybrid prefix cache reports through its
connector (`HybridPrefixConnector.get_kv_connector_stats`). Counters travel as increments since
the previous step, levels as current values.

Prometheus names (in vLLM's namespace, as its own connectors' metrics are, so vLLM's registry
handling covers them; all with vLLM's `model_name` and `engine` labels):
- `vllm:hpc_prompt_tokens` and `vllm:hpc_hit_tokens{source="device"|"host"|"disk"}`: admitted
  prompt tokens and those served from the cache, by source (disk: read back, then restored);
- `vllm:hpc_snapshots_published`, `vllm:hpc_snapshots_duplicate`, `vllm:hpc_taps_skipped`;
- `vllm:hpc_blocks_committed{outcome="inserted"|"duplicate"}`;
- `vllm:hpc_evictions{what="page_backed"|"page_unbacked"|"snapshot_slot"|"node"|"snapshot"}`;
- `vllm:hpc_host_bytes{what="written"|"restored"}` and, measured by the workers,
  `vllm:hpc_host_transfer_seconds{what=...}`: their ratio over any window is the host tier's
  copy bandwidth;
- `vllm:hpc_disk_bytes{what="written"|"read"}` (write-behind batches every worker made durable
  and the journal recorded; reads every worker checked), `vllm:hpc_disk_writes_failed`,
  `vllm:hpc_disk_reads_declined` (reads the host tier had no room for),
  `vllm:hpc_disk_reads_ahead` (reads planned for waiting requests before their turn),
  `vllm:hpc_disk_reads_failed` and `vllm:hpc_disk_records_dropped` (records a read found
  damaged);
- gauges `vllm:hpc_snapshots`, `vllm:hpc_snapshot_slots_used`, `vllm:hpc_active_slots_used`,
  `vllm:hpc_device_pages_free`, `vllm:hpc_device_pages_evictable`,
  `vllm:hpc_device_pages_state` (pages holding states: running requests', snapshots', the
  scratch row), host bytes by kind, `vllm:hpc_disk_bytes_{used,free}`, and
  `vllm:hpc_host_{write,restore}_bytes_per_second`: the bandwidth of the copies that landed in
  the last step that landed any.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from vllm_hpc.runtime.telemetry import COUNTERS, LEVELS, WORKER_COUNTERS, WORKER_LEVELS

_COUNTERS = {m.name: m for m in (*COUNTERS, *WORKER_COUNTERS)}
_HITS = [m.name for m in COUNTERS if m.family == "vllm:hpc_hit_tokens"]
"""`vllm:hpc_hit_tokens` by source: the cache's hits, wherever they came from."""
_LEVELS = {m.name: m for m in (*LEVELS, *WORKER_LEVELS)}


@dataclass
class HybridPrefixStats(KVConnectorStats):
    """Counter increments and current levels of one or more engine steps."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for name, value in other.data.items():
            merged[name] = merged.get(name, 0) + value if _is_counter(name) else value
        return HybridPrefixStats(merged)

    def reduce(self) -> dict[str, int | float]:
        summary: dict[str, int | float] = {k: v for k, v in self.data.items() if v}
        prompt = self.data.get("prompt_tokens", 0)
        if prompt:
            hits = sum(self.data.get(name, 0) for name in _HITS)
            summary["hit_rate"] = round(hits / prompt, 3)
        return summary

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in self.data if _is_counter(name))


def _is_counter(name: str) -> bool:
    return name in _COUNTERS


class HybridPrefixPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        families: dict[str, Any] = {}
        self._counters: dict[str, dict[int, Any]] = {}
        for name, metric in _COUNTERS.items():
            label = metric.label
            if metric.family not in families:
                labels = labelnames + ([label[0]] if label else [])
                families[metric.family] = self._counter_cls(
                    name=metric.family, documentation=metric.doc, labelnames=labels
                )
            per_engine = {
                engine: [*values, label[1]] if label else values
                for engine, values in per_engine_labelvalues.items()
            }
            self._counters[name] = create_metric_per_engine(families[metric.family], per_engine)
        self._levels = {
            name: create_metric_per_engine(
                self._gauge_cls(
                    name=metric.family,
                    documentation=metric.doc,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                ),
                per_engine_labelvalues,
            )
            for name, metric in _LEVELS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name][engine_idx].inc(value)
            elif name in self._levels:
                self._levels[name][engine_idx].set(value)
