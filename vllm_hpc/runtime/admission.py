"""Admission: a waiting request's lookup, its wait for a sibling (in-flight coalescing) or for
a read from the disk tier, the prefetch a blocked head gets, and the admission itself: source,
state row, pages.

A lookup is read-only for the index (§6.1-§6.3). `admit` takes a state row, the quoted source
and the first chunk's pages, or returns None and the request waits; vLLM keeps the queue's head
waiting, so nothing behind it overtakes it. The state row comes out of the same device pages as
KV (§5.4), so the quote counts it among the pages the request needs.

A source with parts only the disk holds is not admitted: `disk_wait` plans their read into the
host tier, and while it is in flight the request steps aside (the connector's "not yet" to
vLLM), so the requests behind it are scheduled; its next lookup after the read has been
reported finds them on the host and restores them as any host source (disk-tier plan §4). The
landed read stays pinned until then: its copies are disk-backed, which host eviction takes
first. `admit` plans the read too, for a request vLLM does not let step aside (one bounded in
what it reads): it then waits as a blocked head does (§6.6). A request whose deeper snapshot
another read is bringing in (the start-up read's, another request's) waits for that read as
for its own. A read that fails drops the damaged records, and the next lookup finds a
shallower source.
"""

from __future__ import annotations

from vllm_hpc.index import (
    BLOCK_TOKENS,
    AdmissionQuote,
    GrowthPages,
    MatchResult,
    PageId,
    PrefillRequest,
    PrefixIndex,
    PreparedPrompt,
    Readiness,
    Restore,
    RowId,
    Snapshot,
    SnapshotKind,
    SourceOption,
    TapPlanner,
    pages_for,
    plan_exact_tap,
)
from vllm_hpc.index.transfers import DiskRead, ReadRoom
from vllm_hpc.index.types import Medium
from vllm_hpc.runtime.lane import Lane
from vllm_hpc.runtime.pipeline import StepPipeline
from vllm_hpc.runtime.plan import HostRestore, ImageCopy, PageCopy, PageSlab, StateCopy
from vllm_hpc.runtime.records import InfeasibleRequest, Lookup, RequestInfo, RuntimeConfig
from vllm_hpc.runtime.telemetry import AdmissionCounters


