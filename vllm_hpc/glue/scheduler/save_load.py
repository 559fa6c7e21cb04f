"""The scheduler's half of the prefix cache file (§5.5): what is saved and loaded, and the log.

The index lives here, in the engine core; the slab bytes live in the workers' host tiers. So a
load opens the file and checks it here (header, fingerprint, tables, checksum lists: no slab
bytes), rebuilds the entries host-only in the index, then has each worker read its own slab
bytes into the slabs the index gave them (`glue/worker/slab_io.py`). A whole save goes
into the slabs of its file order, which each worker started reading while the engine was
still starting (`glue/worker/preload.py`): then the load only waits for that read to end.
A save lets the pending copies run and every host write land, exports the tables, and has the
worker write the file with its slab bytes. Both reach the workers through the engine core's
`collective_rpc` (`glue/scheduler/engine_core.py` calls in at start-up and at shutdown).

With tensor parallelism each rank's worker holds its own bytes of every slab: the engine core
lays out one temporary file with a section per rank, each worker writes its section into it,
and the engine core renames it once every rank is done (so the ranks share one filesystem, as
the workers of one host do); each worker reads its own section at the next start.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm_hpc.glue.stop_signals import stop_signals_caught
from vllm_hpc.glue.worker.slab_io import (
    SlabTransfer,
    copy_failure,
    end_preload,
    land_host_writes,
    load_slabs,
    save_over,
    save_slabs,
)
from vllm_hpc.persistence import (
    abandon,
    begin_cache_file,
    commit,
    open_cache_file,
    remove_temporaries,
)
from vllm_hpc.runtime.cache import HybridPrefixCache

logger = logging.getLogger("vllm.vllm_hpc")

Rpc = Callable[..., list[Any]]
"""``rpc(function, *args)``: run ``function(worker, *args)`` on every worker, one result each."""
SETTLE_STEPS = 8
"""Empty steps a save runs at most for the pending copies to run and the host writes to land:
one issues what the last step planned, the next collects the landings."""


class PrefixCacheFile:
    """One engine's ``--prefix-cache-file``: loaded once at start-up, saved once at the stop."""

    def __init__(
        self, path: str, fingerprint: dict[str, Any], cache: HybridPrefixCache, ranks: int
    ) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.cache = cache
        self.ranks = ranks
        """Tensor-parallel ranks: one slab section each."""

    def restore(self, rpc: Rpc) -> None:
        """Load the file into the empty cache, or log why not and start empty. The workers'
        start-up reads end either way before the first request."""
        try:
            self._restore(rpc)
        finally:
            rpc(end_preload)

    def _restore(self, rpc: Rpc) -> None:
        for stale in remove_temporaries(self.path):
            logger.warning("prefix cache file: removed %s, left by a save that was killed", stale)
        started = time.perf_counter()
        opened = open_cache_file(self.path, self.fingerprint)
        if isinstance(opened, str):
            logger.info("prefix cache not restored: %s", opened)
            return
        try:
            loaded = self.cache.index.load_saved(opened.saved)
        except ValueError as error:
            logger.warning("prefix cache not restored: %s", error)
            return
        results = rpc(load_slabs, opened, loaded.slabs)
        refused = _refusal(results)
        if refused is not None:
            self.cache.reset()
            logger.warning("prefix cache not restored: %s", refused)
            return
        seconds = time.perf_counter() - started
        counters = self.cache.file
        counters.file_restored_snapshots += loaded.snapshots
        counters.file_restored_blocks += loaded.blocks
        counters.file_restored_bytes += loaded.bytes
        counters.file_load_milliseconds += round(seconds * 1000)
        read = _read_during_start_up(results)
        if read is None:
            timing = f"in {seconds:.2f} s ({_mib_per_s(loaded.bytes, seconds)})"
        else:
            counters.file_read_during_startup_milliseconds += round(read * 1000)
            timing = (
                f"read while the engine started in {read:.2f} s "
                f"({_mib_per_s(loaded.bytes, read)}), {seconds:.2f} s added to start-up"
            )
        logger.info(
            "prefix cache restored from %s: %d of %d snapshots, %d of %d blocks, %.1f MiB %s%s",
            self.path,
            loaded.snapshots,
            loaded.saved_snapshots,
            loaded.blocks,
            loaded.saved_blocks,
            loaded.bytes / 2**20,
            timing,
            "" if loaded.complete else " (the host tier is smaller than the save: kept by value)",
        )

    def save(self, rpc: Rpc, idle_step: Callable[[], None], failure: str | None) -> None:
        """Let the pending copies and host writes finish, then write the file. An engine that
        stopped on an error (``failure``) or a worker that stopped on a copy error saves
        nothing and keeps the previous file. Either way the workers then stop on their next
        stop signal again (`glue/stop_signals.py`)."""
        try:
            failure = failure or next((f for f in rpc(copy_failure) if f is not None), None)
            if failure is not None:
                logger.warning("prefix cache not saved (%s): the previous file stays", failure)
                return
            with stop_signals_caught(_forward_to_workers) as abandoned:
                self._save(rpc, idle_step, abandoned)
        finally:
            with contextlib.suppress(Exception):  # a failed executor: its workers are gone
                rpc(save_over)

    def _save(self, rpc: Rpc, idle_step: Callable[[], None], abandoned: threading.Event) -> None:
        started = time.perf_counter()
        for _ in range(SETTLE_STEPS):
            if self.cache.settled or abandoned.is_set():
                break
            rpc(land_host_writes)
            idle_step()
        if abandoned.is_set():
            logger.warning("prefix cache not saved: a second stop signal; the previous file stays")
            return
        if not self.cache.settled:
            logger.warning(
                "prefix cache file: copies still pending after %d steps; what they carry is "
                "not saved",
                SETTLE_STEPS,
            )
        saved, flush = self.cache.plan_save()
        logger.info(
            "prefix cache file: saving %d snapshots (%d of them from device slots), %d blocks "
            "(%.1f MiB of slabs) to %s",
            len(saved.snapshots),
            0 if flush is None else len(flush.images),
            len(saved.blocks),
            len(saved.slabs) * saved.geometry.slab_bytes / 2**20,
            self.path,
        )
        try:
            pending = begin_cache_file(self.path, self.fingerprint, saved, range(self.ranks))
        except OSError as error:
            logger.warning("prefix cache not saved: cannot write %s: %s", self.path, error)
            return
        try:
            results = rpc(save_slabs, pending, flush)
            refused = _refusal(results)
            if refused is None and abandoned.is_set():
                refused = "abandoned on a second stop signal"
            if refused is not None:
                abandon(pending)
                logger.warning("prefix cache not saved: %s; the previous file stays", refused)
                return
            size = commit(pending)
        except BaseException:
            abandon(pending)
            raise
        seconds = time.perf_counter() - started
        logger.info(
            "prefix cache saved to %s: %d snapshots, %d blocks, %.1f MiB in %.2f s (%.0f MiB/s)",
            self.path,
            len(saved.snapshots),
            len(saved.blocks),
            size / 2**20,
            seconds,
            size / 2**20 / max(seconds, 1e-9),
        )


def _forward_to_workers(signum: int) -> None:
    """A second stop signal reached the engine core, which waits for the workers: pass it on to
    the worker processes, whose save then abandons (in process, the worker takes it itself)."""
    logger.warning("prefix cache file: %s during the save", signal.Signals(signum).name)
    for child in multiprocessing.active_children():
        if child.pid is not None:
            os.kill(child.pid, signum)


def _mib_per_s(nbytes: int, seconds: float) -> str:
    return f"{nbytes / 2**20 / max(seconds, 1e-9):.0f} MiB/s"


def _read_during_start_up(results: list[SlabTransfer]) -> float | None:
    """The slowest worker's read during start-up, when every worker's load used its own."""
    reads = [r.read_during_start_up for r in results]
    if not reads or any(read is None for read in reads):
        return None
    return max(read for read in reads if read is not None)


def _refusal(results: list[SlabTransfer]) -> str | None:
    return next((r.refused for r in results if r.refused is not None), None)
