"""`glue/stop_signals.py` without vLLM: an engine core that outlives the stop's grace is asked
for its threads' stacks, and it and the processes below it write them even while their main
threads wait outside Python; an engine core's stop is taken from the first stop signal alone."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil

from vllm_hpc.glue.stop_signals import (
    ORDERLY_STOP,
    STOP_SIGNALS,
    send_stack_dump,
    stop_on_the_first_signal,
)

WAITER = """
import subprocess, sys, threading
from vllm_hpc.glue.stop_signals import dump_stacks_on_request

def {name}():
    lock = threading.Lock()
    lock.acquire()
    print("ready", flush=True)
    lock.acquire()  # blocks for good: only a signal's C handler still runs

dump_stacks_on_request()
if {spawn}:
    below = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE)
    assert below.stdout.readline() == b"ready\\n"
{name}()
"""


def test_a_stuck_process_and_the_one_below_it_write_their_stacks() -> None:
    below = WAITER.format(name="below_waits", spawn=False)
    top = WAITER.format(name="top_waits", spawn=True)
    process = subprocess.Popen(
        [sys.executable, "-c", top, below],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        send_stack_dump(process.pid)
        time.sleep(1.0)
    finally:
        for each in psutil.Process(process.pid).children(recursive=True):
            each.kill()
        process.kill()
        _, stderr = process.communicate(timeout=30)
    assert "top_waits" in stderr and "below_waits" in stderr, stderr
    assert stderr.count("(most recent call first)") >= 2, stderr


@contextmanager
def handlers_kept() -> Iterator[None]:
    """The stop signals' handlers as they were, whatever the test installs."""
    signals = (*STOP_SIGNALS, ORDERLY_STOP)
    previous = {signum: signal.getsignal(signum) for signum in signals}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_only_the_first_stop_signal_reaches_vllms_handler_even_one_nested_in_it() -> None:
    """vLLM's engine-core handler is not reentrant (its wakeup's `threading.Event.set` holds a
    lock): the front end's `ORDERLY_STOP` and another SIGINT, arriving while it runs for the
    group's SIGINT, and a SIGTERM after it, do not reach it."""
    calls: list[int] = []

    def vllms(signum: int, frame: Any) -> None:
        calls.append(signum)
        if len(calls) == 1:  # signals arriving while it runs: their handlers run nested
            signal.raise_signal(ORDERLY_STOP)
            signal.raise_signal(signal.SIGINT)

    with handlers_kept():
        signal.signal(signal.SIGTERM, vllms)
        signal.signal(signal.SIGINT, vllms)
        stop_on_the_first_signal(lambda: False)
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)
    assert calls == [signal.SIGINT]


def test_no_stop_signal_reaches_vllms_handler_once_the_flush_has_begun() -> None:
    calls: list[int] = []
    with handlers_kept():
        signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
        stop_on_the_first_signal(lambda: True)
        signal.raise_signal(ORDERLY_STOP)
        signal.raise_signal(signal.SIGTERM)
    assert calls == []
