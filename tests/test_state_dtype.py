"""The recurrent state's dtype: hybrid-prefix caches it as vLLM does for the same checkpoint.

Its own module: each case starts an engine of its own, and the engines of another module's
fixtures would leave too little memory for it.
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_support import HYBRID, running_llm

from vllm_hpc.tiny_model import MOE_RECIPE, tiny_model_path

pytestmark = pytest.mark.engine


def _state_dtypes(llm: Any) -> set[tuple[str, ...]]:
    """The dtypes of every GDN layer's (conv, recurrent) state tensors in an in-process engine."""

    def read(model: Any) -> set[tuple[str, ...]]:
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
            QwenGatedDeltaNetAttention,
        )

        layers = [m for m in model.modules() if isinstance(m, QwenGatedDeltaNetAttention)]
        return {tuple(str(t.dtype) for t in layer.kv_cache) for layer in layers}

    return set().union(*llm.apply_model(read))


@pytest.mark.parametrize("checkpoint", ["float32", "bfloat16"])
def test_states_are_kept_in_the_checkpoints_dtype(checkpoint: str) -> None:
    """The recurrent state is cached in the checkpoint's `mamba_ssm_dtype`, as vLLM caches it
    for its own Qwen3.5 classes (it applies that by architecture name). hybrid-prefix's classes
    did not get it: their state followed the platform's default instead (bf16 on CUDA and on
    AVX2 CPUs, float32 on AVX-512-BF16 CPUs), and on AVX2 machines the MoE branch of
    `test_moe.py` parted from the cold run."""
    with running_llm(
        model=str(tiny_model_path(MOE_RECIPE)),
        in_process=True,
        additional_config=HYBRID,
        hf_overrides={"mamba_ssm_dtype": checkpoint},
    ) as llm:
        assert llm.llm_engine.vllm_config.cache_config.mamba_ssm_cache_dtype == checkpoint
        assert _state_dtypes(llm) == {("torch.bfloat16", f"torch.{checkpoint}")}
