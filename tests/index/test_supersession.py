"""Supersession and retain-on-hit (§9.3, §13.1 'Supersession and admission')."""

from __future__ import annotations

from tests.index.harness import BLOCK, Harness, make_index, snap, toks
from vllm_hpc.index import SnapshotKind


def test_a_lineage_supersedes_its_previous_tap_and_a_hit_retains_it() -> None:
    h = Harness(make_index(host_slabs=32, slots=8))
    prompt = toks(1, 3 * BLOCK + 5)
    first, second = map(snap, h.run(prompt, taps=[BLOCK, 2 * BLOCK]))
    assert first.superseded and not second.superseded
    # A retry that diverges between the two taps resumes from the first one: retained again.
    retry = prompt[:BLOCK] + toks(2, BLOCK + 5)
    admission = h.admit(retry)
    assert admission.source is first and not first.superseded and first.hits == 1
    # ...until that lineage moves on past it.
    h.tap(admission.lease, retry, 2 * BLOCK)
    assert first.superseded
    h.finish(admission.lease)


def test_the_endpoint_leaves_the_last_tap_retained() -> None:
    h = Harness(make_index(host_slabs=32, slots=8))
    prompt = toks(3, 3 * BLOCK + 5)
    first, last, end = map(snap, h.run(prompt, taps=[BLOCK, 2 * BLOCK], endpoint=True))
    assert end.kind is SnapshotKind.ENDPOINT
    assert [first.superseded, last.superseded, end.superseded] == [True, False, False]


def test_the_next_turn_supersedes_the_endpoint_it_resumed_from() -> None:
    h = Harness(make_index(host_slabs=32, slots=8))
    turn1 = toks(4, 2 * BLOCK + 10)
    (end1,) = map(snap, h.run(turn1, endpoint=True))
    turn2 = turn1 + toks(5, 2 * BLOCK)
    admission = h.admit(turn2)
    assert admission.source is end1 and admission.lease.resumed_from_endpoint
    end2 = snap(h.tap(admission.lease, turn2, len(turn2), SnapshotKind.ENDPOINT))
    assert end1.superseded and not end2.superseded
    h.finish(admission.lease)


def test_a_boundary_is_superseded_only_while_the_tree_below_is_one_chain() -> None:
    h = Harness(make_index(host_slabs=64, slots=8))
    preamble = toks(6, 2 * BLOCK)
    # One conversation: its later tap supersedes the boundary below which nothing branched.
    solo = preamble + toks(7, 2 * BLOCK)
    boundary, _ = map(snap, h.run(solo, taps=[2 * BLOCK, 3 * BLOCK], kind=SnapshotKind.BOUNDARY))
    assert boundary.kind is SnapshotKind.BOUNDARY and boundary.superseded
    # Another conversation continues from the boundary (resuming from it retains it), so the
    # tree below now branches, and its later tap leaves the boundary retained.
    other = preamble + toks(8, 2 * BLOCK)
    admission = h.admit(other)
    assert admission.source is boundary and not boundary.superseded
    h.tap(admission.lease, other, 3 * BLOCK)
    assert not boundary.superseded
    h.finish(admission.lease)


def test_a_divergent_tail_below_a_boundary_counts_as_a_branch() -> None:
    h = Harness(make_index(host_slabs=64, slots=8))
    preamble = toks(9, 2 * BLOCK)
    first = preamble + toks(10, 2 * BLOCK)
    (boundary,) = map(
        snap, h.run(first[: 2 * BLOCK + 1], taps=[2 * BLOCK], kind=SnapshotKind.BOUNDARY)
    )
    # A conversation ends 10 tokens past the boundary: an endpoint with a tail, no block.
    other = preamble + toks(11, 10)
    admission = h.admit(other)
    assert admission.source is boundary
    h.tap(admission.lease, other, len(other), SnapshotKind.ENDPOINT)
    h.finish(admission.lease)
    # The first conversation now moves past the boundary: the tree below is not one chain.
    admission = h.admit(first)
    h.tap(admission.lease, first, 3 * BLOCK)
    assert not boundary.superseded
    h.finish(admission.lease)


def test_a_tap_captured_before_its_blocks_commit_leaves_a_shared_boundary() -> None:
    """The engine takes a tap's slot before the chunk's blocks commit: the chain check below a
    Boundary must wait for this conversation's own blocks, or it sees one chain and supersedes
    a snapshot two conversations share."""
    h = Harness(make_index(host_slabs=64, slots=8))
    preamble = toks(9, 2 * BLOCK)
    (boundary,) = map(
        snap, h.run(preamble + toks(10, BLOCK + 5), taps=[2 * BLOCK], kind=SnapshotKind.BOUNDARY)
    )
    other = preamble + toks(11, 2 * BLOCK)
    admission = h.admit(other)
    assert admission.source is boundary
    slot = h.index.take_snapshot_slot(admission.lease, SnapshotKind.TAP, 3 * BLOCK)
    assert slot is not None and not boundary.superseded
    h.commit(admission.lease, other, 3 * BLOCK)
    h.index.publish_snapshot(
        admission.lease, kind=SnapshotKind.TAP, frontier=3 * BLOCK, tail_tokens=[], slot=slot
    )
    assert not boundary.superseded
    h.finish(admission.lease)


def test_a_boundary_another_conversation_resumed_from_stays_retained() -> None:
    """The conversations that continued below a Boundary can lose their blocks to eviction
    (dead KV) while it stays: the tree below is one chain again, and the next conversation that
    resumes from the Boundary and moves on must not supersede it, or a preamble that every
    session hits goes first under host pressure (seen on the H200: `gpu_engine_modules.md`)."""
    h = Harness(make_index(host_slabs=64, slots=8))
    preamble = toks(12, 2 * BLOCK)
    # Its creator ends one token past it: nothing of that conversation lies below the Boundary.
    (boundary,) = map(snap, h.run([*preamble, 7], taps=[2 * BLOCK], kind=SnapshotKind.BOUNDARY))
    session = preamble + toks(13, 2 * BLOCK)
    admission = h.admit(session)
    assert admission.source is boundary and boundary.hits == 1
    h.tap(admission.lease, session, 3 * BLOCK)
    assert not boundary.superseded
    h.finish(admission.lease)
