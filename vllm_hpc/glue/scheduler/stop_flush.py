"""The stop's save with a disk tier (§5.5): write the queue behind, then sync the journal.

The disk tier writes behind the host tier all the time, so at an orderly stop only its queue
is left: the snapshots on the host, and the blocks of their paths, that are not on disk yet.
Snapshots only the device holds (an endpoint the host tier declined, or whose host image
pressure evicted) would go with the device: they are first written through to the host, most
valuable first, as their publication would have been (`PrefixIndex.write_through_at_stop`),
and so join the queue. The engine core runs empty steps, as vLLM does after requests finish,
while the workers copy them (`glue/worker/disk_tier.py`) and each step journals what every
rank made durable (`DiskTier.step`), until the cache is settled before and after a step (a
step plans its writes behind before the host writes it lands). Then the journal is durable
and holds everything a restart finds.

The stop's grace bounds the wait (`derived.save_grace_seconds`, the time the front end gives
the engine core, `glue/frontend/save_grace.py`), and so does a second stop signal (the user's
"stop now"): what is not journaled then is lost, and everything journaled before stays. A
write that fails ends the wait too. An engine core that stopped on an error, or a worker that
stopped on a copy error, writes nothing more: the journal stays as the last step left it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm_hpc.glue.scheduler.disk_tier import DiskTier
from vllm_hpc.glue.stop_signals import stop_signals_caught
from vllm_hpc.glue.worker.stop_rpc import copy_failure, land_host_writes, stop_over

logger = logging.getLogger("vllm.vllm_hpc")

Rpc = Callable[..., list[Any]]
"""``rpc(function, *args)``: run ``function(worker, *args)`` on every worker, one result each."""
POLL_SECONDS = 0.005
"""The pause between empty steps while the workers' writes run on their threads."""


def flush_at_stop(
    disk: DiskTier,
    rpc: Rpc,
    idle_step: Callable[[], None],
    failure: str | None,
    grace_seconds: float,
) -> None:
    """Write the disk tier's queue behind and sync its journal, within ``grace_seconds``. An
    engine that stopped on an error (``failure``) or a worker that stopped on a copy error
    writes nothing more. Either way the workers then stop on their next stop signal again
    (`glue/stop_signals.py`)."""
    try:
        failure = failure or next((f for f in rpc(copy_failure) if f is not None), None)
        if failure is not None:
            logger.warning(
                "prefix cache: nothing more written to disk (%s); the journal keeps what it held",
                failure,
            )
            return
        with stop_signals_caught(_second_signal) as abandoned:
            _flush(disk, rpc, idle_step, abandoned, time.monotonic() + grace_seconds)
    finally:
        with contextlib.suppress(Exception):  # a failed executor: its workers are gone
            rpc(stop_over)


def _flush(
    disk: DiskTier,
    rpc: Rpc,
    idle_step: Callable[[], None],
    abandoned: threading.Event,
    deadline: float,
) -> None:
    cache = disk.cache
    started = time.perf_counter()
    written = cache.disk.write_bytes
    failed = cache.index.stats.disk_writes_failed
    through = cache.write_through_at_stop()
    logger.info(
        "prefix cache: writing the disk tier's queue behind to %s (%d host writes of what only "
        "the device held)",
        disk.path.parent,
        through,
    )
    reported = started
    cut_short = None
    settled = False
    while True:
        if abandoned.is_set():
            cut_short = "a second stop signal"
            break
        try:
            rpc(land_host_writes)
            idle_step()
        except Exception as error:  # a worker stopped on the user's second signal
            cut_short = f"an error ({error})"
            break
        # Settled before and after one step: a host write that landed in the step before was
        # not yet writable when that step planned its writes behind.
        if settled and cache.settled:
            break
        settled = cache.settled
        if abandoned.is_set():
            cut_short = "a second stop signal"
        elif cache.index.stats.disk_writes_failed > failed:
            cut_short = "a write failed"
        elif time.monotonic() >= deadline:
            cut_short = "the stop's grace ran out"
        if cut_short is not None:
            break
        now = time.perf_counter()
        if now - reported >= 5.0:  # long work shows progress
            reported = now
            logger.info(
                "prefix cache: %.1f MiB written behind in %.1f s",
                (cache.disk.write_bytes - written) / 2**20,
                now - started,
            )
        time.sleep(POLL_SECONDS)
    try:
        disk.writer.flush_durable()  # each step did; an error there left entries pending
    except OSError as error:
        logger.warning("prefix cache: the journal's last entries are not durable: %s", error)
    nbytes = cache.disk.write_bytes - written
    seconds = time.perf_counter() - started
    logger.info(
        "prefix cache saved to %s: %d journaled entries, %.1f MiB written at the stop in %.2f s%s",
        disk.path.parent,
        disk.live_entries,
        nbytes / 2**20,
        seconds,
        "" if cut_short is None else f"; cut short by {cut_short}: what was not written is lost",
    )


def _second_signal(signum: int) -> None:
    """The user's "stop now": the writes stop after the step that runs (a slab half written is
    named by no journal entry, so losing it loses nothing else)."""
    logger.warning("prefix cache: %s during the stop's writes", signal.Signals(signum).name)
