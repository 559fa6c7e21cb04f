"""The disk tier in a worker: its rank's `DiskStore`, fed each step's write-behind batches from
the host tier's slabs and its read batches into them, and the batches that ended, for the
scheduler (disk-tier plan §1, §2, §4).

The engine thread only hands batches to the store and polls them: the store's threads move the
bytes, checksum them and ``fdatasync`` writes. A batch the store has no room for yet (its bound
on batches in flight) waits here, in order, and is handed over at a later step. The index keeps
the host slabs of a batch pinned (a write's sources) or Filling (a read's destinations) until
the scheduler completes it, so nothing else touches them meanwhile.

Each rank reads its own slab file and checks each record against its own CRC-32 in the
journal; a record that fails (CRC mismatch, short read, I/O error) is logged and reported, and
the scheduler fails the read once every rank has reported.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from vllm_hpc.glue.connector_metadata import CheckedDiskRead, DiskReadReport, DiskWriteReport
from vllm_hpc.glue.worker.disk_store import (
    DiskHandle,
    DiskRecord,
    DiskSlabFile,
    DiskStore,
    ReadResult,
    WriteResult,
    disk_slab_path,
)
from vllm_hpc.glue.worker.host_arena import HostArena
from vllm_hpc.index.host_pool import DiskSlabPool
from vllm_hpc.index.types import SlabId
from vllm_hpc.runtime.plan import DiskWriteBatch, SlabRecord

logger = logging.getLogger("vllm.vllm_hpc")
R = TypeVar("R", WriteResult, ReadResult)


class RankDiskTier:
    def __init__(self, store: DiskStore, arena: HostArena, rank: int) -> None:
        self.store = store
        self.rank = rank
        self._arena = arena
        self._queued_writes: deque[DiskWriteBatch] = deque()
        self._queued_reads: deque[CheckedDiskRead] = deque()
        self._writing: list[tuple[int, DiskHandle[WriteResult]]] = []
        self._reading: list[tuple[int, DiskHandle[ReadResult]]] = []

    @classmethod
    def open(
        cls, directory: str, engine: int, rank: int, budget_bytes: int, arena: HostArena
    ) -> RankDiskTier:
        """Rank ``rank``'s slab file of engine core ``engine``, as many slabs as the index's
        disk pool has (`DiskTierError`, naming the option, where the filesystem cannot hold
        it)."""
        geometry = arena.grid.geometry
        slabs = DiskSlabPool(budget_bytes, geometry).capacity
        path = disk_slab_path(Path(directory), engine, rank)
        return cls(DiskStore(DiskSlabFile(path, geometry.slab_bytes, slabs)), arena, rank)

    def submit(self, writes: Sequence[DiskWriteBatch], reads: Sequence[CheckedDiskRead]) -> None:
        """Queue the step's batches and hand over what the store takes now."""
        self._queued_writes.extend(writes)
        self._queued_reads.extend(reads)
        self._hand_over()

    def ended(self) -> tuple[dict[int, DiskWriteReport], dict[int, DiskReadReport]]:
        """The batches that ended since the last call: a write's records' CRC-32s, or None for
        a batch that failed; a read's records that failed their check (logged)."""
        self._hand_over()
        writes: dict[int, DiskWriteReport] = {}
        ended_writes, self._writing = _ended(self._writing)
        for batch, result in ended_writes:
            if result.error is not None:
                logger.warning(
                    "hybrid-prefix disk tier: write batch %d failed: %s", batch, result.error
                )
                writes[batch] = None
            else:
                writes[batch] = result.crcs
        reads: dict[int, DiskReadReport] = {}
        ended_reads, self._reading = _ended(self._reading)
        for batch, got in ended_reads:
            for failure in got.failures:
                logger.warning(
                    "hybrid-prefix disk tier: read batch %d, record %d on rank %d: %s (%s)",
                    batch,
                    failure.record,
                    self.rank,
                    failure.reason.value,
                    failure.detail,
                )
            reads[batch] = tuple(failure.record for failure in got.failures)
        return writes, reads

    def _records(self, records: Sequence[SlabRecord]) -> list[DiskRecord]:
        return [
            DiskRecord(
                tuple(SlabId(slab) for slab in record.disk),
                tuple(memoryview(self._arena.slab(slab).numpy()) for slab in record.host),
            )
            for record in records
        ]

    def _hand_over(self) -> None:
        # Reads first: a request waits for each of them.
        while self._queued_reads:
            read = self._queued_reads[0]
            crcs = [record_crcs[self.rank] for record_crcs in read.crcs]
            handle = self.store.submit_read(self._records(read.records), crcs)
            if handle is None:  # the store's bound: again at a later step
                break
            self._queued_reads.popleft()
            self._reading.append((read.batch, handle))
        while self._queued_writes:
            batch = self._queued_writes[0]
            written = self.store.submit_write(self._records(batch.records))
            if written is None:
                return
            self._queued_writes.popleft()
            self._writing.append((batch.batch, written))


def _ended(
    pending: list[tuple[int, DiskHandle[R]]],
) -> tuple[list[tuple[int, R]], list[tuple[int, DiskHandle[R]]]]:
    """Batches whose handle has a result, and those still in flight (polled once each)."""
    ended: list[tuple[int, R]] = []
    still: list[tuple[int, DiskHandle[R]]] = []
    for batch, handle in pending:
        result = handle.poll()
        if result is None:
            still.append((batch, handle))
        else:
            ended.append((batch, result))
    return ended, still
