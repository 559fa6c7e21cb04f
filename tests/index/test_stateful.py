"""Random interleavings of the whole request life cycle keep every invariant (§10).

The machine plays a scheduler-side manager: admissions, block commits, taps, endpoints,
releases, transfer completions arriving late, active-page pressure and resets, over prompts
that share prefixes, under tight device, slot and host capacities and with a lookup hash that
collides often. After every step the index audits itself from scratch.
"""

from __future__ import annotations

import copy
from array import array
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.index.harness import BLOCK, JournalReplay, make_index
from vllm_hpc.index import (
    BlockNode,
    BlockWrite,
    Lease,
    PageId,
    Prefetch,
    PrefixIndex,
    Readiness,
    Restore,
    RowId,
    SnapshotKind,
    SnapshotWrite,
    xxh3_block_hash,
)
from vllm_hpc.index.prompt import pack_tokens
from vllm_hpc.index.transfers import DiskRead, DiskWrite, ReadRoom

DOCS = [[(d * 31 + i * 17) % 997 for i in range(6 * BLOCK)] for d in range(2)]
HEADS = [[*doc, 1] for doc in DOCS]


def colliding_hash(parent: int, tokens: bytes, extra: int) -> int:
    """Three buckets only: exact comparison must separate every sibling."""
    return (parent + tokens[0] + extra) % 3


@dataclass
class Running:
    lease: Lease
    tokens: list[int]
    restore: Restore | None
    private: list[PageId] = field(default_factory=list)
    row: RowId | None = None
    """Its state row, where states share the page space."""


