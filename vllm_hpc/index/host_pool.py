"""Accounting of the pinned host tier and the disk tier: fixed-size slabs shared by blocks and
snapshots (§5.4).

Every record is a whole number of equal slabs, so there is no fragmentation and capacity is just
the free count. Host slabs are grouped in chunks of at most 4 GiB (one huge pinned allocation
can fail or stall); a slab never crosses a chunk, and the binding must not join copies across
chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Generic, TypeVar

from vllm_hpc.index.types import DiskSlabId, SlabId

SLAB_ALIGN_BYTES = 4096
CHUNK_LIMIT_BYTES = 4 << 30


@dataclass(frozen=True, slots=True)
class HostGeometry:
    """Byte sizes of one block record and one snapshot state image."""

    block_bytes: int
    image_bytes: int

    def __post_init__(self) -> None:
        if self.block_bytes <= 0 or self.image_bytes <= 0:
            raise ValueError("block_bytes and image_bytes must be positive")

    @property
    def slab_bytes(self) -> int:
        """One block record rounded up to 4 KiB."""
        return -(-self.block_bytes // SLAB_ALIGN_BYTES) * SLAB_ALIGN_BYTES

    @property
    def image_slabs(self) -> int:
        """ceil(image_bytes / slab_bytes): an image is split over that many (scattered) slabs."""
        return -(-self.image_bytes // self.slab_bytes)

    def snapshot_slabs(self, has_tail: bool) -> int:
        return self.image_slabs + (1 if has_tail else 0)

    @property
    def min_budget_slabs(self) -> int:
        """The smallest host tier: one snapshot with its tail plus one block."""
        return self.snapshot_slabs(has_tail=True) + 1


class SlabUse(IntEnum):
    FREE = 0
    NODE = 1
    IMAGE = 2
    TAIL = 3


Id = TypeVar("Id", SlabId, DiskSlabId)


def budget_slabs(budget_bytes: int, geometry: HostGeometry, tier: str, disable: str) -> int:
    """Whole slabs in ``budget_bytes``; ValueError for a budget that is negative or smaller
    than one snapshot with its tail plus one block. ``tier`` names the budget in the message,
    ``disable`` how to turn the tier off."""
    if budget_bytes < 0:
        raise ValueError(f"{tier} must not be negative, got {budget_bytes}")
    slab_bytes = geometry.slab_bytes
    capacity = budget_bytes // slab_bytes
    minimum = geometry.min_budget_slabs
    if budget_bytes and capacity < minimum:
        raise ValueError(
            f"{tier} {budget_bytes} bytes is smaller than one snapshot with its "
            f"tail plus one block ({minimum} slabs of {slab_bytes} bytes = "
            f"{minimum * slab_bytes} bytes); {disable}"
        )
    return capacity


class SlabPool(Generic[Id]):
    """Slab ids 0..capacity-1 with an O(1) index-stack free list: the allocator of the host and
    the disk tier alike (a disk slab has the host slab's size, §2 of the disk-tier plan)."""

    def __init__(self, capacity: int, geometry: HostGeometry, ids: Callable[[int], Id]) -> None:
        self.geometry = geometry
        self.capacity = capacity
        self._uses = bytearray(self.capacity)
        self._in_use = [0] * len(SlabUse)
        self._free: list[Id] = [ids(s) for s in range(self.capacity - 1, -1, -1)]

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_slabs(self) -> list[Id]:
        return list(self._free)

    def num_in_use(self, use: SlabUse) -> int:
        """Slabs holding blocks, images or tails (for monitoring)."""
        return self._in_use[use]

    def use(self, slab: Id) -> SlabUse:
        return SlabUse(self._uses[slab])

    def allocate(self, count: int, use: SlabUse) -> list[Id] | None:
        """``count`` slabs in ascending order, or None when fewer are free (the caller evicts
        first). Ascending, because the free stack hands back recently freed runs reversed, and
        an image on consecutive slabs moves as one byte range a plane, or fewer."""
        assert use is not SlabUse.FREE
        if count > len(self._free):
            return None
        taken = sorted(self._free.pop() for _ in range(count))
        for slab in taken:
            self._uses[slab] = use
        self._in_use[use] += count
        return taken

    def take(self, slabs: list[Id], use: SlabUse) -> None:
        """Claim these free slabs: a journal's replay names the slabs its entries lie in
        (disk-tier plan §5). ValueError, before any change, for a slab out of range or in use."""
        assert use is not SlabUse.FREE
        wanted = set(slabs)
        if len(wanted) != len(slabs):
            raise ValueError("a slab is named twice")
        if any(not 0 <= slab < self.capacity or self._uses[slab] != SlabUse.FREE for slab in slabs):
            raise ValueError("a slab to take is out of range or not free")
        self._free = [slab for slab in self._free if slab not in wanted]
        for slab in slabs:
            self._uses[slab] = use
        self._in_use[use] += len(slabs)

    def free(self, slabs: tuple[Id, ...] | list[Id]) -> None:
        for slab in slabs:
            assert self._uses[slab] != SlabUse.FREE, f"slab {slab} freed twice"
            self._in_use[self._uses[slab]] -= 1
            self._uses[slab] = SlabUse.FREE
            self._free.append(slab)


class HostSlabPool(SlabPool[SlabId]):
    """The pinned host tier's slabs, in chunks; budget 0 means no host tier."""

    def __init__(self, budget_bytes: int, geometry: HostGeometry) -> None:
        capacity = budget_slabs(
            budget_bytes, geometry, "host cache budget", "use 0 to disable the host tier"
        )
        super().__init__(capacity, geometry, SlabId)
        self.slabs_per_chunk = max(1, CHUNK_LIMIT_BYTES // geometry.slab_bytes)
        full, rest = divmod(self.capacity, self.slabs_per_chunk)
        self.chunk_slabs: tuple[int, ...] = (self.slabs_per_chunk,) * full + (
            (rest,) if rest else ()
        )

    def chunk_of(self, slab: SlabId) -> int:
        return slab // self.slabs_per_chunk

    def location(self, slab: SlabId) -> tuple[int, int]:
        """(chunk index, byte offset inside that chunk) of a slab."""
        chunk, index = divmod(slab, self.slabs_per_chunk)
        return chunk, index * self.geometry.slab_bytes


class DiskSlabPool(SlabPool[DiskSlabId]):
    """The disk tier's slabs: one file of them per rank, no chunks; budget 0 means no disk
    tier."""

    def __init__(self, budget_bytes: int, geometry: HostGeometry) -> None:
        capacity = budget_slabs(
            budget_bytes,
            geometry,
            "IndexConfig.disk_budget_bytes",
            "use 0 to disable the disk tier",
        )
        super().__init__(capacity, geometry, DiskSlabId)
        self._freed: list[DiskSlabId] = []

    def free(self, slabs: tuple[DiskSlabId, ...] | list[DiskSlabId]) -> None:
        super().free(slabs)
        self._freed.extend(slabs)

    def take_freed(self) -> list[DiskSlabId]:
        """Slabs freed since the last call, in order: the disk tier's journal records the
        entries that held them as dropped (a slab may be freed again after reuse)."""
        freed, self._freed = self._freed, []
        return freed
