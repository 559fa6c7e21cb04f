"""The cache's metrics in vLLM's stats pipeline: log lines and Prometheus (`/metrics`).

vLLM carries a KV connector's stats from the engine core to the front end every step and hands
them to the connector class's Prometheus recorder; the hybrid prefix cache reports through its
connector (`HybridPrefixConnector.get_kv_connector_stats`). Counters travel as increments since
the previous step, levels as current values.

Prometheus names (in vLLM's namespace, as its own connectors' metrics are, so vLLM's registry
handling covers them; all with vLLM's `model_name` and `engine` labels):
- `vllm:hpc_prompt_tokens` and `vllm:hpc_hit_tokens{source="device"}`: admitted prompt tokens
  and those served from the cache, by source;
- `vllm:hpc_snapshots_published`, `vllm:hpc_snapshots_duplicate`, `vllm:hpc_taps_skipped`;
- `vllm:hpc_blocks_committed{outcome="inserted"|"duplicate"}`;
- `vllm:hpc_evictions{what="page_backed"|"page_unbacked"|"snapshot_slot"|"node"|"snapshot"}`;
- `vllm:hpc_host_bytes{what="written"|"restored"}` and, measured by the workers,
  `vllm:hpc_host_transfer_seconds{what=...}`: their ratio over any window is the host tier's
  copy bandwidth;
- gauges `vllm:hpc_snapshots`, `vllm:hpc_snapshot_slots_used`, `vllm:hpc_active_slots_used`,
  `vllm:hpc_device_pages_free`, `vllm:hpc_device_pages_evictable`, host bytes by kind, and
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

from vllm_hpc.glue.host_arena import TransferHandle
from vllm_hpc.runtime.telemetry import COUNTERS, LEVELS

# counter name -> (Prometheus name, documentation, label name, label value)
_COUNTER_METRICS = {
    "prompt_tokens": ("vllm:hpc_prompt_tokens", "Prompt tokens of admitted requests", None, None),
    "hit_tokens_device": (
        "vllm:hpc_hit_tokens",
        "Prompt tokens served from the hybrid prefix cache",
        "source",
        "device",
    ),
    "hit_tokens_host": (
        "vllm:hpc_hit_tokens",
        "Prompt tokens served from the hybrid prefix cache",
        "source",
        "host",
    ),
    "host_write_bytes": ("vllm:hpc_host_bytes", "Bytes moved by the host tier", "what", "written"),
    "host_restore_bytes": (
        "vllm:hpc_host_bytes",
        "Bytes moved by the host tier",
        "what",
        "restored",
    ),
    "host_write_seconds": (
        "vllm:hpc_host_transfer_seconds",
        "Seconds the host tier's copies took (copy stream time, measured by the workers)",
        "what",
        "written",
    ),
    "host_restore_seconds": (
        "vllm:hpc_host_transfer_seconds",
        "Seconds the host tier's copies took (copy stream time, measured by the workers)",
        "what",
        "restored",
    ),
    "host_dead_reclaimed": ("vllm:hpc_evictions", "Cache evictions", "what", "host_dead_block"),
    "host_superseded_evicted": (
        "vllm:hpc_evictions",
        "Cache evictions",
        "what",
        "host_superseded_snapshot",
    ),
    "host_gdsf_evicted": ("vllm:hpc_evictions", "Cache evictions", "what", "host_snapshot"),
    "host_writes_declined": (
        "vllm:hpc_host_writes_declined",
        "Write-through batches the host tier had no room for",
        None,
        None,
    ),
    "blocks_prefetched": (
        "vllm:hpc_host_prefetched_blocks",
        "Host-only blocks copied to the device while their request waited at the queue's head",
        None,
        None,
    ),
    "prefetched_blocks_used": (
        "vllm:hpc_host_prefetch_hits",
        "Prefetched blocks an admission then found on the device",
        None,
        None,
    ),
    "prefetches_skipped": (
        "vllm:hpc_host_prefetches_skipped",
        "Steps whose prefetch for the blocked head was answered from the last fruitless attempt",
        None,
        None,
    ),
    "coalesced_requests": (
        "vllm:hpc_coalesced_requests",
        "Queue heads admitted after waiting for a running request's snapshot of their prefix",
        None,
        None,
    ),
    "blocks_inserted": ("vllm:hpc_blocks_committed", "Blocks committed", "outcome", "inserted"),
    "blocks_duplicate": ("vllm:hpc_blocks_committed", "Blocks committed", "outcome", "duplicate"),
    "snapshots_published": ("vllm:hpc_snapshots_published", "Snapshots published", None, None),
    "snapshots_duplicate": (
        "vllm:hpc_snapshots_duplicate",
        "Snapshot publications that found an identical snapshot",
        None,
        None,
    ),
    "taps_skipped_no_slot": (
        "vllm:hpc_taps_skipped",
        "Taps and endpoints skipped for want of a snapshot slot",
        None,
        None,
    ),
    "device_evictions_backed": ("vllm:hpc_evictions", "Cache evictions", "what", "page_backed"),
    "device_evictions_unbacked": ("vllm:hpc_evictions", "Cache evictions", "what", "page_unbacked"),
    "slot_evictions": ("vllm:hpc_evictions", "Cache evictions", "what", "snapshot_slot"),
    "nodes_deleted": ("vllm:hpc_evictions", "Cache evictions", "what", "node"),
    "snapshots_deleted": ("vllm:hpc_evictions", "Cache evictions", "what", "snapshot"),
}
_LEVEL_DOCS = {
    "snapshots": "Snapshots held",
    "snapshot_slots_used": "Device snapshot slots in use",
    "active_slots_used": "Active state slots in use (running requests)",
    "device_pages_free": "Free device KV pages",
    "device_pages_evictable": "Cached device KV pages no request holds (evictable)",
    "host_bytes_blocks": "Host tier bytes holding KV blocks",
    "host_bytes_images": "Host tier bytes holding snapshot state images",
    "host_bytes_tails": "Host tier bytes holding snapshot tail pages",
    "host_bytes_free": "Free host tier bytes",
    "host_write_bytes_per_second": "Bandwidth of the write-through copies that landed last",
    "host_restore_bytes_per_second": "Bandwidth of the restores and prefetches that landed last",
}
TRANSFER_COUNTERS = ("host_write_seconds", "host_restore_seconds")
"""Counters the workers report (`TransferMeter`), beside the cache's `COUNTERS`."""


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
            hits = self.data.get("hit_tokens_device", 0) + self.data.get("hit_tokens_host", 0)
            summary["hit_rate"] = round(hits / prompt, 3)
        return summary

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in self.data if _is_counter(name))


