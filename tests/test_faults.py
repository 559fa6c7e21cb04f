"""Injected faults on the real engine (`vllm_hpc.faults`; in-process engines, so the worker sees
the armed points): a host tier that cannot be allocated, host copies and device state copies
that fail in a worker, and host copies that stay in flight for several steps.
vLLM makes a worker's error engine-wide: the engine must stop with one message that says what
failed, and an engine started afterwards must serve from a clean cache."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from engine_support import (
    RESUME_PATHS,
    SMALL_POOL_PAGES,
    assert_same_up_to_near_tie,
    cache_of,
    cancel_after_steps,
    cold_reference,
    greedy,
    random_prompt,
    running_llm,
    settle_and_audit,
    small_pool_llm,
)

from vllm_hpc import faults
from vllm_hpc.glue.worker.connector_worker import issued_copies, steps_beside_write_issue

pytestmark = pytest.mark.engine

HOSTED = {"kv_cache_manager": "hybrid-prefix", "host_cache_mib": 64}
SMALL = {
    "max_model_len": 2048,
    "num_gpu_blocks_override": SMALL_POOL_PAGES,
    "max_num_batched_tokens": 512,
}


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Any) -> Iterator[Any]:
    with cold_reference(max_model_len=2048) as llm:
        yield llm


def _messages(error: BaseException | None) -> list[str]:
    """An exception's message and those of its causes."""
    messages = []
    while error is not None:
        messages.append(str(error))
        error = error.__cause__ or error.__context__
    return messages


