"""The host tier's bytes: pinned slab chunks and the copies between them and the device (§5.4).

The index (`HostSlabPool`) decides which slab holds what; this moves the bytes. One block record
fills one slab, a snapshot image is split over ``image_slabs`` scattered slabs (its packed byte
``o`` lives in slab ``o // slab_bytes``), and a tail is one block record. The slabs are pinned in
chunks of whole slabs, at most 4 GiB each, laid out exactly as the index numbers them.

A batch is a list of byte ranges (`copy_ranges`: one per plane of each page, one per slab
segment of each image plane, merged where they continue one another). On CUDA 12.8+ the ranges
go to the driver in one `cudaMemcpyBatchAsync` call per part of a batch (a write-through batch is
one part, a restore one per layer), checked once at start-up against the per-range calls it
replaces (which stay the fallback). Write-through batches run on a transfer stream; a restore
runs on a restore stream in the order a forward pass reads it (the tail's page first, then layer
by layer), with an event after each part, so the first prefill pass waits per layer and computes
while later layers still arrive (§6.5, §11.1). Both streams first wait for the compute stream's
queued work: write sources and restore destinations may be touched by kernels already queued.

On CPU the same byte ranges are moved synchronously with `memmove` over ordinary memory; waits
are no-ops.
"""

from __future__ import annotations

import ctypes
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from vllm_hpc.derived import check_host_budget
from vllm_hpc.faults import SLOW_COPY_CYCLES, InjectedFault, armed
from vllm_hpc.glue.worker.copy_ranges import CopyRanges, RangePlanner, Records
from vllm_hpc.glue.worker.cudart import CudaRuntime
from vllm_hpc.glue.worker.host_layout import DeviceLayout
from vllm_hpc.index import HostGeometry, HostSlabPool
from vllm_hpc.index.host_pool import SLAB_ALIGN_BYTES
from vllm_hpc.runtime.plan import ImageCopy, PageSlab

logger = logging.getLogger("vllm.vllm_hpc")

Slabs = TypeVar("Slabs", int, np.ndarray)


@dataclass(frozen=True, slots=True)
class SlabGrid:
    """How slab ids map onto chunks: ``slab // slabs_per_chunk``, as the index numbers them."""

    geometry: HostGeometry
    capacity: int
    slabs_per_chunk: int

    @classmethod
    def of(cls, pool: HostSlabPool) -> SlabGrid:
        return cls(pool.geometry, pool.capacity, pool.slabs_per_chunk)

    @classmethod
    def for_budget(cls, host_cache_mib: int, geometry: HostGeometry) -> SlabGrid:
        """The grid of a ``--host-cache-mib`` budget, taken from the index's own pool."""
        check_host_budget(host_cache_mib, geometry)
        return cls.of(HostSlabPool(host_cache_mib << 20, geometry))

    @property
    def slab_bytes(self) -> int:
        return self.geometry.slab_bytes

    @property
    def chunk_slabs(self) -> tuple[int, ...]:
        full, rest = divmod(self.capacity, self.slabs_per_chunk)
        return (self.slabs_per_chunk,) * full + ((rest,) if rest else ())

    def location(self, slab: Slabs) -> tuple[Slabs, Slabs]:
        """(chunk, byte offset in that chunk) of a slab, or of each of an array of slabs."""
        chunk, index = divmod(slab, self.slabs_per_chunk)
        return chunk, index * self.slab_bytes


@dataclass
class ArenaStats:
    """Cumulative counters, for metrics and tests."""

    bytes_written: int = 0
    bytes_restored: int = 0
    copies: int = 0
    """Byte ranges issued: one per plane of a page, one per slab segment of an image plane,
    less those merged into the range before them."""
    write_batches: int = 0
    restore_batches: int = 0


@dataclass
class _Step:
    """Ranges that land together: one layer's share of a batch (or the restore's prelude)."""

    layer: str | None
    ranges: CopyRanges


@dataclass
class CopyTiming:
    """When a batch's copies ran: timing events around them on the copy stream (CUDA), or the
    seconds the synchronous copies took (CPU). Feeds the bandwidth metrics."""

    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    cpu_seconds: float = 0.0

    def seconds(self) -> float:
        """The copy time; on CUDA only once the batch has landed."""
        if self.start is None or self.end is None:
            return self.cpu_seconds
        return float(self.start.elapsed_time(self.end)) / 1000


