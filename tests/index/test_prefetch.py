"""Prefetching the blocked head (§6.6)."""

from __future__ import annotations

import random

import pytest

from tests.index.harness import BLOCK, Harness, make_index, snap, toks
from tests.index.test_stateful import IndexMachine
from vllm_hpc.index import PageId, Prefetch, Residency, SnapshotKind


def host_only_path(h: Harness, seed: int) -> list[int]:
    """A 3-block prompt with a tap at its end whose blocks were pushed off the device."""
    prompt = toks(seed, 3 * BLOCK + 5)
    snap(h.run(prompt, taps=[3 * BLOCK])[0])
    grabbed = h.index.allocate_pages(h.index.available_pages)
    assert grabbed is not None
    h.index.free_pages(grabbed)
    return prompt


def test_prefetch_brings_the_path_back_and_admission_finds_it_resident() -> None:
    h = Harness(make_index(pages=16, host_slabs=32))
    index = h.index
    prompt = host_only_path(h, seed=1)
    match = index.match(index.prepare_prompt(prompt))
    prefetch = index.prefetch(match)
    assert prefetch is not None and [c.node.depth for c in prefetch.copies] == [0, 1, 2]
    assert all(node.device is Residency.FILLING for node in match.path)
    assert index.prefetch(index.match(index.prepare_prompt(prompt))) is None  # landing
    h.check()
    index.complete_prefetch(prefetch)
    assert all(node.device is Residency.RESIDENT and not node.held for node in match.path)
    admission = h.admit(prompt, complete=False)
    assert admission.restore is not None and admission.restore.blocks == ()
    index.complete_restore(admission.restore)
    h.finish(admission.lease)
    assert index.stats.blocks_prefetched == 3
    assert index.stats.prefetched_blocks_used == 3


def test_prefetch_uses_only_spare_pages_and_never_drops_a_last_copy() -> None:
    h = Harness(make_index(pages=16, host_slabs=32))
    index = h.index
    prompt = host_only_path(h, seed=2)
    held: list[PageId] | None = index.allocate_pages(index.store.pages.num_free - 2)
    assert held is not None
    lru = index.store.lru
    spare = index.store.pages.num_free + lru.num_backed
    unbacked = len(lru) - lru.num_backed
    assert spare < 3
    prefetch = index.prefetch(index.match(index.prepare_prompt(prompt)), limit=8)
    assert prefetch is not None and len(prefetch.copies) == spare
    assert len(lru) - lru.num_backed == unbacked
    index.complete_prefetch(prefetch)
    index.free_pages(held)
    h.check()


def test_nothing_to_prefetch_without_a_host_tier_or_host_only_blocks() -> None:
    h = Harness(make_index(pages=16))
    prompt = toks(3, 3 * BLOCK + 5)
    h.run(prompt, taps=[3 * BLOCK])
    assert h.index.prefetch(h.index.match(h.index.prepare_prompt(prompt))) is None
    h2 = Harness(make_index(pages=16, host_slabs=32))
    h2.run(prompt, taps=[3 * BLOCK])
    assert h2.index.prefetch(h2.index.match(h2.index.prepare_prompt(prompt))) is None


# -- a blocked head asks every step: fruitless attempts are not repeated for nothing ----------


class Head:
    """A waiting request that asks for a prefetch each step, matched afresh each time."""

    def __init__(self, h: Harness, tokens: list[int]) -> None:
        self.index = h.index
        self.prompt = h.index.prepare_prompt(tokens)

    def ask(self) -> Prefetch | None:
        return self.index.prefetch(self.index.match(self.prompt))

    @property
    def skipped(self) -> int:
        return self.index.stats.prefetches_skipped


