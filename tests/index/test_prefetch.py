"""Prefetching the blocked head (§6.6)."""

from __future__ import annotations

from tests.index.harness import BLOCK, Harness, make_index, snap, toks
from vllm_hpc.index import PageId, Residency


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