class Admission:
    def __init__(self, config: RuntimeConfig, index: PrefixIndex, pipeline: StepPipeline) -> None:
        if config.active_cap <= 0:
            raise ValueError(f"need room for one running request, got {config.active_cap}")
        if index.row_pages <= 0:
            raise ValueError("the index must hold the state rows (IndexConfig.row_pages)")
        self.config = config
        self.index = index
        self.pipeline = pipeline
        self.planner = TapPlanner(config.tap_policy)
        self.live: set[Lane] = set()
        """Admitted requests not yet finished."""
        self.counters = AdmissionCounters()
        self._prepared: dict[str, PreparedPrompt] = {}
        self._waited: set[str] = set()
        """Waiting requests that held back for a sibling's snapshot (§12.2)."""
        self._reads: dict[str, DiskRead] = {}
        """Waiting requests' reads from the disk tier, in flight or landed (and then kept
        pinned by the index until the requests awaiting it are admitted or leave); a request
        may await a read planned for another (`_landing`)."""
        self._no_disk: set[str] = set()
        """Waiting requests whose read found no host room: they are quoted without the disk."""

    def leave(self, lane: Lane) -> None:
        """The lane finished: it no longer counts against the cap (its row goes when its last
        capture has published, `Captures`)."""
        self.live.remove(lane)

    def cached_tokens(self, request: RequestInfo) -> int:
        """Tokens of the request the deepest matching snapshot holds: a probe that plans,
        keeps and waits for nothing."""
        if not self.config.prefix_reuse:
            return 0
        frontiers = self.index.match(self._prompt(request), request.read_limit).frontiers
        return frontiers[-1] if frontiers else 0

    def _prompt(self, request: RequestInfo) -> PreparedPrompt:
        """The request's prepared prompt: the one its last lookup kept while its tokens are
        the same, else hashed anew. Hashing is the costly part of a lookup, and a waiting
        request is looked up again every step until it is admitted."""
        prompt = self._prepared.get(request.request_id)
        if prompt is not None and prompt.num_tokens == len(request.token_ids):
            return prompt
        return self.index.prepare_prompt(
            request.token_ids, media=request.media, cache_salt=request.cache_salt
        )

    def lookup(self, request: RequestInfo) -> Lookup:
        """Match the prompt, choose the source and plan the taps (§6.1-6.3, §7.1). Read-only."""
        n = len(request.token_ids)
        if not self.config.prefix_reuse:
            return Lookup(None, 0, [])
        prompt = self._prepared[request.request_id] = self._prompt(request)
        match = self.index.match(prompt, request.read_limit)
        quote = self._quote(request.request_id, match, self._growth(n, with_row=True))
        if quote.readiness is Readiness.PERMANENTLY_INFEASIBLE:
            raise InfeasibleRequest(
                f"request {request.request_id}: {n} tokens need {pages_for(n)} KV pages of "
                f"{BLOCK_TOKENS} tokens and state rows of {self._lane_pages} pages; the device "
                f"pool has {self.index.store.usable_pages} beside its scratch row"
            )
        frontier = quote.source.frontier if quote.source is not None else 0
        snapshot = quote.source.snapshot if quote.source is not None else None
        from_endpoint = snapshot is not None and snapshot.kind is SnapshotKind.ENDPOINT
        taps = self.planner.plan_request(
            PrefillRequest(
                num_tokens=request.num_prompt_tokens,
                base=frontier,
                matched_tokens=match.matched_tokens,
                existing=match.frontiers,
                breakpoints=request.breakpoints,
                template_hints=request.template_hints,
                media=prompt.media,
                resumed_from_endpoint=from_endpoint,
            )
        )
        # A media prompt never waits on a sibling (§12.2): its blocks are keyed by the items too.
        coalesce = request.read_limit is None and not prompt.media
        sibling = self._sibling(prompt, request, frontier) if coalesce else None
        if sibling is not None:
            self._waited.add(request.request_id)
        return Lookup(quote, frontier, taps, prompt, sibling, request.read_limit)

    def _sibling(self, prompt: PreparedPrompt, request: RequestInfo, frontier: int) -> Lane | None:
        """In-flight coalescing (§12.2): the running request whose snapshot, published soon, will
        serve this prompt at least one block deeper than the cache serves it now.

        The target is the last block boundary of the prefix both prompts share (and below each
        one's last token). A sibling that has not reached it yet gets an exact Boundary tap
        there; one that has passed it serves only through a capture still publishing. A wait
        always ends: the sibling publishes, passes the target without a slot for it, or leaves.
        """
        best: Lane | None = None
        deepest = frontier + BLOCK_TOKENS - 1
        for lane in self.live:
            other = lane.prompt
            if other is None or other.media or other.cache_salt != prompt.cache_salt:
                continue
            shared = _shared_blocks(prompt, other) * BLOCK_TOKENS
            limit = min(shared, request.num_prompt_tokens - 1, lane.num_prompt_tokens - 1)
            target = limit - limit % BLOCK_TOKENS
            if lane.scheduled_end >= target:
                target = max((c.frontier for c in lane.captures if c.frontier <= target), default=0)
            if target > deepest:
                best, deepest = lane, target
        if best is not None and best.scheduled_end < deepest:
            best.taps = plan_exact_tap(best.taps, deepest)
        return best

    def _quote(self, request_id: str, match: MatchResult, growth: GrowthPages) -> AdmissionQuote:
        """The request's quote: without the disk once its read found no host room. The lookup
        and the admission's quote again must agree, or a request quoted without the disk would
        find the disk source again at each admission and wait forever."""
        return self.index.quote(match, growth, disk=request_id not in self._no_disk)

    def _growth(self, n: int, with_row: bool) -> GrowthPages:
        """Pages a request of ``n`` tokens needs when it resumes at a frontier: its first
        chunk's, and its state row's unless it holds one already."""
        chunk = self.config.chunk_tokens
        row = self._lane_pages if with_row else 0

        def growth(frontier: int) -> int:
            end = min(n, frontier + chunk)
            return max(0, pages_for(end) - pages_for(frontier)) + row

        return growth

    def prefetch(self, lookup: Lookup) -> None:
        """The queue's head cannot be admitted now: copy its source's host-only blocks into
        spare device pages while it waits (§6.6), so its admission restores only the rest.

        The copies run on the restore stream like a restore's, before the next step's forward
        passes read anything (the workers order them), so they complete at the next step.
        The lookup's match serves unless the cache changed since (matching walks the whole
        prompt); the index answers at once while nothing that could open a copy changed."""
        quote = lookup.quote
        if quote is None or lookup.prompt is None or lookup.read_limit == 0:
            return
        if lookup.sibling is not None:
            return
        if self.index.is_current(quote):
            match = quote.match
        else:
            match = self.index.match(lookup.prompt, lookup.read_limit)
        prefetch = self.index.prefetch(match)
        if prefetch is None:
            return
        blocks = tuple(PageSlab(copy.page, copy.slab) for copy in prefetch.copies)
        self.pipeline.prefetch(HostRestore(blocks, None, None), prefetch)

    def forget(self, request_id: str) -> None:
        """The request was admitted or left the queue: drop what its lookups kept (a read
        still in flight lands for the cache all the same)."""
        self._prepared.pop(request_id, None)
        self._waited.discard(request_id)
        self._drop_read(request_id)
        self._no_disk.discard(request_id)

    def _drop_read(self, request_id: str) -> None:
        """The request no longer awaits its read: a landed one no other request awaits is
        unpinned (one in flight lands for the cache all the same, unpinned)."""
        read = self._reads.pop(request_id, None)
        if read is not None and self.index.holds_read(read) and not self.awaits(read):
            self.index.release_disk_read(read)

    def awaits(self, read: DiskRead) -> bool:
        """Whether a waiting request still awaits ``read``: it stays pinned once landed."""
        return read in self._reads.values()

    @property
    def kept_reads(self) -> int:
        """Waiting requests' landed reads the index keeps pinned for them (the audit's count)."""
        return sum(self.index.holds_read(read) for read in set(self._reads.values()))

    def reading_for(self, request_id: str) -> bool:
        """Whether the request's read from the disk tier is in flight."""
        read = self._reads.get(request_id)
        return read is not None and self.pipeline.reading(read)

    def disk_wait(self, request_id: str, lookup: Lookup) -> bool:
        """Whether the request steps aside for a read from the disk tier (in flight, or
        planned now for its lookup's source) rather than be admitted: vLLM then schedules
        the requests behind it. One waiting for a sibling is `admit`'s to hold back."""
        if lookup.quote is None or lookup.sibling is not None:
            return False
        return self._read_from_disk(request_id, lookup.quote)

    def _read_from_disk(self, request_id: str, quote: AdmissionQuote) -> bool:
        """Whether the request waits for a read from the disk tier: one in flight, one already
        bringing in a snapshot deeper than its quote's source (the start-up read's, another
        request's), or one its quote's source needs, planned now. A read the host has no room
        for is given up: the request is quoted without the disk from its next lookup on."""
        if self.reading_for(request_id):
            return True
        landing = self._landing(quote)
        if landing is not None:
            self._drop_read(request_id)
            self._reads[request_id] = landing
            return True
        source = _read_source(quote)
        if not source.disk_bytes:
            return False
        assert source.snapshot is not None
        if self.index.is_current(quote) and not self._plan_read(request_id, source.snapshot):
            self._no_disk.add(request_id)
        return True

    def read_ahead(self, request_id: str, lookup: Lookup) -> bool:
        """A waiting request vLLM has not reached (its running set is full, or the step's token
        budget spent): plan the read its lookup's source needs from the disk tier now, so that
        it has landed when the request's turn comes (§6.6's prefetch, extended to the disk).
        Its room evicts no last copy (`ReadRoom.LOSSLESS`): the turn may not come soon. One
        that finds no room is not given up: the request's turn reads as a hit. Whether it was
        planned."""
        quote = lookup.quote
        if quote is None or lookup.sibling is not None or request_id in self._reads:
            return False
        source = _read_source(quote)
        if not source.disk_bytes or self._landing(quote) is not None:
            return False
        assert source.snapshot is not None
        if not self.index.is_current(quote):
            return False
        if not self._plan_read(request_id, source.snapshot, ReadRoom.LOSSLESS):
            return False
        self.counters.disk_reads_ahead += 1
        return True

    def _plan_read(
        self, request_id: str, snapshot: Snapshot, room: ReadRoom = ReadRoom.ANY
    ) -> bool:
        """Read ``snapshot``'s disk-only parts for the request (`PrefixIndex.plan_disk_read`);
        a read it landed before serves no longer. Whether the host had room."""
        read = self.index.plan_disk_read(snapshot, room)
        self._drop_read(request_id)
        if read is None:
            return False
        self.pipeline.disk_read(read)
        self._reads[request_id] = read
        return True

    def _landing(self, quote: AdmissionQuote) -> DiskRead | None:
        """The read in flight of the deepest candidate deeper than the quote's source: source
        choice passes over a snapshot whose copies are landing, and waiting for them costs
        less than prefilling what they hold."""
        frontier = quote.source.frontier if quote.source is not None else 0
        for snapshot in reversed(quote.match.candidates):
            if snapshot.frontier <= frontier:
                return None
            read = self.pipeline.read_of(snapshot)
            if read is not None:
                return read
        return None

    def _hit_medium(self, request_id: str, source: Snapshot | None, from_host: bool) -> Medium:
        """Where an admission's prefix came from, for the hit counters: the disk when its
        source is what a read of its own brought to the host, restored from there or from the
        pages a prefetch copied it to while the request waited for room."""
        read = self._reads.get(request_id)
        if read is not None and read.snapshot is source:
            return Medium.DISK
        return Medium.HOST if from_host else Medium.DEVICE

    def admit(
        self, request: RequestInfo, lookup: Lookup, num_new_tokens: int, lookahead: int = 0
    ) -> Lane | None:
        """Take a state row, the source and pages for the first chunk; None: no room now,
        counting the decode pages the running requests are still owed and its own
        (`RuntimeConfig.decode_reserve_tokens`)."""
        frontier = lookup.frontier
        quote = lookup.quote
        if lookup.sibling is not None:
            return None
        if quote is not None and self._read_from_disk(request.request_id, quote):
            return None  # before the cap: the read runs while the request waits for room
        if len(self.live) >= self.config.active_cap:
            return None
        end = frontier + num_new_tokens + lookahead
        if quote is not None and quote.readiness is not Readiness.READY:
            return None
        need = pages_for(end) - frontier // BLOCK_TOKENS + self._lane_pages
        if quote is None and need > self.index.available_pages:
            return None
        n = request.num_prompt_tokens
        reserve_end = n + min(request.max_output_tokens, self.config.decode_reserve_tokens)
        if self.live:  # alone, a request takes what there is: it never waits on a reserve
            owed = sum(
                owed_pages(lane.reserve_end, lane.num_prompt_tokens, len(lane.pages))
                for lane in self.live
            )
            own = owed_pages(reserve_end, n, 0)
            if need + own + owed > self.index.available_pages:
                return None
        rows = self._take_rows(quote)
        if rows is None:
            return None
        row, *spec_rows = rows
        if quote is not None:
            quote = self._requote(request.request_id, lookup, quote)
            if quote is None:
                for row in rows:
                    self.index.release_state_row(row, unused=True)
                return None
        from_host = False
        pages: list[PageId] = []
        private: set[PageId] = set()
        lease = None
        source = None
        if quote is not None:
            grant = self.index.acquire(quote)
            lease, source = grant.lease, grant.source
            pages = [node.device_page for node in lease.path]  # type: ignore[misc]
            restore = grant.restore
            if restore is not None:
                from_host = self._plan_restore(restore, row, pages, private)
        new = self.pipeline.allocate(pages_for(end) - len(pages))
        if new is None:
            raise RuntimeError(f"a quoted admission of {request.request_id} found no pages")
        pages.extend(new)
        private.update(new)
        lane = Lane(
            request.request_id,
            row,
            pages,
            private,
            lease,
            frontier,
            request.num_prompt_tokens,
            prompt=lookup.prompt if lease is not None else None,
            taps=list(lookup.taps),
            newest_frontier=frontier,
            from_host=from_host,
            reserve_end=reserve_end,
            spec_rows=tuple(spec_rows),
        )
        self.live.add(lane)
        if request.request_id in self._waited:
            self.counters.coalesced_requests += 1
        hit = self._hit_medium(request.request_id, source, from_host)
        self.forget(request.request_id)
        self.counters.prompt_tokens += len(request.token_ids)
        if hit is Medium.DISK:
            self.counters.hit_tokens_disk += frontier
        elif hit is Medium.HOST:
            self.counters.hit_tokens_host += frontier
        else:
            self.counters.hit_tokens_device += frontier
        return lane

    @property
    def _lane_pages(self) -> int:
        """Pages of the state rows one running request holds (`RuntimeConfig.lane_rows`)."""
        return self.index.row_pages * self.config.lane_rows

    def _take_rows(self, quote: AdmissionQuote | None) -> list[RowId] | None:
        """The new lane's state rows, all or none."""
        rows: list[RowId] = []
        for _ in range(self.config.lane_rows):
            row = self.index.take_state_row(quote)
            if row is None:
                for taken in rows:
                    self.index.release_state_row(taken, unused=True)
                return None
            rows.append(row)
        return rows

    def _requote(
        self, request_id: str, lookup: Lookup, quote: AdmissionQuote
    ) -> AdmissionQuote | None:
        """The quote again, now that the row is taken (which evicted, so the cache moved on):
        its source was kept, so it still serves unless the pages ran short."""
        assert lookup.prompt is not None
        match = self.index.match(lookup.prompt, lookup.read_limit)
        growth = self._growth(lookup.prompt.num_tokens, with_row=False)
        fresh = self._quote(request_id, match, growth)
        same = (
            fresh.readiness is Readiness.READY
            and fresh.source is not None
            and quote.source is not None
            and fresh.source.snapshot is quote.source.snapshot
            and fresh.source.frontier == quote.source.frontier
        )
        return fresh if same else None

    def _plan_restore(
        self, restore: Restore, row: int, pages: list[PageId], private: set[PageId]
    ) -> bool:
        """Plan the copies that put the snapshot into the lane; True when any come from the
        host. The lane's copy of a host-only tail is restored from the slab too, so no device
        copy has to wait for the restore."""
        blocks = [PageSlab(copy.page, copy.slab) for copy in restore.blocks]
        image = None
        if restore.image_slot is not None:
            source = self.index.slot_row(restore.image_slot)
            self.pipeline.plan.state_copies.append(StateCopy(source, row))
        else:
            image = ImageCopy(row, restore.image_slabs)
        tail = None
        if restore.tail is not None:
            tail_slab, tail_page = restore.tail
            tail = PageSlab(tail_page, tail_slab)
        if restore.tail_page is not None:
            cow = self._allocate_one()
            if tail is not None:
                blocks.append(PageSlab(cow, tail.slab))
            else:
                self.pipeline.plan.page_copies.append(PageCopy(restore.tail_page, cow))
            pages.append(cow)
            private.add(cow)
        self.pipeline.land(restore)
        if not blocks and image is None:
            return False
        self.pipeline.host_restore(HostRestore(tuple(blocks), tail, image))
        return True

    def grow(self, lane: Lane, num_tokens: int) -> list[PageId] | None:
        """Pages so the block table covers ``num_tokens`` tokens; None when there is no room."""
        new = self.pipeline.allocate(pages_for(num_tokens) - len(lane.pages))
        if new is None:
            return None
        lane.pages.extend(new)
        lane.private.update(new)
        return new

    def _allocate_one(self) -> PageId:
        """A page the admission's quote already counted."""
        pages = self.pipeline.allocate(1)
        if not pages:
            raise RuntimeError("a quoted admission found no page")
        return pages[0]


