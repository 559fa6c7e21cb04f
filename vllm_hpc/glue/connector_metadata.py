"""What the two halves of `HybridPrefixConnector` send each other every step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_hpc.runtime.plan import DiskWriteBatch, HostRestore, HostWrite, InPassCapture, StateCopy


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


DiskWriteReport = tuple[int, ...] | None
"""One worker's end of a write-behind batch: a CRC-32 per record, durable; None: it failed."""


@dataclass
class WritesLanded(KVConnectorWorkerMetadata):
    """Write-through batches that have landed, with how many workers reported each, and
    write-behind batches that ended, with each reporting worker's (tensor-parallel rank's)
    result."""

    batches: dict[int, int] = field(default_factory=dict)
    disk: dict[int, dict[int, DiskWriteReport]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, WritesLanded)
        merged = dict(self.batches)
        for batch, count in other.batches.items():
            merged[batch] = merged.get(batch, 0) + count
        disk = {batch: dict(ranks) for batch, ranks in self.disk.items()}
        for batch, ranks in other.disk.items():
            disk.setdefault(batch, {}).update(ranks)
        return WritesLanded(merged, disk)
