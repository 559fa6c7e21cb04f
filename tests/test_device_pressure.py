"""The device tier under memory pressure (real engine)."""

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


def test_snapshot_slots_go_to_newer_snapshots(small: Any, cold: Any) -> None:
    """Three snapshot slots, six conversations in a row, each leaving a tail tap and an
    endpoint: older snapshots give their slots up (§9.2) or go with their blocks, whose pages
    the later conversations take (KV and snapshots share the pages, §5.4); no more than three
    stay on the device, and answers stay exact. First in the module: an earlier test's
    snapshots, worth more (longer prompts), would keep their slots."""
    cache = cache_of(small)
    stats = cache.index.stats
    before = stats.slot_evictions + stats.snapshots_deleted
    prompts = [random_prompt(seed=300 + i, length=600) for i in range(6)]
    for prompt in prompts:
        out = greedy(small, [prompt], 96)[0]
        assert_same_up_to_near_tie(out, cold, prompt, 96)
    assert stats.slot_evictions + stats.snapshots_deleted > before
    assert len(cache.index.store.slot_rows) <= 3
    follow_up = prompts[-1] + tokens(out) + random_prompt(seed=399, length=100)
    assert_same_up_to_near_tie(greedy(small, [follow_up], ANSWER)[0], cold, follow_up, ANSWER)
    cache.audit()


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
