"""The workers' half of `HybridPrefixConnector`: each step's state copies and in-pass
captures, the host tier's write-through batches and layer-pipelined restores, the disk tier's
write-behind and read batches, and the reports of which batches have landed."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context, is_forward_context_available

from vllm_hpc.derived import disk_tier_spec
from vllm_hpc.faults import SLOW_COPY_STEPS, armed
from vllm_hpc.glue.connector_metadata import (
    DiskReadReport,
    DiskWriteReport,
    HostWrite,
    StepMetadata,
    WritesLanded,
)
from vllm_hpc.glue.metrics import HybridPrefixStats
from vllm_hpc.glue.stop_signals import defer_first_stop_signal, dump_stacks_on_request
from vllm_hpc.glue.worker.call_clock import HostCallClock
from vllm_hpc.glue.worker.disk_tier import RankDiskTier
from vllm_hpc.glue.worker.host_arena import HostArena, RestoreHandle, SlabGrid
from vllm_hpc.glue.worker.host_layout import DeviceLayout
from vllm_hpc.glue.worker.in_pass import StepCaptures
from vllm_hpc.glue.worker.transfer_meter import TransferMeter
from vllm_hpc.glue.worker.write_issuer import PendingWrite, WriteIssuer
from vllm_hpc.options import PluginOptions

logger = logging.getLogger("vllm.vllm_hpc")


class CacheCopyError(RuntimeError):
    """A copy the cache planned failed in a worker; the message says what it means for the
    engine. vLLM makes a worker's error engine-wide, so the engine stops."""

    def __init__(self, what: str, error: BaseException) -> None:
        super().__init__(
            f"hybrid-prefix {what} failed in this worker ({type(error).__name__}: {error}). "
            "The engine stops; a restarted engine starts with an empty cache (its device and "
            "host copies are not reused)."
        )


_HOST_COPY = "host tier: a copy between the device and the host"
"""What failed, in a `CacheCopyError` raised by a host write, restore or prefetch."""


@dataclass(frozen=True, slots=True)
class _WritesDue:
    """A step's write-through batches, bound before its forward pass and issued after it has
    been launched, behind ``ready`` (the compute stream's position at the bind).

    They go after the launch because a prefill step's thousands of small copies, each waiting
    for the step before, fill the driver's launch queue: issued before the forward pass, the
    pass's kernels would queue behind them, and the GPU would sit idle between prefill steps
    until the copies were all submitted. vLLM starts its own connectors' asynchronous loads
    after the forward launch for the same reason. They are issued by the `WriteIssuer`'s
    thread, which is the one to wait when they fill the launch queue."""

    writes: list[HostWrite]
    ready: torch.cuda.Event | None


@dataclass(frozen=True, slots=True)
class _WriteInFlight:
    batch: int
    handle: PendingWrite
    step: int
    """The worker step that issued it (the `host_slow` fault holds its report back)."""


ONE_ENGINE_PER_PROCESS = (
    "hybrid-prefix: this engine's worker found the KV connector of an earlier hybrid-prefix "
    "engine in its process. vLLM 0.32.0 keeps one KV connector per process (an engine core "
    "run in the caller's process, VLLM_ENABLE_V1_MULTIPROCESSING=0, keeps it after its "
    "shutdown too), and this engine would lay the earlier one's state pool over its own KV "
    "cache. Run each engine core in a process of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1, "
    "vLLM's default), or shut the earlier engine down and call vLLM's "
    "ensure_kv_transfer_shutdown() before starting the next"
)
"""Raised at start-up rather than serve two engines from one cache."""


