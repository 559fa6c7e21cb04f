"""The host tier's copy batches, timed in the worker: seconds and bandwidth for the stats that
vLLM carries to the front end (`vllm_hpc.glue.metrics`)."""

from __future__ import annotations

from typing import Protocol

from vllm_hpc.glue.metrics import HybridPrefixStats
from vllm_hpc.glue.worker.host_arena import CopyTiming


class CopyBatch(Protocol):
    """A batch in flight: a `TransferHandle`, or a `PendingWrite` the issuer thread holds."""

    nbytes: int

    @property
    def timing(self) -> CopyTiming: ...

    def done(self) -> bool: ...


class TransferMeter:
    """Worker side: the host tier's copy batches that have landed, as seconds and bandwidth."""

    def __init__(self) -> None:
        self._pending: list[tuple[str, CopyBatch]] = []
        self.totals: dict[str, tuple[int, float]] = {"write": (0, 0.0), "restore": (0, 0.0)}
        """Bytes and seconds of every batch read so far, by kind (benchmarks read these)."""

    def track(self, kind: str, handle: CopyBatch) -> None:
        """``kind``: "write" or "restore" (prefetches are restores)."""
        if handle.nbytes:
            self._pending.append((kind, handle))

    def read(self) -> HybridPrefixStats | None:
        """The batches that landed since the last read, or None if none did."""
        landed: list[tuple[str, CopyBatch]] = []
        waiting: list[tuple[str, CopyBatch]] = []
        for entry in self._pending:
            (landed if entry[1].done() else waiting).append(entry)
        self._pending = waiting
        if not landed:
            return None
        data: dict[str, float] = {}
        for kind in ("write", "restore"):
            handles = [handle for k, handle in landed if k == kind]
            if not handles:
                continue
            seconds = sum(handle.timing.seconds() for handle in handles)
            nbytes = sum(handle.nbytes for handle in handles)
            total_bytes, total_seconds = self.totals[kind]
            self.totals[kind] = (total_bytes + nbytes, total_seconds + seconds)
            data[f"host_{kind}_seconds"] = seconds
            if seconds > 0:
                data[f"host_{kind}_bytes_per_second"] = nbytes / seconds
        return HybridPrefixStats(data)
