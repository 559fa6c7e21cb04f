"""Copy plans the index hands to whoever moves the bytes, and reports back on completion.

The index never touches tensor memory or files. An operation that needs data moved reserves the
destinations, marks them Filling, pins the sources and returns one of these records; the copy
runs elsewhere and the matching ``complete_*`` call makes the destinations resident and drops the
pins (§6.5, §7.4, §7.6).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.types import DiskSlabId, PageId, SlabId, SlotId


@dataclass(frozen=True, slots=True, eq=False)
class BlockCopy:
    node: BlockNode
    page: PageId
    slab: SlabId


@dataclass(frozen=True, slots=True, eq=False)
class BlockWrite:
    """Device -> host write-through of a released lane's device-only blocks, page to slab."""

    copies: tuple[BlockCopy, ...]
    pinned: BlockNode
    """Deepest written node; it and its ancestors stay pinned until completion."""


@dataclass(frozen=True, slots=True, eq=False)
class Prefetch:
    """Host -> device copies of a waiting request's host-only path blocks, slab to a new
    cache-owned page (Filling), while it waits for room (§6.6)."""

    copies: tuple[BlockCopy, ...]
    pinned: BlockNode
    """Deepest node of the path; it and its ancestors stay pinned until completion."""


@dataclass(frozen=True, slots=True, eq=False)
class SnapshotWrite:
    """Device -> host write-through of a published snapshot's image (slot) and tail page."""

    snapshot: Snapshot
    slot: SlotId
    image_slabs: tuple[SlabId, ...]
    tail_page: PageId | None
    tail_slab: SlabId | None


@dataclass(frozen=True, slots=True, eq=False)
class Restore:
    """What an admission from a snapshot must copy before the lane can run (§6.4).

    * ``blocks``: host-only path blocks, slab -> a new cache-owned page (Filling);
    * ``tail``: a host-only tail, slab -> a new cache-owned page (Filling);
    * the image: from device slot ``image_slot``, or else from host ``image_slabs``, into the
      lane's own state row;
    * ``tail_page``: the device tail page the lane copies into its private page (COW).
    """

    snapshot: Snapshot
    blocks: tuple[BlockCopy, ...]
    tail: tuple[SlabId, PageId] | None
    image_slot: SlotId | None
    image_slabs: tuple[SlabId, ...]
    tail_page: PageId | None


@dataclass(frozen=True, slots=True, eq=False)
class DiskCopy:
    """One block record between its host slab and its disk slab (either way)."""

    node: BlockNode
    slab: SlabId
    disk_slab: DiskSlabId


@dataclass(frozen=True, slots=True, eq=False)
class DiskWrite:
    """Host -> disk write-behind of a snapshot's image and tail, with the blocks of its anchor
    path not on disk yet (disk-tier plan §1). The host copies stay pinned until the write lands
    or fails; device pages are not pinned."""

    snapshot: Snapshot
    blocks: tuple[DiskCopy, ...]
    image_slabs: tuple[SlabId, ...]
    image_disk_slabs: tuple[DiskSlabId, ...]
    tail: tuple[SlabId, DiskSlabId] | None


@dataclass(frozen=True, slots=True, eq=False)
class DiskRead:
    """Disk -> host read of a snapshot's disk-only parts into new host slabs (Filling, as a
    restore's pages are), so that a host restore can follow (§4 of the plan). The disk copies
    stay pinned until the read lands or fails; device pages are not pinned."""

    snapshot: Snapshot
    blocks: tuple[DiskCopy, ...]
    image_disk_slabs: tuple[DiskSlabId, ...]
    image_slabs: tuple[SlabId, ...]
    """Both empty when the image is in a device slot or on the host."""
    tail: tuple[DiskSlabId, SlabId] | None


class ReadRoom(Enum):
    """What a read from disk may evict from the host tier to make its room (§9.3)."""

    FREE = "free"
    """Free slabs only: the start-up read, which must not push out what requests brought."""
    LOSSLESS = "lossless"
    """What loses nothing too (host copies the disk holds, dead KV, superseded snapshots), no
    last copy: a read ahead of its request's turn, which may not come soon."""
    ANY = "any"
    """By value too, as any hit: the request reads now or recomputes."""


WriteRecord = BlockWrite | SnapshotWrite
"""A host write-through: a path's blocks, or a snapshot's image and tail."""
Transfer = Restore | BlockWrite | SnapshotWrite | Prefetch | DiskWrite | DiskRead
