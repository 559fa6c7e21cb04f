"""Where a prefill captures snapshots ("taps", §7.1): every tap decision is made here.

Candidates in priority order::

    1 explicit breakpoint       exact     Boundary   the client names the reuse point
    2 generation opener         exact     Tap        next turn re-renders history after it
    3 end of tools / system     exact     Boundary   new sessions share the preamble
      (protocol-automatic marker: priority 3, exact, Tap)
    4 prompt tail n - 1         flexible  Tap        retry of the same prompt
    5 ladder n - G·2^k          flexible  Tap        edits deep in the history
    6 every chunk boundary      flexible  Tap        only with ``dense_flexible``

`TapPlanner.plan` applies the spec's rules to hints; `TapPlanner.plan_request` is what the
runtime calls for a request: its breakpoints, template hints and junction made hints, planned,
and the tail aligned to what the capture path can take. `plan_exact_tap` adds a coalescing
target to a running request's taps (§12.2); `snapshot_kind` is the kind of one snapshot that
serves several taps (a cluster, or the taps one capture takes).

An exact tap is captured at its position, a flexible one where it costs no extra forward pass:
the runtime realizes them (`vllm_hpc.runtime.capture`: at a chunk's end, or inside the pass where
the workers can). A position need not be a multiple of 64: a tap inside a block publishes with
a tail. Every plan is a pure function of its inputs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from vllm_hpc.index.prompt import MediaItem, resume_floor
from vllm_hpc.index.types import BLOCK_TOKENS, SnapshotKind


class TapSource(Enum):
    EXPLICIT = 1
    OPENER = 2
    STRUCTURAL = 3
    AUTOMATIC = 4
    TAIL = 5
    LADDER = 6
    CHUNK = 7

    @property
    def priority(self) -> int:
        """1 is the most important; structural and automatic markers share priority 3."""
        return _PRIORITY[self]

    @property
    def exact(self) -> bool:
        return self in _EXACT

    @property
    def boundary(self) -> bool:
        """Published as a Boundary snapshot, which conversations may share (§9.3)."""
        return self in (TapSource.EXPLICIT, TapSource.STRUCTURAL)


_PRIORITY = {
    TapSource.EXPLICIT: 1,
    TapSource.OPENER: 2,
    TapSource.STRUCTURAL: 3,
    TapSource.AUTOMATIC: 3,
    TapSource.TAIL: 4,
    TapSource.LADDER: 5,
    TapSource.CHUNK: 6,
}
_EXACT = frozenset(
    {TapSource.EXPLICIT, TapSource.OPENER, TapSource.STRUCTURAL, TapSource.AUTOMATIC}
)
_SEMANTIC = frozenset({TapSource.OPENER, TapSource.STRUCTURAL, TapSource.AUTOMATIC})


@dataclass(frozen=True, slots=True)
class TapHint:
    """A semantic position from the frontend: a breakpoint, the opener or a structural end."""

    position: int
    source: TapSource


@dataclass(frozen=True, slots=True)
class PlannedTap:
    position: int
    source: TapSource
    kind: SnapshotKind
    """TAP or BOUNDARY (a semantic cluster is Boundary if any member was)."""

    @property
    def exact(self) -> bool:
        return self.source.exact


SPEC_TAPS = 2
"""§14.2: new snapshots a prompt may leave without a host tier..."""
SPEC_TAPS_HOST = 8
"""...and with one."""
SPEC_LADDER_TOKENS = 4096
"""§14.2: the least ladder step G (at least twice the prefill chunk)."""
SPEC_MIN_GAP_TOKENS = 1024
"""§14.2: the least gap between a ladder tap and any other snapshot (at least one chunk)."""


@dataclass(frozen=True, slots=True)
class TapPolicy:
    max_new_taps: int = 8
    ladder_tokens: int = 4096
    """G: ladder rungs at n - G·2^k."""
    min_gap_tokens: int = 1024
    """Ladder rungs keep this distance from every other tap, snapshot and the base."""
    proximity_tokens: int = 64
    """A non-explicit candidate this close after another tap is redundant."""
    chunk_tokens: int = 2048
    """The grain of flexible taps: the prefill chunk, or less where taps cost no pass split."""
    dense_flexible: bool = False
    """Also tap every ``chunk_tokens`` from the base (lowest priority): denser reuse when memory
    allows."""

    @classmethod
    def for_engine(
        cls, chunk_tokens: int, host_tier: bool, *, dense_flexible: bool = False
    ) -> TapPolicy:
        """The §14.2 defaults for a prefill chunk size and host tier presence."""
        return cls(
            max_new_taps=SPEC_TAPS_HOST if host_tier else SPEC_TAPS,
            ladder_tokens=max(SPEC_LADDER_TOKENS, 2 * chunk_tokens),
            min_gap_tokens=max(SPEC_MIN_GAP_TOKENS, chunk_tokens),
            chunk_tokens=chunk_tokens,
            dense_flexible=dense_flexible,
        )


@dataclass(frozen=True, slots=True)
class TapRequest:
    """What the spec's rules plan from (`TapPlanner.plan`): the semantic positions as hints."""

    num_tokens: int
    base: int
    """F_s: the frontier the request resumes from; taps lie in (base, n - 1]."""
    hints: Sequence[TapHint] = ()
    message_boundaries: Sequence[int] = ()
    existing: Sequence[int] = ()
    """Frontiers of snapshots already on the prompt's path (``MatchResult.frontiers``)."""
    media: Sequence[MediaItem] = ()
    resumed_from_endpoint: bool = False


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    """A request's prefill as its lookup sees it: what `TapPlanner.plan_request` plans from."""

    num_tokens: int
    """The prompt's tokens."""
    base: int
    """F_s: the frontier the request resumes from."""
    matched_tokens: int = 0
    """Where the prompt leaves the cached path (``MatchResult.matched_tokens``): the junction."""
    existing: Sequence[int] = ()
    """Frontiers of snapshots already on the prompt's path (``MatchResult.frontiers``)."""
    breakpoints: Sequence[int] = ()
    """The client's ``cache_breakpoints``."""
    template_hints: Sequence[TapHint] = ()
    """The chat template's opener and structural end (`ChatMarkers.hints`)."""
    media: Sequence[MediaItem] = ()
    resumed_from_endpoint: bool = False


