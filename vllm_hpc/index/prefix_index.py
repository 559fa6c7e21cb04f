"""PrefixIndex: the facade a scheduler-side KV-cache manager drives (§4, §6, §7, §9).

The manager is the only mutator and calls from one thread. Operations that need bytes moved
return a plan from ``transfers`` and expect the matching ``complete_*`` call once the copy has
landed. Caller mistakes raise ``ValueError``; "no room now" is a ``None`` return.

A request's life::

    prompt = index.prepare_prompt(tokens, cache_salt=salt)      # off the hot path
    quote = index.quote(index.match(prompt), growth_pages)      # READY / BLOCKED / INFEASIBLE
    admission = index.acquire(quote)                            # refs, pins, restore plan
    ... copy admission.restore, then index.complete_restore(admission.restore)
    ... per full block: index.commit_block(lease, tokens, page)
    ... per tap: slot = index.take_snapshot_slot(...); copy the state in; publish_snapshot(...)
    write = index.release(lease)                                # write-through plan
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import takewhile

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.config import IndexConfig
from vllm_hpc.index.device_pool import PageState
from vllm_hpc.index.eviction_order import most_valuable_on_disk, value_key
from vllm_hpc.index.host_eviction import snapshot_pinned
from vllm_hpc.index.host_pool import SlabUse
from vllm_hpc.index.invariants import check_invariants
from vllm_hpc.index.journal import Journal, JournalEvent
from vllm_hpc.index.lease import Lease
from vllm_hpc.index.outcomes import CommitOutcome, CommitResult, Publication
from vllm_hpc.index.prompt import MediaItem, PreparedPrompt, pack_tokens, prepare_prompt
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.source_choice import (
    AdmissionGrant,
    AdmissionQuote,
    GrowthPages,
    MatchResult,
    choose,
    classify,
    lookup,
    record_read,
    source_options,
)
from vllm_hpc.index.stats import CacheStats
from vllm_hpc.index.store import CacheStore
from vllm_hpc.index.supersession import may_supersede
from vllm_hpc.index.transfers import (
    BlockCopy,
    BlockWrite,
    DiskCopy,
    DiskRead,
    DiskWrite,
    Prefetch,
    ReadRoom,
    Restore,
    SnapshotWrite,
    Transfer,
    WriteRecord,
)
from vllm_hpc.index.types import (
    BLOCK_BYTES_PACKED,
    BLOCK_TOKENS,
    DiskSlabId,
    Medium,
    PageId,
    Residency,
    RowId,
    SlotId,
    SnapshotKind,
)

PREFETCH_BLOCKS = 256
"""Blocks one prefetch copies at most (§6.6): about 1 GB of a 27B-shaped model's KV."""


class StaleQuoteError(ValueError):
    """The cache changed between ``quote`` and ``acquire``: quote again."""


@dataclass(frozen=True, slots=True, eq=False)
class _FruitlessPrefetch:
    """A prefetch attempt that copied nothing, and what its answer depended on (§6.6)."""

    target: Snapshot | None
    """The match's deepest candidate: the prefetch copies its path."""
    limit: int
    epoch: int
    """``CacheStore.prefetch_epoch`` after the attempt."""
    free_pages: int

    def still_holds(self, match: MatchResult, limit: int, store: CacheStore) -> bool:
        """Whether an attempt now is sure to copy nothing as well: the same deepest candidate
        (so the same path), no change since that can open a copy, no more free pages."""
        return (
            _target(match) is self.target
            and limit == self.limit
            and store.prefetch_epoch == self.epoch
            and store.pages.num_free <= self.free_pages
        )


