"""What the scheduler glue tells the runtime of the steps still in flight when a request ends
under async scheduling (`glue/scheduler/kv_manager.in_flight_steps`): from the tokens each step
it saw scheduled and not yet reported holds for the request."""

from __future__ import annotations

from vllm_hpc.glue.scheduler.kv_manager import in_flight_steps
from vllm_hpc.runtime.cache import InFlight


def test_no_step_in_flight() -> None:
    assert in_flight_steps(797, []) is None


def test_one_step_in_flight_begins_where_its_tokens_end() -> None:
    # A step of one token and two drafts, scheduled before the output that ended the request:
    # vLLM has moved num_computed_tokens past its three tokens.
    assert in_flight_steps(743, [3]) == InFlight(steps=1, first_position=740)


def test_two_steps_in_flight() -> None:
    assert in_flight_steps(502, [1, 1]) == InFlight(steps=2, first_position=500)
