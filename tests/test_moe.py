"""Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`) served by the hybrid prefix cache (real engine)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from engine_support import (
    HYBRID,
    NO_MOE_KERNELS,
    assert_same_up_to_near_tie,
    cache_of,
    greedy,
    moe_kernels_missing,
    random_prompt,
    running_llm,
    tokens,
)

from vllm_hpc.tiny_model import MOE_RECIPE, tiny_model_path

pytestmark = [pytest.mark.engine, pytest.mark.skipif(moe_kernels_missing(), reason=NO_MOE_KERNELS)]


@pytest.fixture(scope="module")
def moe_model() -> str:
    return str(tiny_model_path(MOE_RECIPE))


@pytest.fixture(scope="module")
def cold(moe_model: str) -> Iterator[Any]:
    with running_llm(model=moe_model, enable_prefix_caching=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def hybrid(moe_model: str) -> Iterator[Any]:
    with running_llm(model=moe_model, in_process=True, additional_config=HYBRID) as llm:
        yield llm


def test_moe_next_turn_and_branch_resume_exactly(hybrid: Any, cold: Any) -> None:
    prompt = random_prompt(seed=1, length=1300)
    first = greedy(hybrid, [prompt], 96)[0]
    assert_same_up_to_near_tie(first, cold, prompt, 96)
    turn = prompt + tokens(first) + random_prompt(seed=2, length=200)
    second = greedy(hybrid, [turn], 32)[0]
    assert second.num_cached_tokens == len(prompt) + 96 - 1  # the first turn's endpoint
    assert_same_up_to_near_tie(second, cold, turn, 32)
    # A branch at token 700 finds no state below it, and leaves a Boundary tap where it leaves
    # the cached path (640); the next branch there resumes from it.
    for seed, cached in ((3, 0), (4, 640)):
        branch = prompt[:700] + random_prompt(seed=seed, length=100)
        out = greedy(hybrid, [branch], 32)[0]
        assert out.num_cached_tokens == cached
        assert_same_up_to_near_tie(out, cold, branch, 32)
    cache_of(hybrid).audit()
