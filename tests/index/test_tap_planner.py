"""TapPlanner (§7.1, §13.1 'TapPlanner'): the spec's rules, and a request's taps as the runtime
plans them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hpc.index import (
    MediaItem,
    PlannedTap,
    PrefillRequest,
    SnapshotKind,
    TapHint,
    TapPlanner,
    TapPolicy,
    TapRequest,
    TapSource,
    plan_exact_tap,
    resume_floor,
)

DEFAULT = TapPolicy()  # G = 4096, min gap 1024, budget 8


def positions(taps: list[PlannedTap]) -> list[tuple[int, TapSource, SnapshotKind]]:
    return [(t.position, t.source, t.kind) for t in taps]


def test_chat_turn_keeps_the_system_block_and_the_opener_which_absorbs_the_tail() -> None:
    request = TapRequest(
        num_tokens=5000,
        base=0,
        hints=[TapHint(500, TapSource.STRUCTURAL), TapHint(4990, TapSource.OPENER)],
        message_boundaries=[500, 2000, 4990],
    )
    # Tail 4999 is within 64 after the opener; the ladder rung 5000 - 4096 = 904 snaps back to
    # the boundary 500 (within the min gap), which is already taken.
    assert positions(TapPlanner(DEFAULT).plan(request)) == [
        (500, TapSource.STRUCTURAL, SnapshotKind.BOUNDARY),
        (4990, TapSource.OPENER, SnapshotKind.TAP),
    ]


def test_semantic_boundaries_closer_than_64_cluster_at_the_earliest() -> None:
    request = TapRequest(
        num_tokens=3000,
        base=0,
        hints=[TapHint(2950, TapSource.STRUCTURAL), TapHint(2990, TapSource.OPENER)],
    )
    # One cluster at 2950: opener priority, Boundary kind inherited from the structural member.
    assert positions(TapPlanner(DEFAULT).plan(request)) == [
        (2950, TapSource.OPENER, SnapshotKind.BOUNDARY)
    ]


def test_a_request_resumed_from_an_endpoint_skips_the_opener() -> None:
    hints = [TapHint(2990, TapSource.OPENER)]
    request = TapRequest(num_tokens=3000, base=100, hints=hints, resumed_from_endpoint=True)
    assert positions(TapPlanner(DEFAULT).plan(request)) == [
        (2999, TapSource.TAIL, SnapshotKind.TAP)
    ]


def test_proximity_drops_non_explicit_candidates_but_not_explicit_ones() -> None:
    request = TapRequest(
        num_tokens=1000,
        base=0,
        hints=[TapHint(950, TapSource.EXPLICIT), TapHint(960, TapSource.EXPLICIT)],
        existing=[940],
    )
    # Both explicit taps stay although 940 lies within 64 before them; the tail 999 is
    # within 64 after 960 and is dropped.
    assert [t.position for t in TapPlanner(DEFAULT).plan(request)] == [950, 960]
    # A structural boundary 50 after an existing snapshot is dropped; the tail, 99 after it,
    # is kept.
    request = TapRequest(
        num_tokens=1000, base=0, hints=[TapHint(950, TapSource.STRUCTURAL)], existing=[900]
    )
    assert [t.position for t in TapPlanner(DEFAULT).plan(request)] == [999]


def test_a_candidate_inside_a_media_span_moves_to_its_start() -> None:
    media = [MediaItem(begin=300, length=200, digest=b"i" * 32)]
    request = TapRequest(
        num_tokens=450, base=0, hints=[TapHint(400, TapSource.EXPLICIT)], media=media
    )
    # Explicit 400 -> 300; the tail 449 also lies inside the span -> 300, a duplicate.
    assert [t.position for t in TapPlanner(DEFAULT).plan(request)] == [300]


def test_no_resume_point_has_an_item_beginning_in_its_tail() -> None:
    """The tail (tokens after the last full block) is matched by its tokens alone, and every
    image's placeholder tokens are alike: an item may not begin there."""
    small = MediaItem(begin=130, length=20, digest=b"i" * 32)
    assert resume_floor([small], 170) == 130  # past the item, same block: back to its start
    assert resume_floor([small], 140) == 130  # inside it
    assert resume_floor([small], 200) == 200  # the item began in an earlier block
    assert resume_floor([small], 130) == 130
    chained = [MediaItem(begin=10, length=20, digest=b"a" * 32), small]
    assert resume_floor(chained, 40) == 10
    long = MediaItem(begin=30, length=90, digest=b"b" * 32)  # spans blocks 0 and 1
    assert resume_floor([*chained, long], 140) == 130
    assert resume_floor([*chained, long], 100) == 10  # inside it: 30, whose block holds 10


