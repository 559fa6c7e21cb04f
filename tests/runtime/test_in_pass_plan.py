"""The runtime's plans for in-pass taps (`RuntimeConfig.in_pass_taps`), without vLLM.

An engine whose workers save states inside a prefill pass must not split a chunk for a tap on a
block boundary, must capture every such tap at its own position (not at the chunk's end), and
must publish it after the step like any capture; elsewhere taps keep splitting the chunk.
"""

from __future__ import annotations

import pytest

from tests.runtime.driver import CHUNK, make_cache, prompt, run
from vllm_hpc.runtime.cache import HybridPrefixCache, RequestInfo
from vllm_hpc.runtime.plan import InPassCapture, StepPlan


def prefill(
    cache: HybridPrefixCache,
    tokens: list[int],
    breakpoints: tuple[int, ...] = (),
    budget: int = CHUNK,
) -> tuple[list[tuple[int, int]], list[StepPlan]]:
    """The chunks a prompt ran in and each step's plan (`driver.run`, no answer)."""
    result = run(cache, tokens, breakpoints=breakpoints, budget=budget)
    return result.chunks, result.plans


def snapshot_frontiers(cache: HybridPrefixCache) -> list[int]:
    return sorted(s.frontier for s in cache.index.store.snapshots)


def test_a_block_aligned_exact_tap_does_not_split_the_chunk() -> None:
    tokens = prompt(1000)
    chunks, plans = prefill(make_cache(in_pass=True), tokens, breakpoints=(640,))
    assert chunks == [(0, 1000)]
    in_pass = [c for p in plans for c in p.in_pass]
    row = in_pass[0].row  # the request's state row
    assert InPassCapture(row=row, offset=640, dst=in_pass[0].dst) in in_pass
    # The prompt tail's tap, floor64(n - 1), is captured in the pass too.
    assert {c.offset for c in in_pass} == {640, 960}


def test_without_in_pass_taps_the_same_tap_splits_the_chunk() -> None:
    tokens = prompt(1000)
    chunks, plans = prefill(make_cache(in_pass=False), tokens, breakpoints=(640,))
    assert chunks == [(0, 640), (640, 960), (960, 1000)]
    assert not any(p.in_pass for p in plans)


def test_a_tap_inside_a_block_still_splits() -> None:
    tokens = prompt(1000)
    cache = make_cache(in_pass=True)
    chunks, _ = prefill(cache, tokens, breakpoints=(650,))
    assert chunks[0] == (0, 650)
    assert 650 in snapshot_frontiers(cache)


def test_in_pass_taps_publish_at_their_positions() -> None:
    tokens = prompt(2500)
    cache = make_cache(in_pass=True, dense=True)
    chunks, plans = prefill(cache, tokens)
    assert chunks == [(0, 1024), (1024, 2048), (2048, 2500)]
    frontiers = snapshot_frontiers(cache)
    # Dense flexible taps every 256 tokens land at their own positions, inside the chunks.
    assert {256, 512, 768, 1280} <= set(frontiers)
    # Each in-pass capture is planned in the step whose pass computes it.
    for (start, end), plan in zip(chunks, plans, strict=True):
        assert all(0 < c.offset < end - start and c.offset % 64 == 0 for c in plan.in_pass)
    assert frontiers[-1] == 2496  # the prompt tail, floor64(n - 1)


@pytest.mark.parametrize("in_pass", [False, True])
def test_a_retry_resumes_at_the_prompt_tail(in_pass: bool) -> None:
    tokens = prompt(1000)
    cache = make_cache(in_pass=in_pass)
    prefill(cache, tokens)
    cache.new_step()
    lookup = cache.lookup(RequestInfo("retry", tokens, len(tokens)))
    assert lookup.frontier == 960


def test_chunks_end_on_block_boundaries_so_later_chunks_tap_in_the_pass() -> None:
    """A step budget that is not a multiple of 64 (shared with other requests) would leave every
    chunk after the first starting inside a block, where no tap can be saved in the pass."""
    tokens = prompt(2500)
    cache = make_cache(in_pass=True, dense=True)
    chunks, plans = prefill(cache, tokens, budget=1000)
    assert chunks == [(0, 960), (960, 1920), (1920, 2500)]
    assert all(plan.in_pass for plan in plans)
    assert {1024, 1280, 1536, 2048} <= set(snapshot_frontiers(cache))


def test_without_in_pass_taps_chunks_keep_the_whole_budget() -> None:
    chunks, _ = prefill(make_cache(in_pass=False), prompt(2500), budget=1000)
    assert chunks[0] == (0, 1000)


def test_a_chunk_that_cannot_reach_a_block_boundary_waits() -> None:
    """What is left of a step's budget after other requests may not reach the next boundary:
    the chunk then waits for the next step (0) rather than leave the prompt's next chunk off
    the 64-token grid; the prompt's last chunk and a budget below one block run as given."""
    cache = make_cache(in_pass=True)
    assert cache.chunk_limit([], 0, 40, 1000) == 0  # a new request: the step's last 40 tokens
    assert cache.chunk_limit([], 960, 40, 2500) == 0
    assert cache.chunk_limit([], 950, 5, 2500) == 0  # an unaligned start (an endpoint resume)
    assert cache.chunk_limit([], 950, 40, 2500) == 10  # reaches the boundary at 960
    assert cache.chunk_limit([], 960, 40, 1000) == 40  # ends the prompt
    assert make_cache(in_pass=False).chunk_limit([], 0, 40, 1000) == 40


def test_a_budget_below_one_block_still_schedules_short_chunks() -> None:
    chunks, _ = prefill(make_cache(in_pass=True, chunk_tokens=48), prompt(200), budget=48)
    assert chunks[:2] == [(0, 48), (48, 64)]
    assert chunks[-1][1] == 200