def _read_source(quote: AdmissionQuote) -> SourceOption:
    """The source a read from disk prepares: the quote's, or while the request is blocked for
    room (no source fits now), the one cost chooses, so that the read runs while it waits
    (§6.6's prefetch, extended to the disk)."""
    return quote.source if quote.source is not None else quote.preferred


def owed_pages(reserve_end: int, num_prompt_tokens: int, pages_taken: int) -> int:
    """Decode pages of a request's reserve (up to ``reserve_end`` tokens) beyond its prompt's
    pages that it has not taken yet."""
    return max(0, pages_for(reserve_end) - max(pages_taken, pages_for(num_prompt_tokens)))


def _shared_blocks(a: PreparedPrompt, b: PreparedPrompt) -> int:
    """Full blocks two prompts share from the start, compared exactly.

    Lookup hashes are chained, so equal hashes at block k mean (barring a collision, which the
    byte comparison catches) equal blocks 0..k: a binary search finds the shared run.
    """
    low, high = 0, min(len(a.block_hashes), len(b.block_hashes))
    while low < high:
        mid = (low + high + 1) // 2
        if a.block_hashes[mid - 1] == b.block_hashes[mid - 1]:
            low = mid
        else:
            high = mid - 1
    exact = (
        a.token_range(0, low * BLOCK_TOKENS) == b.token_range(0, low * BLOCK_TOKENS)
        and a.block_extras[:low] == b.block_extras[:low]
    )
    return low if exact else 0
