"""Recurrent-state snapshots anchored on tree nodes (§5.3)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.types import (
    TICK_ZERO,
    TOKEN_BYTES,
    DiskSlabId,
    Medium,
    PageId,
    Residency,
    SlabId,
    SlotId,
    SnapshotId,
    SnapshotKind,
    Tick,
    resident_media,
)


@dataclass(slots=True, eq=False)
class Snapshot:
    """The complete model state after tokens [0, frontier) of one exact token path.

    The path is the anchor's blocks plus ``tail``: the 0-63 exact tokens after the anchor. A
    snapshot with a tail owns one private page (device and/or host) holding the tail's KV.

    ::

        root ── N0 ── N1 (anchor) ┆ tail ┆
        [0 ............ 128)      [128 .. frontier)
    """

    id: SnapshotId
    kind: SnapshotKind
    anchor: BlockNode = field(repr=False)
    tail: bytes = field(repr=False)
    published: Tick
    # Image copies: a device snapshot slot and/or host slabs.
    slot: SlotId | None = None
    published_plan: int = 0
    """The step plan being built when it was published: its slot's row may be the target of a
    capture copy in that plan, so the row becomes KV pages only in a later one (§5.4)."""
    image_slabs: tuple[SlabId, ...] = ()
    image_host: Residency = Residency.ABSENT
    # Tail copies (only when the tail is not empty).
    tail_page: PageId | None = None
    tail_device: Residency = Residency.ABSENT
    tail_slab: SlabId | None = None
    tail_host: Residency = Residency.ABSENT
    # The disk copy: image and tail (if any) together, written behind the host copy.
    image_disk_slabs: tuple[DiskSlabId, ...] = ()
    image_disk: Residency = Residency.ABSENT
    tail_disk_slab: DiskSlabId | None = None
    tail_disk: Residency = Residency.ABSENT
    restore_pins: int = 0
    """In-flight transfers reading or writing it; its anchor path is pinned with it."""
    disk_pins: int = 0
    """In-flight disk writes and reads of it; its anchor path is disk-pinned with it."""
    # Supersession and recency (§9.2, §9.3).
    superseded: bool = False
    superseded_at: Tick = TICK_ZERO
    last_hit: Tick = TICK_ZERO
    hits: int = 0
    # Nearest snapshot above on the path, and the snapshots whose nearest it is (§9.3).
    ancestor: Snapshot | None = field(default=None, repr=False)
    dependents: set[Snapshot] = field(default_factory=set, repr=False)
    # GDSF valuation: H = base_l + (1 + hits) * cost / size.
    base_l: float = 0.0
    cost: float = 0.0
    size: int = 0
    priority: float = 0.0
    # The disk tier's GDSF: its own L (``disk_base_l``) and its own Z (exclusive disk bytes).
    disk_base_l: float = 0.0
    disk_size: int = 0
    disk_priority: float = 0.0

    @property
    def tail_len(self) -> int:
        return len(self.tail) // TOKEN_BYTES

    @property
    def frontier(self) -> int:
        return self.anchor.end + self.tail_len

    @property
    def holds_host(self) -> bool:
        return bool(self.image_slabs) or self.tail_slab is not None

    @property
    def holds_disk(self) -> bool:
        return bool(self.image_disk_slabs) or self.tail_disk_slab is not None

    @property
    def image_media(self) -> frozenset[Medium]:
        """The tiers holding a resident image (a slot's image is resident)."""
        device = Residency.ABSENT if self.slot is None else Residency.RESIDENT
        return resident_media(device, self.image_host, self.image_disk)

    @property
    def tail_media(self) -> frozenset[Medium]:
        """The tiers holding a resident tail; every tier for a snapshot without one."""
        if not self.tail:
            return frozenset(Medium)
        return resident_media(self.tail_device, self.tail_host, self.tail_disk)

    @property
    def media(self) -> frozenset[Medium]:
        """The tiers a request could restore it from, each alone (image and tail both there)."""
        return self.image_media & self.tail_media

    @property
    def complete_on_device(self) -> bool:
        """Restorable without the host tier: image in a slot and tail (if any) on device."""
        return self.slot is not None and (not self.tail or self.tail_device is Residency.RESIDENT)

    def covers(self, other: Snapshot) -> bool:
        """True when this snapshot lies strictly above ``other`` on other's token path."""
        if other.frontier <= self.frontier:
            return False
        node: BlockNode | None = other.anchor
        below: BlockNode | None = None
        while node is not None and node.depth > self.anchor.depth:
            below, node = node, node.parent
        if node is not self.anchor:
            return False
        following = other.tail if below is None else below.tokens
        return following.startswith(self.tail)
