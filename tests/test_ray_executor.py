"""vLLM's Ray executor (`--distributed-executor-backend ray`) with hybrid-prefix: the same KV
connector runs in Ray's workers, so a small-pool engine resumes from a tap, an endpoint and a
host restore with a cold run's tokens. Starts and stops a local Ray instance of its own.

CUDA only: vLLM 0.32.0's CPU platform has no Ray support (its `ray_device_key` is empty, and the
Ray executor cannot ask Ray for CPU workers), so on these CPU machines it skips. The lent GPU's
image has no Ray: `scripts/gpu_ray_parcel.sh` (vLLM 0.32) and `scripts/stage_vllm034.sh`'s extras
(vLLM 0.34, whose `RayExecutorV2` runs the workers in Ray actors around the multiprocessing
executor's message queues) carry it there; without it the module skips."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_support import (
    NO_RAY,
    RESUME_PATHS,
    cold_reference,
    ray_missing,
    resume_from_a_tap_an_endpoint_and_the_host,
    small_pool_llm,
)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM 0.32.0 runs Ray on GPUs only"),
    pytest.mark.skipif(ray_missing(), reason=NO_RAY),
]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    import ray

    ray.init(num_gpus=1, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Any) -> Iterator[Any]:
    with cold_reference(max_model_len=2048) as llm:
        yield llm


@pytest.fixture(scope="module")
def on_ray(local_ray: None, tiny_model_dir: Any) -> Iterator[Any]:
    with small_pool_llm(RESUME_PATHS, distributed_executor_backend="ray") as llm:
        yield llm


def test_ray_workers_serve_the_resume_paths(on_ray: Any, cold: Any) -> None:
    resume_from_a_tap_an_endpoint_and_the_host(on_ray, cold, seed=520)
