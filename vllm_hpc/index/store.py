"""The one owner of every copy, pin and derived set of the index (§5.2-§5.4, §9.4).

Every change of residency, refs or pins goes through here, so the derived structures (device
LRU, dead-KV set, superseded order, GDSF values) are resynced at the single place the state
changes. Copies are bookkeeping only: dropping one frees an id, it never waits for data.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from vllm_hpc.index.block_tree import BlockNode, BlockTree
from vllm_hpc.index.config import IndexConfig
from vllm_hpc.index.device_lru import DeviceLRU, LruEntry
from vllm_hpc.index.device_pool import DevicePagePool, PageState
from vllm_hpc.index.eviction_order import (
    KV_PAGE_ROOM,
    SNAPSHOT_SLOT_ROOM,
    STATE_ROW_ROOM,
    Room,
    first_found,
    loses_nothing,
)
from vllm_hpc.index.gdsf import GdsfValuation
from vllm_hpc.index.host_eviction import (
    BackedCopy,
    DeadBlock,
    StaleSnapshot,
    TierEvictor,
    ValuedSnapshot,
)
from vllm_hpc.index.host_pool import DiskSlabPool, HostSlabPool, SlabPool, SlabUse
from vllm_hpc.index.journal import Journal
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.snapshot_slots import DeviceSnapshotSlots, may_give_way
from vllm_hpc.index.snapshot_table import PathChange, SnapshotTable
from vllm_hpc.index.state_rows import choose_kv_row
from vllm_hpc.index.stats import CacheStats
from vllm_hpc.index.types import (
    DiskSlabId,
    Medium,
    PageId,
    Residency,
    RowId,
    SlabId,
    SlotId,
    SnapshotId,
    SnapshotKind,
    Tick,
)

SCRATCH_ROW = RowId(0)
"""The workers' scratch state: vLLM pads unused block-table entries with 0."""


