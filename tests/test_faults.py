"""Injected faults on the real engine (`vllm_hpc.faults`; in-process engines, so the worker sees
the armed points): a host tier that cannot be allocated, and host copies and device state copies
that fail in a worker.
vLLM makes a worker's error engine-wide: the engine must stop with one message that says what
failed, and an engine started afterwards must serve from a clean cache."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from engine_support import (
    SMALL_POOL_PAGES,
    assert_same_up_to_near_tie,
    cold_reference,
    greedy,
    random_prompt,
    running_llm,
    settle_and_audit,
)

from vllm_hpc import faults

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