class ConnectorWorker:
    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._kv_storage: frozenset[int] | None = None
        """The KV cache buffers registered (`register_kv_caches`), by address."""
        self.meter = TransferMeter()
        """The host tier's copies, timed on their streams."""
        self.clock = HostCallClock()
        """The host tier's calls on the engine thread, timed on the wall clock."""
        self._pool: Any = None
        self._arena: HostArena | None = None
        self._issuer: WriteIssuer | None = None
        self._disk: RankDiskTier | None = None
        """The disk tier's writes and reads (None without one)."""
        self._due: _WritesDue | None = None
        self._writing: list[_WriteInFlight] = []
        self._steps = 0
        self.steps_beside_issue = 0
        """Steps bound while a write batch handed over earlier was still being issued: the
        engine thread went on instead of waiting for the issue (#48)."""
        self._restores: list[RestoreHandle] = []
        self._prefetches: list[RestoreHandle] = []
        self.issued: Counter[str] = Counter()
        """Copies this worker ran, by kind: each rank runs every step's plan on its own shard
        of the pages and states (tensor parallelism), so all ranks' counts agree."""
        self.failed: CacheCopyError | None = None
        """The copy error this worker stopped on: its host tier is not saved (§5.5)."""

    @property
    def arena(self) -> HostArena | None:
        """The host tier's slabs (None without one)."""
        return self._arena

    def stats(self) -> HybridPrefixStats | None:
        with self.clock.timed("transfer check"):
            landed = self.meter.read()
        data = {**(landed.data if landed else {}), **self.clock.read()}
        return HybridPrefixStats(data) if data else None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Lay the state pool over the KV cache buffer, then bind the host tier to both.
        Another engine's buffers are refused (`ONE_ENGINE_PER_PROCESS`)."""
        storage = frozenset(t.untyped_storage().data_ptr() for t in kv_caches.values())
        if self._kv_storage not in (None, storage):
            raise RuntimeError(ONE_ENGINE_PER_PROCESS)
        self._kv_storage = storage
        pool = self._state_pool()
        rows = pool.bind(kv_caches, self._kv_cache_config.num_blocks)
        logger.info(
            "hybrid-prefix state rows: %d rows of %d KV pages in the KV cache buffer",
            rows.num_rows,
            rows.row_pages,
        )
        options = PluginOptions.from_additional_config(self._vllm_config.additional_config)
        host_mib = options.host_tier_mib
        if not host_mib:
            return
        layout = DeviceLayout.bind(kv_caches, self._kv_cache_config.num_blocks, pool)
        grid = SlabGrid.for_budget(host_mib, layout.geometry)
        # Pinning takes seconds per 10 GiB: say so before, and how long it took after.
        logger.info(
            "hybrid-prefix host tier: allocating %d MiB (%d slabs of %.2f MiB in %d chunks)%s",
            host_mib,
            grid.capacity,
            grid.slab_bytes / 2**20,
            len(grid.chunk_slabs),
            ", pinned" if layout.device.type == "cuda" else "",
        )
        started = time.perf_counter()
        self._arena = HostArena(layout, grid)
        self._issuer = WriteIssuer(self._arena)
        logger.info(
            "hybrid-prefix host tier ready in %.1f s%s",
            time.perf_counter() - started,
            " (batched copies)" if self._arena.batched else "",
        )
        pool.restores = self._restores
        parallel = self._vllm_config.parallel_config
        disk = disk_tier_spec(options)
        if disk is not None:
            self._disk = RankDiskTier.open(
                disk.directory,
                parallel.data_parallel_index,
                tensor_parallel_rank(),
                disk.budget_bytes,
                self._arena,
            )
            if parallel.distributed_executor_backend == "mp":  # a worker process of its own
                defer_first_stop_signal(f"worker {tensor_parallel_rank()}")
                dump_stacks_on_request()

    def bind_connector_metadata(self, connector_metadata: StepMetadata) -> None:
        self.issue_writes()  # a step whose runner finalized no pass (not seen in vLLM 0.32)
        self._steps += 1
        if any(not w.handle.issued() for w in self._writing):
            self.steps_beside_issue += 1
        # Later kernels must not overtake the previous step's restores, wherever they read.
        with self.clock.timed("restore wait"):
            for handle in [*self._restores, *self._prefetches]:
                handle.wait_all()
        self._restores.clear()
        self._prefetches.clear()
        pool = self._state_pool()
        if connector_metadata.state_zeros:
            pool.zero(connector_metadata.state_zeros)
            self.issued["state_zero"] += len(connector_metadata.state_zeros)
        if connector_metadata.state_copies:
            self.issued["state_copy"] += len(connector_metadata.state_copies)
            try:
                pool.copy(connector_metadata.state_copies)
            except Exception as error:
                raise self._fail("device state pool: a copy between state slots", error) from error
        captures = connector_metadata.in_pass
        pool.in_pass = StepCaptures.build(captures, pool.device) if captures else None
        arena = self._arena
        if arena is None:
            return
        if connector_metadata.host_writes:
            self._due = _WritesDue(list(connector_metadata.host_writes), arena.mark())
        writes, reads = connector_metadata.disk_writes, connector_metadata.disk_reads
        if self._disk is not None and (writes or reads):
            with self.clock.timed("disk handover", f"{len(writes)} writes, {len(reads)} reads"):
                self._disk.submit(writes, reads)
            self.issued["disk_write"] += len(writes)
            self.issued["disk_read"] += len(reads)
        restores, prefetches = connector_metadata.host_restores, connector_metadata.prefetches
        try:
            with self.clock.timed(
                "restore issue", f"{len(restores)} restores, {len(prefetches)} prefetches"
            ):
                for restore in restores:
                    self._restores.append(
                        arena.restore(restore.blocks, restore.tail, restore.image)
                    )
                for prefetch in prefetches:
                    self._prefetches.append(arena.restore(prefetch.blocks))
        except Exception as error:
            raise self._fail(_HOST_COPY, error) from error
        self.issued["host_restore"] += len(connector_metadata.host_restores)
        self.issued["prefetch"] += len(connector_metadata.prefetches)
        for handle in [*self._restores, *self._prefetches]:
            self.meter.track("restore", handle)
        if self._restores and _full_graph_follows():
            # A FULL CUDA graph runs no Python: neither `wait_for_layer_load` nor the GDN
            # layers' `pool.wait_restored`. Such a step (a one-token resume among decodes) is
            # short; let it start behind the whole restore (stream waits, no host sync).
            for handle in self._restores:
                handle.wait_all()

    def issue_writes(self) -> None:
        """Issue the bound step's write-through batches (`_WritesDue`): after its forward pass
        has been launched, or at the latest before the next step binds."""
        due, self._due = self._due, None
        if due is None or self._arena is None or self._issuer is None:
            return
        blocks = sum(len(write.blocks) for write in due.writes)
        images = sum(len(write.images) for write in due.writes)
        try:
            with self.clock.timed("write handover", f"{blocks} blocks, {images} images"):
                for write in due.writes:
                    ranges = self._arena.prepare_write(write.blocks, write.images)
                    what = f"{len(write.blocks)} blocks, {len(write.images)} images"
                    written = self._issuer.submit(ranges, due.ready, what)
                    self._writing.append(_WriteInFlight(write.batch, written, self._steps))
                    self.issued["host_write"] += 1
                    self.meter.track("write", written)
        except Exception as error:
            raise self._fail(_HOST_COPY, error) from error

    def _fail(self, what: str, error: BaseException) -> CacheCopyError:
        self.failed = CacheCopyError(what, error)
        return self.failed

    def land_writes(self) -> None:
        """Issue the bound writes, then block until every write-through batch has landed; the
        next step reports them (an orderly stop, before the host tier is saved)."""
        self.issue_writes()
        for write in self._writing:
            write.handle.synchronize()

    def clear_connector_metadata(self) -> None:
        """After the step's forward pass: its in-pass captures are saved, and a later pass
        (a warm-up, a dummy run) must not save them again over the slots."""
        self.issue_writes()
        if self._pool is not None:
            self._pool.in_pass = None

    def build_connector_worker_meta(self) -> WritesLanded | None:
        """Report the write batches that have landed since the last step, and the disk tier's
        batches that ended (a write's CRCs or its failure, a read's failed records)."""
        held = SLOW_COPY_STEPS if armed("host_slow") else 0
        try:
            with self.clock.timed("write check"):
                landed = [
                    w for w in self._writing if w.handle.done() and self._steps - w.step >= held
                ]
        except Exception as error:  # the issuer thread's, raised by `done`
            raise self._fail(_HOST_COPY, error) from error
        disk_writes: dict[int, dict[int, DiskWriteReport]] = {}
        disk_reads: dict[int, dict[int, DiskReadReport]] = {}
        if self._disk is not None:
            with self.clock.timed("disk check"):
                rank = self._disk.rank
                writes, reads = self._disk.ended()
                disk_writes = {batch: {rank: crcs} for batch, crcs in writes.items()}
                disk_reads = {batch: {rank: failed} for batch, failed in reads.items()}
        if not landed and not disk_writes and not disk_reads:
            return None
        self._writing = [w for w in self._writing if w not in landed]
        return WritesLanded(dict.fromkeys((w.batch for w in landed), 1), disk_writes, disk_reads)

    def _state_pool(self) -> Any:
        if self._pool is None:
            from vllm_hpc.glue.worker.model import HybridPrefixGDN

            layers = self._vllm_config.compilation_config.static_forward_context.values()
            gdn = next(layer for layer in layers if isinstance(layer, HybridPrefixGDN))
            self._pool = gdn.state_pool
        return self._pool

    def wait_for_layer_load(self, layer_name: str) -> None:
        """An attention layer is about to read its KV: wait for this step's restores of it."""
        for handle in self._restores:
            handle.wait_layer(layer_name)