class CacheStore:
    def __init__(
        self, config: IndexConfig, stats: CacheStats, journal: Journal | None = None
    ) -> None:
        self.journal = journal
        """Where residency changes are recorded for KV cache events; None when off."""
        self.tree = BlockTree(config.hasher)
        self.snapshots = SnapshotTable()
        self.pages = DevicePagePool(config.device_pages, config.first_page_id, config.row_pages)
        self.lru = DeviceLRU()
        self.slots = DeviceSnapshotSlots(config.snapshot_slots)
        self.slot_rows: dict[SlotId, RowId] = {}
        """The row holding each staged or owned slot's image (when states share the pages)."""
        self.active_rows: set[RowId] = set()
        """Rows holding running requests' states."""
        self.quarantine: list[RowId] = []
        """State rows given back while the step plan being built may still copy into or out of
        them: their pages become free KV pages once that plan is handed out (`plan_taken`)."""
        self.plan = 0
        """Step plans handed out so far: the number of the plan being built."""
        self.fresh_rows: list[RowId] = []
        """Rows taken from KV pages since the last plan: the workers zero them first."""
        if self.pages.num_rows:
            self.pages.take_row(SCRATCH_ROW)
        self.slabs = HostSlabPool(config.host_budget_bytes, config.geometry)
        self.disk_slabs = DiskSlabPool(config.disk_budget_bytes, config.geometry)
        self.host = TierEvictor(Medium.HOST)
        self.disk = TierEvictor(Medium.DISK)
        self.superseded: OrderedDict[Snapshot, None] = OrderedDict()
        """Every superseded snapshot, in supersession order (both tiers evict them first)."""
        self.value = GdsfValuation(config.cost, config.geometry)
        self.stats = stats
        self.prefetched: set[BlockNode] = set()
        """Device copies a prefetch brought back that no admission has used yet (§6.6)."""
        self.tick = Tick(0)
        """Logical clock: advanced once per mutating call; recency and quote epochs use it."""
        self.prefetch_epoch = 0
        """Counts the changes that can let a prefetch for the same deepest snapshot copy what it
        could not (§6.6): a copy landing (a Filling path no longer blocks), a device copy dropped
        from a node that stays (a block to copy), an entry joining the host-backed device LRU
        (spare room). Free pages, the rest of spare room, the prefetch compares itself; a
        snapshot or node deleted or added changes the deepest snapshot of a match, or does not
        touch its path."""

    def advance(self) -> None:
        self.tick = Tick(self.tick + 1)

    # -- derived-set membership -------------------------------------------------------------

    def sync_node(self, node: BlockNode) -> None:
        """LRU iff device-resident and unheld (backed iff host-resident); the tiers' dead and
        backed sets per §9.3."""
        if self.journal is not None and not node.is_root:
            self._journal_block(node)
        if node.is_root:
            self.tree.discard_root_if_idle(node)
            return
        if node.device is Residency.RESIDENT and not node.held:
            if self.lru.place(node):
                self.prefetch_epoch += 1
        else:
            self.lru.remove(node)
        self.host.sync_node(node)
        self.disk.sync_node(node)

    def _journal_block(self, node: BlockNode) -> None:
        assert self.journal is not None and node.parent is not None
        first = node.parent.is_root
        self.journal.block(node, self.tree.salt_of(node.parent) if first else None)

    def sync_snapshot(self, snapshot: Snapshot) -> None:
        """The tail page's LRU entry iff resident and unpinned; the host's backed set."""
        if self.journal is not None:
            self.journal.snapshot(snapshot)
        if snapshot.tail_device is Residency.RESIDENT and snapshot.restore_pins == 0:
            if self.lru.place(snapshot):
                self.prefetch_epoch += 1
        else:
            self.lru.remove(snapshot)
        self.host.sync_snapshot(snapshot)

    def _apply(self, change: PathChange, *touched: Snapshot) -> None:
        for node in change.crossed:
            self.host.sync_node(node)
            self.disk.sync_node(node)
        owner = () if change.owner is None else (change.owner,)
        for snapshot in (*change.relinked, *owner, *touched):
            if snapshot in self.snapshots:
                self.value.revalue(snapshot)

    def _resize_owner(self, node: BlockNode, medium: Medium, sign: int) -> None:
        """A node's host or disk copy came (``sign`` 1) or went (-1): its exclusive owner (if
        any) changes size on that tier."""
        if node.retained_snapshots_below == 1:
            owner = self.snapshots.by_id[SnapshotId(node.retained_id_sum)]
            self.value.resize(owner, medium, sign * self.value.geometry.block_bytes)

    # -- refs and pins (path-closed) --------------------------------------------------------

    def ref(self, node: BlockNode, delta: int) -> None:
        node.active_refs += delta
        assert node.active_refs >= 0, "ref count below zero"
        self.sync_node(node)

    def pin_path(self, node: BlockNode, delta: int) -> None:
        """Pin (or unpin) ``node`` and every ancestor: a transfer's sources and destinations."""
        current: BlockNode | None = node
        while current is not None:
            current.restore_pins += delta
            assert current.restore_pins >= 0, "pin count below zero"
            self.sync_node(current)
            current = current.parent

    def pin_snapshot(self, snapshot: Snapshot, delta: int) -> None:
        snapshot.restore_pins += delta
        assert snapshot.restore_pins >= 0, "snapshot pin count below zero"
        self.pin_path(snapshot.anchor, delta)
        self.sync_snapshot(snapshot)

    def disk_pin_snapshot(self, snapshot: Snapshot, delta: int) -> None:
        """Pin (or unpin) a disk transfer's snapshot and its path: their host and disk copies
        stay, their device pages stay evictable (path-closed, as `pin_path`)."""
        snapshot.disk_pins += delta
        assert snapshot.disk_pins >= 0, "snapshot disk pin count below zero"
        current: BlockNode | None = snapshot.anchor
        while current is not None:
            current.disk_pins += delta
            assert current.disk_pins >= 0, "disk pin count below zero"
            self.sync_node(current)
            current = current.parent
        self.sync_snapshot(snapshot)

    # -- copies: a destination is Filling until its transfer lands ---------------------------

    def cache_page(self, node: BlockNode, page: PageId) -> None:
        """A sequence's committed page becomes the node's device copy (inserted or adopted)."""
        self.pages.set_state(page, PageState.ACTIVE, PageState.CACHED)
        node.device_page, node.device = page, Residency.RESIDENT
        self.sync_node(node)

    def fill_device(self, node: BlockNode) -> PageId:
        """A device page to restore a host-only node into (room was made by the caller)."""
        (page,) = self.pages.allocate(1, PageState.FILLING)
        node.device_page, node.device = page, Residency.FILLING
        self.sync_node(node)
        return page

    def land_device(self, node: BlockNode) -> None:
        assert node.device is Residency.FILLING and node.device_page is not None
        self.pages.set_state(node.device_page, PageState.FILLING, PageState.CACHED)
        node.device = Residency.RESIDENT
        self.prefetch_epoch += 1
        self.sync_node(node)

    def fill_host(self, node: BlockNode, slab: SlabId) -> None:
        """A write-through destination for a device-resident node."""
        node.host_slab, node.host = slab, Residency.FILLING
        self._resize_owner(node, Medium.HOST, 1)
        self.sync_node(node)

    def land_host(self, node: BlockNode) -> None:
        assert node.host is Residency.FILLING
        node.host = Residency.RESIDENT
        self.prefetch_epoch += 1
        self.sync_node(node)

    def fill_disk(self, node: BlockNode, slab: DiskSlabId) -> None:
        """A disk write's destination for a host-resident node."""
        node.disk_slab, node.disk = slab, Residency.FILLING
        self._resize_owner(node, Medium.DISK, 1)
        self.sync_node(node)

    def add_disk_node(
        self, parent: BlockNode, tokens: bytes, extra: int, slab: DiskSlabId
    ) -> BlockNode:
        """A journaled block comes back disk-only (disk-tier plan §5), under a parent already
        rebuilt; ValueError, before any change, where its slab is taken."""
        self.disk_slabs.take([slab], SlabUse.NODE)
        node = self.tree.insert(parent, tokens, extra)
        self.fill_disk(node, slab)
        self.land_disk(node)
        return node

    def land_disk(self, node: BlockNode) -> None:
        assert node.disk is Residency.FILLING
        node.disk = Residency.RESIDENT
        self.sync_node(node)

    def cancel_host(self, node: BlockNode) -> None:
        """A Filling host copy whose transfer failed goes; the node keeps its other copies."""
        assert node.host is Residency.FILLING and node.host_slab is not None
        self.slabs.free((node.host_slab,))
        self._resize_owner(node, Medium.HOST, -1)
        node.host_slab, node.host = None, Residency.ABSENT
        self.sync_node(node)

    def cancel_disk(self, node: BlockNode) -> None:
        """A Filling disk copy whose write failed goes; the node keeps its other copies."""
        assert node.disk is Residency.FILLING and node.disk_slab is not None
        self.disk_slabs.free((node.disk_slab,))
        self._resize_owner(node, Medium.DISK, -1)
        node.disk_slab, node.disk = None, Residency.ABSENT
        self.sync_node(node)

    def fill_tail_device(self, snapshot: Snapshot) -> PageId:
        (page,) = self.pages.allocate(1, PageState.FILLING)
        snapshot.tail_page, snapshot.tail_device = page, Residency.FILLING
        self.sync_snapshot(snapshot)
        return page

    def land_tail_device(self, snapshot: Snapshot) -> None:
        assert snapshot.tail_device is Residency.FILLING and snapshot.tail_page is not None
        self.pages.set_state(snapshot.tail_page, PageState.FILLING, PageState.CACHED)
        snapshot.tail_device = Residency.RESIDENT
        self.sync_snapshot(snapshot)

    def fill_snapshot_host(
        self, snapshot: Snapshot, image: list[SlabId], tail: SlabId | None
    ) -> None:
        """Host destinations for the image and/or the tail (a disk read may bring one)."""
        assert image or tail is not None
        if image:
            snapshot.image_slabs, snapshot.image_host = tuple(image), Residency.FILLING
        if tail is not None:
            snapshot.tail_slab, snapshot.tail_host = tail, Residency.FILLING
        self.sync_snapshot(snapshot)

    def land_snapshot_host(self, snapshot: Snapshot) -> None:
        assert Residency.FILLING in (snapshot.image_host, snapshot.tail_host)
        if snapshot.image_host is Residency.FILLING:
            snapshot.image_host = Residency.RESIDENT
        if snapshot.tail_host is Residency.FILLING:
            snapshot.tail_host = Residency.RESIDENT
        self.sync_snapshot(snapshot)

    def cancel_snapshot_host(self, snapshot: Snapshot) -> None:
        """Filling host copies whose transfer failed go; resident ones and the other tiers'
        copies stay."""
        if snapshot.image_host is Residency.FILLING:
            self.slabs.free(snapshot.image_slabs)
            snapshot.image_slabs, snapshot.image_host = (), Residency.ABSENT
        if snapshot.tail_host is Residency.FILLING:
            assert snapshot.tail_slab is not None
            self.slabs.free((snapshot.tail_slab,))
            snapshot.tail_slab, snapshot.tail_host = None, Residency.ABSENT
        self.sync_snapshot(snapshot)

    def fill_snapshot_disk(
        self, snapshot: Snapshot, image: list[DiskSlabId], tail: DiskSlabId | None
    ) -> None:
        snapshot.image_disk_slabs, snapshot.image_disk = tuple(image), Residency.FILLING
        if tail is not None:
            snapshot.tail_disk_slab, snapshot.tail_disk = tail, Residency.FILLING
        self.sync_snapshot(snapshot)

    def land_snapshot_disk(self, snapshot: Snapshot) -> None:
        assert snapshot.image_disk is Residency.FILLING
        snapshot.image_disk = Residency.RESIDENT
        if snapshot.tail_disk_slab is not None:
            snapshot.tail_disk = Residency.RESIDENT
        self.value.stamp_disk(snapshot)
        self.sync_snapshot(snapshot)

    def cancel_snapshot_disk(self, snapshot: Snapshot) -> None:
        """Filling disk copies whose write failed go; the snapshot keeps its other copies."""
        assert snapshot.image_disk is Residency.FILLING
        self._free_snapshot_disk(snapshot)
        self.sync_snapshot(snapshot)

    def drop_node_device(self, node: BlockNode) -> None:
        assert not node.held and node.device is Residency.RESIDENT and node.device_page is not None
        self.prefetched.discard(node)
        if node.media == {Medium.DEVICE}:
            self.delete_subtree(node)
            return
        self.pages.free((node.device_page,))
        node.device_page = None
        node.device = Residency.ABSENT
        self.prefetch_epoch += 1
        self.sync_node(node)

    def drop_node_host(self, node: BlockNode) -> None:
        assert not node.slabs_held and node.host is Residency.RESIDENT
        assert node.host_slab is not None
        if node.media == {Medium.HOST}:
            self.delete_subtree(node)
            return
        self.slabs.free((node.host_slab,))
        self._resize_owner(node, Medium.HOST, -1)
        node.host_slab = None
        node.host = Residency.ABSENT
        self.sync_node(node)

    def drop_node_disk(self, node: BlockNode) -> None:
        assert not node.slabs_held and node.disk is Residency.RESIDENT
        assert node.disk_slab is not None
        if node.media == {Medium.DISK}:
            self.delete_subtree(node)
            return
        self.disk_slabs.free((node.disk_slab,))
        self._resize_owner(node, Medium.DISK, -1)
        node.disk_slab = None
        node.disk = Residency.ABSENT
        self.sync_node(node)

    def delete_subtree(self, top: BlockNode) -> None:
        """§9.4: ``top`` lost its last copy; delete it, its subtree and their snapshots."""
        for node in self.tree.subtree(top):
            assert not node.slabs_held, "deleting a held node"
            for snapshot in list(node.snapshots or ()):
                self.delete_snapshot(snapshot)
            assert node.retained_snapshots_below == 0
            if node.device_page is not None:
                self.pages.free((node.device_page,))
                self.lru.remove(node)
            if node.host_slab is not None:
                self.slabs.free((node.host_slab,))
            if node.disk_slab is not None:
                self.disk_slabs.free((node.disk_slab,))
            self.host.forget(node)
            self.disk.forget(node)
            node.device_page, node.device = None, Residency.ABSENT
            node.host_slab, node.host = None, Residency.ABSENT
            node.disk_slab, node.disk = None, Residency.ABSENT
            self.prefetched.discard(node)
            if self.journal is not None:
                self._journal_block(node)
            self.tree.remove_leaf(node)
            self.stats.nodes_deleted += 1

    # -- snapshot copies --------------------------------------------------------------------

    def add_snapshot(
        self,
        anchor: BlockNode,
        tail: bytes,
        kind: SnapshotKind,
        slot: SlotId,
        tail_page: PageId | None,
    ) -> Snapshot:
        snapshot = Snapshot(
            self.snapshots.new_id(), kind, anchor, tail, self.tick, slot=slot, last_hit=self.tick
        )
        self.slots.assign(slot, snapshot)
        snapshot.published_plan = self.plan
        if tail_page is not None:
            self.pages.set_state(tail_page, PageState.ACTIVE, PageState.CACHED)
            snapshot.tail_page, snapshot.tail_device = tail_page, Residency.RESIDENT
        self._register(snapshot)
        self.stats.snapshots_published += 1
        return snapshot

    def add_disk_snapshot(
        self,
        anchor: BlockNode,
        tail: bytes,
        kind: SnapshotKind,
        image: list[DiskSlabId],
        tail_slab: DiskSlabId | None,
        hits: int,
    ) -> Snapshot:
        """A journaled snapshot comes back disk-only (disk-tier plan §5); ValueError, before
        any change, where one of its slabs is taken."""
        pool = self.disk_slabs
        if tail_slab is not None and (
            tail_slab in image
            or not 0 <= tail_slab < pool.capacity
            or pool.use(tail_slab) is not SlabUse.FREE
        ):
            raise ValueError(f"the tail's disk slab {tail_slab} is out of range or not free")
        pool.take(image, SlabUse.IMAGE)
        if tail_slab is not None:
            pool.take([tail_slab], SlabUse.TAIL)
        snapshot = self._add_loaded_snapshot(anchor, tail, kind, hits)
        self.fill_snapshot_disk(snapshot, image, tail_slab)
        self.land_snapshot_disk(snapshot)
        return snapshot

    def _add_loaded_snapshot(
        self, anchor: BlockNode, tail: bytes, kind: SnapshotKind, hits: int
    ) -> Snapshot:
        """A snapshot a load brings back, with its hits and no copy yet (the caller's next)."""
        snapshot = Snapshot(
            self.snapshots.new_id(), kind, anchor, tail, self.tick, last_hit=self.tick, hits=hits
        )
        self._register(snapshot)
        return snapshot

    def _register(self, snapshot: Snapshot) -> None:
        self.value.stamp(snapshot)
        self._apply(self.snapshots.add(snapshot), snapshot)
        self.sync_snapshot(snapshot)

    def delete_snapshot(self, snapshot: Snapshot) -> None:
        assert snapshot.restore_pins == snapshot.disk_pins == 0, "deleting a pinned snapshot"
        if snapshot.slot is not None:
            self.release_slot(snapshot.slot, snapshot.published_plan < self.plan)
            snapshot.slot = None
        if snapshot.tail_page is not None:
            self.pages.free((snapshot.tail_page,))
            snapshot.tail_page, snapshot.tail_device = None, Residency.ABSENT
        self._free_snapshot_host(snapshot)
        self._free_snapshot_disk(snapshot)
        self.lru.remove(snapshot)
        self.host.forget(snapshot)
        self.superseded.pop(snapshot, None)
        self._apply(self.snapshots.remove(snapshot))
        if snapshot.anchor.is_root:
            self.tree.discard_root_if_idle(snapshot.anchor)
        if self.journal is not None:
            self.journal.snapshot(snapshot, deleted=True)
        self.stats.snapshots_deleted += 1

    def _free_snapshot_host(self, snapshot: Snapshot) -> None:
        self.slabs.free(snapshot.image_slabs)
        snapshot.image_slabs, snapshot.image_host = (), Residency.ABSENT
        if snapshot.tail_slab is not None:
            self.slabs.free((snapshot.tail_slab,))
            snapshot.tail_slab, snapshot.tail_host = None, Residency.ABSENT

    def _free_snapshot_disk(self, snapshot: Snapshot) -> None:
        self.disk_slabs.free(snapshot.image_disk_slabs)
        snapshot.image_disk_slabs, snapshot.image_disk = (), Residency.ABSENT
        if snapshot.tail_disk_slab is not None:
            self.disk_slabs.free((snapshot.tail_disk_slab,))
            snapshot.tail_disk_slab, snapshot.tail_disk = None, Residency.ABSENT

    @staticmethod
    def _kept_without(snapshot: Snapshot, medium: Medium, image: bool, tail: bool) -> bool:
        """Whether the snapshot keeps an image and a tail somewhere once its ``image`` and/or
        ``tail`` copies on ``medium`` go; if not, it is lost (§9.4)."""
        gone = frozenset((medium,))
        return bool(
            (snapshot.image_media - gone if image else snapshot.image_media)
            and (snapshot.tail_media - gone if tail else snapshot.tail_media)
        )

    def drop_snapshot_host(self, snapshot: Snapshot) -> None:
        """Give up the host copies; a snapshot with no image or tail left is then lost."""
        if not self._kept_without(snapshot, Medium.HOST, image=True, tail=True):
            self.delete_snapshot(snapshot)
            return
        self._free_snapshot_host(snapshot)
        self.sync_snapshot(snapshot)

    def drop_snapshot_disk(self, snapshot: Snapshot) -> None:
        """Give up the disk copies; a snapshot with no image or tail left is then lost."""
        if not self._kept_without(snapshot, Medium.DISK, image=True, tail=True):
            self.delete_snapshot(snapshot)
            return
        self._free_snapshot_disk(snapshot)
        self.sync_snapshot(snapshot)

    def drop_snapshot_image_device(self, snapshot: Snapshot) -> None:
        assert snapshot.slot is not None
        if not self._kept_without(snapshot, Medium.DEVICE, image=True, tail=False):
            self.delete_snapshot(snapshot)
            return
        self.release_slot(snapshot.slot, snapshot.published_plan < self.plan)
        snapshot.slot = None
        self.sync_snapshot(snapshot)

    def drop_snapshot_tail_device(self, snapshot: Snapshot) -> None:
        assert snapshot.tail_page is not None
        if not self._kept_without(snapshot, Medium.DEVICE, image=False, tail=True):
            self.delete_snapshot(snapshot)
            return
        self.pages.free((snapshot.tail_page,))
        snapshot.tail_page, snapshot.tail_device = None, Residency.ABSENT
        self.sync_snapshot(snapshot)

    # -- supersession and hits --------------------------------------------------------------

    def set_superseded(self, snapshot: Snapshot, superseded: bool) -> None:
        if snapshot.superseded == superseded:
            return
        change = self.snapshots.set_superseded(snapshot, superseded)
        if superseded:
            snapshot.superseded_at = self.tick
            self.superseded[snapshot] = None
        else:
            del self.superseded[snapshot]
        self._apply(change, snapshot)

    def touch(self, snapshot: Snapshot, hit: bool) -> None:
        """A hit (or a duplicate publication) refreshes recency and retains the snapshot."""
        snapshot.hits += 1 if hit else 0
        snapshot.last_hit = self.tick
        self.value.stamp(snapshot)
        if snapshot.superseded:
            self.set_superseded(snapshot, False)
        else:
            self.value.revalue(snapshot)

    # -- eviction ---------------------------------------------------------------------------

    @property
    def available_pages(self) -> int:
        """Free pages plus what eviction can free now: each device LRU entry owns one page, and
        each snapshot that may give way to KV pages one row (§6.3, §9.5)."""
        rows = self.slots.num_give_way(self.plan) if self.pages.num_rows else 0
        return self.pages.num_free + len(self.lru) + rows * self.pages.row_pages

    def row_pages_given_way(self, snapshot: Snapshot) -> int:
        """Pages `available_pages` counts for ``snapshot``'s row: an admission from it pins it."""
        if not self.pages.num_rows or snapshot.slot is None:
            return 0
        return self.pages.row_pages if may_give_way(snapshot, self.plan) else 0

    @property
    def usable_pages(self) -> int:
        """Pages one request could ever use: all but the scratch row."""
        return self.pages.capacity - (self.pages.row_pages if self.pages.num_rows else 0)

    def make_device_room(self, count: int) -> bool:
        """Evict in `KV_PAGE_ROOM` order until ``count`` pages are free, or return False at
        once. Exact (`available_pages`)."""
        if self.pages.num_free >= count:  # the common case: no count of what could go
            return True
        if self.available_pages < count:
            return False
        # Evicting never supersedes a snapshot, gives one a host copy or puts an entry on the
        # LRU: a source found empty is not asked again (the snapshots' is an O(D) scan).
        sources = deque(KV_PAGE_ROOM)
        while self.pages.num_free < count:
            assert sources, "available_pages counted a row that cannot go"
            if not self._free_pages_from(sources[0]):
                sources.popleft()
        return True

    def _free_pages_from(self, source: Room) -> bool:
        """Free a page, or a snapshot's row of them, from ``source``; False when it has none."""
        match source:
            case Room.BACKED_PAGE | Room.UNBACKED_PAGE:
                entry = self.lru.oldest(backed=source is Room.BACKED_PAGE)
                if entry is not None:
                    self._evict(entry)
                return entry is not None
            case Room.LOSSLESS_SNAPSHOT | Room.SNAPSHOT:
                victim = self._giving_way(source, self.plan, None)
                if victim is not None:
                    self._drop_image(victim)
                return victim is not None
        raise ValueError(f"KV pages do not come from a {source.value}")

    def _evict(self, entry: LruEntry) -> None:
        """Drop one device LRU entry's page, counted as backed or unbacked (§9.1, §9.4)."""
        if self.lru.is_backed(entry):
            self.stats.device_evictions_backed += 1
        else:
            self.stats.device_evictions_unbacked += 1
        if isinstance(entry, Snapshot):
            self.drop_snapshot_tail_device(entry)
        else:
            self.drop_node_device(entry)

    def make_host_room(self, count: int, limit: float | None = None) -> bool:
        """Evict from the host tier (§9.3) until ``count`` slabs are free.

        Returns False when nothing more may go; what was evicted stays evicted.
        """
        return self._make_tier_room(self.host, self.slabs, count, limit)

    def make_disk_room(self, count: int, limit: float | None = None) -> bool:
        """`make_host_room` for the disk tier, by its own order and values."""
        return self._make_tier_room(self.disk, self.disk_slabs, count, limit)

    def _make_tier_room(
        self,
        tier: TierEvictor,
        pool: SlabPool[SlabId] | SlabPool[DiskSlabId],
        count: int,
        limit: float | None,
    ) -> bool:
        host = tier.medium is Medium.HOST
        stats = self.stats
        while pool.num_free < count:
            victim = tier.next_victim(self.snapshots, self.superseded, limit)
            if victim is None:
                return False
            match victim:
                case BackedCopy(entry):
                    stats.host_backed_evicted += 1
                    if isinstance(entry, Snapshot):
                        self.drop_snapshot_host(entry)
                    else:
                        self.drop_node_host(entry)
                case DeadBlock(node):
                    if host:
                        stats.host_dead_reclaimed += 1
                        self.drop_node_host(node)
                    else:
                        stats.disk_dead_reclaimed += 1
                        self.drop_node_disk(node)
                case StaleSnapshot(snapshot):
                    # Only this tier's copy: one still in a device slot keeps serving edits and
                    # retries until the slot is wanted (superseded owners go first there too).
                    if host:
                        stats.host_superseded_evicted += 1
                        self.drop_snapshot_host(snapshot)
                    else:
                        stats.disk_superseded_evicted += 1
                        self.drop_snapshot_disk(snapshot)
                case ValuedSnapshot(snapshot):
                    if host:
                        stats.host_gdsf_evicted += 1
                        self.value.inflate(snapshot.priority)
                        self.drop_snapshot_host(snapshot)
                    else:
                        stats.disk_gdsf_evicted += 1
                        self.value.inflate_disk(snapshot.disk_priority)
                        self.drop_snapshot_disk(snapshot)
        return True

    def take_slot(self, new_priority: float) -> SlotId | None:
        """A device snapshot slot for a capture, by `SNAPSHOT_SLOT_ROOM`, staged; None to skip
        it. ``new_priority`` is the capture's estimated value (`may_replace`)."""
        if self.slots.num_free and not self.pages.num_rows:
            return self._stage(self.slots.next_free, None)
        return first_found(SNAPSHOT_SLOT_ROOM, lambda source: self._slot_from(source, new_priority))

    def _slot_from(self, source: Room, new_priority: float) -> SlotId | None:
        """A slot from ``source``, staged with its row; None when it has none."""
        if source is Room.REPLACED_SNAPSHOT:
            victim = self.slots.replacement(new_priority)
            if victim is None:
                return None
            assert victim.slot is not None
            slot, row = victim.slot, self.slot_rows.pop(victim.slot, None)
            self._drop_image(victim)
            return self._stage(slot, row)
        if not self.slots.num_free:
            return None
        slot = self.slots.next_free  # before the row: evicting for it may free other slots
        row = self._row_from(source, frozenset(), None)
        return None if row is None else self._stage(slot, row)

    def _stage(self, slot: SlotId, row: RowId | None) -> SlotId:
        self.slots.stage(slot)
        if row is not None:
            self.slot_rows[slot] = row
        return slot

    def release_slot(self, slot: SlotId, row_unused: bool) -> None:
        """Free a slot and give its row back to KV: at once when no copy of the plan being
        built can touch the row (``row_unused``), else once that plan is handed out."""
        self.slots.release(slot)
        row = self.slot_rows.pop(slot, None)
        if row is not None:
            self.give_back_row(row, row_unused)

    # -- state rows (§5.4) ---------------------------------------------------------

    def take_state_row(self, protected: frozenset[PageId], keep: Snapshot | None) -> RowId | None:
        """A row for a running request's state (§9.5: active requests win), by
        `STATE_ROW_ROOM`, or None when every row holds something in use. ``protected`` pages
        and ``keep`` (the admission's own source) stay."""
        row = first_found(STATE_ROW_ROOM, lambda source: self._row_from(source, protected, keep))
        if row is not None:
            self.active_rows.add(row)
        return row

    def _row_from(
        self, source: Room, protected: frozenset[PageId], keep: Snapshot | None
    ) -> RowId | None:
        """A row for a state from ``source``, evicting what it holds; None when it has none."""
        match source:
            case Room.GIVEN_BACK_ROW:
                return self._take_quarantined()
            case Room.LOSSLESS_KV_ROW | Room.KV_ROW:
                return self._take_kv_row(protected, source is Room.LOSSLESS_KV_ROW)
            case Room.LOSSLESS_SNAPSHOT | Room.SNAPSHOT:
                victim = self._giving_way(source, None, keep)
                return None if victim is None else self._row_of_snapshot(victim)
        raise ValueError(f"a state row does not come from a {source.value}")

    @property
    def state_rows_held(self) -> int:
        """Rows that are states now: the scratch, running requests', slots', the quarantine."""
        if not self.pages.num_rows:
            return 0
        return 1 + len(self.active_rows) + len(self.slot_rows) + len(self.quarantine)

    def release_state_row(self, row: RowId, unused: bool = False) -> None:
        """A running request's state is no longer needed; its row returns to KV after the plan
        being built (whose copies may read it, as the request's last capture does). An
        ``unused`` row taken from KV pages in this plan returns at once; one taken over from a
        state (a quarantined or a snapshot's row) may still be read or written by this plan's
        copies, so it waits too."""
        self.active_rows.remove(row)
        self.give_back_row(row, now=unused and row in self.fresh_rows)

    def give_back_row(self, row: RowId, now: bool) -> None:
        if now:
            if row in self.fresh_rows:  # KV pages again before the workers zeroed it
                self.fresh_rows.remove(row)
            self.pages.give_row(row)
            self.prefetch_epoch += 1
        else:
            self.quarantine.append(row)

    def plan_taken(self) -> None:
        """The plan being built was handed out: quarantined rows become free KV pages."""
        self.plan += 1
        for row in self.quarantine:
            self.give_back_row(row, now=True)
        self.quarantine.clear()

    def _take_quarantined(self) -> RowId | None:
        """A row just given back serves a new state at once: copies into and out of state rows
        keep their order within a plan. Only KV pages must wait for the plan to go out."""
        return self.quarantine.pop() if self.quarantine else None

    def _take_kv_row(self, protected: frozenset[PageId], lossless_only: bool) -> RowId | None:
        choice = choose_kv_row(self.pages, self.lru, protected, lossless_only)
        if choice is None:
            return None
        for entry in choice.evict:
            if entry in self.lru:  # else gone with an ancestor evicted just before
                self._evict(entry)
        self.pages.take_row(choice.row)
        self.fresh_rows.append(choice.row)
        self.stats.state_rows_from_kv += 1
        return choice.row

    def _row_of_snapshot(self, victim: Snapshot) -> RowId:
        """Take the victim's row over directly (copies into it stay ordered in the plan)."""
        assert victim.slot is not None
        row = self.slot_rows.pop(victim.slot)
        self._drop_image(victim)
        return row

    def _giving_way(
        self, source: Room, plan: int | None, exclude: Snapshot | None
    ) -> Snapshot | None:
        """The next owner by `GIVE_WAY`, or None; for `Room.LOSSLESS_SNAPSHOT`, only one that
        loses nothing."""
        victim = self.slots.give_way(plan, exclude)
        if victim is None or (source is Room.LOSSLESS_SNAPSHOT and not loses_nothing(victim)):
            return None
        return victim

    def _drop_image(self, victim: Snapshot) -> None:
        """The victim gives its slot up and loses its device image (and, device-only,
        everything). L rises only for a value victim: a superseded one goes first by rule
        (§9.2, §9.3)."""
        self.stats.slot_evictions += 1
        if not loses_nothing(victim):
            self.value.inflate(victim.priority)
        self.drop_snapshot_image_device(victim)
