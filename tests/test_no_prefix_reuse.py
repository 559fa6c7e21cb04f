"""--no-prefix-reuse on the real engine: nothing is looked up, inserted or captured.

A module of its own: an in-process engine must not run beside another one (they would share
vLLM's KV-connector agent, `engine_support.running_llm`).
"""

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
    tokens,
)

pytestmark = pytest.mark.engine

ANSWER = 32


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
