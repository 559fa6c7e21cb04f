"""Shared harness for the index tests: drives requests through the public PrefixIndex API."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_hpc.index import (
    AdmissionGrant,
    BlockNode,
    CacheCostModel,
    CommitOutcome,
    HostGeometry,
    IndexConfig,
    Lease,
    MediaItem,
    PageId,
    PrefixIndex,
    Publication,
    Readiness,
    Snapshot,
    SnapshotId,
    SnapshotKind,
)
from vllm_hpc.index.journal import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    JournalEvent,
    SnapshotPublished,
    SnapshotRemoved,
    node_media,
    snapshot_media,
)
from vllm_hpc.index.prompt import pack_tokens
from vllm_hpc.index.types import Medium

BLOCK = 64
SLAB = 4096


def toks(seed: int, count: int) -> list[int]:
    """Deterministic distinct-looking tokens; equal seeds give equal sequences."""
    return [(seed * 7919 + i * 104729) % 50_000 for i in range(count)]


def snap(publication: Publication | None) -> Snapshot:
    """The snapshot of a publication that must have happened."""
    assert publication is not None
    return publication.snapshot


def simple_cost() -> CacheCostModel:
    """Round numbers for hand computation: 1 ms per token, 1 µs per attention pair,
    1 MB/s host-to-device, 0.5 MB/s disk reads, no fixed costs."""
    return CacheCostModel(
        token_s=1e-3,
        attention_pair_s=1e-6,
        chunk_s=0.0,
        chunk_tokens=1 << 20,
        h2d_bytes_per_s=1e6,
        batch_latency_s=0.0,
        disk_read_bytes_per_s=5e5,
    )


def make_index(
    *,
    pages: int = 64,
    slots: int = 4,
    host_slabs: int = 0,
    disk_slabs: int = 0,
    block_bytes: int = 1000,
    image_bytes: int = 4000,
    first_page_id: int = 1,
    cost: CacheCostModel | None = None,
    hasher=None,
    row_pages: int = 0,
    record_events: bool = False,
) -> PrefixIndex:
    geometry = HostGeometry(block_bytes=block_bytes, image_bytes=image_bytes)
    extra = {} if hasher is None else {"hasher": hasher}
    config = IndexConfig(
        device_pages=pages,
        geometry=geometry,
        first_page_id=first_page_id,
        snapshot_slots=slots,
        host_budget_bytes=host_slabs * geometry.slab_bytes,
        disk_budget_bytes=disk_slabs * geometry.slab_bytes,
        cost=cost or simple_cost(),
        row_pages=row_pages,
        record_events=record_events,
        **extra,
    )
    return PrefixIndex(config)


def load_disk_only(
    index: PrefixIndex, tokens: Sequence[int], frontiers: Sequence[int], hits: int = 0
) -> list[Snapshot]:
    """Journaled entries as a restart brings them back, disk-only: the blocks of ``tokens`` up
    to the last of ``frontiers`` (block boundaries) and a tap at each with ``hits`` (its
    value), on free disk slabs."""
    free = iter(index.store.disk_slabs.free_slabs)
    parent = None
    snapshots = []
    for depth in range(max(frontiers) // BLOCK):
        block = pack_tokens(tokens[depth * BLOCK : (depth + 1) * BLOCK])
        parent = index.load_disk_block(parent, block, 0, next(free))
        if parent.end in frontiers:
            image = [next(free) for _ in range(index.store.value.geometry.image_slabs)]
            snapshots.append(
                index.load_disk_snapshot(
                    parent,
                    kind=SnapshotKind.TAP,
                    tail=b"",
                    image_slabs=image,
                    tail_slab=None,
                    hits=hits,
                )
            )
    return snapshots


class JournalReplay:
    """What a consumer of the journal believes is resident, rebuilt from the events alone."""

    def __init__(self) -> None:
        self.blocks: set[tuple[BlockNode, Medium]] = set()
        self.snapshots: set[tuple[SnapshotId, Medium]] = set()

    def apply(self, events: Sequence[JournalEvent]) -> None:
        for event in events:
            match event:
                case BlockStored(node, medium, _):
                    assert (node, medium) not in self.blocks, "stored twice"
                    assert node.parent is not None
                    assert node.parent.is_root or any(
                        (node.parent, m) in self.blocks for m in Medium
                    ), "a block stored before its parent"
                    self.blocks.add((node, medium))
                case BlockRemoved(node, medium):
                    self.blocks.remove((node, medium))
                case AllCleared():
                    self.blocks.clear()
                    self.snapshots.clear()
                case SnapshotPublished(snapshot, anchor, tail, frontier, medium):
                    assert frontier == anchor.end + len(tail) // 4
                    assert (snapshot, medium) not in self.snapshots, "published twice"
                    self.snapshots.add((snapshot, medium))
                case SnapshotRemoved(snapshot, _, _, _, medium):
                    self.snapshots.remove((snapshot, medium))

    def check(self, index: PrefixIndex) -> None:
        """The replay equals the index's resident copies and restorable snapshots."""
        self.apply(index.drain_events())
        store = index.store
        blocks = {
            (node, medium)
            for root in store.tree.roots
            for node in store.tree.subtree(root)
            if not node.is_root
            for medium in node_media(node)
        }
        snapshots = {(s.id, medium) for s in store.snapshots for medium in snapshot_media(s)}
        assert self.blocks == blocks
        assert self.snapshots == snapshots


