"""What the cache reports for monitoring: cumulative counters and current levels.

Read by the vLLM glue once per engine step, so everything here is O(1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class AdmissionCounters:
    """Tokens of admitted requests, by where their prefix came from."""

    prompt_tokens: int = 0
    hit_tokens_device: int = 0
    """Tokens served from a snapshot (and its blocks) resident on the device."""
    hit_tokens_host: int = 0
    """Tokens served from a snapshot restored (in part) from the host tier."""
    hit_tokens_disk: int = 0
    """Tokens served from a snapshot read (in part) from the disk tier, then restored from the
    host tier."""
    coalesced_requests: int = 0
    """Queue heads admitted after waiting for a running sibling's snapshot (§12.2); requests
    queued behind a waiting head are not counted."""
    disk_reads_ahead: int = 0
    """Reads from the disk tier planned for waiting requests before vLLM reached them
    (`Admission.read_ahead`)."""


@dataclass(slots=True)
class HostCounters:
    """Bytes the host tier moves, as planned (the workers copy them before the next step ends)."""

    write_bytes: int = 0
    restore_bytes: int = 0


@dataclass(slots=True)
class DiskCounters:
    """Bytes the disk tier moved: write batches every worker reported durable, read batches
    every worker reported checked."""

    write_bytes: int = 0
    read_bytes: int = 0


@dataclass(slots=True)
class AuditCounters:
    """The cache audit's comparisons (`--cache-audit-rate`, `glue/scheduler/cache_audit.py`)."""

    audit_checked: int = 0
    """Audited prompts whose recomputation from the root was compared with the cached path."""
    audit_diverged_device: int = 0
    """Of those, answers that parted beyond the near-tie rule, resumed from the device."""
    audit_diverged_host: int = 0
    """The same, resumed with a restore from the host tier."""


@dataclass(frozen=True, slots=True)
class Metric:
    """One value the cache reports, and the Prometheus series that shows it (`glue/metrics.py`
    builds the series from this registry; counters travel as increments, levels as values)."""

    name: str
    """Its key in `HybridPrefixCache.telemetry()` and in the stats vLLM carries each step."""
    family: str
    """Prometheus name, in vLLM's namespace; counters of one family differ by ``label``."""
    doc: str
    label: tuple[str, str] | None = None


def _by(label: str, family: str, doc: str, **names: str) -> tuple[Metric, ...]:
    """One family's counters, keyed by label value: ``value=name``."""
    return tuple(Metric(name, family, doc, (label, value)) for value, name in names.items())


