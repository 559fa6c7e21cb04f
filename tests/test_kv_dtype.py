"""`--kv-cache-dtype fp8` with hybrid-prefix on the real engine: attention KV stored as FP8
(e4m3) pages. The host tier copies a page's bytes whatever their dtype, so a block or tail comes
back bit-exact (`tests/test_host_arena.py` checks that for every KV dtype); here a small-pool
engine resumes from a tap, from an endpoint and from a host restore, each answer checked against
a cold run that stores its KV as FP8 too, with the audit after each.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_support import (
    RESUME_PATHS,
    ROW_PAGES,
    cold_reference,
    resume_from_a_tap_an_endpoint_and_the_host,
    small_pool_llm,
)


def _fp8_kv_here() -> bool:
    """vLLM's CPU attention stores FP8 KV only with AVX-512 or AMX (`cpu_attn._get_attn_isa`
    refuses it otherwise at start-up); CUDA always can."""
    return (
        torch.cuda.is_available()
        or torch.cpu._is_avx512_supported()
        or torch.cpu._is_amx_tile_supported()
    )


pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        not _fp8_kv_here(), reason="FP8 KV on CPU needs AVX-512 or AMX (vLLM's CPU attention)"
    ),
]

FP8 = {"kv_cache_dtype": "fp8", "max_model_len": 2048}


@pytest.fixture(scope="module")
def fp8_cold(tiny_model_dir: Any) -> Iterator[Any]:
    with cold_reference(**FP8) as llm:
        yield llm


@pytest.fixture(scope="module")
def fp8(tiny_model_dir: Any) -> Iterator[Any]:
    # FP8 pages are half as large, so a state row is twice as many: the 59 KV pages could not
    # also hold a running request's row, as they do with bf16 pages. One row is added for it.
    with small_pool_llm(RESUME_PATHS, row_pages=2 * ROW_PAGES, running_rows=1, **FP8) as llm:
        assert llm.llm_engine.vllm_config.cache_config.cache_dtype == "fp8"
        yield llm


def test_fp8_kv_resumes_from_a_tap_an_endpoint_and_the_host(fp8: Any, fp8_cold: Any) -> None:
    resume_from_a_tap_an_endpoint_and_the_host(fp8, fp8_cold, seed=300)
