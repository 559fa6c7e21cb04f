"""Two hybrid-prefix engines in one process: vLLM 0.32.0 keeps one KV connector per process, so
a second in-process engine would lay the first one's state pool over its own KV cache. It is
refused at start-up with an error that says why, and the first engine serves on, exactly."""

from __future__ import annotations

from typing import Any

import pytest
from engine_support import (
    RESUME_PATHS,
    greedy_params,
    random_prompt,
    settle_and_audit,
    small_pool_llm,
    tokens,
)

from vllm_hpc.tiny_model import llm_kwargs

pytestmark = pytest.mark.engine


def _answer(llm: Any, prompt: list[int]) -> list[int]:
    out = llm.generate([{"prompt_token_ids": prompt}], greedy_params(16), use_tqdm=False)[0]
    return tokens(out)


def test_a_second_engine_is_refused_and_the_first_serves_on(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import LLM, envs

    prompt = random_prompt(seed=1200, length=900)
    with small_pool_llm(RESUME_PATHS) as first:
        before = _answer(first, prompt)
        # Started directly: the test helper's clean-up after a failed start would also take
        # the first engine's connector and process groups down.
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        envs.disable_envs_cache()
        config = {**RESUME_PATHS}
        with pytest.raises(Exception, match="one KV connector per process"):
            LLM(**llm_kwargs(max_model_len=2048, additional_config=config))
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
        assert _answer(first, prompt) == before
        settle_and_audit(first)