ADMISSION = (
    Metric("prompt_tokens", "vllm:hpc_prompt_tokens", "Prompt tokens of admitted requests"),
    *_by(
        "source",
        "vllm:hpc_hit_tokens",
        "Prompt tokens served from the hybrid prefix cache",
        device="hit_tokens_device",
        host="hit_tokens_host",
        disk="hit_tokens_disk",
    ),
    Metric(
        "coalesced_requests",
        "vllm:hpc_coalesced_requests",
        "Queue heads admitted after waiting for a running request's snapshot of their prefix",
    ),
    Metric(
        "disk_reads_ahead",
        "vllm:hpc_disk_reads_ahead",
        "Reads from the disk tier planned for waiting requests before their turn",
    ),
)
"""`AdmissionCounters` fields."""
INDEX = (
    *_by(
        "outcome",
        "vllm:hpc_blocks_committed",
        "Blocks committed",
        inserted="blocks_inserted",
        duplicate="blocks_duplicate",
    ),
    Metric("snapshots_published", "vllm:hpc_snapshots_published", "Snapshots published"),
    Metric(
        "snapshots_duplicate",
        "vllm:hpc_snapshots_duplicate",
        "Snapshot publications that found an identical snapshot",
    ),
    Metric(
        "taps_skipped_no_slot",
        "vllm:hpc_taps_skipped",
        "Taps and endpoints skipped for want of a snapshot slot",
    ),
    *_by(
        "what",
        "vllm:hpc_evictions",
        "Cache evictions",
        page_backed="device_evictions_backed",
        page_unbacked="device_evictions_unbacked",
        snapshot_slot="slot_evictions",
        node="nodes_deleted",
        snapshot="snapshots_deleted",
        host_dead_block="host_dead_reclaimed",
        host_superseded_snapshot="host_superseded_evicted",
        host_snapshot="host_gdsf_evicted",
    ),
    Metric(
        "host_writes_declined",
        "vllm:hpc_host_writes_declined",
        "Write-through batches the host tier had no room for",
    ),
    Metric(
        "disk_writes_failed",
        "vllm:hpc_disk_writes_failed",
        "Snapshots whose write-behind a worker failed to make durable (nothing journaled)",
    ),
    Metric(
        "disk_reads_declined",
        "vllm:hpc_disk_reads_declined",
        "Reads from the disk tier the host tier had no room for (their requests recompute)",
    ),
    Metric(
        "disk_reads_failed",
        "vllm:hpc_disk_reads_failed",
        "Reads from the disk tier that did not land (their requests recompute)",
    ),
    Metric(
        "disk_records_dropped",
        "vllm:hpc_disk_records_dropped",
        "Disk tier records that failed a read's check, dropped",
    ),
    Metric(
        "blocks_prefetched",
        "vllm:hpc_host_prefetched_blocks",
        "Host-only blocks copied to the device while their request waited at the queue's head",
    ),
    Metric(
        "prefetched_blocks_used",
        "vllm:hpc_host_prefetch_hits",
        "Prefetched blocks an admission then found on the device",
    ),
    Metric(
        "prefetches_skipped",
        "vllm:hpc_host_prefetches_skipped",
        "Steps whose prefetch for the blocked head was answered from the last fruitless attempt",
    ),
)
"""`vllm_hpc.index.CacheStats` fields reported."""
HOST = _by(
    "what",
    "vllm:hpc_host_bytes",
    "Bytes moved by the host tier",
    written="host_write_bytes",
    restored="host_restore_bytes",
)
"""`HostCounters` fields, prefixed ``host_``."""
DISK = _by(
    "what",
    "vllm:hpc_disk_bytes",
    "Bytes moved by the disk tier",
    written="disk_write_bytes",
    read="disk_read_bytes",
)
"""`DiskCounters` fields, prefixed ``disk_``."""
AUDIT = (
    Metric(
        "audit_checked",
        "vllm:hpc_audit_checked",
        "Sampled resumed prompts recomputed from the root and compared (--cache-audit-rate)",
    ),
    *_by(
        "source",
        "vllm:hpc_audit_diverged",
        "Audited prompts whose greedy answer from the cache parted from the recomputation",
        device="audit_diverged_device",
        host="audit_diverged_host",
    ),
)
"""`AuditCounters` fields."""
COUNTERS = ADMISSION + INDEX + HOST + DISK + AUDIT
"""The cache's monotonic counters."""
WORKER_COUNTERS = (
    *_by(
        "what",
        "vllm:hpc_host_transfer_seconds",
        "Seconds the host tier's copies took (copy stream time, measured by the workers)",
        written="host_write_seconds",
        restored="host_restore_seconds",
    ),
    Metric(
        "engine_thread_host_seconds",
        "vllm:hpc_engine_thread_host_seconds",
        "Wall seconds the engine thread spent issuing and checking the host tier's copies",
    ),
)
"""Counters the workers measure (`glue.worker.transfer_meter.TransferMeter` and
`glue.worker.call_clock.HostCallClock`), beside the cache's."""


def _level(name: str, doc: str) -> Metric:
    return Metric(name, f"vllm:hpc_{name}", doc)


LEVELS = (
    _level("snapshots", "Snapshots held"),
    _level("snapshot_slots_used", "Device snapshot slots in use"),
    _level("active_slots_used", "Active state slots in use (running requests)"),
    _level("device_pages_free", "Free device KV pages"),
    _level("device_pages_evictable", "Cached device KV pages no request holds (evictable)"),
    _level("device_pages_state", "Device pages holding states (running requests, snapshots)"),
    _level("host_bytes_blocks", "Host tier bytes holding KV blocks"),
    _level("host_bytes_images", "Host tier bytes holding snapshot state images"),
    _level("host_bytes_tails", "Host tier bytes holding snapshot tail pages"),
    _level("host_bytes_free", "Free host tier bytes"),
    _level("disk_bytes_used", "Disk tier bytes holding blocks, images and tails"),
    _level("disk_bytes_free", "Free disk tier bytes"),
)
"""The cache's current values."""
WORKER_LEVELS = (
    _level("host_write_bytes_per_second", "Bandwidth of the write-through copies that landed last"),
    _level(
        "host_restore_bytes_per_second",
        "Bandwidth of the restores and prefetches that landed last",
    ),
    _level(
        "engine_thread_host_longest_seconds",
        "Longest single host-tier call on the engine thread in the last reported period",
    ),
)
"""Levels the workers measure: the bandwidth of the copies that landed in the last step that
landed any, and the longest engine-thread call of the last period that timed one."""