class TransferHandle:
    """A write-through batch in flight. The caller polls `done()` and then tells the index
    (``complete_*``): until then sources stay pinned and destinations Filling."""

    def __init__(self, nbytes: int, timing: CopyTiming, device: torch.device) -> None:
        self.nbytes = nbytes
        self.timing = timing
        self._device = device

    def done(self) -> bool:
        end = self.timing.end
        return end is None or bool(end.query())

    def synchronize(self) -> None:
        """Block the CPU until the batch has landed (shutdown, tests)."""
        if self.timing.end is not None:
            self.timing.end.synchronize()


class RestoreHandle(TransferHandle):
    """A restore batch in flight: an event after each layer's copies.

    The waits make the *current* stream wait (`cudaStreamWaitEvent`); they never block the CPU.
    The lane's first prefill pass calls `wait_layer(name)` just before each layer runs; later
    passes are stream-ordered behind it. Nothing waits for the prelude (the cached tail page)
    alone: the lane reads its own copy of the tail, which arrives with the layers. A lane
    released before its first pass calls `wait_all`: its state row may still be a destination."""

    def __init__(
        self,
        nbytes: int,
        timing: CopyTiming,
        layers: dict[str, torch.cuda.Event],
        device: torch.device,
    ) -> None:
        super().__init__(nbytes, timing, device)
        self._layers = layers

    def wait_layer(self, name: str) -> None:
        event = self._layers.get(name)
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)

    def wait_all(self) -> None:
        if self.timing.end is not None:
            torch.cuda.current_stream(self._device).wait_event(self.timing.end)


