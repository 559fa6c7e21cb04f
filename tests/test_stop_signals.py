"""`glue/stop_signals.py` without vLLM: an engine core that outlives the stop's grace is asked
for its threads' stacks, and it and the processes below it write them even while their main
threads wait outside Python."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from vllm_hpc.glue.stop_signals import send_stack_dump

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
