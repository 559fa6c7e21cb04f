"""The start-up read (§5.5): after the journal's replay, the disk tier's most valuable snapshots
are read into the host tier's free room, so that the first hits after a restart restore from
the host instead of waiting for the disk.

The reads go through the path a hit's read takes (`PrefixIndex.plan_disk_read`, one
`DiskReadBatch` each, CRC-checked by every worker), one snapshot with the disk-only blocks of
its path at a time, from the engine's first steps on: requests are scheduled meanwhile, a
request's own read queues behind at most one of them, and a request whose snapshot is being
read waits for that read as for its own (`Admission`). The order is the disk's own value order
(`PrefixIndex.preload_order`); the bound is the host tier's free slabs: nothing is evicted for
it. A snapshot that does not fit, is on the host already, or is landing for another read is
passed over. A read that fails its check drops the damaged records, as any read does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from vllm_hpc.index import PrefixIndex, Snapshot
from vllm_hpc.index.transfers import DiskRead, ReadRoom
from vllm_hpc.runtime.pipeline import StepPipeline, disk_slab_count


@dataclass(slots=True)
class PreloadProgress:
    """What the start-up read has done so far, for its log lines."""

    queued: int = 0
    """Snapshots it started with: every retained one the disk holds."""
    read: int = 0
    """Snapshots read into the host tier (with the disk-only blocks of their paths)."""
    slabs: int = 0
    """Slabs those reads brought into the host tier."""
    failed: int = 0
    """Reads that failed their check (the damaged records dropped)."""


class Preload:
    """The start-up read's queue of snapshots and its one read in flight: one at a time, so a
    request's own read waits behind at most one of them."""

    def __init__(self, index: PrefixIndex, pipeline: StepPipeline) -> None:
        self.index = index
        self.pipeline = pipeline
        self.progress = PreloadProgress()
        self._queue: deque[Snapshot] = deque()
        self._reading: DiskRead | None = None

    def start(self) -> None:
        """The journal was replayed: queue the disk's snapshots, most valuable first."""
        self._queue = deque(self.index.preload_order())
        self.progress = PreloadProgress(queued=len(self._queue))

    @property
    def pending(self) -> bool:
        """Whether snapshots are left to try or a read is in flight."""
        return bool(self._queue) or self._reading is not None

    def plan(self) -> None:
        """As a step's plan is taken, where no read of this is in flight: the next snapshot
        the host tier's free slabs hold, read in this plan."""
        if self._reading is not None:
            return
        while self._queue:
            snapshot = self._queue.popleft()
            if snapshot not in self.index.store.snapshots:
                continue
            read = self.index.plan_disk_read(snapshot, ReadRoom.FREE)
            if read is not None:
                self.pipeline.disk_read(read)
                self._reading = read
                return

    def ended(self, read: DiskRead, landed: bool) -> None:
        """A read completed (``landed``) or failed; one of this lets the next be planned."""
        if read is not self._reading:
            return
        self._reading = None
        if landed:
            self.progress.read += 1
            self.progress.slabs += disk_slab_count(read)
        else:
            self.progress.failed += 1

    def stop(self) -> None:
        """Plan nothing more (the stop, a reset): a read in flight still lands."""
        self._queue.clear()