def _is_counter(name: str) -> bool:
    return name in COUNTERS or name in TRANSFER_COUNTERS


class TelemetryReader:
    """Turns the cache's cumulative counters into per-step increments."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def read(self, values: dict[str, int]) -> HybridPrefixStats | None:
        data: dict[str, int] = {name: values[name] for name in LEVELS}
        changed = False
        for name in COUNTERS:
            delta = values[name] - self._last.get(name, 0)
            data[name] = delta
            changed |= delta != 0
        if not changed and all(values[n] == self._last.get(n) for n in LEVELS):
            return None
        self._last = dict(values)
        return HybridPrefixStats(data)


class TransferMeter:
    """Worker side: the host tier's copy batches that have landed, as seconds and bandwidth."""

    def __init__(self) -> None:
        self._pending: list[tuple[str, TransferHandle]] = []
        self.totals: dict[str, tuple[int, float]] = {"write": (0, 0.0), "restore": (0, 0.0)}
        """Bytes and seconds of every batch read so far, by kind (benchmarks read these)."""

    def track(self, kind: str, handle: TransferHandle) -> None:
        """``kind``: "write" or "restore" (prefetches are restores)."""
        if handle.nbytes:
            self._pending.append((kind, handle))

    def read(self) -> HybridPrefixStats | None:
        """The batches that landed since the last read, or None if none did."""
        landed: list[tuple[str, TransferHandle]] = []
        waiting: list[tuple[str, TransferHandle]] = []
        for entry in self._pending:
            (landed if entry[1].done() else waiting).append(entry)
        self._pending = waiting
        if not landed:
            return None
        data: dict[str, float] = {}
        for kind in ("write", "restore"):
            handles = [handle for k, handle in landed if k == kind]
            if not handles:
                continue
            seconds = sum(handle.timing.seconds() for handle in handles)
            nbytes = sum(handle.nbytes for handle in handles)
            total_bytes, total_seconds = self.totals[kind]
            self.totals[kind] = (total_bytes + nbytes, total_seconds + seconds)
            data[f"host_{kind}_seconds"] = seconds
            if seconds > 0:
                data[f"host_{kind}_bytes_per_second"] = nbytes / seconds
        return HybridPrefixStats(data)


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
        for name, (metric, doc, label, value) in _COUNTER_METRICS.items():
            if metric not in families:
                labels = labelnames + ([label] if label else [])
                families[metric] = self._counter_cls(
                    name=metric, documentation=doc, labelnames=labels
                )
            family = families[metric]
            per_engine = {
                engine: [*values, value] if label else values
                for engine, values in per_engine_labelvalues.items()
            }
            self._counters[name] = create_metric_per_engine(family, per_engine)
        self._levels = {
            name: create_metric_per_engine(
                self._gauge_cls(
                    name=f"vllm:hpc_{name}",
                    documentation=doc,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                ),
                per_engine_labelvalues,
            )
            for name, doc in _LEVEL_DOCS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name][engine_idx].inc(value)
            elif name in self._levels:
                self._levels[name][engine_idx].set(value)
