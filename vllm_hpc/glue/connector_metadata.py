"""What the two halves of `HybridPrefixConnector` send each other every step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_hpc.runtime.plan import (
    DiskWriteBatch,
    HostRestore,
    HostWrite,
    InPassCapture,
    SlabRecord,
    StateCopy,
)


@dataclass(frozen=True, slots=True)
class CheckedDiskRead:
    """A read from the disk tier (`vllm_hpc.runtime.plan.DiskReadBatch`) with each record's
    CRC-32 per tensor-parallel rank from the journal: each rank checks its own."""

    batch: int
    records: tuple[SlabRecord, ...]
    crcs: tuple[tuple[int, ...], ...]
    """Per record, one CRC-32 per rank."""


@dataclass
class StepMetadata(KVConnectorMetadata):
    """What the workers copy for one step (`vllm_hpc.runtime.plan`, less vLLM's page copies)."""

    state_zeros: list[int] = field(default_factory=list)
    state_copies: list[StateCopy] = field(default_factory=list)
    in_pass: list[InPassCapture] = field(default_factory=list)
    host_writes: list[HostWrite] = field(default_factory=list)
    host_restores: list[HostRestore] = field(default_factory=list)
    prefetches: list[HostRestore] = field(default_factory=list)
    disk_writes: list[DiskWriteBatch] = field(default_factory=list)
    disk_reads: list[CheckedDiskRead] = field(default_factory=list)


DiskWriteReport = tuple[int, ...] | None
"""One worker's end of a write-behind batch: a CRC-32 per record, durable; None: it failed."""
DiskReadReport = tuple[int, ...]
"""One worker's end of a read batch: the records (by place) that failed; empty: all passed."""
Report = TypeVar("Report")


@dataclass
class WritesLanded(KVConnectorWorkerMetadata):
    """Write-through batches that have landed, with how many workers reported each, and
    write-behind and read batches of the disk tier that ended, with each reporting worker's
    (tensor-parallel rank's) result."""

    batches: dict[int, int] = field(default_factory=dict)
    disk: dict[int, dict[int, DiskWriteReport]] = field(default_factory=dict)
    disk_reads: dict[int, dict[int, DiskReadReport]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, WritesLanded)
        merged = dict(self.batches)
        for batch, count in other.batches.items():
            merged[batch] = merged.get(batch, 0) + count
        return WritesLanded(
            merged, _by_rank(self.disk, other.disk), _by_rank(self.disk_reads, other.disk_reads)
        )


def _by_rank(
    one: dict[int, dict[int, Report]], other: dict[int, dict[int, Report]]
) -> dict[int, dict[int, Report]]:
    """Two workers' reports of disk batches, merged by batch and rank."""
    merged = {batch: dict(ranks) for batch, ranks in one.items()}
    for batch, ranks in other.items():
        merged.setdefault(batch, {}).update(ranks)
    return merged