def _full_graph_follows() -> bool:
    """Whether the pass this step's metadata is bound for replays a FULL CUDA graph. V2 binds
    before a FULL replay outside the forward context and before other passes inside it
    (`vllm/v1/worker/gpu/model_runner.py` execute_model); V1 binds inside it, mode set."""
    if not is_forward_context_available():
        return True
    return get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.FULL


def worker_connector() -> ConnectorWorker:
    """This worker process's half of the connector (for functions the engine core runs on
    every worker through `collective_rpc`)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group().worker
    assert isinstance(connector, ConnectorWorker), "not vllm_hpc's KV connector"
    return connector


def issued_copies(worker: Any) -> dict[str, int]:
    """This worker's `ConnectorWorker.issued` (run through the engine's `collective_rpc`)."""
    return dict(worker_connector().issued)


def slow_host_calls(worker: Any) -> int:
    """This worker's host-tier calls that held the engine thread for `SLOW_CALL_SECONDS` or
    more (`HostCallClock.slow_calls`, through `collective_rpc`)."""
    return worker_connector().clock.slow_calls


def steps_beside_write_issue(worker: Any) -> int:
    """This worker's `ConnectorWorker.steps_beside_issue` (through `collective_rpc`)."""
    return worker_connector().steps_beside_issue


def slow_write_issues(worker: Any) -> int:
    """This worker's write batches whose issue took `SLOW_CALL_SECONDS` or more on the write
    issuer's thread, beside the engine thread (through `collective_rpc`; 0 without a host tier)."""
    issuer = worker_connector()._issuer
    return issuer.clock.slow_calls if issuer is not None else 0


def tensor_parallel_rank() -> int:
    """This worker's rank: the disk tier's slab file it writes and reads."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
