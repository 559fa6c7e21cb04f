"""The byte ranges of a host tier batch, computed with array arithmetic rather than per copy.

A step that finishes 16 requests on the Qwen3.5-27B shape writes their blocks (18 pages over
16 attention layers) and endpoint images (96 state planes, each split at slab edges): 5,000-7,000
ranges. Built one Python object a copy, planning them holds the engine's one thread for tens of
milliseconds, while the GPU waits for the next step. So a kind's ranges (pages, or images) for
every layer of a batch come from one array expression over the batch's page, row and slab
numbers, and no Python object is built per range.

Every range is (absolute destination address, absolute source address, bytes), the form
`cudaMemcpyBatchAsync` takes. Ranges that continue one another on both sides, in one host chunk,
are merged, so an image over consecutive slabs moves as one range per plane or fewer. A range
never crosses a chunk edge: each chunk is registered with the driver on its own, and one
transfer over two registrations is not something the driver promises to accept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_hpc.glue.worker.host_layout import DeviceLayout, Plane

if TYPE_CHECKING:
    from vllm_hpc.glue.worker.host_arena import SlabGrid

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True, eq=False)
class CopyRanges:
    """Byte ranges, as int64 arrays of one length: addresses fit in 63 bits on every platform
    PyTorch runs on, so the arrays pass to the driver as its pointer and size arrays."""

    dst: np.ndarray
    src: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    @classmethod
    def empty(cls) -> CopyRanges:
        return cls(_EMPTY, _EMPTY, _EMPTY)

    @classmethod
    def concat(cls, parts: Sequence[CopyRanges]) -> CopyRanges:
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty()
        return cls(
            np.concatenate([p.dst for p in parts]),
            np.concatenate([p.src for p in parts]),
            np.concatenate([p.nbytes for p in parts]),
        )

    def merged(self, fences: np.ndarray | None = None) -> CopyRanges:
        """Runs of ranges that each start where the one before ended, on both sides, as one;
        with ``fences`` (a label a range), only ranges of one label join."""
        if len(self) < 2:
            return self
        ends_dst, ends_src = self.dst[:-1] + self.nbytes[:-1], self.src[:-1] + self.nbytes[:-1]
        joins = (ends_dst == self.dst[1:]) & (ends_src == self.src[1:])
        if fences is not None:
            joins &= fences[:-1] == fences[1:]
        if not joins.any():
            return self
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        return CopyRanges(self.dst[starts], self.src[starts], np.add.reduceat(self.nbytes, starts))

    def as_lists(self) -> tuple[list[int], list[int], list[int]]:
        return self.dst.tolist(), self.src.tolist(), self.nbytes.tolist()


@dataclass(frozen=True, slots=True)
class _Segments:
    """The pieces of a set of planes that each lie in one slab: a column a piece. A page's
    plane is one piece (in slab 0 of its block record); a state plane is one piece per slab of
    the image it touches."""

    device: np.ndarray
    """Address of the piece in unit (page or state row) 0."""
    pitch: np.ndarray
    """Bytes from one unit to the next."""
    slab_index: np.ndarray
    """Which of the record's slabs holds the piece."""
    slab_offset: np.ndarray
    length: np.ndarray

    @classmethod
    def of(cls, rows: list[tuple[int, int, int, int, int]]) -> _Segments:
        device, pitch, slab_index, slab_offset, length = (
            np.array(rows, dtype=np.int64).reshape(-1, 5).T
        )
        return cls(device, pitch, slab_index, slab_offset, length)


@dataclass(frozen=True, slots=True, eq=False)
class Records:
    """The units (pages, or state rows) of a batch and their records' slabs, checked and
    located once for every layer: ``units[i]``'s record starts each of its slabs at host
    address ``bases[i, k]``, in chunk ``chunks[i, k]``."""

    units: np.ndarray
    bases: np.ndarray
    chunks: np.ndarray


class RangePlanner:
    """The ranges of block and image copies between one worker's device layout and its slab
    chunks. Addresses are taken once: the KV buffer and the chunks never move."""

    def __init__(
        self, layout: DeviceLayout, grid: SlabGrid, chunks: Sequence[torch.Tensor]
    ) -> None:
        self._grid = grid
        self._chunk_base = np.array([c.data_ptr() for c in chunks], dtype=np.int64)
        self._units = {False: layout.num_pages, True: layout.num_rows}
        rows = {layer.name: self._rows(layer.planes) for layer in layout.layers}
        self._layers = {name: _Segments.of(r) for name, r in rows.items()}
        self._pages, self._images = (
            _Segments.of([r for x in layout.layers if x.is_state == state for r in rows[x.name]])
            for state in (False, True)
        )

    def _rows(self, planes: Sequence[Plane]) -> list[tuple[int, int, int, int, int]]:
        """(device address, pitch, slab, offset in it, length) of each piece of the planes: a
        record's packed byte ``o`` lives in its slab ``o // slab_bytes``."""
        slab_bytes = self._grid.slab_bytes
        rows = []
        for plane in planes:
            device, done = plane.storage.data_ptr() + plane.offset, 0
            while done < plane.nbytes:
                k, inner = divmod(plane.record_offset + done, slab_bytes)
                length = min(slab_bytes - inner, plane.nbytes - done)
                rows.append((device + done, plane.pitch, k, inner, length))
                done += length
        return rows

    def records(self, units: np.ndarray, slabs: np.ndarray, state: bool) -> Records:
        """``units[i]`` (pages, or with ``state`` state rows) with its record's slabs
        ``slabs[i]`` (one for a block, the image's for an image), checked and located."""
        bad_unit = units[(units < 0) | (units >= self._units[state])]
        if len(bad_unit):
            raise IndexError(f"{'state row' if state else 'page'} {bad_unit[0]} out of range")
        bad_slab = slabs[(slabs < 0) | (slabs >= self._grid.capacity)]
        if len(bad_slab):
            raise IndexError(f"slab {bad_slab[0]} out of range")
        chunks, offsets = self._grid.location(slabs)
        return Records(units, self._chunk_base[chunks] + offsets, chunks)

    def layer(self, name: str, records: Records, to_host: bool) -> CopyRanges:
        """One layer's ranges, unit by unit."""
        return _ranges(self._layers[name], records, to_host)

    def pages(self, records: Records, to_host: bool) -> CopyRanges:
        """Every attention layer's ranges for the blocks, block by block."""
        return _ranges(self._pages, records, to_host)

    def batch(self, blocks: Records, images: Records, to_host: bool) -> CopyRanges:
        """Every layer's ranges for the blocks and the images of a batch, in one expression
        each: block by block, then image by image."""
        return CopyRanges.concat(
            [self.pages(blocks, to_host), _ranges(self._images, images, to_host)]
        )


def _ranges(segments: _Segments, records: Records, to_host: bool) -> CopyRanges:
    if not len(records.units) or not len(segments.length):
        return CopyRanges.empty()
    host = records.bases[:, segments.slab_index] + segments.slab_offset
    device = segments.device + records.units[:, None] * segments.pitch
    sizes = np.broadcast_to(segments.length, host.shape)
    dst, src = (host, device) if to_host else (device, host)
    chunks = records.chunks[:, segments.slab_index].ravel()
    return CopyRanges(dst.ravel(), src.ravel(), sizes.ravel()).merged(fences=chunks)
