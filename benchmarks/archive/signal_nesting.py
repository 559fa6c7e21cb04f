"""Why an engine core once never stopped (CI, stop 56): a stop signal's handler running nested
in another's, inside the `threading.Event.set` that wakes vLLM's busy loop.

Each trial forks a target process whose SIGINT and SIGUSR2 handler is shaped like vLLM's
engine-core one (some Python work, standing for its log line, then `Event.set` on an event a
thread waits on); it reports a nested handler by its exit status. The parent sends it SIGINT,
then SIGUSR2 a random 0-300 us later, as the group's SIGINT and the front end's
`ORDERLY_STOP` arrive, and counts the target as hung when it has not exited 0.5 s later (the
nested handler's `Event.set` waiting for the lock its own thread holds); it is then killed.
With ``--first-only`` the handlers go through the guard of
`glue/stop_signals.stop_on_the_first_signal`.

    .venv/bin/python benchmarks/archive/signal_nesting.py [--trials N] [--first-only]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import threading
import time
from typing import Any

from vllm_hpc.glue.stop_signals import ORDERLY_STOP, stop_on_the_first_signal

NESTED = 3
"""The target's exit status when a handler ran inside another."""


def target(first_only: bool, ready: int) -> None:
    """The signalled process: installs the handlers, says so on ``ready``, runs 20 ms."""
    wakeup = threading.Event()
    threading.Thread(target=wakeup.wait, daemon=True).start()
    depth = nested = 0

    def vllms(signum: int, frame: Any) -> None:
        nonlocal depth, nested
        depth += 1
        nested = max(nested, depth - 1)
        busy = 0
        for i in range(3000):  # the handler's log line
            busy += i
        wakeup.set()
        depth -= 1

    for signum in (signal.SIGTERM, signal.SIGINT, ORDERLY_STOP):
        signal.signal(signum, vllms)
    if first_only:
        stop_on_the_first_signal(lambda: False)
    os.write(ready, b"r")
    start = time.perf_counter()
    while time.perf_counter() - start < 0.02:
        pass
    os._exit(NESTED if nested else 0)


def trial(first_only: bool) -> tuple[bool, bool]:
    """One pair of signals: (whether a handler ran nested, whether the target hung)."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        target(first_only, write)
    os.close(write)
    os.read(read, 1)
    os.close(read)
    os.kill(child, signal.SIGINT)
    delay, start = random.random() * 3e-4, time.perf_counter()
    while time.perf_counter() - start < delay:
        pass
    os.kill(child, ORDERLY_STOP)
    deadline = time.perf_counter() + 0.5
    while time.perf_counter() < deadline:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            return os.waitstatus_to_exitcode(status) == NESTED, False
        time.sleep(0.005)
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    return True, True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=500)
    parser.add_argument("--first-only", action="store_true")
    args = parser.parse_args()
    results = [trial(args.first_only) for _ in range(args.trials)]
    nested = sum(n for n, _ in results)
    hung = sum(h for _, h in results)
    guard = "first signal only" if args.first_only else "every signal"
    print(f"{guard}: {nested} nested, {hung} hung of {args.trials} trials")


if __name__ == "__main__":
    main()