def test_the_budget_keeps_the_highest_priorities() -> None:
    hints = [TapHint(p, TapSource.EXPLICIT) for p in (100, 200, 300)]
    hints.append(TapHint(900, TapSource.OPENER))
    request = TapRequest(num_tokens=1000, base=0, hints=hints)
    taps = TapPlanner(TapPolicy(max_new_taps=2)).plan(request)
    assert [(t.position, t.source) for t in taps] == [
        (100, TapSource.EXPLICIT),
        (200, TapSource.EXPLICIT),
    ]


def test_ladder_rungs_are_geometric_and_keep_the_min_gap() -> None:
    policy = TapPolicy(max_new_taps=32, ladder_tokens=1000, min_gap_tokens=500)
    request = TapRequest(num_tokens=20_000, base=0)
    taps = TapPlanner(policy).plan(request)
    # Tail 19999, then rungs 19000, 18000, 16000, 12000, 4000 (20000 - 1000·2^k > 0).
    assert [t.position for t in taps] == [4000, 12000, 16000, 18000, 19000, 19999]
    assert all(not t.exact for t in taps)


def test_ladder_snaps_back_to_a_message_boundary_within_the_gap() -> None:
    policy = TapPolicy(ladder_tokens=1000, min_gap_tokens=500)
    request = TapRequest(num_tokens=3000, base=0, message_boundaries=[1400, 1700, 2100])
    # Rung 2000 -> boundary 1700 (300 back); rung 1000 -> no boundary within 500 -> stays.
    assert [t.position for t in TapPlanner(policy).plan(request)] == [1000, 1700, 2999]


def test_dense_flexible_mode_adds_chunk_boundaries_last() -> None:
    policy = TapPolicy(
        max_new_taps=16, ladder_tokens=1 << 20, chunk_tokens=512, dense_flexible=True
    )
    request = TapRequest(num_tokens=2100, base=64, hints=[TapHint(1000, TapSource.OPENER)])
    taps = TapPlanner(policy).plan(request)
    # Chunk candidates base + 512·j: 576, 1088 (88 after the opener: kept), 1600; 2112 > n - 1.
    assert [(t.position, t.source) for t in taps] == [
        (576, TapSource.CHUNK),
        (1000, TapSource.OPENER),
        (1088, TapSource.CHUNK),
        (1600, TapSource.CHUNK),
        (2099, TapSource.TAIL),
    ]
    assert TapPlanner(TapPolicy(chunk_tokens=512)).plan(request) == [taps[1], taps[4]]


def test_hints_must_be_semantic_positions() -> None:
    request = TapRequest(num_tokens=100, base=0, hints=[TapHint(50, TapSource.LADDER)])
    with pytest.raises(ValueError, match="semantic"):
        TapPlanner(DEFAULT).plan(request)


def test_for_engine_resolves_the_spec_defaults() -> None:
    assert TapPolicy.for_engine(8192, host_tier=True) == TapPolicy(
        max_new_taps=8, ladder_tokens=16384, min_gap_tokens=8192, chunk_tokens=8192
    )
    assert TapPolicy.for_engine(512, host_tier=False).max_new_taps == 2
    assert TapPolicy.for_engine(512, host_tier=False).ladder_tokens == 4096


# -- a request's taps as the runtime plans them (beyond the spec) -------------------------


def test_breakpoints_become_explicit_taps_except_at_one_and_the_tail_is_aligned() -> None:
    request = PrefillRequest(num_tokens=1000, base=0, breakpoints=[1, 300])
    # The tail 999 becomes an exact tap at floor64(999) = 960.
    assert positions(TapPlanner(DEFAULT).plan_request(request)) == [
        (300, TapSource.EXPLICIT, SnapshotKind.BOUNDARY),
        (960, TapSource.AUTOMATIC, SnapshotKind.TAP),
    ]


def test_the_junction_is_a_structural_boundary_past_the_base() -> None:
    request = PrefillRequest(num_tokens=1000, base=128, matched_tokens=640, existing=[128])
    assert positions(TapPlanner(DEFAULT).plan_request(request)) == [
        (640, TapSource.STRUCTURAL, SnapshotKind.BOUNDARY),
        (960, TapSource.AUTOMATIC, SnapshotKind.TAP),
    ]
    at_base = PrefillRequest(num_tokens=1000, base=128, matched_tokens=128, existing=[128])
    assert positions(TapPlanner(DEFAULT).plan_request(at_base)) == [
        (960, TapSource.AUTOMATIC, SnapshotKind.TAP)
    ]


def test_the_aligned_tail_is_dropped_near_a_snapshot_and_flexible_after_an_endpoint() -> None:
    # The spec keeps the tail 999 (99 after 900); at 960 it lies within a block of 900.
    request = PrefillRequest(num_tokens=1000, base=0, existing=[900])
    assert TapPlanner(DEFAULT).plan_request(request) == []
    request = PrefillRequest(num_tokens=1000, base=100, resumed_from_endpoint=True)
    assert positions(TapPlanner(DEFAULT).plan_request(request)) == [
        (999, TapSource.TAIL, SnapshotKind.TAP)
    ]