class PrefixIndex:
    def __init__(self, config: IndexConfig) -> None:
        self.config = config
        self.stats = CacheStats()
        self.journal = Journal() if config.record_events else None
        """Residency changes since `drain_events`; None unless ``config.record_events``."""
        self.store = CacheStore(config, self.stats, self.journal)
        """Internal state, exposed for tests and diagnostics: mutate only through this facade."""
        self._leases: set[Lease] = set()
        self._in_flight: set[Transfer] = set()
        self._kept_reads: set[DiskRead] = set()
        """Landed disk reads whose pins stay until their request is admitted or leaves."""
        self._fruitless: _FruitlessPrefetch | None = None

    # -- lookup and admission ---------------------------------------------------------------

    def prepare_prompt(
        self,
        tokens: Iterable[int],
        *,
        media: Sequence[MediaItem] = (),
        cache_salt: str | None = None,
    ) -> PreparedPrompt:
        """Pack the prompt and hash its blocks with this index's hasher (once per prompt)."""
        return prepare_prompt(
            tokens, hasher=self.store.tree.hasher, media=media, cache_salt=cache_salt
        )

    def match(self, prompt: PreparedPrompt, limit: int | None = None) -> MatchResult:
        """Matched path and candidate snapshots (§6.1), no deeper than ``limit`` tokens when
        given. Read-only."""
        return lookup(self.store.tree, prompt, limit)

    def quote(
        self, match: MatchResult, growth_pages: GrowthPages, disk: bool = True
    ) -> AdmissionQuote:
        """Choose a source by cost and classify it by page arithmetic (§6.2, §6.3). Read-only.
        A source with ``disk_bytes`` needs `plan_disk_read` before it can be acquired;
        ``disk=False`` quotes only sources that need none."""
        store = self.store
        options = source_options(
            match,
            store.lru,
            store.value.cost,
            store.value.geometry,
            store.row_pages_given_way,
            disk and store.disk_slabs.enabled,
            store.slabs.capacity,
        )
        readiness, source, need = classify(
            options, growth_pages, store.available_pages, store.usable_pages
        )
        return AdmissionQuote(readiness, source, choose(options), need, match, store.tick)

    def is_current(self, quote: AdmissionQuote) -> bool:
        """Nothing changed since ``quote``: its match and source still hold."""
        return quote.epoch == self.store.tick

    def acquire(self, quote: AdmissionQuote) -> AdmissionGrant:
        """Ref the quoted source's path, pin its snapshot and reserve restore destinations."""
        store = self.store
        source = quote.source
        if source is None:
            raise ValueError(f"cannot acquire a {quote.readiness.value} quote")
        if not self.is_current(quote):
            raise StaleQuoteError(f"quote of tick {quote.epoch}, cache at tick {store.tick}")
        if source.disk_bytes:
            raise ValueError("the source needs a disk read first (plan_disk_read)")
        store.advance()
        lease = Lease(store.tree.root_for(quote.match.prompt.cache_salt))
        store.ref(lease.root, 1)
        self._leases.add(lease)
        snapshot = source.snapshot
        if snapshot is None:
            self.stats.misses += 1
            return AdmissionGrant(lease, None, 0, None)
        for node in quote.match.path[: snapshot.anchor.depth + 1]:
            store.ref(node, 1)
            lease.path.append(node)
            if node in store.prefetched:
                store.prefetched.remove(node)
                self.stats.prefetched_blocks_used += 1
        store.pin_snapshot(snapshot, 1)
        room = store.make_device_room(source.restore_pages)
        assert room, "a fresh READY quote must fit"
        blocks = []
        for node in lease.path:
            if node.device is Residency.ABSENT:
                assert node.host_slab is not None
                blocks.append(BlockCopy(node, store.fill_device(node), node.host_slab))
        tail = None
        if snapshot.tail and snapshot.tail_device is Residency.ABSENT:
            assert snapshot.tail_slab is not None
            tail = (snapshot.tail_slab, store.fill_tail_device(snapshot))
        store.touch(snapshot, hit=True)
        lease.resumed_from = snapshot
        lease.resumed_from_endpoint = snapshot.kind is SnapshotKind.ENDPOINT
        lease.previous_frontier = snapshot.frontier
        restore = Restore(
            snapshot=snapshot,
            blocks=tuple(blocks),
            tail=tail,
            image_slot=snapshot.slot,
            image_slabs=snapshot.image_slabs if snapshot.slot is None else (),
            tail_page=snapshot.tail_page,
        )
        self._in_flight.add(restore)
        if source.host_bytes:
            self.stats.hits_host += 1
        else:
            self.stats.hits_device += 1
        return AdmissionGrant(lease, snapshot, snapshot.frontier, restore)

    def complete_restore(self, restore: Restore) -> None:
        """The restore's copies landed (and the lane copied the image and tail out)."""
        self._finish(restore)
        for copy in restore.blocks:
            self.store.land_device(copy.node)
        if restore.tail is not None:
            self.store.land_tail_device(restore.snapshot)
        self.store.pin_snapshot(restore.snapshot, -1)

    def prefetch(self, match: MatchResult, limit: int = PREFETCH_BLOCKS) -> Prefetch | None:
        """§6.6: copy up to ``limit`` host-only blocks of the path to the deepest candidate into
        spare device pages while its request waits; None when there is nothing to copy.

        Spare pages are free ones and host-backed cached ones: a prefetch never drops a last
        copy. The path stays pinned until ``complete_prefetch``; the blocks then sit at the MRU
        end of the device LRU like any cached block, and the admission finds them resident.

        A request waits for many steps, and checking its path costs about as much as matching
        it. After an attempt that copied nothing, an attempt for a match with the same deepest
        candidate is answered without a look at the path until a change that can open a copy
        (``CacheStore.prefetch_epoch``) or more free pages. (The spec retries while the last
        attempt copied blocks or spare room grew; a landing or an eviction can open one too.)
        ``match`` must be current, as for ``quote``.
        """
        store = self.store
        last = self._fruitless
        if last is not None and last.still_holds(match, limit, store):
            self.stats.prefetches_skipped += 1
            return None
        prefetch = self._prefetch(match, limit)
        self._fruitless = (
            None
            if prefetch is not None
            else _FruitlessPrefetch(
                _target(match), limit, store.prefetch_epoch, store.pages.num_free
            )
        )
        return prefetch

    def _prefetch(self, match: MatchResult, limit: int) -> Prefetch | None:
        if not match.candidates or not self.store.slabs.enabled:
            return None
        store = self.store
        path = match.path[: match.candidates[-1].anchor.depth + 1]
        if any(Residency.FILLING in (node.device, node.host) for node in path):
            return None  # another transfer is landing on this path: its own time will come
        # Only as deep as the host reaches: a disk-only block needs a disk read first.
        path = list(takewhile(lambda node: bool(node.media - {Medium.DISK}), path))
        wanted = [node for node in path if node.device is Residency.ABSENT]
        if not wanted:
            return None
        store.advance()
        store.pin_path(path[-1], 1)  # off the LRU: making room must not take the path itself
        count = min(len(wanted), limit, store.pages.num_free + store.lru.num_backed)
        if count == 0:
            store.pin_path(path[-1], -1)
            return None
        assert store.make_device_room(count)
        copies = []
        for node in wanted[:count]:
            assert node.host_slab is not None
            copies.append(BlockCopy(node, store.fill_device(node), node.host_slab))
        prefetch = Prefetch(tuple(copies), path[-1])
        self._in_flight.add(prefetch)
        self.stats.blocks_prefetched += count
        return prefetch

    def complete_prefetch(self, prefetch: Prefetch) -> None:
        """The prefetch's copies landed: the blocks are device-resident cache."""
        self._finish(prefetch)
        for copy in prefetch.copies:
            self.store.land_device(copy.node)
            self.store.prefetched.add(copy.node)
        self.store.pin_path(prefetch.pinned, -1)

    # -- the disk tier (disk-tier plan §1, §3) ----------------------------------------------

    def plan_disk_writes(self, max_bytes: int) -> list[DiskWrite]:
        """Write-behind: the most valuable retained snapshots whose image and tail are on the
        host and not on disk, each with the blocks of its anchor path not on disk yet, while
        their bytes fit ``max_bytes``. Blocks with no snapshot below (dead KV) are never
        written: nothing resumes from them. Disk room comes by `DISK_EVICTION`, never from a
        snapshot worth more on disk than the one written. The host copies stay pinned until
        ``complete_disk_write`` or ``fail_disk_write``."""
        if max_bytes < 0:
            raise ValueError(f"max_bytes must not be negative, got {max_bytes}")
        store = self.store
        if not store.disk_slabs.enabled:
            return []
        candidates = sorted(filter(_writable, store.snapshots), key=value_key, reverse=True)
        if candidates:
            store.advance()
        slab_bytes = store.value.geometry.slab_bytes
        writes: list[DiskWrite] = []
        for snapshot in candidates:
            # An earlier write of this plan may have taken a shared block, or made disk room.
            if snapshot not in store.snapshots or not _writable(snapshot):
                continue
            write = self._write_to_disk(snapshot, max_bytes // slab_bytes)
            if write is not None:
                writes.append(write)
                max_bytes -= _disk_slabs(write) * slab_bytes
        return writes

    def _write_to_disk(self, snapshot: Snapshot, max_slabs: int) -> DiskWrite | None:
        store = self.store
        image_count = store.value.geometry.image_slabs
        blocks = [node for node in snapshot.anchor.path() if node.disk is Residency.ABSENT]
        count = image_count + bool(snapshot.tail) + len(blocks)
        if count > max_slabs:
            return None
        store.disk_pin_snapshot(snapshot, 1)  # making room must not take its own path
        if not store.make_disk_room(count, limit=store.value.disk_estimate(snapshot)):
            store.disk_pin_snapshot(snapshot, -1)
            self.stats.disk_writes_declined += 1
            return None
        pool = store.disk_slabs
        block_slabs = pool.allocate(len(blocks), SlabUse.NODE)
        image = pool.allocate(image_count, SlabUse.IMAGE)
        tail = pool.allocate(1, SlabUse.TAIL) if snapshot.tail else []
        assert block_slabs is not None and image is not None and tail is not None
        copies = []
        for node, disk_slab in zip(blocks, block_slabs, strict=True):
            assert node.host_slab is not None
            store.fill_disk(node, disk_slab)
            copies.append(DiskCopy(node, node.host_slab, disk_slab))
        store.fill_snapshot_disk(snapshot, image, tail[0] if tail else None)
        tail_pair = None
        if tail:
            assert snapshot.tail_slab is not None
            tail_pair = (snapshot.tail_slab, tail[0])
        write = DiskWrite(snapshot, tuple(copies), snapshot.image_slabs, tuple(image), tail_pair)
        self._in_flight.add(write)
        self.stats.disk_writes += 1
        return write

    def complete_disk_write(self, write: DiskWrite) -> None:
        """The write's slabs are on disk (and, from step 2 on, journaled)."""
        self._finish(write)
        for copy in write.blocks:
            self.store.land_disk(copy.node)
        self.store.land_snapshot_disk(write.snapshot)
        self.store.disk_pin_snapshot(write.snapshot, -1)

    def fail_disk_write(self, write: DiskWrite) -> None:
        """The write did not land: its disk slabs are free again, the host copies unpinned."""
        self._finish(write)
        for copy in write.blocks:
            self.store.cancel_disk(copy.node)
        self.store.cancel_snapshot_disk(write.snapshot)
        self.store.disk_pin_snapshot(write.snapshot, -1)
        self.stats.disk_writes_failed += 1

    def plan_disk_read(self, snapshot: Snapshot, room: ReadRoom = ReadRoom.ANY) -> DiskRead | None:
        """Read what only the disk holds of ``snapshot`` and its path into new host slabs,
        evicting from the host what ``room`` allows, so a host restore can follow (§4 of the
        plan): the path's disk-only blocks, and its image and tail as one record (the journal's
        CRC covers both) where the host holds neither and the device does not hold all it needs.
        None when nothing is to read, a copy of it is landing, a path block has only a device
        copy (the device LRU may drop it, and a disk read pins no device page), or the host has
        no room (counted as declined for a hit's read alone: `ReadRoom.ANY`)."""
        store = self.store
        if snapshot not in store.snapshots:
            raise ValueError("the snapshot is not in this index")
        path = snapshot.anchor.path()
        if any(not node.media - {Medium.DEVICE} or _filling(node) for node in path):
            return None
        record = record_read(snapshot, disk=True)
        if record is None or _filling_snapshot(snapshot):
            return None
        disk_only = frozenset((Medium.DISK,))
        blocks = [node for node in path if node.media == disk_only]
        image_count = store.value.geometry.image_slabs if record else 0
        read_tail = record and bool(snapshot.tail)
        count = len(blocks) + image_count + read_tail
        if not count or (room is ReadRoom.FREE and count > store.slabs.num_free):
            return None
        store.advance()
        store.disk_pin_snapshot(snapshot, 1)  # making room must not take its own path
        # A limit below every value: the eviction stops where a last copy would go.
        limit = -math.inf if room is ReadRoom.LOSSLESS else None
        if not store.make_host_room(count, limit=limit):
            store.disk_pin_snapshot(snapshot, -1)
            if room is ReadRoom.ANY:
                self.stats.disk_reads_declined += 1
            return None
        pool = store.slabs
        block_slabs = pool.allocate(len(blocks), SlabUse.NODE)
        image = pool.allocate(image_count, SlabUse.IMAGE)
        tail = pool.allocate(1, SlabUse.TAIL) if read_tail else []
        assert block_slabs is not None and image is not None and tail is not None
        copies = []
        for node, slab in zip(blocks, block_slabs, strict=True):
            assert node.disk_slab is not None
            store.fill_host(node, slab)
            copies.append(DiskCopy(node, slab, node.disk_slab))
        tail_pair = None
        if tail:
            assert snapshot.tail_disk_slab is not None
            tail_pair = (snapshot.tail_disk_slab, tail[0])
        if image:
            store.fill_snapshot_host(snapshot, image, tail[0] if tail else None)
        image_disk = snapshot.image_disk_slabs if image else ()
        read = DiskRead(snapshot, tuple(copies), image_disk, tuple(image), tail_pair)
        self._in_flight.add(read)
        self.stats.disk_reads += 1
        return read

    def preload_order(self) -> list[Snapshot]:
        """The snapshots the disk holds, most valuable first by its own value: what a start-up
        reads into the host tier's free room, in order (`most_valuable_on_disk`)."""
        return most_valuable_on_disk(self.store.snapshots)

    def complete_disk_read(self, read: DiskRead, keep: bool = False) -> None:
        """The read's host slabs hold the records: they are host copies like any other. With
        ``keep`` its disk pin stays until `release_disk_read`: the copies it brought are
        disk-backed, so host eviction would take them first (§9.3) before the request waiting
        for them is admitted, and it would read them again."""
        self._finish(read)
        for copy in read.blocks:
            self.store.land_host(copy.node)
        if read.image_slabs:
            self.store.land_snapshot_host(read.snapshot)
        if keep:
            self._kept_reads.add(read)
        else:
            self.store.disk_pin_snapshot(read.snapshot, -1)

    def holds_read(self, read: DiskRead) -> bool:
        """Whether ``read`` landed and is kept pinned (`complete_disk_read` with ``keep``)."""
        return read in self._kept_reads

    def release_disk_read(self, read: DiskRead) -> None:
        """The request a kept read waited for was admitted or left: its copies are unpinned."""
        if read not in self._kept_reads:
            raise ValueError("the read is not kept")
        self._kept_reads.remove(read)
        self.store.disk_pin_snapshot(read.snapshot, -1)

    def fail_disk_read(self, read: DiskRead, damaged: Sequence[BlockNode | Snapshot] = ()) -> int:
        """The read did not land: its host slabs are free again and the disk copies unpinned.
        The ``damaged`` records (a path block, the snapshot) failed their check: their disk
        copies go, and where one was a last copy what depends on it (§9.4), so that a lookup
        finds a shallower source. A record another transfer still holds stays (a later read
        checks it again). Returns the records dropped."""
        self._finish(read)
        store = self.store
        for copy in read.blocks:
            store.cancel_host(copy.node)
        if read.image_slabs:
            store.cancel_snapshot_host(read.snapshot)
        store.disk_pin_snapshot(read.snapshot, -1)
        self.stats.disk_reads_failed += 1
        dropped = 0
        for entry in damaged:
            if isinstance(entry, Snapshot):
                if entry not in store.snapshots or not entry.holds_disk or snapshot_pinned(entry):
                    continue
                store.drop_snapshot_disk(entry)
            else:
                if entry.disk is not Residency.RESIDENT or entry.slabs_held:
                    continue
                store.drop_node_disk(entry)
            dropped += 1
        self.stats.disk_records_dropped += dropped
        return dropped

    # -- active pages -----------------------------------------------------------------------

    @property
    def available_pages(self) -> int:
        """Free pages plus evictable cached ones and snapshot rows: what active sequences may
        claim (§9.5)."""
        return self.store.available_pages

    # -- state rows (§5.4) ---------------------------------------------------------

    @property
    def row_pages(self) -> int:
        """Pages per state row; 0 when states live outside the page space."""
        return self.store.pages.row_pages if self.store.pages.num_rows else 0

    def take_state_row(self, quote: AdmissionQuote | None = None) -> RowId | None:
        """A row for a request about to be admitted, evicting as `CacheStore.take_state_row`
        orders; None when none can be had now (the request waits). ``quote``'s source (its
        path, tail and image) stays, so a fresh quote can still choose it."""
        store = self.store
        store.advance()
        protected: frozenset[PageId] = frozenset()
        keep = quote.source.snapshot if quote is not None and quote.source is not None else None
        if quote is not None and keep is not None:
            path = quote.match.path[: keep.anchor.depth + 1]
            pages = {node.device_page for node in path if node.device_page is not None}
            if keep.tail_page is not None:
                pages.add(keep.tail_page)
            protected = frozenset(pages)
        return store.take_state_row(protected, keep)

    def release_state_row(self, row: RowId, unused: bool = False) -> None:
        """A running request's row goes back (`CacheStore.release_state_row`)."""
        self.store.advance()
        self.store.release_state_row(row, unused)

    def slot_row(self, slot: SlotId) -> RowId:
        """The row holding snapshot slot ``slot``'s image."""
        return self.store.slot_rows[slot]

    def take_fresh_rows(self) -> list[RowId]:
        """Rows that held KV pages until now, for the plan being built to zero."""
        rows, self.store.fresh_rows = self.store.fresh_rows, []
        return rows

    def plan_taken(self) -> None:
        """The runtime handed the step plan being built to the workers."""
        self.store.advance()
        self.store.plan_taken()

    def allocate_pages(self, count: int) -> list[PageId] | None:
        """``count`` private pages for a sequence, evicting cache as needed; None if no room."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} pages")
        store = self.store
        store.advance()
        if not store.make_device_room(count):
            return None
        return store.pages.allocate(count, PageState.ACTIVE)

    def free_pages(self, pages: Iterable[PageId]) -> None:
        """Return a sequence's private (duplicate, growth) pages."""
        pages = list(pages)
        for page in pages:
            self._check_private(page)
        self.store.advance()
        self.store.pages.free(pages)

    # -- prefill and decode -----------------------------------------------------------------

    def commit_block(
        self, lease: Lease, tokens: Sequence[int] | bytes, page: PageId, extra: int = 0
    ) -> CommitResult:
        """The sequence completed its next block in ``page`` (§7.6); the node stays ref'd."""
        self._check_lease(lease)
        packed = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
        if len(packed) != BLOCK_BYTES_PACKED:
            raise ValueError(f"a block holds {BLOCK_TOKENS} tokens, got {len(packed) // 4}")
        if not 0 <= extra < 1 << 64:
            raise ValueError(f"extra key must be an unsigned 64-bit value, got {extra}")
        self._check_private(page)
        store = self.store
        store.advance()
        node = store.tree.child(lease.parent, packed, extra)
        if node is None:
            node = store.tree.insert(lease.parent, packed, extra)
            outcome = CommitOutcome.INSERTED
            self.stats.blocks_inserted += 1
        elif node.device is Residency.ABSENT:
            outcome = CommitOutcome.ADOPTED
            self.stats.blocks_adopted += 1
        else:
            outcome = CommitOutcome.DUPLICATE
            self.stats.blocks_duplicate += 1
        if outcome is not CommitOutcome.DUPLICATE:
            store.cache_page(node, page)
        store.ref(node, 1)
        lease.path.append(node)
        return CommitResult(node, outcome)

    def take_snapshot_slot(self, lease: Lease, kind: SnapshotKind, frontier: int) -> SlotId | None:
        """A device slot to capture a tap or endpoint at ``frontier`` into (§9.2), or None to
        skip it. Supersedes the lineage's predecessors first, so the slot can come from them."""
        self._check_lease(lease)
        if frontier < 1:
            raise ValueError(f"a snapshot frontier must be positive, got {frontier}")
        store = self.store
        store.advance()
        self._supersede_lineage(lease, kind, frontier)
        priority = store.value.estimate(
            frontier, lease.previous_frontier, frontier % BLOCK_TOKENS != 0
        )
        slot = store.take_slot(priority)
        if slot is None:
            self.stats.taps_skipped_no_slot += 1
        return slot

    def return_snapshot_slot(self, slot: SlotId) -> None:
        """Give back a staged slot whose capture will not be published."""
        if not self.store.slots.is_staging(slot):
            raise ValueError(f"slot {slot} is not staged")
        self.store.advance()
        self.store.release_slot(slot, row_unused=False)

    def publish_snapshot(
        self,
        lease: Lease,
        *,
        kind: SnapshotKind,
        frontier: int,
        tail_tokens: Sequence[int] | bytes,
        slot: SlotId,
        tail_page: PageId | None = None,
    ) -> Publication:
        """Publish the state captured in ``slot`` at ``frontier`` (§7.4, §7.7).

        The blocks below the frontier must be committed. ``tail_tokens`` are the tokens after the
        last full block, and ``tail_page`` (required iff there are any) holds their KV. The index
        owns the slot and tail page afterwards, also when the publication is a duplicate.
        """
        self._check_lease(lease)
        tail = tail_tokens if isinstance(tail_tokens, bytes) else pack_tokens(tail_tokens)
        store = self.store
        blocks, tail_len = divmod(frontier, BLOCK_TOKENS)
        if frontier < 1 or len(tail) != tail_len * 4:
            raise ValueError(f"frontier {frontier} needs {tail_len} tail tokens")
        if blocks > len(lease.path):
            raise ValueError(f"frontier {frontier} is past the lease's committed blocks")
        if not store.slots.is_staging(slot):
            raise ValueError(f"slot {slot} was not taken with take_snapshot_slot")
        if (tail_page is None) != (tail_len == 0):
            raise ValueError("a tail page is required exactly when the frontier has a tail")
        if tail_page is not None:
            self._check_private(tail_page)
        store.advance()
        self._supersede_lineage(lease, kind, frontier)
        anchor = lease.path[blocks - 1] if blocks else lease.root
        existing = store.snapshots.find(anchor, tail)
        if existing is None:
            snapshot = store.add_snapshot(anchor, tail, kind, slot, tail_page)
            write = self._write_snapshot(snapshot)
        else:
            store.release_slot(slot, row_unused=False)
            if tail_page is not None:
                store.pages.free((tail_page,))
            store.touch(existing, hit=False)
            self.stats.snapshots_duplicate += 1
            snapshot, write = existing, None
        if kind is not SnapshotKind.ENDPOINT:
            lease.last_tap = snapshot
        lease.previous_frontier = frontier
        return Publication(snapshot, existing is not None, write)

    def complete_snapshot_write(self, write: SnapshotWrite) -> None:
        self._finish(write)
        self.store.land_snapshot_host(write.snapshot)
        self.store.pin_snapshot(write.snapshot, -1)

    # -- release ----------------------------------------------------------------------------

    def release(self, lease: Lease) -> BlockWrite | None:
        """Drop the lease's refs, deepest block first into the device LRU (§7.7), and plan the
        host write-through of its device-only blocks (§7.6); None when nothing is written."""
        self._check_lease(lease)
        store = self.store
        store.advance()
        lease.released = True
        self._leases.remove(lease)
        write = self._write_blocks(lease.path)
        for node in reversed(lease.path):
            store.ref(node, -1)
        store.ref(lease.root, -1)
        return write

    def complete_block_write(self, write: BlockWrite) -> None:
        self._finish(write)
        for copy in write.copies:
            self.store.land_host(copy.node)
        self.store.pin_path(write.pinned, -1)

    # -- maintenance ------------------------------------------------------------------------

    def reset(self) -> bool:
        """Empty the cache; refused (False) while any sequence, capture, transfer or kept read
        is open."""
        store = self.store
        if self._leases or self._in_flight or self._kept_reads or store.slots.staging:
            return False
        if store.pages.pages_in(PageState.ACTIVE) or store.active_rows:
            return False
        self._renew_store()
        return True

    def clear(self) -> None:
        """Empty the cache whatever is open. For a caller that drops, with it, every lease,
        capture, transfer and kept read it still tracks (an engine with no request running)."""
        self._leases.clear()
        self._in_flight.clear()
        self._renew_store()

    def _renew_store(self) -> None:
        self.store = CacheStore(self.config, self.stats, self.journal)
        self._kept_reads.clear()
        self._fruitless = None
        if self.journal is not None:
            self.journal.cleared()

    def drain_events(self) -> list[JournalEvent]:
        """Residency changes since the last call, oldest first (empty unless recording)."""
        return self.journal.drain() if self.journal is not None else []

    # -- the stop (§5.5) ---------------------------------------------------------------------

    def write_through_at_stop(self) -> list[WriteRecord]:
        """At an orderly stop the device goes: plan the host write-through of every retained
        snapshot that only the device holds complete, with its path's device-only blocks,
        highest GDSF priority first, as a publication or a release would have. Each then goes
        to disk behind the host tier like any other. What the host tier has no room for,
        even after evicting what is worth less (§9.3), stays behind: a restart loses it."""
        store = self.store
        candidates = sorted(
            filter(_device_only, store.snapshots), key=lambda s: (-s.priority, s.id)
        )
        if candidates:
            store.advance()
        writes: list[WriteRecord] = []
        for snapshot in candidates:
            path = snapshot.anchor.path()
            if not all(_copyable(node) for node in path):
                continue  # a block of its path is nowhere a restart could read it from
            blocks = self._write_blocks([n for n in path if n.device is Residency.RESIDENT])
            if blocks is not None:
                writes.append(blocks)
            on_host_or_disk = all(
                n.host is not Residency.ABSENT or n.disk is not Residency.ABSENT for n in path
            )
            if on_host_or_disk and snapshot in store.snapshots and _device_only(snapshot):
                written = self._write_snapshot(snapshot)
                if written is not None:
                    writes.append(written)
        return writes

    def load_disk_block(
        self,
        parent: BlockNode | None,
        tokens: bytes,
        extra: int,
        slab: DiskSlabId,
        cache_salt: str | None = None,
    ) -> BlockNode:
        """Rebuild a journaled block disk-only (disk-tier plan §5) under ``parent``, a block
        loaded before it, or None: the root of ``cache_salt``; a hit reads it back
        (`plan_disk_read`). ValueError, before any change, for a block that exists, a slab that
        is taken or malformed tokens."""
        store = self.store
        if len(tokens) != BLOCK_BYTES_PACKED:
            raise ValueError(f"a block holds {BLOCK_TOKENS} tokens, got {len(tokens) // 4}")
        if parent is None:
            parent = store.tree.root_for(cache_salt)
        try:
            if store.tree.child(parent, tokens, extra) is not None:
                raise ValueError("the block is in the index already")
            store.advance()
            return store.add_disk_node(parent, tokens, extra, slab)
        except ValueError:
            if parent.is_root:
                store.tree.discard_root_if_idle(parent)
            raise

    def load_disk_snapshot(
        self,
        anchor: BlockNode | None,
        *,
        kind: SnapshotKind,
        tail: bytes,
        image_slabs: Sequence[DiskSlabId],
        tail_slab: DiskSlabId | None,
        hits: int,
        cache_salt: str | None = None,
    ) -> Snapshot:
        """Rebuild a journaled snapshot disk-only at ``anchor`` (a block loaded before it, or
        None: the root of ``cache_salt``), as `load_disk_block`. ValueError, before any change,
        for a snapshot that exists, a slab that is taken or a malformed image or tail."""
        store = self.store
        if len(image_slabs) != store.value.geometry.image_slabs:
            raise ValueError(f"an image of {len(image_slabs)} slabs")
        if len(tail) >= BLOCK_BYTES_PACKED or len(tail) % 4 or (tail_slab is None) != (not tail):
            raise ValueError("a tail slab is required exactly when there are tail tokens")
        if anchor is None:
            anchor = store.tree.root_for(cache_salt)
        try:
            if store.snapshots.find(anchor, tail) is not None:
                raise ValueError("the snapshot is in the index already")
            store.advance()
            return store.add_disk_snapshot(anchor, tail, kind, list(image_slabs), tail_slab, hits)
        except ValueError:
            if anchor.is_root:
                store.tree.discard_root_if_idle(anchor)
            raise

    @property
    def num_leases(self) -> int:
        """Sequences holding the cache (admitted and not yet released)."""
        return len(self._leases)

    @property
    def num_in_flight(self) -> int:
        """Transfers planned and not yet completed."""
        return len(self._in_flight)

    @property
    def num_kept_reads(self) -> int:
        """Landed disk reads kept pinned for their waiting requests."""
        return len(self._kept_reads)

    def check_invariants(self) -> None:
        """Rebuild every derived structure from scratch and compare (raises InvariantError)."""
        check_invariants(self.store, self._leases, self._in_flight | self._kept_reads)

    # -- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _check_lease(lease: Lease) -> None:
        if lease.released:
            raise ValueError("the lease was already released")

    def _check_private(self, page: PageId) -> None:
        if self.store.pages.state(page) is not PageState.ACTIVE:
            raise ValueError(f"page {page} is not a sequence's private page")

    def _finish(self, transfer: Transfer) -> None:
        if transfer not in self._in_flight:
            raise ValueError("unknown or already completed transfer")
        self._in_flight.remove(transfer)
        self.store.advance()

    def _supersede_lineage(self, lease: Lease, kind: SnapshotKind, frontier: int) -> None:
        """The lineage moves past its resumed snapshot, and a tap past its previous tap; an
        endpoint leaves the last tap retained for a next turn that re-renders the reply."""
        predecessors = [lease.resumed_from]
        if kind is not SnapshotKind.ENDPOINT:
            predecessors.append(lease.last_tap)
        for previous in predecessors:
            if (
                previous is not None
                and previous in self.store.snapshots
                and previous.frontier < frontier
                and _decidable(lease, previous)
                and may_supersede(previous)
            ):
                self.store.set_superseded(previous, True)
        resumed = lease.resumed_from
        if resumed is not None and resumed.frontier < frontier and _decidable(lease, resumed):
            lease.resumed_from = None

    def _write_snapshot(self, snapshot: Snapshot) -> SnapshotWrite | None:
        """Plan the image and tail write-through, evicting only what is worth no more (§9.3)."""
        store = self.store
        if not store.slabs.enabled:
            return None
        geometry = store.value.geometry
        if not store.make_host_room(
            geometry.snapshot_slabs(bool(snapshot.tail)), limit=snapshot.priority
        ):
            self.stats.host_writes_declined += 1
            return None
        assert snapshot in store.snapshots and snapshot.slot is not None
        image = store.slabs.allocate(geometry.image_slabs, SlabUse.IMAGE)
        tail = store.slabs.allocate(1, SlabUse.TAIL) if snapshot.tail else []
        assert image is not None and tail is not None
        tail_slab = tail[0] if tail else None
        store.fill_snapshot_host(snapshot, image, tail_slab)
        store.pin_snapshot(snapshot, 1)
        write = SnapshotWrite(snapshot, snapshot.slot, tuple(image), snapshot.tail_page, tail_slab)
        self._in_flight.add(write)
        return write

    def _write_blocks(self, path: list[BlockNode]) -> BlockWrite | None:
        """Plan write-through of the device-only blocks, shallowest first when room is short."""
        store = self.store
        wanted = [node for node in path if node.host is Residency.ABSENT]
        if not store.slabs.enabled or not wanted:
            return None
        store.make_host_room(len(wanted))
        todo = wanted[: store.slabs.num_free]
        if len(todo) < len(wanted):
            self.stats.host_writes_declined += 1
        if not todo:
            return None
        slabs = store.slabs.allocate(len(todo), SlabUse.NODE)
        assert slabs is not None
        copies = []
        for node, slab in zip(todo, slabs, strict=True):
            assert node.device is Residency.RESIDENT and node.device_page is not None
            store.fill_host(node, slab)
            copies.append(BlockCopy(node, node.device_page, slab))
        store.pin_path(todo[-1], 1)
        write = BlockWrite(tuple(copies), todo[-1])
        self._in_flight.add(write)
        return write


def _filling(node: BlockNode) -> bool:
    return Residency.FILLING in (node.device, node.host, node.disk)


def _filling_snapshot(snapshot: Snapshot) -> bool:
    copies = (snapshot.image_host, snapshot.image_disk)
    tails = (snapshot.tail_device, snapshot.tail_host, snapshot.tail_disk)
    return Residency.FILLING in (*copies, *tails)


def _writable(snapshot: Snapshot) -> bool:
    """Retained, whole on the host and not on disk, nothing of it or its path landing, and
    every block of its path on the host or the disk: a disk write then holds it whole."""
    if snapshot.superseded or snapshot.holds_disk or Medium.HOST not in snapshot.media:
        return False
    if _filling_snapshot(snapshot):
        return False
    return all(
        not _filling(node) and bool(node.media & {Medium.HOST, Medium.DISK})
        for node in snapshot.anchor.path()
    )


def _device_only(snapshot: Snapshot) -> bool:
    """Retained and complete only on the device: its image in a slot and its tail on a
    device page, neither of them on the host, landing there, or on disk."""
    if snapshot.superseded or not snapshot.complete_on_device:
        return False
    return not (snapshot.holds_host or snapshot.holds_disk or _filling_snapshot(snapshot))


def _copyable(node: BlockNode) -> bool:
    """On the host or disk (or landing there), or on the device for a write-through."""
    if node.host is not Residency.ABSENT or node.disk is not Residency.ABSENT:
        return True
    return node.device is Residency.RESIDENT


def _disk_slabs(write: DiskWrite) -> int:
    return len(write.blocks) + len(write.image_disk_slabs) + (write.tail is not None)


def _target(match: MatchResult) -> Snapshot | None:
    """The snapshot a prefetch for ``match`` copies the path of: the deepest candidate."""
    return match.candidates[-1] if match.candidates else None


def _decidable(lease: Lease, previous: Snapshot) -> bool:
    """Whether the lineage can tell yet if it supersedes ``previous``.

    A Boundary is superseded only while the tree below it is one chain, so the check must see
    this lease's own blocks below it: a tap captured before they are committed would otherwise
    find only the chain of the conversation that left the Boundary and supersede a snapshot two
    conversations share. The publication decides instead, once the blocks are in.
    """
    if previous.kind is not SnapshotKind.BOUNDARY:
        return True
    return len(lease.path) * BLOCK_TOKENS > previous.frontier
