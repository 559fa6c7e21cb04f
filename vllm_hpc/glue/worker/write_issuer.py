"""The host tier's write-through batches, issued from a thread of their own (#48).

A write batch is thousands of small device -> host copies queued behind the compute stream's
position at the step's bind, which under async scheduling is the previous step's forward pass
(over a second for a large prefill). When a batch's copies outnumber what the driver's launch
queue holds, the call that issues them blocks the CPU until the GPU has worked through enough
of that queue. On the engine thread that would stop every running request's next token for as
long (the suspected cause of #48's pauses, not yet confirmed on a GPU). Here only this thread
waits: the engine thread prepares the batch (its ranges and counters), hands it over and polls
the handle, which is done once the batch was issued and has landed. One thread keeps the
batches in order on the one write-through stream. Without CUDA the copies are synchronous
memmoves that cannot block for long, and are issued inline unless the `host_issue_slow` fault
makes them block (the CPU test of the thread).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vllm_hpc.faults import ISSUE_GATE, SLOW_ISSUE_SECONDS, armed
from vllm_hpc.glue.worker.call_clock import HostCallClock
from vllm_hpc.glue.worker.copy_ranges import CopyRanges
from vllm_hpc.glue.worker.host_arena import CopyTiming, HostArena, TransferHandle


class PendingWrite:
    """A write batch handed to the `WriteIssuer`; duck-types `TransferHandle` for the meter."""

    def __init__(self, nbytes: int, issued: Future[TransferHandle]) -> None:
        self.nbytes = nbytes
        self._issued = issued

    def issued(self) -> bool:
        """Whether the issuer thread has finished issuing it (never blocks)."""
        return self._issued.done()

    def done(self) -> bool:
        """Issued and landed (never blocks). An error of the issue is raised here, on the
        caller's thread."""
        return self._issued.done() and self._issued.result().done()

    @property
    def timing(self) -> CopyTiming:
        """The copies' timing events (only once `done`)."""
        return self._issued.result().timing

    def synchronize(self) -> None:
        """Block until the batch has been issued and has landed (shutdown, tests)."""
        self._issued.result().synchronize()


class WriteIssuer:
    """One thread that issues an arena's write batches in the order they are submitted."""

    def __init__(self, arena: HostArena) -> None:
        self._arena = arena
        device = arena.layout.device
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="hybrid-prefix-writes",
            initializer=_use_device,
            initargs=(device,),
        )
        self.clock = HostCallClock(thread="the write issuer thread")
        """Each issue's wall time on that thread; a long one is logged (the engine thread
        went on meanwhile)."""

    def submit(self, ranges: CopyRanges, after: torch.cuda.Event | None, what: str) -> PendingWrite:
        """Queue a batch prepared by `HostArena.prepare_write`; ``what`` names it in the log.
        Where issuing cannot block (CPU memmoves, no fault) it is done here: the batch has
        landed when this returns, so its landing is reported in the same step."""
        if not _issue_can_block(self._arena.layout.device):
            issued: Future[TransferHandle] = Future()
            issued.set_result(self._arena.issue_write(ranges, after))
            return PendingWrite(ranges.total_bytes, issued)
        return PendingWrite(ranges.total_bytes, self._pool.submit(self._issue, ranges, after, what))

    def _issue(
        self, ranges: CopyRanges, after: torch.cuda.Event | None, what: str
    ) -> TransferHandle:
        with self.clock.timed("write issue", f"{what}, {len(ranges)} copies"):
            if armed("host_issue_slow"):
                ISSUE_GATE.wait(SLOW_ISSUE_SECONDS)
            return self._arena.issue_write(ranges, after)


def _issue_can_block(device: torch.device) -> bool:
    """CUDA issues block once the launch queue is full; `host_issue_slow` makes any issue
    block, so the thread is exercised on CPU too."""
    return device.type == "cuda" or armed("host_issue_slow")


def _use_device(device: torch.device) -> None:
    """The issuer thread's current CUDA device is its arena's (a new thread starts on 0)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
