"""BlockTree identity and match (§5.1, §6.1, §13.1 'BlockTree')."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.index.harness import BLOCK, Harness, make_index, toks
from vllm_hpc.index import CommitOutcome, MediaItem, SnapshotKind, xxh3_block_hash


def constant_hash(parent: int, tokens: bytes, extra: int) -> int:
    return 7


def test_insert_then_match_exact_tokens() -> None:
    h = Harness(make_index())
    prompt = toks(1, 5 * BLOCK)
    h.run(prompt)
    match = h.index.match(h.index.prepare_prompt([*prompt, 1]))
    assert len(match.path) == 5
    assert [node.depth for node in match.path] == [0, 1, 2, 3, 4]
    # One token different in block 2 stops the path there.
    edited = list(prompt)
    edited[2 * BLOCK + 17] += 1
    match = h.index.match(h.index.prepare_prompt([*edited, 1]))
    assert len(match.path) == 2


def test_match_stops_before_the_block_holding_the_last_token() -> None:
    """At least one prompt token is always prefilled (F <= n - 1), so a prompt of exactly k
    blocks matches at most k - 1 of them."""
    h = Harness(make_index())
    prompt = toks(2, 4 * BLOCK)
    h.run(prompt)
    assert len(h.index.match(h.index.prepare_prompt(prompt)).path) == 3
    assert len(h.index.match(h.index.prepare_prompt([*prompt, 9])).path) == 4


@pytest.mark.parametrize("hasher", [xxh3_block_hash, constant_hash])
def test_siblings_are_told_apart_by_exact_tokens(hasher) -> None:
    """With a forced constant lookup hash every child collides; exact comparison still
    separates them and a prompt matching none of them gets no false hit."""
    h = Harness(make_index(hasher=hasher))
    shared = toks(3, BLOCK)
    branches = [shared + toks(10 + i, 2 * BLOCK) for i in range(3)]
    for branch in branches:
        h.run(branch)
    for branch in branches:
        match = h.index.match(h.index.prepare_prompt([*branch, 0]))
        assert [n.tokens for n in match.path] == [
            h.index.prepare_prompt(branch).block_tokens(b) for b in range(3)
        ]
    stranger = shared + toks(99, 2 * BLOCK)
    match = h.index.match(h.index.prepare_prompt([*stranger, 0]))
    assert len(match.path) == 1


def test_constant_hash_never_gives_a_false_hit_for_a_new_prefix() -> None:
    h = Harness(make_index(hasher=constant_hash))
    h.run(toks(4, 3 * BLOCK))
    match = h.index.match(h.index.prepare_prompt([*toks(5, 3 * BLOCK), 0]))
    assert match.path == []


def test_extra_key_takes_part_in_identity() -> None:
    """The same tokens with a different media digest are a different block."""
    h = Harness(make_index(hasher=constant_hash))
    prompt = toks(6, 3 * BLOCK)
    image_a = MediaItem(begin=70, length=40, digest=b"a" * 32)
    image_b = MediaItem(begin=70, length=40, digest=b"b" * 32)
    admission = h.admit(prompt, media=[image_a])
    extras = h.index.prepare_prompt(prompt, media=[image_a]).block_extras
    assert extras[0] == 0 and extras[1] != 0 and extras[2] == 0
    for block in range(3):
        pages = h.index.allocate_pages(1)
        assert pages is not None
        h.index.commit_block(
            admission.lease, prompt[block * BLOCK : (block + 1) * BLOCK], pages[0], extras[block]
        )
    h.finish(admission.lease)
    same = h.index.match(h.index.prepare_prompt([*prompt, 0], media=[image_a]))
    other = h.index.match(h.index.prepare_prompt([*prompt, 0], media=[image_b]))
    assert len(same.path) == 3
    assert len(other.path) == 1


def test_media_key_digests_every_earlier_item() -> None:
    prompt = toks(7, 4 * BLOCK)
    first = MediaItem(begin=10, length=20, digest=b"x" * 32)
    second = MediaItem(begin=140, length=30, digest=b"y" * 32)
    other_first = MediaItem(begin=10, length=20, digest=b"z" * 32)
    one = make_index().prepare_prompt(prompt, media=[first, second]).block_extras
    two = make_index().prepare_prompt(prompt, media=[other_first, second]).block_extras
    assert one[0] != two[0] and one[2] != two[2]  # block 2 overlaps `second`
    assert one[1] == two[1] == 0 and one[3] == two[3] == 0


def test_different_cache_salts_never_share_entries() -> None:
    """The salt selects the root, so even a constant hash cannot cross tenants."""
    h = Harness(make_index(hasher=constant_hash))
    prompt = toks(8, 3 * BLOCK)
    h.run(prompt, taps=[40, 2 * BLOCK], salt="tenant-a")
    same = h.index.match(h.index.prepare_prompt([*prompt, 0], cache_salt="tenant-a"))
    other = h.index.match(h.index.prepare_prompt([*prompt, 0], cache_salt="tenant-b"))
    none = h.index.match(h.index.prepare_prompt([*prompt, 0]))
    assert len(same.path) == 3 and same.frontiers == [40, 128]
    assert other.path == [] and other.candidates == []
    assert none.path == [] and none.candidates == []


def test_tail_snapshot_matches_exact_tail_tokens_only() -> None:
    h = Harness(make_index())
    prompt = toks(9, 3 * BLOCK)
    h.run(prompt, taps=[BLOCK + 10])
    assert h.index.match(h.index.prepare_prompt(prompt)).frontiers == [BLOCK + 10]
    edited = list(prompt)
    edited[BLOCK + 9] += 1  # last tail token differs
    assert h.index.match(h.index.prepare_prompt(edited)).frontiers == []
    edited = list(prompt)
    edited[BLOCK + 10] += 1  # first token after the frontier differs: still a hit
    assert h.index.match(h.index.prepare_prompt(edited)).frontiers == [BLOCK + 10]


def test_candidates_respect_f_at_most_n_minus_one() -> None:
    h = Harness(make_index())
    prompt = toks(10, 3 * BLOCK)
    h.run(prompt, taps=[BLOCK, 2 * BLOCK, 2 * BLOCK + 5])
    index = h.index
    assert index.match(index.prepare_prompt(prompt[: 2 * BLOCK + 6])).frontiers == [64, 128, 133]
    assert index.match(index.prepare_prompt(prompt[: 2 * BLOCK + 5])).frontiers == [64, 128]
    assert index.match(index.prepare_prompt(prompt[: 2 * BLOCK + 1])).frontiers == [64, 128]
    assert index.match(index.prepare_prompt(prompt[: 2 * BLOCK])).frontiers == [64]


def test_match_rejects_a_frontier_inside_a_media_span() -> None:
    h = Harness(make_index())
    prompt = toks(11, 3 * BLOCK)
    h.run(prompt, taps=[2 * BLOCK])
    inside = MediaItem(begin=2 * BLOCK - 8, length=16, digest=b"m" * 32)
    starting = MediaItem(begin=2 * BLOCK, length=16, digest=b"m" * 32)
    index = h.index
    # Block extras differ with media, so compare candidates on a media-free path: a span that
    # only covers the tail part beyond the path's blocks is what the check is about.
    prompt_inside = index.prepare_prompt([*prompt, 0], media=[inside])
    assert index.match(prompt_inside).frontiers == []
    prompt_starting = index.prepare_prompt([*prompt, 0], media=[starting])
    assert prompt_starting.block_extras[1] == 0
    assert index.match(prompt_starting).frontiers == [2 * BLOCK]


def test_commit_outcomes_inserted_duplicate_adopted() -> None:
    h = Harness(make_index(pages=8, host_slabs=16))
    prompt = toks(12, 2 * BLOCK)
    first = h.admit(prompt)
    assert h.commit(first.lease, prompt) == [CommitOutcome.INSERTED] * 2
    second = h.admit(prompt)  # no snapshot: from the root, recomputing both blocks
    assert h.commit(second.lease, prompt) == [CommitOutcome.DUPLICATE] * 2
    h.finish(second.lease)
    h.finish(first.lease)  # write-through: both blocks now host-backed
    grabbed = h.index.allocate_pages(h.index.available_pages)  # evicts both device copies
    assert grabbed is not None
    h.index.free_pages(grabbed)
    assert all(n.device_page is None for n in h.index.match(h.index.prepare_prompt(prompt)).path)
    third = h.admit(prompt)
    assert h.commit(third.lease, prompt) == [CommitOutcome.ADOPTED] * 2
    h.finish(third.lease)


def test_publishing_twice_is_a_noop_that_refreshes_recency() -> None:
    h = Harness(make_index())
    prompt = toks(13, 3 * BLOCK)
    (first,) = h.run(prompt, taps=[2 * BLOCK])
    assert first is not None
    published = h.index.stats.snapshots_published
    (again,) = h.run(prompt, taps=[2 * BLOCK])
    assert again is not None and again.duplicate and again.snapshot is first.snapshot
    assert h.index.stats.snapshots_published == published
    assert first.snapshot.last_hit > first.snapshot.published
    assert len(list(h.index.store.snapshots)) == 1


def test_kinds_are_recorded() -> None:
    h = Harness(make_index())
    prompt = toks(14, 3 * BLOCK + 3)
    pubs = h.run(prompt, taps=[BLOCK], endpoint=True, kind=SnapshotKind.BOUNDARY)
    assert [p.snapshot.kind for p in pubs if p] == [SnapshotKind.BOUNDARY, SnapshotKind.ENDPOINT]


def test_the_index_imports_neither_torch_nor_vllm() -> None:
    code = (
        "import sys, vllm_hpc.index; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm')]; "
        "assert not bad, bad"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
