"""What keys a cache entry beyond token ids (`vllm_hpc.glue.scheduler.cache_key`), on the real
engine: LoRA adapters and prompt embeddings. Images have `tests/test_vision.py`.

Two random adapters built locally (`tiny_lora_path`) change both the attention KV and the
recurrent states, so an entry shared between them would give a wrong answer; two embedding
prompts of one length have the same placeholder token ids. Every answer is compared with a
cold run of the same request, and the cache is audited after each scenario.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_support import (
    HYBRID,
    greedy_params,
    random_prompt,
    running_llm,
    settle_and_audit,
    tokens,
)

from vllm_hpc.exactness import first_parting, top1_margins
from vllm_hpc.tiny_model import DEFAULT_RECIPE, tiny_lora_path

pytestmark = pytest.mark.engine

ANSWER = 16
FEATURES = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2, "enable_prompt_embeds": True}


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> Iterator[Any]:
    with running_llm(in_process=True, additional_config=HYBRID, **FEATURES) as engine:
        yield engine


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Any) -> Iterator[Any]:
    with running_llm(enable_prefix_caching=False, **FEATURES) as engine:
        yield engine


def adapter(seed: int) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"adapter-{seed}", seed, str(tiny_lora_path(seed)))


def run(llm: Any, prompt: dict[str, Any], lora: Any = None, logprobs: int | None = None) -> Any:
    params = greedy_params(ANSWER, logprobs=logprobs)
    return llm.generate([prompt], params, lora_request=lora, use_tqdm=False)[0]


def assert_like_cold(out: Any, cold: Any, prompt: dict[str, Any], lora: Any = None) -> None:
    ref = run(cold, prompt, lora, logprobs=2).outputs[0]
    parting = first_parting(tokens(out), ref.token_ids, top1_margins(ref.logprobs))
    assert parting is None or parting.near_tie, parting.describe()


def test_an_adapter_hits_only_its_own_entries(llm: Any, cold: Any) -> None:
    prompt = {"prompt_token_ids": random_prompt(seed=1, length=900)}
    first, second = adapter(1), adapter(2)
    base = run(llm, prompt)
    assert base.num_cached_tokens == 0
    with_first = run(llm, prompt, first)
    assert with_first.num_cached_tokens == 0, "adapter 1 read the base model's entries"
    with_second = run(llm, prompt, second)
    assert with_second.num_cached_tokens == 0, "adapter 2 read adapter 1's entries"
    again = run(llm, prompt, first)
    assert again.num_cached_tokens == 896
    base_again = run(llm, prompt)
    assert base_again.num_cached_tokens == 896
    assert tokens(with_first) != tokens(with_second) != tokens(base)  # they do differ
    for out, lora in ((with_first, first), (with_second, second), (again, first), (base, None)):
        assert_like_cold(out, cold, prompt, lora)
    assert_like_cold(base_again, cold, prompt)
    settle_and_audit(llm)


def test_embedding_prompts_hit_only_the_same_embeddings(llm: Any, cold: Any) -> None:
    generator = torch.Generator().manual_seed(5)
    shape = (900, DEFAULT_RECIPE.hidden_size)
    one, two = (
        {"prompt_embeds": (torch.randn(shape, generator=generator) * 0.05).to(torch.bfloat16)}
        for _ in range(2)
    )
    first = run(llm, one)
    other = run(llm, two)  # same length, so the same placeholder token ids
    assert other.num_cached_tokens == 0, "two embedding prompts shared an entry"
    again = run(llm, {"prompt_embeds": one["prompt_embeds"].clone()})
    assert again.num_cached_tokens == 896
    tokens_only = run(llm, {"prompt_token_ids": [0] * 900})
    assert tokens_only.num_cached_tokens == 0
    for out, prompt in ((first, one), (other, two), (again, one)):
        assert_like_cold(out, cold, prompt)
    settle_and_audit(llm)
