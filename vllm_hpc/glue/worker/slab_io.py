"""The workers' half of the prefix cache file (§5.5): this worker's slab bytes to and from it.

The engine core runs these functions on every worker through its executor's `collective_rpc`
(`glue/scheduler/save_load.py` decides what to save and load), so the slab bytes never
leave the process whose host tier holds them: only the tables (a few bytes per entry) cross.
Each worker writes and reads the section of its own tensor-parallel rank.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from vllm_hpc.faults import SLOW_SAVE_SECONDS, armed
from vllm_hpc.glue.stop_signals import end_stop_deferral, stop_signals_caught
from vllm_hpc.glue.worker.connector_worker import ConnectorWorker, worker_connector
from vllm_hpc.glue.worker.host_arena import HostArena
from vllm_hpc.glue.worker.preload import progress_log, slab_target, tensor_parallel_rank
from vllm_hpc.index import SlabId
from vllm_hpc.persistence import CacheFile, PendingFile, write_section
from vllm_hpc.runtime.plan import HostWrite

logger = logging.getLogger("vllm.vllm_hpc")


@dataclass(frozen=True, slots=True)
class SlabTransfer:
    """What one worker moved between its host tier and the file, or why it did not."""

    nbytes: int = 0
    """Slab bytes this rank wrote (a save) or read (a load)."""
    seconds: float = 0.0
    refused: str | None = None
    """Why nothing (or not everything) moved; None when it all did."""
    read_during_start_up: float | None = None
    """A load whose bytes the worker read while the engine started: that read's seconds
    (``seconds`` is then only the wait for its end)."""


def copy_failure(worker: Any) -> str | None:
    """The copy error this worker stopped on, if any: then its host tier is not saved (what a
    failed copy left in the slabs and the index is not known to agree)."""
    failed = worker_connector().failed
    return None if failed is None else str(failed)


def land_host_writes(worker: Any) -> None:
    """Block until this worker's write-through batches have landed (an orderly stop)."""
    worker_connector().land_writes()


def save_slabs(worker: Any, pending: PendingFile, flush: HostWrite | None = None) -> SlabTransfer:
    """Write this rank's bytes of the save's slabs into its section of ``pending`` (the engine
    core laid the file out and renames it once every rank is done), after ``flush`` has
    copied the device-only snapshots it saves into their host slabs.

    A SIGTERM or SIGINT during the save (the engine core forwards its own) abandons it: the
    engine core then removes the temporary file, and the previous file stays.
    """
    connector = worker_connector()
    arena = _arena(connector)
    connector.land_writes()
    started = time.perf_counter()
    if flush is not None:
        try:
            arena.write(flush.blocks, flush.images).synchronize()
        except Exception as error:  # the previous file stays
            return SlabTransfer(refused=f"cannot copy device-only snapshots to the host: {error}")
    try:
        with stop_signals_caught(_abandoning) as abandoned:
            written = write_section(
                pending,
                tensor_parallel_rank(),
                partial(_slab_bytes, arena, armed("save_slow")),
                progress=progress_log("saving", started),
                cancel=abandoned.is_set,
            )
    except OSError as error:  # a full disk, a file-size limit
        return SlabTransfer(refused=f"cannot write {pending.target}: {error}")
    seconds = time.perf_counter() - started
    if not written:
        return SlabTransfer(seconds=seconds, refused="abandoned on a second stop signal")
    return SlabTransfer(len(pending.slabs) * pending.slab_bytes, seconds)


def load_slabs(worker: Any, cache_file: CacheFile, slabs: Mapping[SlabId, SlabId]) -> SlabTransfer:
    """Copy each saved slab this rank's section holds into the host slab ``slabs`` maps it to,
    checking each against its checksum, unless the start-up read already did exactly that; on
    a refusal some slabs may have been written (the caller empties the index, so they count
    as free)."""
    connector = worker_connector()
    arena = _arena(connector)
    started = time.perf_counter()
    nbytes = len(slabs) * cache_file.saved.geometry.slab_bytes
    preload = connector.take_preload()
    if preload is not None:
        read, waited = preload.finish()
        if read.covers(cache_file, slabs):
            return SlabTransfer(nbytes, waited, read_during_start_up=read.seconds)
    refused = cache_file.read_slabs(
        tensor_parallel_rank(), slabs, slab_target(arena, slabs), progress_log("restoring", started)
    )
    seconds = time.perf_counter() - started
    return SlabTransfer(0 if refused else nbytes, seconds, refused)


def save_over(worker: Any) -> None:
    """The engine core's save is over: this worker's first stop signal stops it again."""
    end_stop_deferral()


def end_preload(worker: Any) -> None:
    """Stop the start-up read if no load took it (the engine core refused the file): the
    slabs it filled are free, and nothing may write into them after this."""
    preload = worker_connector().take_preload()
    if preload is not None:
        preload.cancel()


def _slab_bytes(arena: HostArena, slow: bool, slab: SlabId) -> bytes:
    if slow:  # fault point `save_slow`
        time.sleep(SLOW_SAVE_SECONDS)
    return arena.slab(slab).numpy().tobytes()


def _arena(connector: ConnectorWorker) -> HostArena:
    arena = connector.arena
    assert arena is not None, "--prefix-cache-file is refused without a host tier"
    return arena


def _abandoning(signum: int) -> None:
    logger.warning(
        "prefix cache file: %s during the save: abandoning it, the previous file stays",
        signal.Signals(signum).name,
    )
