"""HybridPrefixCache: one engine's cache runtime, driven by the scheduler (§6, §7, §8).

The scheduler calls it in this order each step::

    new_step()                                    # land last step's restores, publish captures
    lookup(request) -> Lookup                     # waiting request: source and taps (read-only)
    chunk_limit(...)                              # a prefill chunk ends at the next exact tap
    admit(request, lookup, ...) / grow(lane, ...) # pages and state slot, or None: no room now
    on_scheduled(lane, start, end)                # plan the taps this chunk reaches
    take_plan() -> StepPlan                       # the copies the workers run before the step
    ... the step runs ...
    commit(lane, tokens, n)                       # full blocks join the tree, taps publish
    finish(lane, tokens, n)                       # endpoint snapshot, release

Timing rules that keep copies exact (every copy of a plan runs before the step's forward pass,
in order):

- A tap at the end of a chunk copies the state after that chunk, so its copy goes into the
  *next* plan. A tap at the start of the prompt's final chunk copies it into the current one.
- Where the workers can (`RuntimeConfig.in_pass_taps`), a tap at a 64-token offset inside a
  chunk that starts on a block boundary is captured during the pass (`InPassCapture`): it
  neither splits the chunk nor waits for its end.
- A snapshot is published when the blocks below it are committed and its state copy is queued;
  a restore from it is queued later, so it reads the copied state. A snapshot whose tail page is
  copied too is published only once that copy's plan was handed out, since vLLM runs the page
  copies of one step together.
- Pages a finished request releases may still be read by copies in the pending plan: they
  return to the pool only after that plan was handed out (quarantine).

Host tier (§6.4, §7.6): write-through batches (released blocks, published snapshots) join the
plan and complete when the workers report them (`complete_writes`); until then the index keeps
their sources pinned. A restore from the host lands before the admitted request's first forward
pass reads each layer, so it completes at the next step, like a device restore.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_hpc.index import (
    BLOCK_TOKENS,
    AdmissionQuote,
    BlockWrite,
    IndexConfig,
    InvariantError,
    MediaItem,
    PageId,
    PlannedTap,
    Prefetch,
    PrefixIndex,
    PreparedPrompt,
    Readiness,
    Restore,
    SlotId,
    SnapshotKind,
    SnapshotWrite,
    TapHint,
    TapPlanner,
    TapPolicy,
    TapRequest,
    TapSource,
)
from vllm_hpc.index.device_pool import PageState
from vllm_hpc.index.host_pool import SlabUse
from vllm_hpc.runtime.lane import Capture, Lane
from vllm_hpc.runtime.plan import (
    HostRestore,
    HostWrite,
    ImageCopy,
    InPassCapture,
    PageCopy,
    PageSlab,
    StateCopy,
    StepPlan,
)
from vllm_hpc.runtime.telemetry import (
    ADMISSION,
    HOST,
    INDEX,
    AdmissionCounters,
    HostCounters,
)


class InfeasibleRequest(ValueError):
    """The request can never fit in the device KV pool, even with an empty cache."""


@dataclass(frozen=True)
class RuntimeConfig:
    index: IndexConfig
    active_slots: int
    """C: state slots of running requests (pool ids 1..C; id 0 is the workers' scratch slot)."""
    tap_policy: TapPolicy
    chunk_tokens: int
    """The scheduler's token budget per step: a new request's first chunk is at most this."""
    prefix_reuse: bool = True
    """False (--no-prefix-reuse): nothing is looked up, inserted or captured."""
    in_pass_taps: bool = False
    """The workers capture states inside a prefill pass, at 64-token offsets (CUDA's GDN kernel
    computes them anyway): taps there need no chunk split."""


@dataclass(frozen=True)
class RequestInfo:
    """What the runtime needs of a request."""

    request_id: str
    token_ids: Sequence[int]
    """All tokens so far: the prompt, then generated tokens."""
    num_prompt_tokens: int
    cache_salt: str | None = None
    breakpoints: tuple[int, ...] = ()
    """Client-named reuse points (token positions): exact Boundary taps (§7.1)."""
    template_hints: tuple[TapHint, ...] = ()
    """Semantic positions the chat template marks: the generation opener, structural ends."""
    read_cache: bool = True
    media: tuple[MediaItem, ...] = ()
    """The prompt's media items (images, videos): their identity keys the blocks they touch."""


@dataclass(frozen=True)
class Lookup:
    """A waiting request's admission source and tap plan; valid until the cache changes."""

    quote: AdmissionQuote | None
    frontier: int
    """Tokens served from the cache: the request prefills [frontier, n)."""
    taps: list[PlannedTap]
    prompt: PreparedPrompt | None = None
    sibling: Lane | None = None
    """A running request that is prefilling more of this prompt than the cache serves now: the
    request waits for its snapshot instead of prefilling the same tokens (§12.2)."""
    read_cache: bool = True
    """False: the request reads nothing from the cache (its quote's match has no candidates)."""


class HybridPrefixCache:
    def __init__(self, config: RuntimeConfig) -> None:
        if config.active_slots <= 0:
            raise ValueError(f"need at least one active state slot, got {config.active_slots}")
        self.config = config
        self.index = PrefixIndex(config.index)
        self.planner = TapPlanner(config.tap_policy)
        self._free_slots = list(range(config.active_slots, 0, -1))
        self._plan = StepPlan()
        self._deferred: list[tuple[Lane, Capture]] = []
        """Captures of the state after the step being planned: their copies join the next plan."""
        self._plans_taken = 0
        self._landing: list[Restore] = []
        """Restores whose copies are in a plan already handed out; complete at the next step."""
        self._prefetching: list[Prefetch] = []
        """Prefetches whose copies are in a plan already handed out; complete at the next step."""
        self._quarantine: list[tuple[int, list[PageId]]] = []
        self._retiring: list[Lane] = []
        """Finished lanes waiting for their captures to publish before they release."""
        self._new_pages: list[PageId] = []
        self._live: set[Lane] = set()
        self._prepared: dict[str, PreparedPrompt] = {}
        self._write_batch: list[BlockWrite | SnapshotWrite] = []
        """Write-through planned for the plan being built."""
        self._writing: dict[int, list[BlockWrite | SnapshotWrite]] = {}
        """Handed-out write batches the workers have not reported done, by batch number."""
        self._waited: set[str] = set()
        """Waiting requests that held back for a sibling's snapshot (§12.2)."""
        self.admissions = AdmissionCounters()
        self.host = HostCounters()

    # -- slots ------------------------------------------------------------------------------

    def snapshot_pool_slot(self, slot: SlotId) -> int:
        """Workers' pool id of index snapshot slot ``slot`` (after the scratch and active slots)."""
        return 1 + self.config.active_slots + slot

    # -- step boundaries --------------------------------------------------------------------

    def new_step(self) -> None:
        """Start planning a step: earlier plans were handed out, so their copies precede it."""
        for restore in self._landing:
            self.index.complete_restore(restore)
        self._landing.clear()
        for prefetch in self._prefetching:
            self.index.complete_prefetch(prefetch)
        self._prefetching.clear()
        keep = []
        for taken_at, pages in self._quarantine:
            if self._plans_taken > taken_at:
                self.index.free_pages(pages)
            else:
                keep.append((taken_at, pages))
        self._quarantine = keep
        for lane, capture in self._deferred:
            self._queue(lane, capture)
        self._deferred.clear()
        for lane in list(self._retiring):
            self._publish_ready(lane)
            if not lane.captures:
                self._retiring.remove(lane)
                self._release(lane)

    def take_plan(self) -> StepPlan:
        """The copies the workers run before this step's forward pass."""
        plan, self._plan = self._plan, StepPlan()
        if self._write_batch:
            plan.host_writes.append(self._host_write(self._plans_taken, self._write_batch))
            self._writing[self._plans_taken] = self._write_batch
            self._write_batch = []
        self._plans_taken += 1
        return plan

    def _host_write(self, batch: int, records: list[BlockWrite | SnapshotWrite]) -> HostWrite:
        blocks: list[PageSlab] = []
        images: list[ImageCopy] = []
        for record in records:
            if isinstance(record, BlockWrite):
                blocks.extend(PageSlab(copy.page, copy.slab) for copy in record.copies)
                continue
            images.append(ImageCopy(self.snapshot_pool_slot(record.slot), record.image_slabs))
            if record.tail_page is not None and record.tail_slab is not None:
                blocks.append(PageSlab(record.tail_page, record.tail_slab))
        geometry = self.config.index.geometry
        self.host.write_bytes += len(blocks) * geometry.block_bytes
        self.host.write_bytes += len(images) * geometry.image_bytes
        return HostWrite(batch, tuple(blocks), tuple(images))

    def complete_writes(self, batches: Sequence[int]) -> None:
        """The workers finished these write-through batches: the host copies are resident."""
        for batch in batches:
            for record in self._writing.pop(batch, ()):
                if isinstance(record, BlockWrite):
                    self.index.complete_block_write(record)
                else:
                    self.index.complete_snapshot_write(record)

    def take_new_pages(self) -> list[PageId]:
        """Pages allocated since the last call (vLLM zeroes them before the step's copies)."""
        pages, self._new_pages = self._new_pages, []
        return pages

    # -- admission --------------------------------------------------------------------------

    def lookup(self, request: RequestInfo) -> Lookup:
        """Match the prompt, choose the source and plan the taps (§6.1-6.3, §7.1). Read-only."""
        n = len(request.token_ids)
        if not self.config.prefix_reuse:
            return Lookup(None, 0, [])
        prompt = self._prepared.get(request.request_id)
        if prompt is None or prompt.num_tokens != n:
            # Hashing is the costly part of a lookup, and a waiting request is looked up again
            # every step until it is admitted: keep its prepared prompt until then.
            prompt = self.index.prepare_prompt(
                request.token_ids, media=request.media, cache_salt=request.cache_salt
            )
            self._prepared[request.request_id] = prompt
        match = self.index.match(prompt)
        if not request.read_cache:
            match = type(match)(prompt, match.root, [], [])
        chunk = self.config.chunk_tokens

        def growth(frontier: int) -> int:
            end = min(n, frontier + chunk)
            return max(0, _pages(end) - _pages(frontier))

        quote = self.index.quote(match, growth)
        if quote.readiness is Readiness.PERMANENTLY_INFEASIBLE:
            raise InfeasibleRequest(
                f"request {request.request_id}: {n} tokens need {_pages(n)} KV pages of "
                f"{BLOCK_TOKENS} tokens; the device pool has {self.config.index.device_pages}"
            )
        frontier = quote.source.frontier if quote.source is not None else 0
        # A breakpoint at 1 would save one token and end a one-token first chunk, which vLLM's
        # CPU GDN kernel cannot prefill (it stops the engine): it is ignored.
        hints = [TapHint(p, TapSource.EXPLICIT) for p in request.breakpoints if p > 1]
        hints.extend(request.template_hints)
        # Beyond the spec: where the prompt leaves the cached path (floored to 64), a Boundary tap
        # lets the next request sharing this prefix resume there.
        junction = match.matched_tokens
        if frontier < junction <= request.num_prompt_tokens - 1:
            hints.append(TapHint(junction, TapSource.STRUCTURAL))
        snapshot = quote.source.snapshot if quote.source is not None else None
        from_endpoint = snapshot is not None and snapshot.kind is SnapshotKind.ENDPOINT
        taps = self.planner.plan(
            TapRequest(
                num_tokens=request.num_prompt_tokens,
                base=frontier,
                hints=hints,
                existing=match.frontiers,
                media=prompt.media,
                resumed_from_endpoint=from_endpoint,
            )
        )
        taps = _aligned_tail(taps, frontier, match.frontiers, from_endpoint)
        # A media prompt never waits on a sibling (§12.2): its blocks are keyed by the items too.
        coalesce = request.read_cache and not prompt.media
        sibling = self._sibling(prompt, request, frontier) if coalesce else None
        if sibling is not None:
            self._waited.add(request.request_id)
        return Lookup(quote, frontier, taps, prompt, sibling, request.read_cache)

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
        for lane in self._live:
            other = lane.prompt
            if other is None or other.media or other.cache_salt != prompt.cache_salt:
                continue
            shared = _shared_blocks(prompt, lane.prompt) * BLOCK_TOKENS
            limit = min(shared, request.num_prompt_tokens - 1, lane.num_prompt_tokens - 1)
            target = limit - limit % BLOCK_TOKENS
            if lane.scheduled_end >= target:
                target = max((c.frontier for c in lane.captures if c.frontier <= target), default=0)
            if target > deepest:
                best, deepest = lane, target
        if best is not None and best.scheduled_end < deepest:
            _plan_exact_tap(best, deepest)
        return best

    def prefetch(self, lookup: Lookup) -> None:
        """The queue's head cannot be admitted now: copy its source's host-only blocks into
        spare device pages while it waits (§6.6), so its admission restores only the rest.

        The copies run on the restore stream like a restore's, before the next step's forward
        passes read anything (the workers order them), so they complete at the next step.
        The lookup's match serves unless the cache changed since (matching walks the whole
        prompt); the index answers at once while nothing that could open a copy changed."""
        quote = lookup.quote
        if quote is None or lookup.prompt is None or not lookup.read_cache:
            return
        if lookup.sibling is not None:
            return
        match = quote.match if self.index.is_current(quote) else self.index.match(lookup.prompt)
        prefetch = self.index.prefetch(match)
        if prefetch is None:
            return
        blocks = tuple(PageSlab(copy.page, copy.slab) for copy in prefetch.copies)
        self._plan.prefetches.append(HostRestore(blocks, None, None))
        self._prefetching.append(prefetch)
        self.host.restore_bytes += len(blocks) * self.config.index.geometry.block_bytes

    def forget(self, request_id: str) -> None:
        """The request was admitted or left the queue: drop what its lookups kept."""
        self._prepared.pop(request_id, None)
        self._waited.discard(request_id)

    def chunk_limit(
        self, taps: Sequence[PlannedTap], start: int, num_new_tokens: int, num_prompt_tokens: int
    ) -> int:
        """Shorten a chunk starting at ``start`` so it ends at the next exact tap that cannot be
        captured inside the pass, if any.

        Where taps are captured inside a pass, a chunk that ends inside the prompt also ends on
        a block boundary (giving up fewer than 64 tokens of the step): the next chunk then
        starts on one, where its taps can be captured in the pass. Without this, one chunk
        ending elsewhere (the step's budget shared with other requests) would leave every
        later chunk of the prompt without in-pass taps.
        """
        end = start + num_new_tokens
        for tap in taps:
            if tap.exact and start < tap.position < end and not self._in_pass(start, tap.position):
                return tap.position - start
        if self.config.in_pass_taps and end < num_prompt_tokens:
            aligned = end - end % BLOCK_TOKENS
            if aligned > start:
                return aligned - start
        return num_new_tokens

    def _in_pass(self, start: int, position: int) -> bool:
        """Whether a chunk from ``start`` can capture the state at ``position`` (inside it)
        during its pass: the kernel's 64-token chunks then end there, on a block boundary, so
        the snapshot needs no tail page (whose KV the pass is still writing)."""
        return (
            self.config.in_pass_taps
            and start % BLOCK_TOKENS == 0
            and position % BLOCK_TOKENS == 0
            and position > start
        )

    def admit(
        self, request: RequestInfo, lookup: Lookup, num_new_tokens: int, lookahead: int = 0
    ) -> Lane | None:
        """Take the source, a state slot and pages for the first chunk; None: no room now."""
        if not self._free_slots:
            return None
        frontier = lookup.frontier
        quote = lookup.quote
        end = frontier + num_new_tokens + lookahead
        if lookup.sibling is not None:
            return None
        if quote is not None and quote.readiness is not Readiness.READY:
            return None
        need = _pages(end) - frontier // BLOCK_TOKENS
        if quote is None and need > self.index.available_pages:
            return None
        slot = self._free_slots.pop()
        from_host = False
        pages: list[PageId] = []
        private: set[PageId] = set()
        lease = None
        if quote is not None:
            admission = self.index.acquire(quote)
            lease = admission.lease
            pages = [node.device_page for node in lease.path]  # type: ignore[misc]
            restore = admission.restore
            if restore is not None:
                from_host = self._plan_restore(restore, slot, pages, private)
        new = self._allocate(_pages(end) - len(pages))
        if new is None:
            raise RuntimeError(f"a quoted admission of {request.request_id} found no pages")
        pages.extend(new)
        private.update(new)
        lane = Lane(
            request.request_id,
            slot,
            pages,
            private,
            lease,
            frontier,
            request.num_prompt_tokens,
            prompt=lookup.prompt if lease is not None else None,
            taps=list(lookup.taps),
            newest_frontier=frontier,
        )
        self._live.add(lane)
        if request.request_id in self._waited:
            self.admissions.coalesced_requests += 1
        self.forget(request.request_id)
        self.admissions.prompt_tokens += len(request.token_ids)
        if from_host:
            self.admissions.hit_tokens_host += frontier
        else:
            self.admissions.hit_tokens_device += frontier
        return lane

    def _plan_restore(
        self, restore: Restore, slot: int, pages: list[PageId], private: set[PageId]
    ) -> bool:
        """Plan the copies that put the snapshot into the lane; True when any come from the
        host. The lane's copy of a host-only tail is restored from the slab too, so no device
        copy has to wait for the restore."""
        blocks = [PageSlab(copy.page, copy.slab) for copy in restore.blocks]
        image = None
        if restore.image_slot is not None:
            source = self.snapshot_pool_slot(restore.image_slot)
            self._plan.state_copies.append(StateCopy(source, slot))
        else:
            image = ImageCopy(slot, restore.image_slabs)
        tail = None
        if restore.tail is not None:
            tail_slab, tail_page = restore.tail
            tail = PageSlab(tail_page, tail_slab)
        if restore.tail_page is not None:
            cow = self._allocate_one()
            if tail is not None:
                blocks.append(PageSlab(cow, tail.slab))
            else:
                self._plan.page_copies.append(PageCopy(restore.tail_page, cow))
            pages.append(cow)
            private.add(cow)
        self._landing.append(restore)
        if not blocks and image is None:
            return False
        self._plan.host_restores.append(HostRestore(tuple(blocks), tail, image))
        geometry = self.config.index.geometry
        self.host.restore_bytes += (len(blocks) + (restore.tail is not None)) * geometry.block_bytes
        self.host.restore_bytes += geometry.image_bytes if image is not None else 0
        return True

    def grow(self, lane: Lane, num_tokens: int) -> list[PageId] | None:
        """Pages so the block table covers ``num_tokens`` tokens; None when there is no room."""
        new = self._allocate(_pages(num_tokens) - len(lane.pages))
        if new is None:
            return None
        lane.pages.extend(new)
        lane.private.update(new)
        return new

    def _allocate_one(self) -> PageId:
        """A page the admission's quote already counted."""
        pages = self._allocate(1)
        if not pages:
            raise RuntimeError("a quoted admission found no page")
        return pages[0]

    def _allocate(self, count: int) -> list[PageId] | None:
        if count <= 0:
            return []
        pages = self.index.allocate_pages(count)
        if pages is not None:
            self._new_pages.extend(pages)
        return pages

    # -- taps -------------------------------------------------------------------------------

    def on_scheduled(self, lane: Lane, token_ids: Sequence[int], start: int, end: int) -> None:
        """The chunk [start, end) of ``lane`` runs this step: capture the taps it reaches."""
        lane.scheduled_end = max(lane.scheduled_end, end)
        due = [t for t in lane.taps if t.position <= end]
        if not due or not lane.caching:
            return
        lane.taps = [t for t in lane.taps if t.position > end]
        in_pass: dict[int, list[PlannedTap]] = {}
        rest = []
        for tap in due:
            # A flexible tap may move back to its block boundary; an exact one stays put.
            position = tap.position if tap.exact else tap.position - tap.position % BLOCK_TOKENS
            if position < end and self._in_pass(start, position):
                in_pass.setdefault(position, []).append(tap)
            else:
                rest.append(tap)
        for position, taps in sorted(in_pass.items()):
            self._capture(lane, token_ids, position, _kind(taps), in_pass_offset=position - start)
        if not rest:
            return
        kind = _kind(rest)
        if end < lane.num_prompt_tokens:
            self._capture(lane, token_ids, end, kind, after_step=True)
        elif start > lane.newest_frontier:  # flexible taps in the final chunk: at its start (§7.1)
            self._capture(lane, token_ids, start, kind, after_step=False)

    def _capture(
        self,
        lane: Lane,
        token_ids: Sequence[int],
        frontier: int,
        kind: SnapshotKind,
        after_step: bool = False,
        in_pass_offset: int | None = None,
    ) -> None:
        """Take a slot (and a tail page) for a snapshot of ``lane`` at ``frontier``. Its copies go
        into the next plan when they must see the state after the step being planned; an
        in-pass capture, ``in_pass_offset`` tokens into this step's chunk (no tail: its frontier
        is a block boundary), goes into this one."""
        assert lane.lease is not None
        if lane.prompt is not None and not lane.prompt.resumable_at(frontier):
            return  # no request could resume there (`resume_floor`)
        slot = self.index.take_snapshot_slot(lane.lease, kind, frontier)
        if slot is None:
            return
        tail_page = page_copy = None
        if frontier % BLOCK_TOKENS:
            source = lane.pages[frontier // BLOCK_TOKENS]
            if kind is SnapshotKind.ENDPOINT:  # the finished request's page moves, no copy
                tail_page = source
                lane.private.discard(source)
            else:
                tail = self._allocate(1)
                if tail is None:
                    self.index.return_snapshot_slot(slot)
                    return
                tail_page = tail[0]
                page_copy = PageCopy(source, tail_page)
        dst = self.snapshot_pool_slot(slot)
        copy: StateCopy | InPassCapture = (
            StateCopy(lane.slot, dst)
            if in_pass_offset is None
            else InPassCapture(lane.slot, in_pass_offset, dst)
        )
        capture = Capture(
            frontier, kind, slot, _tail(token_ids, frontier), tail_page, copy, page_copy
        )
        lane.captures.append(capture)
        if after_step:
            self._deferred.append((lane, capture))
        else:
            self._queue(lane, capture)

    def _queue(self, lane: Lane, capture: Capture) -> None:
        """Put the capture's copies into the plan being built."""
        lane.newest_frontier = max(lane.newest_frontier, capture.frontier)
        copy = capture.state_copy
        if isinstance(copy, InPassCapture):
            self._plan.in_pass.append(copy)
        else:
            self._plan.state_copies.append(copy)
        if capture.page_copy is not None:
            self._plan.page_copies.append(capture.page_copy)
            capture.page_copy_step = self._plans_taken
        capture.copies_queued = True

    # -- after a step -----------------------------------------------------------------------

    def commit(self, lane: Lane, token_ids: Sequence[int], num_computed: int) -> None:
        """Tokens [0, num_computed) of ``lane`` are in KV and state: commit full blocks (§7.6)
        and publish the captures they complete (§7.4)."""
        lease = lane.lease
        if lease is None:
            return
        extras = lane.prompt.block_extras if lane.prompt is not None else ()
        for block in range(len(lease.path), num_computed // BLOCK_TOKENS):
            begin = block * BLOCK_TOKENS
            page = lane.pages[block]
            extra = extras[block] if block < len(extras) else 0  # generated tokens: no media
            result = self.index.commit_block(
                lease, token_ids[begin : begin + BLOCK_TOKENS], page, extra
            )
            if result.page_is_cached:
                lane.private.discard(page)
        self._publish_ready(lane)

    def _publish_ready(self, lane: Lane) -> None:
        assert lane.lease is not None
        committed_blocks = len(lane.lease.path)
        for capture in list(lane.captures):
            if not capture.copies_queued or capture.frontier // BLOCK_TOKENS > committed_blocks:
                continue
            if capture.page_copy_step is not None and capture.page_copy_step >= self._plans_taken:
                continue
            lane.captures.remove(capture)
            publication = self.index.publish_snapshot(
                lane.lease,
                kind=capture.kind,
                frontier=capture.frontier,
                tail_tokens=capture.tail_tokens,
                slot=capture.slot,
                tail_page=capture.tail_page,
            )
            if publication.write is not None:
                self._write_batch.append(publication.write)

    def finish(self, lane: Lane, token_ids: Sequence[int], num_computed: int) -> None:
        """The request ended (finished, aborted or preempted) after ``num_computed`` tokens:
        commit its blocks, capture its endpoint (§7.7) and release it."""
        self._live.remove(lane)
        self._free_slots.append(lane.slot)
        if lane.lease is None:
            self._release(lane)
            return
        for capture in [c for c in lane.captures if c.frontier > num_computed]:
            self._drop(lane, capture)  # a chunk that was planned but never ran (preemption)
        self.commit(lane, token_ids, num_computed)
        if num_computed - lane.newest_frontier >= BLOCK_TOKENS:
            self._capture(lane, token_ids, num_computed, SnapshotKind.ENDPOINT, after_step=False)
        self._publish_ready(lane)
        if lane.captures:
            self._retiring.append(lane)
        else:
            self._release(lane)

    def _drop(self, lane: Lane, capture: Capture) -> None:
        assert not capture.copies_queued
        lane.captures.remove(capture)
        self._deferred.remove((lane, capture))
        self.index.return_snapshot_slot(capture.slot)
        if capture.tail_page is not None:
            self.index.free_pages([capture.tail_page])

    def _release(self, lane: Lane) -> None:
        if lane.private:
            self._quarantine.append((self._plans_taken, sorted(lane.private)))
            lane.private = set()
        if lane.lease is not None:
            write = self.index.release(lane.lease)
            if write is not None:
                self._write_batch.append(write)
            lane.lease = None

    # -- reporting --------------------------------------------------------------------------

    def telemetry(self) -> dict[str, int]:
        """Cumulative counters and current levels (`vllm_hpc.runtime.telemetry`)."""
        index, store = self.index, self.index.store
        values = {m.name: getattr(index.stats, m.name) for m in INDEX}
        values.update({m.name: getattr(self.admissions, m.name) for m in ADMISSION})
        values.update({m.name: getattr(self.host, m.name.removeprefix("host_")) for m in HOST})
        values["snapshots"] = len(store.snapshots)
        values["snapshot_slots_used"] = store.slots.capacity - store.slots.num_free
        values["active_slots_used"] = len(self._live)
        values["device_pages_free"] = store.pages.num_free
        values["device_pages_evictable"] = len(store.lru)
        slabs, slab_bytes = store.slabs, store.slabs.geometry.slab_bytes
        values["host_bytes_blocks"] = slabs.num_in_use(SlabUse.NODE) * slab_bytes
        values["host_bytes_images"] = slabs.num_in_use(SlabUse.IMAGE) * slab_bytes
        values["host_bytes_tails"] = slabs.num_in_use(SlabUse.TAIL) * slab_bytes
        values["host_bytes_free"] = slabs.num_free * slab_bytes
        return values

    def audit(self) -> None:
        """Check the index's invariants and that every private page, state slot, lease and
        transfer is accounted for by a running request, a pending capture, the quarantine or a
        copy in flight (tests)."""
        self.index.check_invariants()
        live = self._live | set(self._retiring)
        expected = {p for lane in live for p in lane.private}
        expected |= {p for _, pages in self._quarantine for p in pages}
        expected |= {c.tail_page for lane in live for c in lane.captures if c.tail_page is not None}
        active = set(self.index.store.pages.pages_in(PageState.ACTIVE))
        if active != expected:
            raise InvariantError(
                f"private pages: {len(active)} held, {len(expected)} accounted for "
                f"(leaked {sorted(active - expected)[:8]}, missing {sorted(expected - active)[:8]})"
            )
        if len(self._free_slots) + len(self._live) != self.config.active_slots:
            raise InvariantError(
                f"active slots: {len(self._free_slots)} free + {len(self._live)} running != "
                f"{self.config.active_slots}"
            )
        transfers = len(self._landing) + len(self._prefetching) + len(self._write_batch)
        transfers += sum(len(records) for records in self._writing.values())
        if self.index.num_in_flight != transfers:
            raise InvariantError(
                f"index has {self.index.num_in_flight} transfers in flight, expected {transfers}"
            )
        leases = sum(lane.lease is not None for lane in live)
        if self.index.num_leases != leases:
            raise InvariantError(f"index holds {self.index.num_leases} leases, expected {leases}")

    @property
    def usage(self) -> float:
        """Fraction of device pages held by running requests (cached pages count as free)."""
        capacity = self.config.index.device_pages
        return 1.0 - self.index.available_pages / capacity

    def reset(self) -> bool:
        """Drop every cached entry; refused (False) while a request runs.

        What finished requests left pending goes with it. Copies not yet handed to the workers
        are dropped. Those handed out run before any later step's copies and passes, so they
        cannot disturb a page or slot given out afresh, and a host write still landing writes a
        slab before any later write to it (one stream).
        """
        if self._live:
            return False
        self._plan = StepPlan()
        for pending in (
            self._deferred,
            self._retiring,
            self._quarantine,
            self._landing,
            self._prefetching,
            self._write_batch,
            self._new_pages,
        ):
            pending.clear()
        self._writing.clear()
        self.index.clear()
        return True


def _pages(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def _aligned_tail(
    taps: list[PlannedTap], base: int, existing: Sequence[int], resumed_from_endpoint: bool
) -> list[PlannedTap]:
    """Beyond the spec: the prompt-tail tap becomes an exact tap at the last block boundary.

    A flexible tail tap is realized at the start of the prompt's final chunk, so a prompt whose
    new tokens fit one chunk (most chat turns) would keep no state near its end, and a retry, or
    a next turn that re-renders the reply, would recompute all of it. One split at
    floor64(n - 1) (one more pass of at most 64 tokens) keeps reuse >= floor64(n - 1), as the
    spec's generation-opener tap does for templated chat. A request resumed from an endpoint
    keeps the flexible tap: its client echoes replies, so its own endpoint serves the next turn
    (§7.1).
    """
    if resumed_from_endpoint:
        return taps
    result = []
    for tap in taps:
        if tap.source is TapSource.TAIL:
            position = tap.position - tap.position % BLOCK_TOKENS
            # The planner's proximity rule, again at the new position: a snapshot at most one
            # block before it already serves the prompts it would.
            others = [base, *existing, *(t.position for t in taps if t is not tap)]
            if any(0 <= position - other <= BLOCK_TOKENS for other in others):
                continue
            tap = PlannedTap(position, TapSource.AUTOMATIC, SnapshotKind.TAP)
        result.append(tap)
    return sorted(result, key=lambda t: t.position)


def _kind(taps: Sequence[PlannedTap]) -> SnapshotKind:
    """One snapshot for several taps: Boundary if any of them is."""
    boundary = any(t.kind is SnapshotKind.BOUNDARY for t in taps)
    return SnapshotKind.BOUNDARY if boundary else SnapshotKind.TAP


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


def _plan_exact_tap(lane: Lane, position: int) -> None:
    """Make sure ``lane`` captures its state exactly at ``position`` (a coalescing target)."""
    if any(t.position == position and t.exact for t in lane.taps):
        return
    tap = PlannedTap(position, TapSource.STRUCTURAL, SnapshotKind.BOUNDARY)
    lane.taps = sorted([*(t for t in lane.taps if t.position != position), tap], key=_position)


def _position(tap: PlannedTap) -> int:
    return tap.position


def _tail(token_ids: Sequence[int], frontier: int) -> list[int]:
    """The tokens after the last full block below ``frontier``."""
    return list(token_ids[frontier - frontier % BLOCK_TOKENS : frontier])
