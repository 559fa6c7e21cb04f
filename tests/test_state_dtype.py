"""The recurrent state's dtype: hybrid-prefix caches it as vLLM does for the same checkpoint.

Its own module: each case starts an engine of its own, and the engines of another module's
fixtures would leave too little memory for it.
"""

from __future__ import annotations

import pytest
from engine_support import HYBRID, running_llm, state_dtypes

from vllm_hpc.tiny_model import MOE_RECIPE, tiny_model_path

pytestmark = pytest.mark.engine


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
        assert state_dtypes(llm) == {("bfloat16", checkpoint)}
