"""The device tier under memory pressure, and with prefix reuse switched off (real engine)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from engine_support import (
    HYBRID,
    assert_same_up_to_near_tie,
    cache_of,
    greedy,
    random_prompt,
    running_llm,
    small_pool_llm,
    tokens,
)

pytestmark = pytest.mark.engine

ANSWER = 32


@pytest.fixture(scope="module")
def small(tiny_model_dir: Any) -> Iterator[Any]:
    """A pool far too small for everything: 59 pages, 4 running requests, 3 snapshot slots."""
    config = {**HYBRID, "device_snapshot_slots": 3, "cache_taps_per_request": 4}
    with small_pool_llm(config) as llm:
        yield llm


def test_active_requests_never_lose_pages_the_cache_gives_way(small: Any, cold: Any) -> None:
    """Four rounds of four 1,500-token requests (24 pages each, 96 wanted of 59): requests
    wait or are preempted by vLLM, cached pages are evicted (their subtrees and snapshots with
    them, there being no host tier), and every answer is still the cold one."""
    cache = cache_of(small)
    for round_ in range(4):
        prompts = [random_prompt(seed=100 * round_ + i, length=1500) for i in range(4)]
        for prompt, out in zip(prompts, greedy(small, prompts, ANSWER), strict=True):
            assert_same_up_to_near_tie(out, cold, prompt, ANSWER)
        cache.audit()
    assert cache.index.stats.device_evictions_unbacked > 0


def test_snapshot_slots_go_to_newer_snapshots(small: Any, cold: Any) -> None:
    """Three snapshot slots, six conversations in a row, each leaving a tail tap and an
    endpoint: older snapshots give their slots up (§9.2), and answers stay exact."""
    cache = cache_of(small)
    before = cache.index.stats.slot_evictions
    prompts = [random_prompt(seed=300 + i, length=600) for i in range(6)]
    for prompt in prompts:
        out = greedy(small, [prompt], 96)[0]
        assert_same_up_to_near_tie(out, cold, prompt, 96)
    assert cache.index.stats.slot_evictions > before
    follow_up = prompts[-1] + tokens(out) + random_prompt(seed=399, length=100)
    assert_same_up_to_near_tie(greedy(small, [follow_up], ANSWER)[0], cold, follow_up, ANSWER)
    cache.audit()


@pytest.fixture(scope="module")
def no_reuse(tiny_model_dir: Any) -> Iterator[Any]:
    config = {**HYBRID, "no_prefix_reuse": True}
    with running_llm(in_process=True, additional_config=config) as llm:
        yield llm


def test_no_prefix_reuse_caches_nothing(no_reuse: Any, cold: Any) -> None:
    prompt = random_prompt(seed=5, length=1500)
    outs = [greedy(no_reuse, [prompt], ANSWER)[0] for _ in range(2)]
    assert tokens(outs[0]) == tokens(outs[1])  # the same computation, nothing reused
    assert_same_up_to_near_tie(outs[0], cold, prompt, ANSWER)
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    index = cache_of(no_reuse).index
    assert not index.store.snapshots
    assert all(not root.children for root in index.store.tree.roots)
    cache_of(no_reuse).audit()