class IndexMachine(RuleBasedStateMachine):
    @initialize(
        pages=st.integers(10, 40),
        slots=st.integers(1, 3),
        host=st.sampled_from([0, 4, 9, 20, 40]),
        collide=st.booleans(),
        row_pages=st.sampled_from([0, 0, 2, 3]),
        record=st.booleans(),
        disk=st.sampled_from([0, 3, 8, 30]),
    )
    def setup(
        self,
        pages: int,
        slots: int,
        host: int,
        collide: bool,
        row_pages: int = 0,
        record: bool = False,
        disk: int = 0,
    ) -> None:
        """With ``row_pages``, states take rows of the page space (running requests' too).
        With ``record``, the journal's replay must equal the residency after every step.
        ``disk`` slabs make a disk tier under a host tier."""
        hasher = colliding_hash if collide else xxh3_block_hash
        self.index: PrefixIndex = make_index(
            pages=pages + (1 + slots + 2) * row_pages,
            slots=slots,
            host_slabs=host,
            hasher=hasher,
            row_pages=row_pages,
            record_events=record,
            disk_slabs=disk if host else 0,
        )
        self.replay = JournalReplay() if record else None
        self.running: list[Running] = []
        self.writes: list[BlockWrite | SnapshotWrite] = []
        self.pressure: list[list[PageId]] = []
        self.prefetches: list[Prefetch] = []
        self.disk_transfers: list[DiskWrite | DiskRead] = []
        self.kept_reads: list[DiskRead] = []
        """Landed reads kept pinned for the request that waits for them."""
        self.waiting = [self.index.prepare_prompt(tokens) for tokens in HEADS]
        """Waiting requests, each with its prepared prompt kept from step to step, as the runtime
        keeps it; the first is the queue's head."""
        self.inflation = 0.0

    # -- admission ----------------------------------------------------------------------

    @rule(
        doc=st.integers(0, 1),
        blocks=st.integers(0, 6),
        cut=st.integers(0, 40),
        suffix=st.lists(st.integers(0, 2), max_size=70),
        salt=st.sampled_from([None, None, "t1"]),
    )
    def admit(self, doc: int, blocks: int, cut: int, suffix: list[int], salt: str | None) -> None:
        """Prompts share whole blocks of two documents, then diverge in a short suffix."""
        tokens = DOCS[doc][: max(blocks * BLOCK - cut, 0)] + suffix
        if not tokens:
            return
        index = self.index
        prompt = index.prepare_prompt(tokens, cache_salt=salt)
        match = index.match(prompt)
        self._assert_exact(match.path, match.candidates, tokens)
        n = len(tokens)
        rows = index.row_pages
        quote = index.quote(match, lambda f: -(-n // BLOCK) - f // BLOCK + rows)
        if quote.readiness is not Readiness.READY:
            return
        assert quote.source is not None
        if quote.source.disk_bytes:  # the runtime's order: read, wait, then look up again
            assert quote.source.snapshot is not None
            read = index.plan_disk_read(quote.source.snapshot)
            if read is not None:
                self.disk_transfers.append(read)
            return
        row = None
        if rows:  # the runtime's order: the row, then a fresh quote that keeps the source
            row = index.take_state_row(quote)
            if row is None:
                return
            source = quote.source
            quote = index.quote(index.match(prompt), lambda f: -(-n // BLOCK) - f // BLOCK)
            assert source is not None
            fresh = quote.source
            if fresh is None or (fresh.snapshot, fresh.frontier) != (
                source.snapshot,
                source.frontier,
            ):
                index.release_state_row(row, unused=True)
                return
        admission = index.acquire(quote)
        # The quote's promise: the sequence's own pages are there once its source is held.
        frontier = admission.frontier
        growth = index.allocate_pages(-(-n // BLOCK) - frontier // BLOCK)
        assert growth is not None, "a READY quote found no room for the sequence's pages"
        index.free_pages(growth)
        self.running.append(Running(admission.lease, tokens, admission.restore, row=row))

    @rule(
        doc=st.integers(0, 1),
        blocks=st.integers(1, 6),
        cut=st.integers(0, 40),
        suffix=st.lists(st.integers(0, 2), max_size=70),
        taps=st.lists(st.integers(1, 6 * BLOCK), max_size=3),
        endpoint=st.booleans(),
    )
    def whole_request(
        self, doc: int, blocks: int, cut: int, suffix: list[int], taps: list[int], endpoint: bool
    ) -> None:
        """Admit, restore, prefill with taps and finish in one step, to grow the cache fast."""
        before = len(self.running)
        self.admit(doc, blocks, cut, suffix, None)
        if len(self.running) == before:
            return
        request = self.running[-1]
        if request.restore is not None:
            self.index.complete_restore(request.restore)
            request.restore = None
        for frontier in sorted(taps):
            self._commit(request, frontier // BLOCK - len(request.lease.path))
            if request.lease.previous_frontier < frontier <= len(request.lease.path) * BLOCK:
                self._publish(request, frontier, SnapshotKind.TAP, write_now=True)
        self._commit(request, 6)
        self._finish(request, endpoint, write_now=True)

    @staticmethod
    def _assert_exact(path, candidates, tokens) -> None:
        packed = pack_tokens(tokens)
        assert b"".join(n.tokens for n in path) == packed[: len(path) * BLOCK * 4]
        for snapshot in candidates:
            prefix = b"".join(n.tokens for n in snapshot.anchor.path()) + snapshot.tail
            assert prefix == packed[: snapshot.frontier * 4]
            assert snapshot.frontier <= len(tokens) - 1

    @precondition(lambda self: any(r.restore for r in self.running))
    @rule(pick=st.integers(0, 99))
    def complete_restore(self, pick: int) -> None:
        pending = [r for r in self.running if r.restore]
        request = pending[pick % len(pending)]
        assert request.restore is not None
        self.index.complete_restore(request.restore)
        request.restore = None

    # -- prefill ------------------------------------------------------------------------

    @precondition(lambda self: any(r.restore is None for r in self.running))
    @rule(pick=st.integers(0, 99), count=st.integers(1, 6))
    def commit_blocks(self, pick: int, count: int) -> None:
        self._commit(self._ready(pick), count)

    def _ready(self, pick: int) -> Running:
        """A running request whose restore has landed (prefill waits for it)."""
        ready = [r for r in self.running if r.restore is None]
        return ready[pick % len(ready)]

    def _commit(self, request: Running, count: int) -> None:
        for _ in range(count):
            block = len(request.lease.path)
            if (block + 1) * BLOCK > len(request.tokens):
                return
            pages = self.index.allocate_pages(1)
            if pages is None:
                return
            chunk = request.tokens[block * BLOCK : (block + 1) * BLOCK]
            result = self.index.commit_block(request.lease, chunk, pages[0])
            if not result.page_is_cached:
                request.private.append(pages[0])

    @precondition(lambda self: any(r.restore is None for r in self.running))
    @rule(
        pick=st.integers(0, 99),
        back=st.integers(0, 70),
        kind=st.sampled_from([SnapshotKind.TAP, SnapshotKind.BOUNDARY]),
        write_now=st.booleans(),
    )
    def tap(self, pick: int, back: int, kind: SnapshotKind, write_now: bool) -> None:
        request = self._ready(pick)
        limit = min(len(request.tokens), len(request.lease.path) * BLOCK + BLOCK - 1)
        frontier = limit - back
        if frontier <= request.lease.previous_frontier or frontier < 1:
            return
        self._publish(request, frontier, kind, write_now)

    def _publish(
        self, request: Running, frontier: int, kind: SnapshotKind, write_now: bool
    ) -> None:
        index = self.index
        slot = index.take_snapshot_slot(request.lease, kind, frontier)
        if slot is None:
            return
        tail_page = None
        if frontier % BLOCK:
            pages = index.allocate_pages(1)
            if pages is None:
                index.return_snapshot_slot(slot)
                return
            tail_page = pages[0]
        start = frontier - frontier % BLOCK
        publication = index.publish_snapshot(
            request.lease,
            kind=kind,
            frontier=frontier,
            tail_tokens=request.tokens[start:frontier],
            slot=slot,
            tail_page=tail_page,
        )
        if publication.write is not None:
            self._land(publication.write, write_now)

    def _land(self, write: BlockWrite | SnapshotWrite, now: bool) -> None:
        if not now:
            self.writes.append(write)
        elif isinstance(write, BlockWrite):
            self.index.complete_block_write(write)
        else:
            self.index.complete_snapshot_write(write)

    @precondition(lambda self: any(r.restore is None for r in self.running))
    @rule(pick=st.integers(0, 99), endpoint=st.booleans(), write_now=st.booleans())
    def finish(self, pick: int, endpoint: bool, write_now: bool) -> None:
        self._finish(self._ready(pick), endpoint, write_now)

    def _finish(self, request: Running, endpoint: bool, write_now: bool) -> None:
        lease = request.lease
        frontier = min(len(request.tokens), len(lease.path) * BLOCK + BLOCK - 1)
        if endpoint and frontier > lease.previous_frontier:
            self._publish(request, frontier, SnapshotKind.ENDPOINT, write_now)
        write = self.index.release(lease)
        if write is not None:
            self._land(write, write_now)
        self.index.free_pages(request.private)
        if request.row is not None:
            self.index.release_state_row(request.row)
        self.running.remove(request)

    @precondition(lambda self: bool(self.writes))
    @rule(pick=st.integers(0, 99))
    def complete_write(self, pick: int) -> None:
        self._land(self.writes.pop(pick % len(self.writes)), now=True)

    # -- a blocked head's prefetch (§6.6) ------------------------------------------------------

    @rule(pick=st.integers(0, 99), more=st.lists(st.integers(0, 2), min_size=1, max_size=70))
    def wait(self, pick: int, more: list[int]) -> None:
        """A request that continues a cached snapshot's prompt starts waiting."""
        root = self.index.store.tree.root(None)
        snapshots = [s for s in self.index.store.snapshots if _root_of(s.anchor) is root]
        if not snapshots or len(self.waiting) >= 5:
            return
        snapshot = snapshots[pick % len(snapshots)]
        packed = b"".join(node.tokens for node in snapshot.anchor.path()) + snapshot.tail
        self.waiting.append(self.index.prepare_prompt([*array("i", packed), *more]))

    @rule()
    def next_head(self) -> None:
        """The head is admitted or cancelled (and comes back later): the next one is the head."""
        self.waiting.append(self.waiting.pop(0))

    @precondition(lambda self: not self.prefetches)
    @rule(limit=st.integers(1, 4), now=st.booleans())
    def prefetch(self, limit: int, now: bool) -> None:
        """The blocked head asks, as every step. Whatever the index answers, often from its
        record of the last attempt, a full attempt on a copy of the index answers the same."""
        index = self.index
        prompt = self.waiting[0]
        fresh = copy.deepcopy(index)
        fresh._fruitless = None  # no record: a full attempt
        expected = fresh.prefetch(fresh.match(prompt), limit)
        prefetch = index.prefetch(index.match(prompt), limit)
        if expected is None:
            assert prefetch is None
            return
        assert prefetch is not None
        assert [c.node.depth for c in prefetch.copies] == [c.node.depth for c in expected.copies]
        if now:
            index.complete_prefetch(prefetch)
        else:
            self.prefetches.append(prefetch)

    @precondition(lambda self: bool(self.prefetches))
    @rule()
    def complete_prefetch(self) -> None:
        self.index.complete_prefetch(self.prefetches.pop())

    # -- the disk tier ----------------------------------------------------------------------

    @rule(slabs=st.integers(0, 12), now=st.booleans())
    def write_behind(self, slabs: int, now: bool) -> None:
        """The writer takes what fits ``slabs`` slabs, most valuable first."""
        slab_bytes = self.index.store.value.geometry.slab_bytes
        for write in self.index.plan_disk_writes(slabs * slab_bytes):
            if now:
                self.index.complete_disk_write(write)
            else:
                self.disk_transfers.append(write)

    @rule(pick=st.integers(0, 99), now=st.booleans(), room=st.sampled_from(ReadRoom))
    def read_back(self, pick: int, now: bool, room: ReadRoom) -> None:
        """A snapshot's disk-only parts are read into the host, as a hit on disk will (or a
        read ahead of its request's turn, or the start-up read: what it may evict differs)."""
        store = self.index.store
        snapshots = [s for s in store.snapshots if s.holds_disk]
        if not snapshots:
            return
        snapshot = snapshots[pick % len(snapshots)]
        if snapshot in store.host.backed:  # the host let it go first, nothing lost
            store.drop_snapshot_host(snapshot)
        if snapshot in store.snapshots and snapshot.slot is not None and not snapshot.restore_pins:
            store.drop_snapshot_image_device(snapshot)  # and the device its slot
        if snapshot not in store.snapshots:
            return
        by_value = self.index.stats.host_gdsf_evicted
        read = self.index.plan_disk_read(snapshot, room)
        if room is not ReadRoom.ANY:  # no last copy goes by value for a read ahead or a start
            assert self.index.stats.host_gdsf_evicted == by_value
        if read is None:
            return
        if now:
            self.index.complete_disk_read(read)
        else:
            self.disk_transfers.append(read)

    @precondition(lambda self: bool(self.disk_transfers))
    @rule(
        pick=st.integers(0, 99),
        fail=st.booleans(),
        damaged=st.sets(st.integers(0, 7)),
        keep=st.booleans(),
    )
    def land_disk_transfer(self, pick: int, fail: bool, damaged: set[int], keep: bool) -> None:
        """A transfer lands or fails; a failed read's ``damaged`` records (by their place in
        the read: its blocks, then the snapshot) lose their disk copies. ``keep``: a landed
        read stays pinned for the request waiting for it."""
        transfer = self.disk_transfers.pop(pick % len(self.disk_transfers))
        index = self.index
        if isinstance(transfer, DiskWrite):
            (index.fail_disk_write if fail else index.complete_disk_write)(transfer)
        elif fail:
            records = [*(copy.node for copy in transfer.blocks), transfer.snapshot]
            index.fail_disk_read(transfer, [records[i] for i in damaged if i < len(records)])
        else:
            index.complete_disk_read(transfer, keep)
            assert index.holds_read(transfer) is keep
            if keep:
                self.kept_reads.append(transfer)

    @precondition(lambda self: bool(self.kept_reads))
    @rule(pick=st.integers(0, 99))
    def release_kept_read(self, pick: int) -> None:
        """The request a kept read waited for was admitted or left."""
        read = self.kept_reads.pop(pick % len(self.kept_reads))
        self.index.release_disk_read(read)
        assert not self.index.holds_read(read)

    @rule(pick=st.integers(0, 99))
    def drop_slot(self, pick: int) -> None:
        """A snapshot gives its device slot up, as to a running request's state."""
        store = self.index.store
        owners = [s for s in store.snapshots if s.slot is not None and not s.restore_pins]
        if owners:
            store.drop_snapshot_image_device(owners[pick % len(owners)])

    @rule(count=st.integers(1, 10), disk=st.booleans())
    def evict_tier(self, count: int, disk: bool) -> None:
        """Pressure on one slab tier, by its own order."""
        store = self.index.store
        if disk:
            store.make_disk_room(count)
        else:
            store.make_host_room(count)

    # -- pressure and maintenance -----------------------------------------------------------

    @rule()
    def plan_taken(self) -> None:
        """A step's plan goes to the workers: rows given back during it become KV pages."""
        self.index.plan_taken()

    @rule(count=st.integers(1, 8))
    def grab_pages(self, count: int) -> None:
        pages = self.index.allocate_pages(count)
        if pages is not None:
            self.pressure.append(pages)

    @precondition(lambda self: bool(self.pressure))
    @rule()
    def drop_pages(self) -> None:
        self.index.free_pages(self.pressure.pop())

    @rule()
    def reset(self) -> None:
        idle = not (
            self.running
            or self.writes
            or self.pressure
            or self.prefetches
            or self.disk_transfers
            or self.kept_reads
        )
        assert self.index.reset() is idle
        if idle:
            self.inflation = 0.0

    @rule(write_now=st.booleans())
    def stop(self, write_now: bool) -> None:
        """The stop's write-through of the snapshots only the device holds (§5.5), from any
        state: what it plans holds a host copy, and the index stays consistent (checked after)."""
        writes = self.index.write_through_at_stop()
        for write in writes:
            self._land(write, write_now)
        planned = {w.snapshot for w in writes if isinstance(w, SnapshotWrite)}
        assert all(s.holds_host for s in planned)

    # -- checks -----------------------------------------------------------------------------

    @invariant()
    def audit(self) -> None:
        self.index.check_invariants()
        inflation = self.index.store.value.inflation
        assert inflation >= self.inflation, "L decreased"
        self.inflation = inflation
        if self.replay is not None:
            self.replay.check(self.index)
        else:
            assert self.index.drain_events() == []


def _root_of(node: BlockNode) -> BlockNode:
    while node.parent is not None:
        node = node.parent
    return node


IndexMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexMachine = IndexMachine.TestCase
