"""The host tier's bytes: pinned slab chunks and the copies between them and the device (§5.4).

The index (`HostSlabPool`) decides which slab holds what; this moves the bytes. One block record
fills one slab, a snapshot image is split over ``image_slabs`` scattered slabs (its packed byte
``o`` lives in slab ``o // slab_bytes``), and a tail is one block record. The slabs are pinned in
chunks of whole slabs, at most 4 GiB each, laid out exactly as the index numbers them.

Copies move runs of consecutive pages whose slabs are consecutive in one chunk as one strided
copy per plane. On CUDA 12.8+ each part of a batch goes to the driver as its byte ranges in one
`cudaMemcpyBatchAsync` call, checked once at start-up against the per-copy calls it replaces
(which stay the fallback). Write-through batches run on a transfer stream; a restore runs on a
restore stream in the order a forward pass reads it (the tail's page first, then layer by
layer), with an event after each part, so the first prefill pass waits per layer and computes
while later layers still arrive (§6.5, §11.1). Both streams first wait for the compute stream's
queued work: write sources and restore destinations may be touched by kernels already queued.

On CPU the same byte ranges run synchronously with `copy_` over ordinary memory; waits are
no-ops.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from vllm_hpc.derived import check_host_budget
from vllm_hpc.faults import SLOW_COPY_CYCLES, InjectedFault, armed
from vllm_hpc.glue.worker.cudart import CudaRuntime
from vllm_hpc.glue.worker.host_layout import DeviceLayout, LayerPlanes, Plane
from vllm_hpc.index import HostGeometry, HostSlabPool
from vllm_hpc.runtime.plan import ImageCopy, PageSlab

logger = logging.getLogger("vllm.vllm_hpc")


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

    def location(self, slab: int) -> tuple[int, int]:
        """(chunk, byte offset in that chunk) of a slab."""
        chunk, index = divmod(slab, self.slabs_per_chunk)
        return chunk, index * self.slab_bytes


@dataclass
class ArenaStats:
    """Cumulative counters, for metrics and tests."""

    bytes_written: int = 0
    bytes_restored: int = 0
    copies: int = 0
    """Copies planned: one per plane per coalesced run, one per image segment."""
    write_batches: int = 0
    restore_batches: int = 0


@dataclass(frozen=True, slots=True)
class _Span:
    storage: torch.Tensor
    offset: int
    pitch: int


@dataclass(frozen=True, slots=True)
class _Copy:
    dst: _Span
    src: _Span
    width: int
    height: int

    def ranges(self) -> Iterator[tuple[int, int, int]]:
        """(destination offset, source offset, bytes) of the contiguous byte ranges it moves:
        one, or one a row when a side is strided."""
        dst, src, width = self.dst, self.src, self.width
        if self.height == 1 or dst.pitch == src.pitch == width:
            yield dst.offset, src.offset, width * self.height
            return
        for row in range(self.height):
            yield dst.offset + row * dst.pitch, src.offset + row * src.pitch, width


@dataclass
class _Step:
    """Copies that land together: one layer's share of a batch (or the restore's prelude)."""

    layer: str | None
    copies: list[_Copy] = field(default_factory=list)


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
    """A restore batch in flight: events after the prelude and after each layer's copies.

    The waits make the *current* stream wait (`cudaStreamWaitEvent`); they never block the CPU.
    The lane's first prefill pass calls `wait_prelude` before anything reads the tail page and
    `wait_layer(name)` just before each layer runs; later passes are stream-ordered behind it.
    A lane released before its first pass calls `wait_all`: its state slot may still be a
    destination."""

    def __init__(
        self,
        nbytes: int,
        timing: CopyTiming,
        prelude: torch.cuda.Event | None,
        layers: dict[str, torch.cuda.Event],
        device: torch.device,
    ) -> None:
        super().__init__(nbytes, timing, device)
        self._prelude = prelude
        self._layers = layers

    def wait_prelude(self) -> None:
        if self._prelude is not None:
            torch.cuda.current_stream(self._device).wait_event(self._prelude)

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
        self._coalesce = True
        self.batched = False
        """Whether a batch's parts go to the driver as `cudaMemcpyBatchAsync` calls."""
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        if self._cuda is not None:
            max_pitch = self._cuda.max_pitch(layout.device)
            pitches = [p.pitch for layer in layout.layers for p in layer.planes]
            self._coalesce = max([grid.slab_bytes, *pitches]) <= max_pitch
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
            chunk = torch.empty(nbytes, dtype=torch.uint8)
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
                "hybrid-prefix host tier: batched copies unavailable (%s); one call a copy",
                error,
            )
            return False
        moved = width * len(offsets)
        same = torch.equal(slab[:moved], probe[:moved])
        slab.zero_()
        if not same:
            logger.warning(
                "hybrid-prefix host tier: cudaMemcpyBatchAsync moved the wrong bytes in its "
                "start-up check; one call a copy"
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
        work. Fault point `host_write`: the batch fails before any copy is issued."""
        if armed("host_write"):
            raise InjectedFault("injected write-through failure")
        steps = self._layer_steps(self._runs(blocks), images, to_host=True)
        nbytes = _bytes(steps)
        self.stats.write_batches += 1
        self.stats.bytes_written += nbytes
        _, timing = self._issue(steps, 0, events_per_step=False, after=after)
        return TransferHandle(nbytes, timing, self.layout.device)

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
        runs = self._runs(blocks)
        prelude = _Step(None)
        for page, slab, _ in self._runs([tail] if tail is not None else []):
            for layer in self.layout.layers:
                if not layer.is_state:
                    prelude.copies += self._block_copies(layer, page, slab, 1, to_host=False)
        images = [image] if image is not None else []
        steps = [prelude, *self._layer_steps(runs, images, to_host=False)]
        nbytes = _bytes(steps)
        self.stats.restore_batches += 1
        self.stats.bytes_restored += nbytes
        events, timing = self._issue(steps, 1, events_per_step=True)
        device = self.layout.device
        if not events:
            return RestoreHandle(nbytes, timing, None, {}, device)
        names = [step.layer for step in steps[1:] if step.layer is not None]
        layers = dict(zip(names, events[1:], strict=True))
        return RestoreHandle(nbytes, timing, events[0], layers, device)

    # -- planning ---------------------------------------------------------------------------

    def _layer_steps(
        self,
        runs: list[tuple[int, int, int]],
        images: Sequence[ImageCopy],
        to_host: bool,
    ) -> list[_Step]:
        """One step per layer in forward order: the block runs of an attention layer, the
        images of a GDN layer."""
        steps = []
        for layer in self.layout.layers:
            step = _Step(layer.name)
            if layer.is_state:
                for image in images:
                    step.copies += self._image_copies(layer, image.slot, image.slabs, to_host)
            else:
                for page, slab, count in runs:
                    step.copies += self._block_copies(layer, page, slab, count, to_host)
            steps.append(step)
        return steps

    def _runs(self, blocks: Sequence[PageSlab]) -> list[tuple[int, int, int]]:
        """(first page, first slab, count) runs of consecutive pages on consecutive slabs of
        one chunk."""
        runs: list[tuple[int, int, int]] = []
        for page, slab in sorted((block.page, block.slab) for block in blocks):
            if not 0 <= slab < self.grid.capacity or not 0 <= page < self.layout.num_pages:
                raise IndexError(f"page {page} or slab {slab} out of range")
            if runs and self._coalesce:
                first_page, first_slab, count = runs[-1]
                if (
                    page == first_page + count
                    and slab == first_slab + count
                    and self.grid.location(slab)[0] == self.grid.location(first_slab)[0]
                ):
                    runs[-1] = (first_page, first_slab, count + 1)
                    continue
            runs.append((page, slab, 1))
        return runs

    def _block_copies(
        self, layer: LayerPlanes, page: int, slab: int, count: int, to_host: bool
    ) -> Iterator[_Copy]:
        chunk, base = self.grid.location(slab)
        for plane in layer.planes:
            host = _Span(self.chunks[chunk], base + plane.record_offset, self.grid.slab_bytes)
            device = _Span(plane.storage, plane.offset + page * plane.pitch, plane.pitch)
            yield _pair(host, device, plane.nbytes, count, to_host)

    def _image_copies(
        self, layer: LayerPlanes, slot: int, slabs: Sequence[int], to_host: bool
    ) -> Iterator[_Copy]:
        if len(slabs) != self.grid.geometry.image_slabs:
            raise ValueError(f"an image takes {self.grid.geometry.image_slabs} slabs, not {slabs}")
        if not 0 <= slot < self.layout.num_slots:
            raise IndexError(f"state slot {slot} out of range")
        for plane in layer.planes:
            for chunk, offset, done, length in self._image_segments(plane, slabs):
                host = _Span(self.chunks[chunk], offset, length)
                device = _Span(plane.storage, plane.offset + slot * plane.pitch + done, length)
                yield _pair(host, device, length, 1, to_host)

    def _image_segments(
        self, plane: Plane, slabs: Sequence[int]
    ) -> Iterator[tuple[int, int, int, int]]:
        """(chunk, chunk offset, offset in the plane, length) of a plane's image bytes: one
        segment per slab it touches, merged where the slabs are consecutive in one chunk."""
        slab_bytes = self.grid.slab_bytes
        done = 0
        while done < plane.nbytes:
            k, inner = divmod(plane.record_offset + done, slab_bytes)
            chunk, base = self.grid.location(slabs[k])
            length = slab_bytes - inner
            while (
                length < plane.nbytes - done
                and k + 1 < len(slabs)
                and slabs[k + 1] == slabs[k] + 1
                and self.grid.location(slabs[k + 1])[0] == chunk
            ):
                k += 1
                length += slab_bytes
            length = min(length, plane.nbytes - done)
            yield chunk, base + inner, done, length
            done += length

    # -- issuing ----------------------------------------------------------------------------

    def _issue(
        self,
        steps: list[_Step],
        stream_index: int,
        events_per_step: bool,
        after: torch.cuda.Event | None = None,
    ) -> tuple[list[torch.cuda.Event], CopyTiming]:
        """Run the steps in order; on CUDA, on the chosen stream behind ``after`` or the
        compute stream's queued work, with an event after each step (or only after the last)."""
        self.stats.copies += sum(len(step.copies) for step in steps)
        if self._cuda is None or self._streams is None:
            started = time.perf_counter()
            for step in steps:
                for copy in step.copies:
                    for dst, src, nbytes in copy.ranges():
                        copy.dst.storage[dst : dst + nbytes].copy_(
                            copy.src.storage[src : src + nbytes]
                        )
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
            if self.batched:
                self._issue_batch(step, stream)
            else:
                self._issue_each(step, stream)
            last = index == len(steps) - 1
            if events_per_step or last:
                event = torch.cuda.Event(enable_timing=last)
                event.record(stream)
                events.append(event)
        return events, CopyTiming(start, events[-1] if events else None)

    def _issue_batch(self, step: _Step, stream: torch.cuda.Stream) -> None:
        assert self._cuda is not None
        if not step.copies:
            return
        dsts: list[int] = []
        srcs: list[int] = []
        sizes: list[int] = []
        for copy in step.copies:
            dst_base = copy.dst.storage.data_ptr()
            src_base = copy.src.storage.data_ptr()
            for dst, src, nbytes in copy.ranges():
                dsts.append(dst_base + dst)
                srcs.append(src_base + src)
                sizes.append(nbytes)
        to_host = step.copies[0].src.storage.is_cuda
        index = self.layout.device.index or 0
        self._cuda.memcpy_batch_async(dsts, srcs, sizes, to_host, index, stream.cuda_stream)

    def _issue_each(self, step: _Step, stream: torch.cuda.Stream) -> None:
        assert self._cuda is not None
        for copy in step.copies:
            dst = copy.dst.storage.data_ptr() + copy.dst.offset
            src = copy.src.storage.data_ptr() + copy.src.offset
            if copy.height == 1:
                self._cuda.memcpy_async(dst, src, copy.width, stream.cuda_stream)
            else:
                self._cuda.memcpy_2d_async(
                    dst,
                    copy.dst.pitch,
                    src,
                    copy.src.pitch,
                    copy.width,
                    copy.height,
                    stream.cuda_stream,
                )


def _pair(host: _Span, device: _Span, width: int, height: int, to_host: bool) -> _Copy:
    return _Copy(host, device, width, height) if to_host else _Copy(device, host, width, height)


def _bytes(steps: list[_Step]) -> int:
    return sum(c.width * c.height for step in steps for c in step.copies)


def _unregister(runtime: CudaRuntime | None, chunks: list[torch.Tensor]) -> None:
    if runtime is not None:
        for chunk in chunks:
            runtime.host_unregister(chunk.data_ptr())
