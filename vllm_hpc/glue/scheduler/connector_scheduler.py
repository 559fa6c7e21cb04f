"""The scheduler's half of `HybridPrefixConnector`: it hands each step's worker plan to the
workers and completes the write batches every worker has landed (the disk tier's, and its
reads, through its journal, `disk_tier.py`); it lets a request waiting for a disk read step
aside; it reports the cache's counters and levels."""

from __future__ import annotations

from typing import Any

from vllm_hpc.glue.connector_metadata import (
    CheckedDiskRead,
    DiskReadReport,
    DiskWriteReport,
    StepMetadata,
    WritesLanded,
)
from vllm_hpc.glue.metrics import HybridPrefixStats
from vllm_hpc.runtime.telemetry import COUNTERS, LEVELS


class ConnectorScheduler:
    def __init__(self, world_size: int) -> None:
        self._world_size = world_size
        self._manager: Any = None
        self._telemetry = TelemetryReader()
        self._landed: dict[int, int] = {}
        """Workers' reports of write batches not yet landed on every worker."""
        self._disk_ended: dict[int, dict[int, DiskWriteReport]] = {}
        """Workers' reports of write-behind batches, by batch and rank, until every rank's."""
        self._disk_read_ended: dict[int, dict[int, DiskReadReport]] = {}
        """Workers' reports of disk reads, by batch and rank, until every rank's."""

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._manager = kv_cache_manager  # vllm_hpc's manager: it has no vLLM block pool

    def get_num_new_matched_tokens(self, request: Any) -> tuple[int | None, bool]:
        """No external tokens: the cache's hits are the manager's. None ("not yet") while the
        request's prefix is being read from the disk tier: vLLM then keeps it in its place in
        the queue, allocates nothing and schedules the requests behind it; a request bounded
        in what it reads is answered 0 by vLLM whatever this says, and waits in
        `Admission.admit` instead."""
        if self._manager.disk_wait(request.request_id):
            return None, False
        return 0, False

    def stats(self) -> HybridPrefixStats | None:
        if self._manager is None:  # asked before the scheduler built its manager
            return None
        return self._telemetry.read(self._manager.cache.telemetry())

    def build_connector_meta(self) -> StepMetadata:
        """The step's plan for the workers; first, the disk tier journals what changed, so
        that what the plan overwrites on disk is journaled as dropped (`DiskTier.step`)."""
        plan = self._manager.take_worker_plan()
        disk_tier = self._manager.disk_tier
        reads: list[CheckedDiskRead] = []
        if disk_tier is not None:
            ended = {b: r for b, r in self._disk_ended.items() if len(r) >= self._world_size}
            for batch in ended:
                del self._disk_ended[batch]
            disk_tier.step(ended)
            reads = [disk_tier.checked(read) for read in plan.disk_reads]
        return StepMetadata(
            plan.state_zeros,
            plan.state_copies,
            plan.in_pass,
            plan.host_writes,
            plan.host_restores,
            plan.prefetches,
            plan.disk_writes,
            reads,
        )

    def update_connector_output(self, connector_output: Any) -> None:
        """Write batches every worker has landed complete in the index, and so do disk reads
        every worker has reported (the next step's lookups find them on the host)."""
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, WritesLanded):
            return
        done = []
        for batch, count in meta.batches.items():
            self._landed[batch] = self._landed.get(batch, 0) + count
            if self._landed[batch] >= self._world_size:
                done.append(batch)
                del self._landed[batch]
        self._manager.cache.complete_writes(done)
        for batch, ranks in meta.disk.items():
            self._disk_ended.setdefault(batch, {}).update(ranks)
        for batch, failed in meta.disk_reads.items():
            reported = self._disk_read_ended.setdefault(batch, {})
            reported.update(failed)
            if len(reported) >= self._world_size:
                del self._disk_read_ended[batch]
                self._manager.disk_tier.read_ended(batch, reported)


class TelemetryReader:
    """Turns the cache's cumulative counters into per-step increments."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def read(self, values: dict[str, int]) -> HybridPrefixStats | None:
        data: dict[str, int] = {m.name: values[m.name] for m in LEVELS}
        changed = False
        for metric in COUNTERS:
            delta = values[metric.name] - self._last.get(metric.name, 0)
            data[metric.name] = delta
            changed |= delta != 0
        if not changed and all(values[m.name] == self._last.get(m.name) for m in LEVELS):
            return None
        self._last = dict(values)
        return HybridPrefixStats(data)
