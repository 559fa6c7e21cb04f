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
    coalesced_requests: int = 0
    """Queue heads admitted after waiting for a running sibling's snapshot (§12.2); requests
    queued behind a waiting head are not counted."""


@dataclass(slots=True)
class HostCounters:
    """Bytes the host tier moves, as planned (the workers copy them before the next step ends)."""

    write_bytes: int = 0
    restore_bytes: int = 0


ADMISSION_COUNTERS = ("prompt_tokens", "hit_tokens_device", "hit_tokens_host", "coalesced_requests")
HOST_COUNTERS = ("write_bytes", "restore_bytes")
INDEX_COUNTERS = (
    "blocks_inserted",
    "blocks_duplicate",
    "snapshots_published",
    "snapshots_duplicate",
    "taps_skipped_no_slot",
    "device_evictions_backed",
    "device_evictions_unbacked",
    "slot_evictions",
    "nodes_deleted",
    "snapshots_deleted",
    "host_dead_reclaimed",
    "host_superseded_evicted",
    "host_gdsf_evicted",
    "host_writes_declined",
    "blocks_prefetched",
    "prefetched_blocks_used",
    "prefetches_skipped",
)
"""`vllm_hpc.index.CacheStats` fields reported."""
COUNTERS = ADMISSION_COUNTERS + INDEX_COUNTERS + tuple(f"host_{n}" for n in HOST_COUNTERS)
"""Monotonic counters, reported as increments."""

LEVELS = (
    "snapshots",
    "snapshot_slots_used",
    "active_slots_used",
    "device_pages_free",
    "device_pages_evictable",
    "host_bytes_blocks",
    "host_bytes_images",
    "host_bytes_tails",
    "host_bytes_free",
)
"""Current values, reported as they are."""
