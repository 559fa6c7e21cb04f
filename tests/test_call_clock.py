"""`HostCallClock`: what the worker reports of its host-tier calls on the engine thread."""

from __future__ import annotations

import logging

import pytest

from vllm_hpc.glue.worker.call_clock import HostCallClock


def test_a_period_reports_its_total_and_longest_call_then_starts_again() -> None:
    clock = HostCallClock(slow_seconds=1.0)
    assert clock.read() == {}
    clock.record("write issue", 0.25)
    clock.record("write check", 0.5)
    assert clock.read() == {
        "engine_thread_host_seconds": 0.75,
        "engine_thread_host_longest_seconds": 0.5,
    }
    assert clock.read() == {}
    clock.record("restore issue", 0.125)
    assert clock.read()["engine_thread_host_longest_seconds"] == 0.125
    assert clock.slow_calls == 0


def test_a_slow_call_is_logged_with_what_it_moved(caplog: pytest.LogCaptureFixture) -> None:
    clock = HostCallClock(slow_seconds=0.0)
    logger = logging.getLogger("vllm.vllm_hpc")  # vLLM's logger does not propagate to the root
    logger.addHandler(caplog.handler)
    try:
        with clock.timed("write issue", "3 blocks, 1 images"):
            pass
    finally:
        logger.removeHandler(caplog.handler)
    assert clock.slow_calls == 1
    assert "host tier's write issue (3 blocks, 1 images)" in caplog.text


def test_a_call_that_raises_is_still_timed() -> None:
    clock = HostCallClock()
    with pytest.raises(RuntimeError), clock.timed("restore issue"):
        raise RuntimeError("copy failed")
    assert clock.read()["engine_thread_host_seconds"] > 0
