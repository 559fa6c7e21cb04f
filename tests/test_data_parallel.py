"""Data parallelism with hybrid-prefix: `vllm serve --data-parallel-size 2` runs two engine
cores, each with its own cache (and its own `--prefix-cache-file`, `vllm_hpc.derived`), its own
series of the plugin's metrics (vLLM's ``engine`` label), and nothing shared by accident. Two
sessions, each pinned to one engine core by vLLM's ``X-data-parallel-rank`` header, hit their
own core's cache; the same next turn sent to the other core finds nothing there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_support import random_prompt
from server_support import greedy_body, metrics, model_id, post, running_server, sample

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.device_count() < 2,
        reason="needs two GPUs, one per engine core",
    ),
    pytest.mark.skipif(
        not torch.cuda.is_available() and len(os.sched_getaffinity(0)) < 2,
        reason="needs two CPU cores, one per engine core",
    ),
]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("dp2") / "server.log"
    first, second = sorted(os.sched_getaffinity(0))[:2]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{first}|{second}")
        extra = ("--data-parallel-size", "2", "--gpu-memory-utilization", "0.08")
        with running_server(tiny_model_dir, log, *extra) as (base, _):
            yield base


def _cached(
    server: str, prompt: list[int], rank: int, max_tokens: int = 16
) -> tuple[int, list[int]]:
    """The cached tokens of one greedy completion on engine core ``rank``, and its answer."""
    status, body = post(
        server,
        greedy_body(model_id(server), prompt, max_tokens),
        headers={"X-data-parallel-rank": str(rank)},
    )
    assert status == 200, body
    usage = body["usage"]["prompt_tokens_details"] or {}
    return usage.get("cached_tokens") or 0, body["choices"][0]["token_ids"]


def test_each_session_hits_its_own_engine_cores_cache(server: str) -> None:
    turns = {}
    for rank in (0, 1):
        prompt = random_prompt(seed=700 + rank, length=1200)
        cached, answer = _cached(server, prompt, rank, max_tokens=80)
        assert cached == 0
        turns[rank] = prompt + answer + random_prompt(seed=710 + rank, length=60)
    for rank in (0, 1):  # the next turn resumes from the first turn's endpoint, on its own core
        assert _cached(server, turns[rank], rank)[0] == 1200 + 80 - 1
    # Sent to the other core, the same next turn finds nothing there.
    assert _cached(server, turns[0] + [7, 8], rank=1)[0] == 0
    text = metrics(server)
    for engine in ("0", "1"):
        assert sample(text, "vllm:hpc_hit_tokens_total{", f'engine="{engine}"') > 0
