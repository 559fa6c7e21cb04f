"""The disk tier in a worker: its rank's `DiskStore`, fed each step's write-behind batches from
the host tier's slabs, and the batches that ended, for the scheduler (disk-tier plan §1, §2).

The engine thread only hands batches to the store and polls them: the store's threads write,
checksum and ``fdatasync``. A batch the store has no room for yet (its bound on batches in
flight) waits here, in order, and is handed over at a later step. The index keeps the host
slabs of a batch pinned until the scheduler completes it, so they hold its bytes meanwhile.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from vllm_hpc.glue.connector_metadata import DiskWriteReport
from vllm_hpc.glue.worker.disk_store import (
    DiskHandle,
    DiskRecord,
    DiskSlabFile,
    DiskStore,
    WriteResult,
    disk_slab_path,
)
from vllm_hpc.glue.worker.host_arena import HostArena
from vllm_hpc.index.host_pool import DiskSlabPool
from vllm_hpc.index.types import SlabId
from vllm_hpc.runtime.plan import DiskWriteBatch

logger = logging.getLogger("vllm.vllm_hpc")


class DiskWriter:
    def __init__(self, store: DiskStore, arena: HostArena) -> None:
        self.store = store
        self._arena = arena
        self._queued: deque[DiskWriteBatch] = deque()
        self._writing: list[tuple[int, DiskHandle[WriteResult]]] = []

    @classmethod
    def open(
        cls, directory: str, engine: int, rank: int, budget_bytes: int, arena: HostArena
    ) -> DiskWriter:
        """Rank ``rank``'s slab file of engine core ``engine``, as many slabs as the index's
        disk pool has (`DiskTierError`, naming the option, where the filesystem cannot hold
        it)."""
        geometry = arena.grid.geometry
        slabs = DiskSlabPool(budget_bytes, geometry).capacity
        path = disk_slab_path(Path(directory), engine, rank)
        return cls(DiskStore(DiskSlabFile(path, geometry.slab_bytes, slabs)), arena)

    def submit(self, batches: Sequence[DiskWriteBatch]) -> None:
        """Queue the step's batches and hand over what the store takes now."""
        self._queued.extend(batches)
        self._hand_over()

    def ended(self) -> dict[int, DiskWriteReport]:
        """The batches that ended since the last call: their records' CRC-32s, or None for a
        batch that failed (logged)."""
        self._hand_over()
        reports: dict[int, DiskWriteReport] = {}
        writing = []
        for batch, handle in self._writing:
            result = handle.poll()
            if result is None:
                writing.append((batch, handle))
            elif result.error is not None:
                logger.warning(
                    "hybrid-prefix disk tier: write batch %d failed: %s", batch, result.error
                )
                reports[batch] = None
            else:
                reports[batch] = result.crcs
        self._writing = writing
        return reports

    def _hand_over(self) -> None:
        while self._queued:
            batch = self._queued[0]
            records = [
                DiskRecord(
                    tuple(SlabId(slab) for slab in record.disk),
                    tuple(memoryview(self._arena.slab(slab).numpy()) for slab in record.host),
                )
                for record in batch.records
            ]
            handle = self.store.submit_write(records)
            if handle is None:  # the store's bound: again at a later step
                return
            self._queued.popleft()
            self._writing.append((batch.batch, handle))