class TapPlanner:
    """Every tap decision of a prefill, under one `TapPolicy`."""

    def __init__(self, policy: TapPolicy) -> None:
        if policy.proximity_tokens < 0 or policy.ladder_tokens <= 0 or policy.chunk_tokens <= 0:
            raise ValueError(f"invalid tap policy {policy}")
        self.policy = policy

    def plan_request(self, request: PrefillRequest) -> list[PlannedTap]:
        """The taps of a request's prefill, sorted by position: its breakpoints, template hints
        and junction planned by the spec's rules (`plan`), then the tail tap aligned to what the
        capture path can take (`_aligned_tail`)."""
        # A breakpoint at 1 would save one token and end a one-token first chunk, which vLLM's
        # CPU GDN kernel cannot prefill (it stops the engine): it is ignored.
        hints = [TapHint(p, TapSource.EXPLICIT) for p in request.breakpoints if p > 1]
        hints.extend(request.template_hints)
        # Beyond the spec: where the prompt leaves the cached path (floored to 64), a Boundary tap
        # lets the next request sharing this prefix resume there.
        junction = request.matched_tokens
        if request.base < junction <= request.num_tokens - 1:
            hints.append(TapHint(junction, TapSource.STRUCTURAL))
        taps = self.plan(
            TapRequest(
                num_tokens=request.num_tokens,
                base=request.base,
                hints=hints,
                existing=request.existing,
                media=request.media,
                resumed_from_endpoint=request.resumed_from_endpoint,
            )
        )
        if request.resumed_from_endpoint:
            return taps
        return _aligned_tail(taps, request.base, request.existing)

    def plan(self, request: TapRequest) -> list[PlannedTap]:
        """The spec's taps for ``request``'s hints, sorted by position, at most
        ``max_new_taps`` of them."""
        if any(not hint.source.exact for hint in request.hints):
            raise ValueError("hints name semantic positions: explicit, opener or structural")
        accepted: list[PlannedTap] = []
        guards = [*request.existing, request.base]
        for candidate in self._candidates(request):
            if len(accepted) == self.policy.max_new_taps:
                break
            if self._admits(candidate, [t.position for t in accepted] + guards):
                accepted.append(candidate)
        return sorted(accepted, key=lambda t: t.position)

    def _admits(self, candidate: PlannedTap, others: list[int]) -> bool:
        """Dedup, the 64-token proximity rule, and the ladder's min gap on both sides."""
        p = candidate.position
        if candidate.source is TapSource.LADDER:
            return p not in others and all(abs(p - q) >= self.policy.min_gap_tokens for q in others)
        if candidate.source is TapSource.EXPLICIT:
            return p not in others
        return not _shadowed(p, others, self.policy.proximity_tokens)

    def _candidates(self, request: TapRequest) -> list[PlannedTap]:
        """Every candidate, placed inside (base, n - 1], in selection order."""
        policy = self.policy
        n = request.num_tokens

        def place(position: int, source: TapSource) -> PlannedTap | None:
            position = resume_floor(request.media, position)
            if not request.base < position <= n - 1:
                return None
            kind = SnapshotKind.BOUNDARY if source.boundary else SnapshotKind.TAP
            return PlannedTap(position, source, kind)

        hints = sorted(request.hints, key=lambda h: (h.position, h.source.value))
        explicit = [place(h.position, h.source) for h in hints if h.source is TapSource.EXPLICIT]
        semantic = [
            place(h.position, h.source)
            for h in hints
            if h.source in _SEMANTIC
            and not (h.source is TapSource.OPENER and request.resumed_from_endpoint)
        ]
        clusters = self._cluster([t for t in semantic if t is not None])
        ladder = []
        boundaries = sorted(request.message_boundaries)
        step = policy.ladder_tokens
        while n - step > request.base:
            rung = self._snap(n - step, boundaries, request.base)
            ladder.append(place(rung, TapSource.LADDER))
            step *= 2
        chunks = []
        if policy.dense_flexible:
            chunks = [
                place(p, TapSource.CHUNK)
                for p in range(request.base + policy.chunk_tokens, n, policy.chunk_tokens)
            ]
        ordered = [
            *explicit,
            *sorted(clusters, key=lambda t: (t.source.priority, t.position)),
            place(n - 1, TapSource.TAIL),
            *ladder,
            *chunks,
        ]
        return [t for t in ordered if t is not None]

    def _cluster(self, taps: list[PlannedTap]) -> list[PlannedTap]:
        """Semantic boundaries closer than ``proximity_tokens`` to a cluster's earliest member
        merge into it: the earliest position is kept, with the best priority and Boundary kind
        of any member."""
        clusters: list[list[PlannedTap]] = []
        for tap in sorted(taps, key=lambda t: (t.position, t.source.value)):
            if clusters and tap.position - clusters[-1][0].position < self.policy.proximity_tokens:
                clusters[-1].append(tap)
            else:
                clusters.append([tap])
        merged = []
        for members in clusters:
            best = min(members, key=lambda t: (t.source.priority, t.position))
            merged.append(PlannedTap(members[0].position, best.source, snapshot_kind(members)))
        return merged

    def _snap(self, rung: int, boundaries: list[int], base: int) -> int:
        """The last message boundary at or before ``rung`` within the min gap, else the rung."""
        index = bisect.bisect_right(boundaries, rung) - 1
        if index >= 0:
            boundary = boundaries[index]
            if boundary > base and rung - boundary <= self.policy.min_gap_tokens:
                return boundary
        return rung


