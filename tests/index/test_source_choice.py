"""Source choice and capacity arithmetic (§6.2, §6.3, §13.1 'Admission arithmetic')."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.index.harness import BLOCK, Harness, make_index, simple_cost, snap, toks
from vllm_hpc.index import (
    Readiness,
    Residency,
    Snapshot,
    SourceOption,
    StaleQuoteError,
)
from vllm_hpc.index.source_choice import classify


def option(frontier: int, seconds: float, restore: int = 0, own: int = 0) -> SourceOption:
    """A synthetic source for the pure arithmetic (no snapshot object needed)."""
    return SourceOption(None, frontier, restore * 1000, restore, 0, own, seconds)


def test_fallback_goes_from_the_chosen_source_to_cheaper_to_materialise_ones() -> None:
    deepest = option(300, seconds=1.0, restore=4)
    device = option(128, seconds=2.0)
    root = option(0, seconds=3.0)
    # s* needs 4 + 1 = 5 > 4 available; s_dev needs 3 <= 4.
    growth = {300: 1, 128: 3, 0: 5}.__getitem__
    readiness, source, need = classify([deepest, device, root], growth, 4, 100)
    assert (readiness, source, need) == (Readiness.READY, device, 3)
    # A chosen s_dev (cheapest) that does not fit falls back to the root only, never to s*.
    cheap_device = option(128, seconds=0.5)
    growth = {300: 0, 128: 9, 0: 5}.__getitem__
    readiness, source, _ = classify([deepest, cheap_device, root], growth, 5, 100)
    assert (readiness, source) == (Readiness.READY, root)


def test_blocked_versus_infeasible() -> None:
    root = option(0, seconds=1.0)
    readiness, source, need = classify([root], lambda f: 10, 9, 10)
    assert (readiness, source, need) == (Readiness.TEMPORARILY_BLOCKED, None, 10)
    readiness, source, need = classify([root], lambda f: 11, 9, 10)
    assert (readiness, source, need) == (Readiness.PERMANENTLY_INFEASIBLE, None, 11)


def test_pages_pinned_by_the_admissions_own_path_are_not_available() -> None:
    deepest = option(300, seconds=1.0, own=3)
    root = option(0, seconds=2.0)
    readiness, source, _ = classify([deepest, root], lambda f: 3, 5, 100)
    assert (readiness, source) == (Readiness.READY, root)  # 5 - 3 = 2 < 3 for s*


def prepare_two_sources(h: Harness, prompt: list[int]) -> tuple[Snapshot, Snapshot]:
    shallow, deep = map(snap, h.run(prompt, taps=[2 * BLOCK, 5 * BLOCK]))
    h.index.store.drop_snapshot_image_device(deep)  # s* restores its image from the host
    return shallow, deep


def test_choice_by_cost_deepest_when_restoring_is_cheap() -> None:
    h = Harness(make_index(host_slabs=32))
    prompt = toks(1, 6 * BLOCK + 5)  # n = 389
    _, deep = prepare_two_sources(h, prompt)
    quote = h.index.quote(h.index.match(h.index.prepare_prompt(prompt)), lambda f: 0)
    # cost(s*)   = 4000/1e6 + prefill(320, 69) = 0.004 + 0.069 + (320·69 + 69·70/2)·1e-6
    #            = 0.004 + 0.069 + 0.024495 = 0.097495
    # cost(s_dev) = prefill(128, 261) = 0.261 + (128·261 + 261·262/2)·1e-6 = 0.328599
    assert quote.readiness is Readiness.READY and quote.source is not None
    assert quote.source.snapshot is deep
    assert quote.source.seconds == pytest.approx(0.097495)
    assert quote.source.host_bytes == 4000


def test_choice_by_cost_device_source_when_the_link_is_slow() -> None:
    slow = replace(simple_cost(), h2d_bytes_per_s=1e3)
    h = Harness(make_index(host_slabs=32, cost=slow))
    prompt = toks(2, 6 * BLOCK + 5)
    shallow, _ = prepare_two_sources(h, prompt)
    quote = h.index.quote(h.index.match(h.index.prepare_prompt(prompt)), lambda f: 0)
    # cost(s*) = 4000/1e3 + 0.093495 = 4.093495 > cost(s_dev) = 0.328599
    assert quote.source is not None and quote.source.snapshot is shallow
    assert quote.source.seconds == pytest.approx(0.328599)


def test_active_sequences_block_and_oversized_requests_are_infeasible() -> None:
    h = Harness(make_index(pages=8))
    index = h.index
    held = index.allocate_pages(8)
    assert held is not None
    prompt = index.prepare_prompt(toks(3, 100))
    assert index.quote(index.match(prompt), lambda f: 2).readiness is Readiness.TEMPORARILY_BLOCKED
    assert index.quote(index.match(prompt), lambda f: 9).readiness is (
        Readiness.PERMANENTLY_INFEASIBLE
    )
    index.free_pages(held)
    quote = index.quote(index.match(prompt), lambda f: 2)
    assert quote.readiness is Readiness.READY
    with pytest.raises(ValueError, match="cannot acquire"):
        index.acquire(index.quote(index.match(prompt), lambda f: 9))
    h.check()


def test_a_quote_is_refused_once_the_cache_moved() -> None:
    h = Harness(make_index())
    index = h.index
    prompt = index.prepare_prompt(toks(4, 100))
    quote = index.quote(index.match(prompt), lambda f: 1)
    pages = index.allocate_pages(1)
    assert pages is not None
    with pytest.raises(StaleQuoteError):
        index.acquire(quote)
    index.free_pages(pages)
    h.check()


def test_restore_plan_and_filling_candidates_are_skipped() -> None:
    h = Harness(make_index(pages=16, host_slabs=32))
    prompt = toks(5, 3 * BLOCK + 5)
    index = h.index
    (tap,) = h.run(prompt, taps=[3 * BLOCK])
    snapshot = snap(tap)
    index.store.drop_snapshot_image_device(snapshot)
    grabbed = index.allocate_pages(index.available_pages)  # path blocks become host-only
    assert grabbed is not None
    index.free_pages(grabbed)
    first = h.admit(prompt, complete=False)
    restore = first.restore
    assert restore is not None and first.frontier == 3 * BLOCK
    assert [copy.node.depth for copy in restore.blocks] == [0, 1, 2]
    assert [copy.slab for copy in restore.blocks] == [n.host_slab for n in first.lease.path]
    assert restore.image_slot is None and restore.image_slabs == snapshot.image_slabs
    assert all(n.device is Residency.FILLING for n in first.lease.path)
    # A second request for the same prompt skips the candidate whose blocks are Filling.
    quote = index.quote(index.match(index.prepare_prompt(prompt)), lambda f: 0)
    assert quote.source is not None and quote.source.snapshot is None
    index.complete_restore(restore)
    with pytest.raises(ValueError, match="already completed"):
        index.complete_restore(restore)
    assert all(n.device is Residency.RESIDENT for n in first.lease.path)
    assert index.stats.hits_host == 1
    h.commit(first.lease, prompt)
    h.finish(first.lease)


class FlatCost:
    """A plugged-in cost model: prefill costs one second per token, restores and reads are
    free."""

    def prefill_seconds(self, base: int, tokens: int) -> float:
        return float(tokens)

    def restore_seconds(self, host_bytes: int) -> float:
        return 0.0

    def disk_read_seconds(self, disk_bytes: int) -> float:
        return 0.0


def test_a_custom_cost_model_plugs_in() -> None:
    h = Harness(make_index(host_slabs=32, cost=FlatCost()))
    prompt = toks(6, 6 * BLOCK + 5)
    _, deep = prepare_two_sources(h, prompt)
    match = h.index.match(h.index.prepare_prompt(prompt))
    assert match.matched_tokens == 6 * BLOCK
    quote = h.index.quote(match, lambda f: 0)
    assert quote.source is not None and quote.source.snapshot is deep
    assert quote.source.seconds == len(prompt) - 5 * BLOCK
