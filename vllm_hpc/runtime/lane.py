"""What the runtime keeps per running request, and per snapshot capture in flight."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_hpc.index import Lease, PageId, PlannedTap, PreparedPrompt, RowId, SlotId, SnapshotKind
from vllm_hpc.runtime.plan import InPassCapture, PageCopy, StateCopy


@dataclass(slots=True, eq=False)
class Capture:
    """A snapshot being captured: its state is copied into ``slot`` by a step's plan, then it is
    published once the blocks below ``frontier`` are committed (§7.4).

    Until then it owns the staged slot and, for a frontier inside a block, the tail page.
    """

    frontier: int
    kind: SnapshotKind
    slot: SlotId
    tail_tokens: list[int]
    """Tokens after the last full block below the frontier."""
    tail_page: PageId | None
    state_copy: StateCopy | InPassCapture
    """Saves the state: before or after a step's pass, or during it."""
    page_copy: PageCopy | None
    """The tail's KV, copied from the request's page (an endpoint takes the page itself)."""
    copies_queued: bool = False
    """Its copies sit in the plan being built or in one already handed to the workers."""
    page_copy_step: int | None = None
    """Plan number carrying its tail page copy: a restore may read the page only later."""


@dataclass(slots=True, eq=False)
class Lane:
    """One running request (a lane): its block table, state row, cache lease and taps."""

    request_id: str
    row: RowId
    """Its state row in the device page space (the workers' state index for it)."""
    pages: list[PageId]
    """Block table of the attention group: page of block b at index b."""
    private: set[PageId]
    """Pages it owns (not cached): freed when it releases, unless a snapshot took them."""
    lease: Lease | None
    """Its hold on the cache; None when the request neither reads nor writes the cache."""
    base: int
    """Reuse frontier it resumed from: it prefilled [base, n)."""
    num_prompt_tokens: int
    prompt: PreparedPrompt | None = None
    """Its prompt as looked up, for in-flight coalescing (§12.2); None when not caching."""
    scheduled_end: int = 0
    """Tokens scheduled so far (the end of its latest chunk)."""
    taps: list[PlannedTap] = field(default_factory=list)
    """Planned prompt taps not yet captured, by position."""
    captures: list[Capture] = field(default_factory=list)
    newest_frontier: int = 0
    """Frontier of its newest snapshot, resumed or captured (endpoint eligibility, §7.7)."""
    from_host: bool = False
    """Its resume restored something from the host tier."""
    reserve_end: int = 0
    """Tokens its pages may grow to before new admissions may take the room: its prompt and
    up to `RuntimeConfig.decode_reserve_tokens` of output."""
    spec_rows: tuple[RowId, ...] = ()
    """With K speculative tokens, K more rows: vLLM's GDN kernel verifies K + 1 tokens in one
    pass and keeps the recurrent state after token t in the request's row t (``row`` is row
    0), so that the next pass resumes from the last accepted one."""
    accepted: int = 1
    """Tokens the lane's last step committed (1 for a prefill chunk): its state after them is the
    recurrent state in ``rows[accepted - 1]`` and the conv window ``accepted - 1`` columns into
    ``row``'s conv buffer (vLLM's speculative layout)."""

    @property
    def rows(self) -> tuple[RowId, ...]:
        """Its state rows, as the GDN groups' block table lists them."""
        return (self.row, *self.spec_rows)

    def state_copy(self, dst: RowId) -> StateCopy:
        """A copy of its committed state into ``dst``, laid out as a prefill leaves it."""
        if self.accepted == 1:
            return StateCopy(self.row, dst)
        return StateCopy(self.row, dst, self.rows[self.accepted - 1], self.accepted - 1)

    @property
    def caching(self) -> bool:
        return self.lease is not None
