"""The step pipeline: the copy plan being built, and what waits for a plan to be handed out.

Every copy of a plan runs before the step's forward pass, in order. What the runtime does
after a plan was handed out follows from that:

- restores and prefetches whose copies are in a handed-out plan complete at the next step;
- captures of the state after the step being planned are deferred: their copies join the next
  plan (`defer`, then `begin_step` queues them);
- pages a finished request releases may still be read by copies in the pending plan: they
  return to the pool only after that plan was handed out (quarantine);
- write-through records (released blocks, published snapshots) join the plan as one batch and
  complete when the workers report the batch (`complete_writes`);
- with a disk tier, each plan carries the step's write-behind (`PrefixIndex.plan_disk_writes`)
  as one batch, completed or failed when every worker reported it (`complete_disk_writes`);
- a waiting request's disk read (`PrefixIndex.plan_disk_read`) joins the plan as a batch of its
  own, completed when every worker checked its records, or failed with the records that did
  not pass (`complete_disk_read`, `fail_disk_read`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vllm_hpc.index import (
    BlockWrite,
    HostGeometry,
    PageId,
    Prefetch,
    PrefixIndex,
    Restore,
)
from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.transfers import DiskRead, DiskWrite, WriteRecord
from vllm_hpc.runtime.lane import Capture, Lane
from vllm_hpc.runtime.plan import (
    DiskReadBatch,
    DiskWriteBatch,
    HostRestore,
    HostWrite,
    ImageCopy,
    InPassCapture,
    PageSlab,
    SlabRecord,
    StepPlan,
)
from vllm_hpc.runtime.telemetry import DiskCounters, HostCounters


class StepPipeline:
    def __init__(self, index: PrefixIndex, geometry: HostGeometry, disk_write_bytes: int) -> None:
        self.index = index
        self.geometry = geometry
        self.disk_write_bytes = disk_write_bytes
        """The byte bound of a step's write-behind (`derived.disk_write_bound`)."""
        self.plan = StepPlan()
        """The plan being built; `take_plan` hands it out."""
        self.plans_taken = 0
        self.host = HostCounters()
        self.disk = DiskCounters()
        self._deferred: list[tuple[Lane, Capture]] = []
        """Captures of the state after the step being planned: their copies join the next plan."""
        self._landing: list[Restore] = []
        """Restores whose copies are in a plan already handed out; complete at the next step."""
        self._prefetching: list[Prefetch] = []
        """Prefetches whose copies are in a plan already handed out; complete at the next step."""
        self._quarantine: list[tuple[int, list[PageId]]] = []
        self._new_pages: list[PageId] = []
        self._write_batch: list[WriteRecord] = []
        """Write-through planned for the plan being built."""
        self._writing: dict[int, list[WriteRecord]] = {}
        """Handed-out write batches the workers have not reported done, by batch number."""
        self._disk_writing: dict[int, list[DiskWrite]] = {}
        """Handed-out write-behind batches not yet reported by every worker, by batch number."""
        self._disk_reading: dict[int, DiskRead] = {}
        """Disk reads planned and not yet reported by every worker, by batch number."""
        self._reads_planned = 0
        self.wrote_behind = False
        """Whether the last plan handed out held a disk write: the bound of a step may have
        left more behind it, for the next plan."""

    # -- step boundaries --------------------------------------------------------------------

    def begin_step(self) -> None:
        """Earlier plans were handed out, so their copies precede the step being planned."""
        for restore in self._landing:
            self.index.complete_restore(restore)
        self._landing.clear()
        for prefetch in self._prefetching:
            self.index.complete_prefetch(prefetch)
        self._prefetching.clear()
        keep = []
        for taken_at, pages in self._quarantine:
            if self.plans_taken > taken_at:
                self.index.free_pages(pages)
            else:
                keep.append((taken_at, pages))
        self._quarantine = keep
        for lane, capture in self._deferred:
            self.queue(lane, capture)
        self._deferred.clear()

    def take_plan(self) -> StepPlan:
        """The copies the workers run before this step's forward pass."""
        plan, self.plan = self.plan, StepPlan()
        plan.state_zeros = list(self.index.take_fresh_rows())
        if self._write_batch:
            plan.host_writes.append(self._host_write(self.plans_taken, self._write_batch))
            self._writing[self.plans_taken] = self._write_batch
            self._write_batch = []
        disk_writes = self.index.plan_disk_writes(self.disk_write_bytes)
        self.wrote_behind = bool(disk_writes)
        if disk_writes:
            records = tuple(record for write in disk_writes for record in disk_records(write))
            plan.disk_writes.append(DiskWriteBatch(self.plans_taken, records))
            self._disk_writing[self.plans_taken] = disk_writes
        self.plans_taken += 1
        self.index.plan_taken()
        return plan

    def _host_write(self, batch: int, records: list[WriteRecord]) -> HostWrite:
        blocks: list[PageSlab] = []
        images: list[ImageCopy] = []
        for record in records:
            if isinstance(record, BlockWrite):
                blocks.extend(PageSlab(copy.page, copy.slab) for copy in record.copies)
                continue
            images.append(ImageCopy(self.index.slot_row(record.slot), record.image_slabs))
            if record.tail_page is not None and record.tail_slab is not None:
                blocks.append(PageSlab(record.tail_page, record.tail_slab))
        self.host.write_bytes += len(blocks) * self.geometry.block_bytes
        self.host.write_bytes += len(images) * self.geometry.image_bytes
        return HostWrite(batch, tuple(blocks), tuple(images))

    def writes_in_flight(self) -> bool:
        """Whether a handed-out write batch has not been reported done yet."""
        return bool(self._writing)

    def complete_writes(self, batches: Sequence[int]) -> None:
        """The workers finished these write-through batches: the host copies are resident."""
        for batch in batches:
            for record in self._writing.pop(batch, ()):
                if isinstance(record, BlockWrite):
                    self.index.complete_block_write(record)
                else:
                    self.index.complete_snapshot_write(record)

    def complete_disk_writes(self, batch: int) -> list[DiskWrite]:
        """Every worker made this write-behind batch durable: the disk copies are resident.
        Its writes, for the journal; none for a batch a reset dropped."""
        writes = self._disk_writing.pop(batch, [])
        for write in writes:
            self.index.complete_disk_write(write)
            self.disk.write_bytes += disk_slab_count(write) * self.geometry.slab_bytes
        return writes

    def fail_disk_writes(self, batch: int) -> list[DiskWrite]:
        """A worker could not make this batch durable: its disk slabs are free again."""
        writes = self._disk_writing.pop(batch, [])
        for write in writes:
            self.index.fail_disk_write(write)
        return writes

    def disk_read(self, read: DiskRead) -> None:
        """A waiting request's read from the disk tier: a batch of the plan being built."""
        batch = self._reads_planned
        self._reads_planned += 1
        self.plan.disk_reads.append(DiskReadBatch(batch, tuple(disk_records(read))))
        self._disk_reading[batch] = read

    def reading(self, read: DiskRead) -> bool:
        """Whether ``read`` has not been reported by every worker yet."""
        return read in self._disk_reading.values()

    def read_of(self, snapshot: Snapshot) -> DiskRead | None:
        """The read in flight that brings ``snapshot`` into the host tier, if any."""
        return next((r for r in self._disk_reading.values() if r.snapshot is snapshot), None)

    @property
    def reads_in_flight(self) -> bool:
        return bool(self._disk_reading)

    def complete_disk_read(self, batch: int, keep: Callable[[DiskRead], bool]) -> DiskRead | None:
        """Every worker read and checked this batch: the host copies are resident, pinned
        while ``keep`` says a waiting request still awaits the read. None for a batch no
        longer tracked."""
        read = self._disk_reading.pop(batch, None)
        if read is not None:
            self.index.complete_disk_read(read, keep(read))
            self.disk.read_bytes += disk_slab_count(read) * self.geometry.slab_bytes
        return read

    def fail_disk_read(self, batch: int, failed: Sequence[int]) -> tuple[DiskRead, int] | None:
        """A worker could not read this batch whole: its host slabs are free again, and the
        ``failed`` records (by their place in the batch) lose their disk copies. The read and
        the records dropped; None for a batch no longer tracked."""
        read = self._disk_reading.pop(batch, None)
        if read is None:
            return None
        records: list[BlockNode | Snapshot] = [copy.node for copy in read.blocks]
        records.append(read.snapshot)  # the record after the blocks, where the read has one
        damaged = [records[index] for index in failed]
        return read, self.index.fail_disk_read(read, damaged)

    def take_new_pages(self) -> list[PageId]:
        """Pages allocated since the last call (vLLM zeroes them before the step's copies)."""
        pages, self._new_pages = self._new_pages, []
        return pages

    # -- what the other parts hand over -----------------------------------------------------

    def allocate(self, count: int) -> list[PageId] | None:
        """``count`` private pages, evicting cache as needed; None when there is no room."""
        if count <= 0:
            return []
        pages = self.index.allocate_pages(count)
        if pages is not None:
            self._new_pages.extend(pages)
        return pages

    def queue(self, lane: Lane, capture: Capture) -> None:
        """Put the capture's copies into the plan being built."""
        lane.newest_frontier = max(lane.newest_frontier, capture.frontier)
        copy = capture.state_copy
        if isinstance(copy, InPassCapture):
            self.plan.in_pass.append(copy)
        else:
            self.plan.state_copies.append(copy)
        if capture.page_copy is not None:
            self.plan.page_copies.append(capture.page_copy)
            capture.page_copy_step = self.plans_taken
        capture.copies_queued = True

    def defer(self, lane: Lane, capture: Capture) -> None:
        """Queue the capture's copies in the next plan: they copy the state after this step."""
        self._deferred.append((lane, capture))

    def undefer(self, lane: Lane, capture: Capture) -> None:
        self._deferred.remove((lane, capture))

    def land(self, restore: Restore) -> None:
        self._landing.append(restore)

    def host_restore(self, copies: HostRestore) -> None:
        """An admission's copies from the host, counted with the host tier's bytes."""
        self.plan.host_restores.append(copies)
        self._count_restore(copies)

    def prefetch(self, copies: HostRestore, prefetch: Prefetch) -> None:
        """A blocked head's prefetch: its copies, and the index's record to complete."""
        self.plan.prefetches.append(copies)
        self._prefetching.append(prefetch)
        self._count_restore(copies)

    def _count_restore(self, copies: HostRestore) -> None:
        pages = len(copies.blocks) + (copies.tail is not None)
        self.host.restore_bytes += pages * self.geometry.block_bytes
        self.host.restore_bytes += self.geometry.image_bytes if copies.image is not None else 0

    def quarantine(self, pages: list[PageId]) -> None:
        """Free ``pages`` once the plan being built was handed out (its copies may read them)."""
        self._quarantine.append((self.plans_taken, pages))

    def write_through(self, record: WriteRecord) -> None:
        self._write_batch.append(record)

    # -- audit and reset ---------------------------------------------------------------------

    @property
    def quarantined_pages(self) -> set[PageId]:
        return {p for _, pages in self._quarantine for p in pages}

    @property
    def idle(self) -> bool:
        """Nothing deferred, planned (rows to zero aside), landing or being written."""
        plan = self.plan
        planned = (
            plan.state_copies
            or plan.in_pass
            or plan.page_copies
            or plan.host_writes
            or plan.host_restores
            or plan.prefetches
            or plan.disk_reads
        )
        return not (self._deferred or planned or self.transfers_pending)

    @property
    def transfers_pending(self) -> int:
        """Index transfers this pipeline will complete: restores, prefetches, writes, reads."""
        writing = sum(len(records) for records in self._writing.values())
        writing += sum(len(writes) for writes in self._disk_writing.values())
        writing += len(self._disk_reading)
        return len(self._landing) + len(self._prefetching) + len(self._write_batch) + writing

    def reset(self) -> None:
        """Drop every pending copy and what waits on one (the caller clears the index)."""
        self.plan = StepPlan()
        for pending in (
            self._deferred,
            self._quarantine,
            self._landing,
            self._prefetching,
            self._write_batch,
            self._new_pages,
        ):
            pending.clear()
        self._writing.clear()
        self._disk_writing.clear()
        self._disk_reading.clear()
        self.wrote_behind = False


def disk_slab_count(transfer: DiskWrite | DiskRead) -> int:
    """The disk slabs a disk transfer moves."""
    return sum(len(record.disk) for record in disk_records(transfer))


def disk_records(transfer: DiskWrite | DiskRead) -> list[SlabRecord]:
    """A disk transfer's records in the order the workers move and check them: each block of
    its path, then the snapshot (image slabs, then the tail slab), which a read may leave out."""
    records = [SlabRecord((copy.slab,), (copy.disk_slab,)) for copy in transfer.blocks]
    host, disk = transfer.image_slabs, transfer.image_disk_slabs
    if isinstance(transfer, DiskWrite) and transfer.tail is not None:
        host, disk = (*host, transfer.tail[0]), (*disk, transfer.tail[1])
    elif isinstance(transfer, DiskRead) and transfer.tail is not None:
        host, disk = (*host, transfer.tail[1]), (*disk, transfer.tail[0])
    if host:
        records.append(SlabRecord(tuple(host), tuple(disk)))
    return records
