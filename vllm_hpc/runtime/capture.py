"""Taps and endpoints of running requests: where a prefill chunk must end, the copies that
capture a lane's state at its taps, publication once the blocks below a capture are committed,
and the endpoint a finished request leaves (§7). Which taps a request has is decided in
`vllm_hpc.index.tap_planner`; this module realizes them.

A tap at the end of a chunk copies the state after that chunk, so its copy goes into the *next*
plan; a tap at the start of the prompt's final chunk copies it into the current one. Where the
workers can (`RuntimeConfig.in_pass_taps`), a tap at a 64-token offset inside a chunk that
starts on a block boundary is captured during the pass (`InPassCapture`): it neither splits the
chunk nor waits for its end. A snapshot is published when the blocks below it are committed and
its state copy is queued; one whose tail page is copied too, only once that copy's plan was
handed out, since vLLM runs the page copies of one step together.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_hpc.index import BLOCK_TOKENS, PlannedTap, PrefixIndex, SnapshotKind, snapshot_kind
from vllm_hpc.runtime.lane import Capture, Lane
from vllm_hpc.runtime.pipeline import StepPipeline
from vllm_hpc.runtime.plan import InPassCapture, PageCopy, StateCopy
from vllm_hpc.runtime.records import InFlight


class Captures:
    def __init__(
        self,
        index: PrefixIndex,
        pipeline: StepPipeline,
        in_pass: bool,
        chunk_tokens: int,
    ) -> None:
        self.index = index
        self.pipeline = pipeline
        self.in_pass_taps = in_pass
        self.chunk_tokens = chunk_tokens
        """The most tokens one request's chunk gets in a step (`RuntimeConfig.chunk_tokens`)."""
        self.retiring: list[Lane] = []
        """Finished lanes waiting for their captures to publish before they release."""

    def begin_step(self) -> None:
        """Finished lanes whose last captures can publish now release."""
        for lane in list(self.retiring):
            self._publish_ready(lane)
            if not lane.captures:
                self.retiring.remove(lane)
                self._release(lane)

    def chunk_limit(
        self, taps: Sequence[PlannedTap], start: int, num_new_tokens: int, num_prompt_tokens: int
    ) -> int:
        """Shorten a chunk starting at ``start`` so it ends at the next exact tap that cannot be
        captured inside the pass, if any; 0 when the request should wait for the next step.

        Where taps are captured inside a pass, a chunk that ends inside the prompt also ends on
        a block boundary: the next chunk then starts on one, where its taps can be captured in
        the pass. Without this, one chunk ending elsewhere (the step's budget shared with other
        requests) would leave the prompt's next chunk without in-pass taps. When what is left
        of the step's budget does not reach the next boundary, the request waits for the next
        step, as under vLLM's own "align" mode with its larger blocks: a step gives up fewer
        than 64 tokens. Only a budget below one block keeps such a chunk, since the request
        would otherwise never run.
        """
        end = start + num_new_tokens
        for tap in taps:
            if tap.exact and start < tap.position < end and not self._in_pass(start, tap.position):
                return tap.position - start
        if self.in_pass_taps and end < num_prompt_tokens:
            aligned = end - end % BLOCK_TOKENS
            if aligned > start or self.chunk_tokens >= BLOCK_TOKENS:
                return max(aligned - start, 0)
        return num_new_tokens

    def _in_pass(self, start: int, position: int) -> bool:
        """Whether a chunk from ``start`` can capture the state at ``position`` (inside it)
        during its pass: the kernel's 64-token chunks then end there, on a block boundary, so
        the snapshot needs no tail page (whose KV the pass is still writing)."""
        return (
            self.in_pass_taps
            and start % BLOCK_TOKENS == 0
            and position % BLOCK_TOKENS == 0
            and position > start
        )

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
            self._capture(
                lane, token_ids, position, snapshot_kind(taps), in_pass_offset=position - start
            )
        if not rest:
            return
        kind = snapshot_kind(rest)
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
                tail = self.pipeline.allocate(1)
                if tail is None:
                    self.index.return_snapshot_slot(slot)
                    return
                tail_page = tail[0]
                page_copy = PageCopy(source, tail_page)
        dst = self.index.slot_row(slot)
        copy: StateCopy | InPassCapture = (
            lane.state_copy(dst)
            if in_pass_offset is None
            else InPassCapture(lane.row, in_pass_offset, dst)
        )
        capture = Capture(
            frontier, kind, slot, _tail(token_ids, frontier), tail_page, copy, page_copy
        )
        lane.captures.append(capture)
        if after_step:
            self.pipeline.defer(lane, capture)
        else:
            self.pipeline.queue(lane, capture)

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
            if (
                capture.page_copy_step is not None
                and capture.page_copy_step >= self.pipeline.plans_taken
            ):
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
                self.pipeline.write_through(publication.write)

    def finish(
        self,
        lane: Lane,
        token_ids: Sequence[int],
        num_computed: int,
        in_flight: InFlight | None = None,
    ) -> None:
        """The request ended (finished, aborted or preempted) after ``num_computed`` tokens:
        commit its blocks, capture its endpoint (§7.7) and release it.

        With speculative decoding the last step may have committed tokens past a stop, which
        vLLM leaves out of the output (they count in ``num_computed``). Its rows keep the state
        after each token it verified, so the endpoint is taken at the last known token from the
        row that holds the state after it (`Lane.accepted`).

        Under async scheduling a request often ends with a step in flight (``in_flight``): vLLM
        scheduled it before it saw the output that ended the request. One step that begins at
        the last known token computes that token first, so once it has run (the endpoint's copy
        goes with a later step) its first row holds the state after every known token, and the
        endpoint is taken from there; its drafts, if any, lie past the endpoint. A step that
        begins later (the last one committed tokens past a stop), or a second step (an abort or
        a preemption between them), overwrites the rows that held it: only the known blocks are
        committed, and no endpoint is taken."""
        if lane.lease is None:
            self._release(lane)
            return
        for capture in [c for c in lane.captures if c.frontier > num_computed]:
            self._drop(lane, capture)  # a chunk that was planned but never ran (preemption)
        known = min(num_computed, len(token_ids))
        self.commit(lane, token_ids, known)
        surplus = num_computed - known
        if in_flight is None:
            if 0 < surplus < lane.accepted:
                lane.accepted -= surplus  # the state after `known` tokens, in an earlier row
                surplus = 0
        elif in_flight.steps == 1 and in_flight.first_position == known - 1:
            lane.accepted = 1  # the state after the in-flight step's first token
            surplus = 0
        if surplus == 0 and known - lane.newest_frontier >= BLOCK_TOKENS:
            self._capture(lane, token_ids, known, SnapshotKind.ENDPOINT, after_step=False)
        self._publish_ready(lane)
        if lane.captures:
            self.retiring.append(lane)
        else:
            self._release(lane)

    def _drop(self, lane: Lane, capture: Capture) -> None:
        assert not capture.copies_queued
        lane.captures.remove(capture)
        self.pipeline.undefer(lane, capture)
        self.index.return_snapshot_slot(capture.slot)
        if capture.tail_page is not None:
            self.index.free_pages([capture.tail_page])

    def _release(self, lane: Lane) -> None:
        for row in lane.rows:
            self.index.release_state_row(row)
        if lane.private:
            self.pipeline.quarantine(sorted(lane.private))
            lane.private = set()
        if lane.lease is not None:
            write = self.index.release(lane.lease)
            if write is not None:
                self.pipeline.write_through(write)
            lane.lease = None


def _tail(token_ids: Sequence[int], frontier: int) -> list[int]:
    """The tokens after the last full block below ``frontier``."""
    return list(token_ids[frontier - frontier % BLOCK_TOKENS : frontier])