class Harness:
    """Runs requests like the scheduler-side manager would, completing transfers at once
    unless told otherwise, and checking the invariants after every step."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.private: dict[Lease, list[PageId]] = {}

    def check(self) -> None:
        self.index.check_invariants()

    def admit(
        self,
        tokens: Sequence[int],
        *,
        salt: str | None = None,
        media: Sequence[MediaItem] = (),
        complete: bool = True,
    ) -> AdmissionGrant:
        index = self.index
        prompt = index.prepare_prompt(tokens, media=media, cache_salt=salt)
        n = len(tokens)
        quote = index.quote(index.match(prompt), lambda f: -(-n // BLOCK) - -(-f // BLOCK))
        assert quote.readiness is Readiness.READY, quote
        admission = index.acquire(quote)
        self.private[admission.lease] = []
        if complete and admission.restore is not None:
            index.complete_restore(admission.restore)
        self.check()
        return admission

    def commit(
        self, lease: Lease, tokens: Sequence[int], upto: int | None = None
    ) -> list[CommitOutcome]:
        """Commit the lease's next full blocks up to token ``upto`` (default: all full ones)."""
        end = (len(tokens) if upto is None else upto) // BLOCK
        outcomes = []
        for block in range(len(lease.path), end):
            pages = self.index.allocate_pages(1)
            assert pages is not None, "test ran out of device pages"
            result = self.index.commit_block(
                lease, tokens[block * BLOCK : (block + 1) * BLOCK], pages[0]
            )
            if not result.page_is_cached:
                self.private[lease].append(pages[0])
            outcomes.append(result.outcome)
        self.check()
        return outcomes

    def tap(
        self,
        lease: Lease,
        tokens: Sequence[int],
        frontier: int,
        kind: SnapshotKind = SnapshotKind.TAP,
        *,
        write: bool = True,
    ) -> Publication | None:
        """Commit up to ``frontier``, capture there and publish (tail page included)."""
        self.commit(lease, tokens, frontier)
        index = self.index
        slot = index.take_snapshot_slot(lease, kind, frontier)
        if slot is None:
            self.check()
            return None
        tail_page = None
        if frontier % BLOCK:
            pages = index.allocate_pages(1)
            assert pages is not None
            tail_page = pages[0]
        start = frontier - frontier % BLOCK
        publication = index.publish_snapshot(
            lease,
            kind=kind,
            frontier=frontier,
            tail_tokens=tokens[start:frontier],
            slot=slot,
            tail_page=tail_page,
        )
        if write and publication.write is not None:
            index.complete_snapshot_write(publication.write)
        self.check()
        return publication

    def finish(self, lease: Lease, *, write: bool = True) -> None:
        block_write = self.index.release(lease)
        if write and block_write is not None:
            self.index.complete_block_write(block_write)
        self.index.free_pages(self.private.pop(lease))
        self.check()

    def run(
        self,
        tokens: Sequence[int],
        taps: Sequence[int] = (),
        *,
        endpoint: bool = False,
        salt: str | None = None,
        kind: SnapshotKind = SnapshotKind.TAP,
    ) -> list[Publication | None]:
        """One whole request: admit, prefill with taps, optional endpoint at n, release."""
        admission = self.admit(tokens, salt=salt)
        lease = admission.lease
        publications = [self.tap(lease, tokens, f, kind) for f in taps]
        if endpoint:
            publications.append(self.tap(lease, tokens, len(tokens), SnapshotKind.ENDPOINT))
        self.commit(lease, tokens)
        self.finish(lease)
        return publications
