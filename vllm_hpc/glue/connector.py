"""The KV connector that carries each step's copies between the scheduler and the workers.

vLLM's KV-connector interface is its supported per-step channel between the scheduler and the
model runners (V1 on CPU, V2 on CUDA), in both directions. The hybrid prefix cache uses it for:

- the state-slot copies of a step (captures into snapshot slots, restores into active slots),
  which the workers run in order before the step's forward pass (`bind_connector_metadata` runs
  before the forward on both runners, also on steps without tokens), and the captures the GDN
  layers save during it (`vllm_hpc.glue.in_pass`);
- the host tier: write-through batches after them, and restores that overlap the forward pass
  (attention layers wait in `wait_for_layer_load`, GDN layers in the state pool);
- back to the scheduler: the write batches that have landed (`build_connector_worker_meta`).

Attention page copies travel in vLLM's own `kv_cache_block_copies`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.config import CUDAGraphMode
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.forward_context import get_forward_context, is_forward_context_available

from vllm_hpc.glue.host_arena import HostArena, RestoreHandle, SlabGrid, TransferHandle
from vllm_hpc.glue.host_layout import DeviceLayout
from vllm_hpc.glue.in_pass import StepCaptures
from vllm_hpc.glue.metrics import (
    HybridPrefixPromMetrics,
    HybridPrefixStats,
    TelemetryReader,
    TransferMeter,
)
from vllm_hpc.options import PluginOptions
from vllm_hpc.runtime.plan import HostRestore, HostWrite, InPassCapture, StateCopy

logger = logging.getLogger("vllm.vllm_hpc")


@dataclass
class StepMetadata(KVConnectorMetadata):
    """What the workers copy for one step (`vllm_hpc.runtime.plan`, less vLLM's page copies)."""

    state_copies: list[StateCopy] = field(default_factory=list)
    in_pass: list[InPassCapture] = field(default_factory=list)
    host_writes: list[HostWrite] = field(default_factory=list)
    host_restores: list[HostRestore] = field(default_factory=list)
    prefetches: list[HostRestore] = field(default_factory=list)


@dataclass
class WritesLanded(KVConnectorWorkerMetadata):
    """Write-through batches that have landed, with how many workers reported each."""

    batches: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, WritesLanded)
        merged = dict(self.batches)
        for batch, count in other.batches.items():
            merged[batch] = merged.get(batch, 0) + count
        return WritesLanded(merged)


class HybridPrefixConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._manager: Any = None
        self._telemetry = TelemetryReader()
        self.meter = TransferMeter()
        """Worker side: the host tier's copies, timed."""
        self._pool: Any = None
        self._arena: HostArena | None = None
        self._writing: list[tuple[int, TransferHandle]] = []
        self._restores: list[RestoreHandle] = []
        self._prefetches: list[RestoreHandle] = []
        self._landed: dict[int, int] = {}
        """Scheduler side: workers' reports of write batches not yet landed on every worker."""

    # -- scheduler side ---------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._manager = kv_cache_manager  # vllm_hpc's manager: it has no vLLM block pool

    def get_kv_connector_stats(self) -> HybridPrefixStats | None:
        """Once per step, on both sides (`vllm_hpc.glue.metrics`): the cache's counters and
        levels from the scheduler, the copies' timing from the workers; vLLM merges the two."""
        if self._manager is None:
            return self.meter.read()
        return self._telemetry.read(self._manager.cache.telemetry())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HybridPrefixStats:
        return HybridPrefixStats(data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> HybridPrefixPromMetrics:
        return HybridPrefixPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        plan = self._manager.take_worker_plan()
        return StepMetadata(
            plan.state_copies, plan.in_pass, plan.host_writes, plan.host_restores, plan.prefetches
        )

    def update_connector_output(self, connector_output: Any) -> None:
        """Write batches every worker has landed complete in the index."""
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, WritesLanded):
            return
        workers = self._vllm_config.parallel_config.world_size
        done = []
        for batch, count in meta.batches.items():
            self._landed[batch] = self._landed.get(batch, 0) + count
            if self._landed[batch] >= workers:
                done.append(batch)
                del self._landed[batch]
        self._manager.cache.complete_writes(done)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # nothing is handed off: a cache

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Bind the host tier to the attention KV caches and the state pool."""
        options = PluginOptions.from_additional_config(self._vllm_config.additional_config)
        host_mib = options.host_tier_mib
        if not host_mib:
            return
        pool = self._state_pool()
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
        logger.info("hybrid-prefix host tier ready in %.1f s", time.perf_counter() - started)
        pool.restores = self._restores

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, StepMetadata)
        # Later kernels must not overtake the previous step's restores, wherever they read.
        for handle in [*self._restores, *self._prefetches]:
            handle.wait_all()
        self._restores.clear()
        self._prefetches.clear()
        pool = self._state_pool()
        if connector_metadata.state_copies:
            pool.copy(connector_metadata.state_copies)
        captures = connector_metadata.in_pass
        pool.in_pass = StepCaptures.build(captures, pool.device) if captures else None
        arena = self._arena
        if arena is None:
            return
        for write in connector_metadata.host_writes:
            self._writing.append((write.batch, arena.write(write.blocks, write.images)))
            self.meter.track("write", self._writing[-1][1])
        for restore in connector_metadata.host_restores:
            self._restores.append(arena.restore(restore.blocks, restore.tail, restore.image))
        for prefetch in connector_metadata.prefetches:
            self._prefetches.append(arena.restore(prefetch.blocks))
        for handle in [*self._restores, *self._prefetches]:
            self.meter.track("restore", handle)
        if self._restores and _full_graph_follows():
            # A FULL CUDA graph runs no Python: neither `wait_for_layer_load` nor the GDN
            # layers' `pool.wait_restored`. Such a step (a one-token resume among decodes) is
            # short; let it start behind the whole restore (stream waits, no host sync).
            for handle in self._restores:
                handle.wait_all()

    def clear_connector_metadata(self) -> None:
        """After the step's forward pass: its in-pass captures are saved, and a later pass
        (a warm-up, a dummy run) must not save them again over the slots."""
        super().clear_connector_metadata()
        if self._pool is not None:
            self._pool.in_pass = None

    def build_connector_worker_meta(self) -> WritesLanded | None:
        """Report the write batches that have landed since the last step."""
        landed = [batch for batch, handle in self._writing if handle.done()]
        if not landed:
            return None
        self._writing = [(b, h) for b, h in self._writing if b not in landed]
        return WritesLanded(dict.fromkeys(landed, 1))

    def _state_pool(self) -> Any:
        if self._pool is None:
            from vllm_hpc.glue.model import HybridPrefixGDN

            layers = self._vllm_config.compilation_config.static_forward_context.values()
            gdn = next(layer for layer in layers if isinstance(layer, HybridPrefixGDN))
            self._pool = gdn.state_pool
        return self._pool

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """An attention layer is about to read its KV: wait for this step's restores of it."""
        for handle in self._restores:
            handle.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def _full_graph_follows() -> bool:
    """Whether the pass this step's metadata is bound for replays a FULL CUDA graph. V2 binds
    before a FULL replay outside the forward context and before other passes inside it
    (`vllm/v1/worker/gpu/model_runner.py` execute_model); V1 binds inside it, mode set."""
    if not is_forward_context_available():
        return True
    return get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.FULL