class HostArena:
    """The slab chunks of one worker and the copies in and out of them."""

    def __init__(self, layout: DeviceLayout, grid: SlabGrid) -> None:
        if grid.geometry != layout.geometry:
            raise ValueError(
                f"host geometry {grid.geometry} does not match the device layout's "
                f"{layout.geometry}: scheduler and worker disagree on the record sizes"
            )
        self.layout = layout
        self.grid = grid
        self.stats = ArenaStats()
        self._cuda = CudaRuntime() if layout.device.type == "cuda" else None
        self.chunks: list[torch.Tensor] = []
        # The finalizer holds the chunks, so each is unpinned before it is freed, also when a
        # later chunk fails to pin.
        self._release = weakref.finalize(self, _unregister, self._cuda, self.chunks)
        for index, slabs in enumerate(grid.chunk_slabs):
            self.chunks.append(self._allocate(index, slabs * grid.slab_bytes))
        self._planner = RangePlanner(layout, grid, self.chunks)
        self.batched = False
        """Whether a batch's parts go to the driver as `cudaMemcpyBatchAsync` calls."""
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        if self._cuda is not None:
            self._streams = (
                torch.cuda.Stream(layout.device),  # write-through
                torch.cuda.Stream(layout.device),  # restore
            )
            self.batched = self._cuda.has_batch and self._batch_round_trips()

    def close(self) -> None:
        """Unpin the chunks now (otherwise when the arena is collected)."""
        self._release()

    def slab(self, slab: int) -> torch.Tensor:
        """One slab's bytes, a uint8 view into its chunk: what the prefix cache file saves and
        loads (§5.5). Only for slabs no copy in flight touches."""
        if not 0 <= slab < self.grid.capacity:
            raise IndexError(f"slab {slab} out of range")
        chunk, offset = self.grid.location(slab)
        return self.chunks[chunk][offset : offset + self.grid.slab_bytes]

    def _allocate(self, index: int, nbytes: int) -> torch.Tensor:
        what = f"host tier chunk {index} ({nbytes / 2**30:.2f} GiB)"
        try:
            if armed(f"host_alloc:{index}"):
                raise InjectedFault("injected allocation failure")
            chunk = _page_aligned(nbytes)
            if self._cuda is not None:
                self._cuda.host_register(chunk.data_ptr(), nbytes)
        except RuntimeError as error:
            pinned = "pin" if self._cuda is not None else "allocate"
            raise RuntimeError(
                f"could not {pinned} {what}: {error}. Lower --host-cache-mib, or raise the "
                "locked-memory limit (ulimit -l) for pinned memory"
            ) from error
        return chunk

    def _batch_round_trips(self) -> bool:
        """Whether `cudaMemcpyBatchAsync` moves bytes here as the per-copy calls do: slab 0's
        bytes, in a few ranges, out to the device and back, before any slab holds anything."""
        assert self._cuda is not None and self._streams is not None
        slab = self.slab(0)
        probe = (torch.arange(len(slab), dtype=torch.int32) % 251).to(torch.uint8)
        scratch = torch.zeros(len(slab), dtype=torch.uint8, device=self.layout.device)
        width = max(1, len(slab) // 4)
        offsets = range(0, len(slab) - width + 1, width)
        host, device = slab.data_ptr(), scratch.data_ptr()
        stream = self._streams[0]
        index = self.layout.device.index or 0
        slab.copy_(probe)
        try:
            for to_host, dst, src in ((False, device, host), (True, host, device)):
                self._cuda.memcpy_batch_async(
                    [dst + o for o in offsets],
                    [src + o for o in offsets],
                    [width] * len(offsets),
                    to_host,
                    index,
                    stream.cuda_stream,
                )
                stream.synchronize()
                if not to_host:
                    slab.zero_()  # what comes back must be the device's copy
        except RuntimeError as error:
            logger.warning(
                "hybrid-prefix host tier: batched copies unavailable (%s); one call a range",
                error,
            )
            return False
        moved = width * len(offsets)
        same = torch.equal(slab[:moved], probe[:moved])
        slab.zero_()
        if not same:
            logger.warning(
                "hybrid-prefix host tier: cudaMemcpyBatchAsync moved the wrong bytes in its "
                "start-up check; one call a range"
            )
        return same

    # -- batches ----------------------------------------------------------------------------

    def mark(self) -> torch.cuda.Event | None:
        """The compute stream's position now (CUDA): a `write` given it copies what the work
        queued so far wrote, and no later kernel's output."""
        if self._cuda is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.layout.device))
        return event

    def write(
        self,
        blocks: Sequence[PageSlab] = (),
        images: Sequence[ImageCopy] = (),
        after: torch.cuda.Event | None = None,
    ) -> TransferHandle:
        """Write-through, device -> host, in one batch (a snapshot's tail page is one of the
        ``blocks``), behind ``after`` (a `mark`) or else behind all the compute stream's queued
        work: `prepare_write`, then `issue_write` on this thread."""
        return self.issue_write(self.prepare_write(blocks, images), after)

    def prepare_write(
        self, blocks: Sequence[PageSlab] = (), images: Sequence[ImageCopy] = ()
    ) -> CopyRanges:
        """A write-through batch's ranges, counted in the stats; the caller's thread does this
        and `issue_write` may run on another. Fault point `host_write`: the batch fails here,
        before any copy is issued."""
        if armed("host_write"):
            raise InjectedFault("injected write-through failure")
        ranges = self.plan_write(blocks, images)
        self.stats.write_batches += 1
        self.stats.bytes_written += ranges.total_bytes
        self.stats.copies += len(ranges)
        return ranges

    def issue_write(
        self, ranges: CopyRanges, after: torch.cuda.Event | None = None
    ) -> TransferHandle:
        """Issue a prepared write batch on the write-through stream. Safe on any one thread
        beside the engine's: it reads only the arena's fixed layout and touches no stats."""
        _, timing = self._issue([_Step(None, ranges)], 0, to_host=True, after=after)
        return TransferHandle(ranges.total_bytes, timing, self.layout.device)

    def plan_write(
        self, blocks: Sequence[PageSlab] = (), images: Sequence[ImageCopy] = ()
    ) -> CopyRanges:
        """The byte ranges of a write-through batch, every layer at once."""
        return self._planner.batch(
            self._block_records(blocks), self._image_records(images), to_host=True
        )

    def restore(
        self,
        blocks: Sequence[PageSlab] = (),
        tail: PageSlab | None = None,
        image: ImageCopy | None = None,
    ) -> RestoreHandle:
        """Restore, host -> device, in forward-pass order; ``tail`` lands in the prelude,
        before the first layer's step. Fault point `host_restore`: it fails before any copy."""
        if armed("host_restore"):
            raise InjectedFault("injected restore failure")
        tails = self._block_records([tail] if tail is not None else [])
        pages = self._block_records(blocks)
        images = self._image_records([image] if image is not None else [])
        steps = [_Step(None, self._planner.pages(tails, to_host=False))]
        for layer in self.layout.layers:
            records = images if layer.is_state else pages
            steps.append(_Step(layer.name, self._planner.layer(layer.name, records, False)))
        nbytes = sum(step.ranges.total_bytes for step in steps)
        self.stats.restore_batches += 1
        self.stats.bytes_restored += nbytes
        self.stats.copies += sum(len(step.ranges) for step in steps)
        events, timing = self._issue(steps, 1, to_host=False)
        device = self.layout.device
        if not events:
            return RestoreHandle(nbytes, timing, {}, device)
        names = [step.layer for step in steps[1:] if step.layer is not None]
        layers = dict(zip(names, events[1:], strict=True))
        return RestoreHandle(nbytes, timing, layers, device)

    def _block_records(self, blocks: Sequence[PageSlab]) -> Records:
        """The blocks' pages, in page order, and their slabs, located."""
        pairs = np.array([(block.page, block.slab) for block in blocks], dtype=np.int64)
        pairs = pairs.reshape(-1, 2)
        pairs = pairs[np.argsort(pairs[:, 0], kind="stable")]
        return self._planner.records(pairs[:, 0], pairs[:, 1:], state=False)

    def _image_records(self, images: Sequence[ImageCopy]) -> Records:
        """The images' state rows and their slabs (a row an image), located."""
        count = self.grid.geometry.image_slabs
        for image in images:
            if len(image.slabs) != count:
                raise ValueError(f"an image takes {count} slabs, not {image.slabs}")
        rows = np.array([image.row for image in images], dtype=np.int64)
        slabs = np.array([image.slabs for image in images], dtype=np.int64)
        return self._planner.records(rows, slabs.reshape(len(images), count), state=True)

    # -- issuing ----------------------------------------------------------------------------

    def _issue(
        self,
        steps: list[_Step],
        stream_index: int,
        to_host: bool,
        after: torch.cuda.Event | None = None,
    ) -> tuple[list[torch.cuda.Event], CopyTiming]:
        """Run the steps in order; on CUDA, on the chosen stream behind ``after`` or the
        compute stream's queued work, with an event after each step."""
        if self._cuda is None or self._streams is None:
            started = time.perf_counter()
            for step in steps:
                for dst, src, nbytes in zip(*step.ranges.as_lists(), strict=True):
                    ctypes.memmove(dst, src, nbytes)
            return [], CopyTiming(cpu_seconds=time.perf_counter() - started)
        stream = self._streams[stream_index]
        if after is None:
            stream.wait_stream(torch.cuda.current_stream(self.layout.device))
        else:
            stream.wait_event(after)
        if armed("host_slow"):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLOW_COPY_CYCLES)
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        events = []
        for index, step in enumerate(steps):
            self._issue_ranges(step.ranges, to_host, stream)
            event = torch.cuda.Event(enable_timing=index == len(steps) - 1)
            event.record(stream)
            events.append(event)
        return events, CopyTiming(start, events[-1])

    def _issue_ranges(self, ranges: CopyRanges, to_host: bool, stream: torch.cuda.Stream) -> None:
        assert self._cuda is not None
        if not len(ranges):
            return
        if self.batched:
            index = self.layout.device.index or 0
            self._cuda.memcpy_batch_async(
                ranges.dst, ranges.src, ranges.nbytes, to_host, index, stream.cuda_stream
            )
            return
        for dst, src, nbytes in zip(*ranges.as_lists(), strict=True):
            self._cuda.memcpy_async(dst, src, nbytes, stream.cuda_stream)


def _page_aligned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory starting on a page: the disk tier reads and writes slabs with
    O_DIRECT, which needs aligned buffers, and torch's large allocations start 64 bytes past
    a page."""
    raw = torch.empty(nbytes + SLAB_ALIGN_BYTES, dtype=torch.uint8)
    skip = -raw.data_ptr() % SLAB_ALIGN_BYTES
    return raw[skip : skip + nbytes]


def _unregister(runtime: CudaRuntime | None, chunks: list[torch.Tensor]) -> None:
    if runtime is not None:
        for chunk in chunks:
            runtime.host_unregister(chunk.data_ptr())
