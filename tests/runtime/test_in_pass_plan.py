"""The runtime's plans for in-pass taps (`RuntimeConfig.in_pass_taps`), without vLLM.

An engine whose workers save states inside a prefill pass must not split a chunk for a tap on a
block boundary, must capture every such tap at its own position (not at the chunk's end), and
must publish it after the step like any capture; elsewhere taps keep splitting the chunk.
"""

from __future__ import annotations

import pytest

from tests.runtime.driver import CHUNK, make_cache, prompt, run
from vllm_hpc.derived import runtime_config
from vllm_hpc.options import PluginOptions
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


def async_prefill(cache: HybridPrefixCache, tokens: list[int], budget: int) -> None:
    """Prefill ``tokens`` as vLLM's async scheduler runs it: each step is scheduled before the
    previous one's output is processed, a non-final chunk in flight already counts as committed
    (vLLM adds output placeholders only for steps that sample), and the host writes a plan
    carries land with the next step's output. Then finish with no answer and audit."""
    n = len(tokens)
    info = RequestInfo("long", tokens, n)
    cache.new_step()
    lookup = cache.lookup(info)
    lane, start = None, lookup.frontier
    in_flight: list[list[int]] = []  # each step's write batches, oldest first
    landing: list[int] = []
    while start < n or in_flight:
        if start < n:
            taps = lookup.taps if lane is None else lane.taps
            size = cache.chunk_limit(taps, start, min(budget, n - start), n)
            if lane is None:
                lane = cache.admit(info, lookup, size)
                assert lane is not None
            else:
                assert cache.grow(lane, start + size) is not None
            cache.on_scheduled(lane, tokens, start, start + size)
            start += size
            in_flight.append([w.batch for w in cache.take_plan().host_writes])
            if len(in_flight) == 1:
                cache.new_step()
                continue
        cache.complete_writes(landing)  # the output of the step in flight before the oldest
        landing = in_flight.pop(0)
        assert lane is not None
        cache.commit(lane, tokens, start - (1 if start == n and in_flight else 0))
        cache.new_step()
    assert lane is not None
    cache.complete_writes(landing)
    cache.finish(lane, tokens, n)
    for _ in range(2):
        cache.take_plan()
        cache.new_step()
    cache.audit()


H100_FLOAT32 = {"device_pages": 3350, "row_pages": 37, "image_bytes": 153_944_064}
"""The 27B VL shape's KV cache on an H100 at 0.85 of its memory under vLLM 0.34, with the
float32 recurrent state the published checkpoints ask for: 90 rows of 37 pages (#47)."""


def test_a_long_prompt_on_an_h100_captures_every_tap_saved_in_the_pass() -> None:
    """The mix's 24,000-token prompt, with the cache the glue derives for that engine: its taps
    of one chunk take their slots in one step and keep them until their host writes land, so
    the derived snapshot cap must hold a prompt's taps, or its final chunk's (the deepest, the
    ones a deep edit or a retry resumes from) are skipped (docs/notes/deep-edit-turn-6.md)."""
    config = runtime_config(
        PluginOptions.from_additional_config({"kv_cache_manager": "hybrid-prefix"}),
        page_bytes=4 << 20,
        max_seqs=256,
        max_model_len=102_400,
        chunk=8192,
        in_pass=True,
        **H100_FLOAT32,
    )
    cache = HybridPrefixCache(config)
    tokens = prompt(24_000)
    async_prefill(cache, tokens, budget=8192)
    assert cache.index.stats.taps_skipped_no_slot == 0
    assert {16_384, 18_432, 19_904, 22_528, 23_936} <= set(snapshot_frontiers(cache))
