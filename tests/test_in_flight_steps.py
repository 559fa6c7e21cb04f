"""What the scheduler glue tells the runtime of the decode steps still in flight when a request
ends under async scheduling (`glue/scheduler/kv_manager.in_flight_steps`), from the counts
vLLM 0.32's async scheduler keeps on the request. A plain record stands in for vLLM's
`Request`: the function reads two of its integers."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_hpc.glue.scheduler.kv_manager import in_flight_steps
from vllm_hpc.runtime.cache import InFlight


def test_no_placeholder_means_no_step_in_flight() -> None:
    request = SimpleNamespace(num_output_placeholders=0, num_computed_tokens=500)
    assert in_flight_steps(request, 3) is None


def test_one_step_in_flight_begins_at_the_last_known_token() -> None:
    # Step N+1 (one token and two drafts) was scheduled before step N's output: vLLM moved
    # num_computed_tokens past its three tokens and counts them as placeholders.
    request = SimpleNamespace(num_output_placeholders=3, num_computed_tokens=503)
    assert in_flight_steps(request, 3) == InFlight(steps=1, first_position=500)


def test_more_placeholders_than_the_newest_step_mean_two_steps() -> None:
    request = SimpleNamespace(num_output_placeholders=2, num_computed_tokens=502)
    assert in_flight_steps(request, 1) == InFlight(steps=2, first_position=500)
