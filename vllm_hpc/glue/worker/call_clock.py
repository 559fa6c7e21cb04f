"""Wall time of the host tier's calls on the engine's thread.

A worker of a single-GPU engine runs on the engine core's one thread, and so do its connector
calls. A call that blocks the CPU there (a copy stream whose launch queue is full, a
synchronizing CUDA call, an allocation) stops every running request's next token for as long.
The copies themselves are asynchronous and timed on their streams (`TransferMeter`); this clock
times the calls that issue and check them, so that such a pause shows in the metrics and in the
log, with the call that made it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("vllm.vllm_hpc")

SLOW_CALL_SECONDS = 0.05
"""A call this long is logged: a decode step of a large model takes about this much."""


class HostCallClock:
    """Totals and the longest call since the last read; slow calls are logged as they end."""

    def __init__(
        self, slow_seconds: float = SLOW_CALL_SECONDS, thread: str = "the engine thread"
    ) -> None:
        self.slow_seconds = slow_seconds
        self.thread = thread
        """Where the timed calls run, for the log."""
        self.seconds = 0.0
        """Every timed call's wall seconds since the last read."""
        self.longest = 0.0
        """The longest timed call since the last read."""
        self.slow_calls = 0
        """Calls of at least ``slow_seconds``, ever (tests and benchmarks read it)."""

    @contextmanager
    def timed(self, call: str, what: str = "") -> Iterator[None]:
        """Time the enclosed host-tier call; ``what`` says what it moved, for the log."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.record(call, time.perf_counter() - started, what)

    def record(self, call: str, seconds: float, what: str = "") -> None:
        self.seconds += seconds
        self.longest = max(self.longest, seconds)
        if seconds >= self.slow_seconds:
            self.slow_calls += 1
            logger.warning(
                "hybrid-prefix: %s spent %.0f ms in the host tier's %s%s",
                self.thread,
                seconds * 1000,
                call,
                f" ({what})" if what else "",
            )

    def read(self) -> dict[str, float]:
        """The stats since the last read (empty when nothing was timed), and a new period."""
        if not self.seconds:
            return {}
        data = {
            "engine_thread_host_seconds": self.seconds,
            "engine_thread_host_longest_seconds": self.longest,
        }
        self.seconds = self.longest = 0.0
        return data