def test_a_host_tier_that_cannot_be_allocated_fails_the_start_naming_the_option(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(faults, "_ARMED", frozenset({"host_alloc:0"}))
    engine = running_llm(in_process=True, additional_config=HOSTED, **SMALL)
    with pytest.raises(Exception) as caught, engine:
        pass
    messages = _messages(caught.value)
    assert any("host tier chunk 0" in m and "--host-cache-mib" in m for m in messages), messages


@pytest.mark.parametrize(
    ("point", "says"),
    [
        ("host_write", "host tier: a copy"),
        ("host_restore", "host tier: a copy"),
        ("state_copy", "device state pool: a copy"),
    ],
)
def test_a_failed_copy_stops_the_engine_saying_so_and_a_restart_serves(
    point: str, says: str, cold: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = random_prompt(seed=1, length=1500)
    with running_llm(in_process=True, additional_config=HOSTED, **SMALL) as llm:
        greedy(llm, [prompt], 8)  # its blocks and endpoint are written through
        for seed in range(10, 14):  # and pushed off the device: the next turn restores them
            greedy(llm, [random_prompt(seed=seed, length=1500)], 4)
        monkeypatch.setattr(faults, "_ARMED", frozenset({point}))
        with pytest.raises(Exception) as caught:
            greedy(llm, [prompt], 8)
            greedy(llm, [random_prompt(seed=20, length=1500)], 4)
        messages = _messages(caught.value)
        assert any(f"hybrid-prefix {says}" in m for m in messages), messages
    monkeypatch.setattr(faults, "_ARMED", frozenset())
    with running_llm(in_process=True, additional_config=HOSTED, **SMALL) as llm:
        out = greedy(llm, [prompt], 8)[0]
        assert out.num_cached_tokens == 0  # a new engine: nothing from the failed one
        assert_same_up_to_near_tie(out, cold, prompt, 8)
        settle_and_audit(llm)


def _from_host(llm: Any) -> int:
    """Host -> device batches rank 0 issued: restores at admission and prefetches for a waiting
    request (which one serves a prompt depends on when the device frees up)."""
    issued = llm.collective_rpc(issued_copies)[0]
    return int(issued["host_restore"] + issued["prefetch"])


def _land_writes(llm: Any) -> None:
    """Short steps until every write batch was issued, landed and reported."""
    pipeline = cache_of(llm).pipeline
    deadline = time.monotonic() + 300
    while pipeline.writes_in_flight() and time.monotonic() < deadline:
        _steps(llm, 1)
    assert not pipeline.writes_in_flight()


def _steps(llm: Any, count: int) -> None:
    """Engine steps that write nothing (prompts shorter than a block): earlier batches land."""
    for seed in range(count):
        greedy(llm, [random_prompt(seed=900 + seed, length=30)], 1)


def test_a_slow_write_issue_holds_back_no_engine_step(
    cold: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`host_issue_slow`: every write-through batch's issue waits on the issuer's thread until
    the test opens the gate, as when the copies fill the driver's launch queue behind a long
    forward pass (#48). The engine thread hands the batches over and goes on stepping, as the
    worker's own step records show; once the gate opens they land, and the written prompt
    comes back from the host exactly."""
    monkeypatch.setattr(faults, "_ARMED", frozenset({"host_issue_slow"}))
    faults.ISSUE_GATE.clear()
    try:
        with small_pool_llm(RESUME_PATHS) as llm:
            _resume_beside_held_issues(llm, cold)
    finally:
        faults.ISSUE_GATE.clear()


def _resume_beside_held_issues(llm: Any, cold: Any) -> None:
    written = random_prompt(seed=70, length=1500)
    assert_same_up_to_near_tie(greedy(llm, [written], 8)[0], cold, written, 8)
    assert cache_of(llm).pipeline.writes_in_flight()  # held at the gate
    _steps(llm, 4)
    beside = llm.collective_rpc(steps_beside_write_issue)
    assert min(beside) >= 4, beside
    faults.ISSUE_GATE.set()
    _land_writes(llm)
    restored = _from_host(llm)
    for seed in range(72, 76):  # device pressure: the written prompt's device copies go
        greedy(llm, [random_prompt(seed=seed, length=1500)], 4)
    # Pages whose writes are in flight stay put, so a restore would not fit and the prompt
    # would be computed from the root (§6.3): let them land first.
    _land_writes(llm)
    out = greedy(llm, [written], 8)[0]
    assert _from_host(llm) > restored, llm.collective_rpc(issued_copies)
    assert out.num_cached_tokens > 0
    assert_same_up_to_near_tie(out, cold, written, 8)
    settle_and_audit(llm)


def test_slow_host_copies_in_flight_at_a_cancel_a_reset_and_under_pressure(
    cold: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`host_slow`: every write-through batch reports itself landed only after eight steps.
    Meanwhile its request ends, another is cancelled mid-prefill with its own writes in
    flight, later requests push the device, and a reset clears the cache under a batch that
    lands afterwards. The audit holds after each; the written prompt then comes back from the
    host exactly, and after the reset nothing is served from the cache."""
    monkeypatch.setattr(faults, "_ARMED", frozenset({"host_slow"}))
    with small_pool_llm(RESUME_PATHS) as llm:
        cache = cache_of(llm)
        written = random_prompt(seed=60, length=1500)
        first = greedy(llm, [written], 8)[0]
        assert_same_up_to_near_tie(first, cold, written, 8)
        assert cache.pipeline.writes_in_flight()
        cancel_after_steps(llm, random_prompt(seed=61, length=1500), steps=2, max_tokens=8)
        cache.audit()
        for seed in range(62, 66):  # device pressure while the writes are still in flight
            greedy(llm, [random_prompt(seed=seed, length=1500)], 4)
            cache.audit()
        _steps(llm, 10)
        assert not cache.pipeline.writes_in_flight()
        out = greedy(llm, [written], 8)[0]
        assert out.num_cached_tokens == 1472  # the prompt's tail tap, restored from the host
        assert_same_up_to_near_tie(out, cold, written, 8)
        greedy(llm, [random_prompt(seed=67, length=1500)], 4)
        assert cache.pipeline.writes_in_flight()
        assert llm.reset_prefix_cache()
        cache.audit()
        _steps(llm, 10)  # the batch the reset dropped lands now
        cache.audit()
        again = greedy(llm, [written], 8)[0]
        assert again.num_cached_tokens == 0
        assert_same_up_to_near_tie(again, cold, written, 8)
        settle_and_audit(llm)
