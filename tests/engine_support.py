"""Helpers for tests that drive a real vLLM engine with token-id prompts."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from vllm_hpc.tiny_model import DEFAULT_RECIPE, llm_kwargs


@contextmanager
def running_llm(**overrides: Any) -> Iterator[Any]:
    """Start a real `vllm.LLM` on the tiny model and shut its engine down afterwards."""
    from vllm import LLM

    llm = LLM(**llm_kwargs(**overrides))
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(DEFAULT_RECIPE.vocab_size) for _ in range(length)]


def greedy(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int = 32) -> list[Any]:
    """Greedy-decode each prompt; returns vLLM's RequestOutputs in prompt order."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)


def counter(llm: Any, name: str) -> float:
    """The value of one of vLLM's counters (summed over its label sets)."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)