def test_a_fruitless_prefetch_is_answered_at_once_until_a_page_is_freed() -> None:
    h = Harness(make_index(pages=16, host_slabs=32))
    index = h.index
    head = Head(h, host_only_path(h, seed=4))
    held = index.allocate_pages(index.available_pages)
    assert held is not None and index.store.pages.num_free == 0
    assert head.ask() is None and head.skipped == 0
    assert head.ask() is None and head.ask() is None
    assert head.skipped == 2
    index.free_pages(held[:1])
    prefetch = head.ask()
    assert prefetch is not None and len(prefetch.copies) == 1
    index.complete_prefetch(prefetch)
    index.free_pages(held[1:])
    h.check()


def test_a_match_with_another_deepest_snapshot_is_not_answered_from_the_record() -> None:
    """A caller that leaves the candidates out (a request that reads no cache) records
    nothing for the prompt's real match."""
    h = Harness(make_index(pages=16, host_slabs=32))
    index = h.index
    match = index.match(index.prepare_prompt(host_only_path(h, seed=5)))
    assert index.prefetch(type(match)(match.prompt, match.root, [], [])) is None
    prefetch = index.prefetch(match)
    assert prefetch is not None and index.stats.prefetches_skipped == 0
    index.complete_prefetch(prefetch)


def test_a_landing_on_the_path_opens_the_prefetch_again() -> None:
    """Another admission restores the head's first block: the head's prefetch waits for that
    copy, and once it lands copies the rest, with no page freed in between."""
    h = Harness(make_index(pages=16, host_slabs=32))
    index = h.index
    prompt = toks(6, 3 * BLOCK + 5)
    h.run(prompt, taps=[BLOCK, 3 * BLOCK])
    grabbed = index.allocate_pages(index.available_pages)
    assert grabbed is not None
    index.free_pages(grabbed)
    other = h.admit(prompt[: BLOCK + 5], complete=False)
    assert other.restore is not None and len(other.restore.blocks) == 1
    head = Head(h, prompt)
    assert head.ask() is None  # block 0 is filling
    assert head.ask() is None and head.skipped == 1
    free = index.store.pages.num_free
    index.complete_restore(other.restore)
    assert index.store.pages.num_free == free
    prefetch = head.ask()
    assert prefetch is not None and [c.node.depth for c in prefetch.copies] == [1, 2]
    index.complete_prefetch(prefetch)
    h.finish(other.lease)


def test_losing_device_copies_of_the_path_opens_the_prefetch_again() -> None:
    """The head's path is on the device (nothing to copy); sequences then take its pages and
    give back as many as there were free: no more free pages, but blocks to copy."""
    h = Harness(make_index(pages=16, host_slabs=32))
    index = h.index
    prompt = toks(7, 3 * BLOCK + 5)
    h.run(prompt, taps=[3 * BLOCK])
    head = Head(h, prompt)
    assert head.ask() is None  # all resident
    assert head.ask() is None and head.skipped == 1
    free = index.store.pages.num_free
    taken = index.allocate_pages(free + 2)  # evicts the two deepest blocks (host-backed)
    assert taken is not None
    index.free_pages(taken[:2])
    assert index.store.pages.num_free <= free
    prefetch = head.ask()
    assert prefetch is not None and [c.node.depth for c in prefetch.copies] == [1, 2]
    index.complete_prefetch(prefetch)
    index.free_pages(taken[2:])
    h.check()


def test_host_backed_blocks_released_into_the_lru_open_the_prefetch_again() -> None:
    """No page is free; a sequence then releases host-backed blocks, which a prefetch may
    replace: spare room grew though the free count did not."""
    h = Harness(make_index(pages=16, host_slabs=32))
    index = h.index
    other = toks(8, 2 * BLOCK + 5)
    prompt = toks(9, 3 * BLOCK + 5)
    h.run(prompt, taps=[3 * BLOCK])
    h.run(other, taps=[2 * BLOCK])
    running = h.admit(other)  # holds its two blocks, resident and host-backed
    held = index.allocate_pages(index.available_pages)  # pushes the head's path off the device
    assert held is not None and index.store.pages.num_free == 0
    head = Head(h, prompt)
    assert head.ask() is None
    assert head.ask() is None and head.skipped == 1
    h.finish(running.lease)
    assert index.store.pages.num_free == 0
    prefetch = head.ask()
    assert prefetch is not None and len(prefetch.copies) == 2
    index.complete_prefetch(prefetch)
    index.free_pages(held)
    h.check()