def test_a_coalescing_target_is_an_exact_boundary_tap() -> None:
    taps = [
        PlannedTap(512, TapSource.LADDER, SnapshotKind.TAP),
        PlannedTap(960, TapSource.AUTOMATIC, SnapshotKind.TAP),
    ]
    # A flexible tap at the target is replaced; an exact one is kept as it is.
    assert positions(plan_exact_tap(taps, 512)) == [
        (512, TapSource.STRUCTURAL, SnapshotKind.BOUNDARY),
        (960, TapSource.AUTOMATIC, SnapshotKind.TAP),
    ]
    assert plan_exact_tap(taps, 960) == taps
    assert [t.position for t in plan_exact_tap(taps, 256)] == [256, 512, 960]


# -- properties over random prompts -------------------------------------------------------


@st.composite
def requests(draw: st.DrawFn) -> tuple[TapPolicy, TapRequest]:
    n = draw(st.integers(1, 300_000))
    base = draw(st.integers(0, n - 1))
    pos = st.integers(0, n + 100)
    sources = st.sampled_from([s for s in TapSource if s.exact])
    hints = draw(st.lists(st.builds(TapHint, pos, sources), max_size=12))
    cuts = sorted(set(draw(st.lists(st.integers(0, n), max_size=8))))
    media = [
        MediaItem(begin=a, length=b - a, digest=b"d" * 32)
        for a, b in zip(cuts[::2], cuts[1::2], strict=False)
        if b > a
    ]
    policy = TapPolicy(
        max_new_taps=draw(st.integers(0, 12)),
        ladder_tokens=draw(st.sampled_from([256, 1024, 4096, 16384])),
        min_gap_tokens=draw(st.sampled_from([64, 1024, 8192])),
        chunk_tokens=draw(st.sampled_from([512, 2048, 8192])),
        dense_flexible=draw(st.booleans()),
    )
    request = TapRequest(
        num_tokens=n,
        base=base,
        hints=hints,
        message_boundaries=draw(st.lists(pos, max_size=20)),
        existing=draw(st.lists(st.integers(0, n), max_size=4)),
        media=media,
        resumed_from_endpoint=draw(st.booleans()),
    )
    return policy, request


@settings(max_examples=150, deadline=None)
@given(requests())
def test_plan_properties(case: tuple[TapPolicy, TapRequest]) -> None:
    policy, request = case
    planner = TapPlanner(policy)
    taps = planner.plan(request)
    n, base = request.num_tokens, request.base
    spots = [t.position for t in taps]
    assert spots == sorted(set(spots)) and len(taps) <= policy.max_new_taps
    assert planner.plan(request) == taps  # deterministic
    shuffled = TapRequest(**{**_as_dict(request), "hints": list(reversed(request.hints))})
    assert planner.plan(shuffled) == taps
    for tap in taps:
        assert base < tap.position <= n - 1
        assert resume_floor(request.media, tap.position) == tap.position
        assert tap.position not in request.existing
        assert _kind_is_consistent(tap, request)
        assert not (request.resumed_from_endpoint and tap.source is TapSource.OPENER)
        guards = [*request.existing, base]
        earlier = [
            t.position for t in taps if t is not tap and t.source.priority <= tap.source.priority
        ]
        if tap.source is TapSource.LADDER:
            assert all(abs(tap.position - q) >= policy.min_gap_tokens for q in guards + earlier)
        elif tap.source is not TapSource.EXPLICIT:
            assert not any(
                0 < tap.position - q <= policy.proximity_tokens for q in guards + earlier
            )
    ladder = [t for t in taps if t.source is TapSource.LADDER]
    if ladder:  # rungs exist only when n > G
        assert len(ladder) <= math.log2(n / policy.ladder_tokens) + 1
    # Budget and priority: a smaller budget keeps a subset, never a lower priority over a higher.
    unlimited = TapPlanner(TapPolicy(**{**_as_dict(policy), "max_new_taps": 1000})).plan(request)
    assert set(taps) <= set(unlimited)
    dropped = set(unlimited) - set(taps)
    if taps and dropped:
        assert max(t.source.priority for t in taps) <= min(t.source.priority for t in dropped)


def _kind_is_consistent(tap: PlannedTap, request: TapRequest) -> bool:
    if not tap.exact:
        return tap.kind is SnapshotKind.TAP
    if tap.source in (TapSource.EXPLICIT, TapSource.STRUCTURAL):
        return tap.kind is SnapshotKind.BOUNDARY
    # An opener or automatic marker is Boundary only by absorbing a structural member.
    has_structural = any(h.source is TapSource.STRUCTURAL for h in request.hints)
    return tap.kind is SnapshotKind.TAP or has_structural


def _as_dict(obj: object) -> dict[str, object]:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}  # type: ignore[attr-defined]