def plan_exact_tap(taps: Sequence[PlannedTap], position: int) -> list[PlannedTap]:
    """``taps`` with an exact Boundary tap at ``position``: a coalescing target (§12.2), where
    waiting requests resume, so a flexible tap, which may be captured elsewhere, will not do."""
    if any(t.position == position and t.exact for t in taps):
        return list(taps)
    tap = PlannedTap(position, TapSource.STRUCTURAL, SnapshotKind.BOUNDARY)
    return sorted([*(t for t in taps if t.position != position), tap], key=lambda t: t.position)


def snapshot_kind(taps: Iterable[PlannedTap]) -> SnapshotKind:
    """The kind of one snapshot that serves several taps: Boundary if any of them is."""
    boundary = any(t.kind is SnapshotKind.BOUNDARY for t in taps)
    return SnapshotKind.BOUNDARY if boundary else SnapshotKind.TAP


def _aligned_tail(taps: list[PlannedTap], base: int, existing: Sequence[int]) -> list[PlannedTap]:
    """Beyond the spec: the prompt-tail tap becomes an exact tap at the last block boundary.

    A flexible tail tap is realized at the start of the prompt's final chunk, so a prompt whose
    new tokens fit one chunk (most chat turns) would keep no state near its end, and a retry, or
    a next turn that re-renders the reply, would recompute all of it. One split at
    floor64(n - 1) (one more pass of at most 64 tokens) keeps reuse >= floor64(n - 1), as the
    spec's generation-opener tap does for templated chat. A request resumed from an endpoint
    keeps the flexible tap (`TapPlanner.plan_request`): its client echoes replies, so its own
    endpoint serves the next turn (§7.1).
    """
    result = []
    for tap in taps:
        if tap.source is TapSource.TAIL:
            position = tap.position - tap.position % BLOCK_TOKENS
            # The proximity rule at the new position, a block wide: a snapshot at most one
            # block before it already serves the prompts it would.
            others = [base, *existing, *(t.position for t in taps if t is not tap)]
            if _shadowed(position, others, BLOCK_TOKENS):
                continue
            tap = PlannedTap(position, TapSource.AUTOMATIC, SnapshotKind.TAP)
        result.append(tap)
    return sorted(result, key=lambda t: t.position)


def _shadowed(position: int, others: Iterable[int], tokens: int) -> bool:
    """Whether another tap or snapshot lies at ``position`` or at most ``tokens`` before it,
    and so already serves the prompts a tap there would."""
    return any(0 <= position - other <= tokens for other in others)
