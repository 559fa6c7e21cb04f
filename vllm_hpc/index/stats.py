"""Counters for monitoring and tests; never read by any policy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CacheStats:
    # Admission sources.
    hits_device: int = 0
    """Admissions from a snapshot with nothing to copy from the host."""
    hits_host: int = 0
    """Admissions from a snapshot that restore something from the host."""
    misses: int = 0
    """Admissions from the root."""
    # Block commits.
    blocks_inserted: int = 0
    blocks_duplicate: int = 0
    blocks_adopted: int = 0
    # Snapshots.
    snapshots_published: int = 0
    snapshots_duplicate: int = 0
    taps_skipped_no_slot: int = 0
    host_writes_declined: int = 0
    """Block or snapshot writes that found no host room (they stay device-only)."""
    blocks_prefetched: int = 0
    """Host-only blocks copied to the device for a waiting request (§6.6)."""
    prefetched_blocks_used: int = 0
    """Prefetched blocks an admission then found on the device (prefetch hits)."""
    prefetches_skipped: int = 0
    """Prefetch attempts answered from the last fruitless one: nothing that could open a copy
    changed since."""
    # Evictions.
    device_evictions_backed: int = 0
    device_evictions_unbacked: int = 0
    slot_evictions: int = 0
    """Snapshots that lost their device slot to a newer snapshot, a running request or KV."""
    state_rows_from_kv: int = 0
    """Rows of KV pages that became a state (their cached pages evicted first)."""
    host_backed_evicted: int = 0
    """Host copies dropped because the disk holds them too (nothing lost)."""
    host_dead_reclaimed: int = 0
    host_superseded_evicted: int = 0
    host_gdsf_evicted: int = 0
    disk_dead_reclaimed: int = 0
    disk_superseded_evicted: int = 0
    disk_gdsf_evicted: int = 0
    # The disk tier's transfers.
    disk_writes: int = 0
    """Snapshots (with the blocks of their paths not on disk yet) planned for disk."""
    disk_writes_declined: int = 0
    """Disk writes that found no disk room worth taking (the snapshot stays off disk)."""
    disk_writes_failed: int = 0
    disk_reads: int = 0
    """Snapshots (with the disk-only blocks of their paths) planned to read into the host."""
    disk_reads_declined: int = 0
    """Reads the host tier had no room for now (its slabs pinned by transfers in flight and
    kept reads): their requests are served without the disk."""
    disk_reads_failed: int = 0
    """Reads that did not land (a record failed its check, or a read error)."""
    disk_records_dropped: int = 0
    """Disk copies of records that failed a read's check, dropped (with what hangs from them
    where they were last copies)."""
    nodes_deleted: int = 0
    snapshots_deleted: int = 0
