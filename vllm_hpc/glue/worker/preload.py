"""Reading the prefix cache file into the host tier while the engine still starts (§5.5).

A long conversation's save is gigabytes, and reading it can take about as long as a cold
prefill of the conversation, so a read after start-up would take back what the file saves the
first request (`docs/results.md`, "Start-up" and "Persistence"). So each worker starts the read
as soon as its host tier is pinned (`ConnectorWorker.register_kv_caches`, before vLLM warms up
and captures its CUDA graphs), on a thread of its own (file reads and checksums release the
GIL), into the slabs of the save's file order (`file_placement`).

Nothing read here is used before the engine core has checked the same file as before
(fingerprint, geometry, tables): when it loads the whole save into that placement, a worker
only waits for its read to end; when it keeps a part (a smaller host tier), refuses the file,
or the file changed since, the read is cancelled or its bytes are overwritten, and the slabs it
filled count as free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_hpc.index import SlabId, file_placement
from vllm_hpc.persistence import CacheFile, SlabTarget, open_cache_file

if TYPE_CHECKING:
    from vllm_hpc.glue.worker.host_arena import HostArena

logger = logging.getLogger("vllm.vllm_hpc")


@dataclass(frozen=True, slots=True)
class PreloadResult:
    """What a worker's start-up read put where, or why it read nothing (or not all)."""

    refused: str | None
    identity: tuple[int, int, int, int] | None = None
    """`CacheFile.identity` of the file it read."""
    placement: dict[SlabId, SlabId] = field(default_factory=dict)
    nbytes: int = 0
    seconds: float = 0.0
    """The read's own time, from its start."""

    def covers(self, cache_file: CacheFile, slabs: Mapping[SlabId, SlabId]) -> bool:
        """Whether these are the bytes a load of ``cache_file`` into ``slabs`` needs."""
        return (
            self.refused is None
            and self.identity == cache_file.identity
            and self.placement == dict(slabs)
        )


class Preload:
    """One worker's read of the file into its host tier, on a thread."""

    def __init__(self, path: str, arena: HostArena, rank: int) -> None:
        self._path, self._arena, self._rank = path, arena, rank
        self._cancel = threading.Event()
        self._started = time.perf_counter()
        self._result = PreloadResult(refused="not finished")
        self._thread = threading.Thread(target=self._run, name="vllm_hpc-preload", daemon=True)
        self._thread.start()

    def finish(self) -> tuple[PreloadResult, float]:
        """Wait for the read to end: its result and the seconds this call waited."""
        waited = time.perf_counter()
        self._thread.join()
        return self._result, time.perf_counter() - waited

    def cancel(self) -> None:
        """Stop the read (before its next slab) and wait for it."""
        self._cancel.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            self._result = self._read()
        except Exception as error:  # the engine core's load reads it again, or refuses it
            self._result = PreloadResult(refused=f"{type(error).__name__}: {error}")
        if self._result.refused is None:
            logger.info(
                "prefix cache file: read %.1f MiB into the host tier during start-up in %.2f s",
                self._result.nbytes / 2**20,
                self._result.seconds,
            )
        else:
            logger.debug("prefix cache file: not read during start-up: %s", self._result.refused)

    def _read(self) -> PreloadResult:
        opened = open_cache_file(self._path, None)
        if isinstance(opened, str):
            return PreloadResult(refused=opened)
        saved, grid = opened.saved, self._arena.grid
        if saved.geometry != grid.geometry:
            return PreloadResult(refused=f"host geometry {saved.geometry} differs")
        if len(saved.slabs) > grid.capacity:
            return PreloadResult(refused="the save is larger than the host tier")
        placement = file_placement(saved)
        refused = opened.read_slabs(
            self._rank,
            placement,
            slab_target(self._arena, placement),
            progress_log("reading during start-up", self._started),
            cancel=self._cancel.is_set,
        )
        return PreloadResult(
            refused,
            opened.identity,
            placement,
            len(placement) * grid.slab_bytes,
            time.perf_counter() - self._started,
        )


def slab_target(arena: HostArena, slabs: Mapping[SlabId, SlabId]) -> SlabTarget:
    """Where a read puts each saved slab: the host slab ``slabs`` maps it to, in place."""

    def target(saved: SlabId) -> memoryview:
        return memoryview(arena.slab(slabs[saved]).numpy())

    return target


def progress_log(doing: str, started: float) -> Callable[[int, int], None]:
    """Log a progress line: bytes done, time and rate (every 64 MiB and at the end)."""

    def report(done: int, total: int) -> None:
        seconds = time.perf_counter() - started
        logger.info(
            "prefix cache file: %s %.1f of %.1f MiB, %.2f s, %.0f MiB/s",
            doing,
            done / 2**20,
            total / 2**20,
            seconds,
            done / 2**20 / max(seconds, 1e-9),
        )

    return report


def tensor_parallel_rank() -> int:
    """This worker's rank: the file section it writes and reads."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