def test_a_host_backed_tail_unpinned_into_the_lru_opens_the_prefetch_again() -> None:
    """The same with a snapshot's tail page: a restore from the snapshot pinned it, and it
    joins the LRU when the restore lands."""
    h = Harness(make_index(pages=16, host_slabs=32))
    index = h.index
    other = toks(10, 2 * BLOCK + 10)
    prompt = toks(11, 3 * BLOCK + 5)
    h.run(prompt, taps=[3 * BLOCK])
    h.run(other, taps=[2 * BLOCK + 10])
    running = h.admit([*other, 1], complete=False)  # pins the snapshot and its tail page
    assert running.restore is not None and running.restore.tail_page is not None
    held = index.allocate_pages(index.available_pages)
    assert held is not None and index.store.pages.num_free == 0
    head = Head(h, prompt)
    assert head.ask() is None
    assert head.ask() is None and head.skipped == 1
    index.complete_restore(running.restore)
    prefetch = head.ask()
    assert prefetch is not None and len(prefetch.copies) == 1
    index.complete_prefetch(prefetch)
    h.finish(running.lease)
    index.free_pages(held)
    h.check()


def _ready(m: IndexMachine) -> bool:
    return any(r.restore is None for r in m.running)


def _random_step(m: IndexMachine, rng: random.Random) -> None:
    """One cache operation, weighted towards those that make and move a head's path."""
    doc, blocks, pick = rng.randrange(2), rng.randint(1, 6), rng.randrange(99)
    now = rng.random() < 0.5
    choice = rng.randrange(14)
    if choice < 3:  # a request on a prefix of a head's prompt: a snapshot on its path
        back = rng.randrange(BLOCK)
        m.whole_request(doc, blocks, 0, [], [blocks * BLOCK - back], rng.random() < 0.3)
    elif choice == 3:
        m.whole_request(doc, blocks, rng.randrange(40), [rng.randrange(3)] * 9, [], True)
    elif choice == 4:
        m.admit(doc, blocks, rng.randrange(40), [], None)
    elif choice == 5 and any(r.restore for r in m.running):
        m.complete_restore(pick)
    elif choice == 6 and _ready(m):
        m.tap(pick, rng.randrange(70), SnapshotKind.TAP, now)
    elif choice == 7 and _ready(m):
        m.finish(pick, rng.random() < 0.5, now)
    elif choice == 8 and m.writes:
        m.complete_write(pick)
    elif choice in (9, 10):
        m.grab_pages(rng.randint(1, 8))
    elif choice == 11 and m.pressure:
        m.drop_pages()
    elif choice == 12:
        m.next_head() if now else m.wait(pick, [rng.randrange(3)] * rng.randint(1, 70))
    elif choice == 13:
        m.reset() if rng.random() < 0.1 else m.commit_blocks(pick, 2) if _ready(m) else None


@pytest.mark.parametrize("seed", range(12))
def test_a_head_asking_every_step_gets_what_a_full_attempt_gets(seed: int) -> None:
    """Random cache operations on a small device with a host tier, the waiting head asking for
    a prefetch after each (as the engine asks every step): the index's answer, often from its
    record of the last attempt, is checked against a full attempt on a copy of the index."""
    rng = random.Random(seed)
    m = IndexMachine()
    m.setup(rng.randint(8, 16), rng.randint(1, 3), rng.choice([9, 40]), collide=False)
    for _ in range(300):
        _random_step(m, rng)
        if m.prefetches and rng.random() < 0.7:
            m.complete_prefetch()
        if not m.prefetches:
            m.prefetch(rng.randint(1, 4), now=rng.random() < 0.3)
        m.audit()
