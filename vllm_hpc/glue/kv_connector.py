"""The KV connector that carries each step's copies between the scheduler and the workers.

vLLM's KV-connector interface is its supported per-step channel between the scheduler and the
model runners (V1 on CPU, V2 on CUDA), in both directions. The hybrid prefix cache uses it for:

- the state-row copies of a step (captures into snapshot slots, restores into the requests' rows),
  which the workers run in order before the step's forward pass (`bind_connector_metadata` runs
  before the forward on both runners, also on steps without tokens), and the captures the GDN
  layers save during it (`vllm_hpc.glue.worker.in_pass`);
- the host tier: write-through batches after them, and restores that overlap the forward pass
  (attention layers wait in `wait_for_layer_load`, GDN layers in the state pool);
- back to the scheduler: the write batches that have landed (`build_connector_worker_meta`);
- a waiting request whose prefix is being read from the disk tier steps aside
  (`get_num_new_matched_tokens` answers "not yet"), so the requests behind it are scheduled.

Attention page copies travel in vLLM's own `kv_cache_block_copies`.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from vllm_hpc.glue.connector_metadata import StepMetadata, WritesLanded
from vllm_hpc.glue.metrics import HybridPrefixPromMetrics, HybridPrefixStats


class HybridPrefixConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's connector interface, dispatched by role to its scheduler half
    (`scheduler/connector_scheduler.py`) or its workers' half (`worker/connector_worker.py`), as
    each process builds one of them."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.scheduler: Any = None
        self.worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            from vllm_hpc.glue.scheduler.connector_scheduler import ConnectorScheduler

            self.scheduler = ConnectorScheduler(vllm_config.parallel_config.world_size)
        else:
            from vllm_hpc.glue.worker.connector_worker import ConnectorWorker

            self.worker = ConnectorWorker(vllm_config, kv_cache_config)

    def get_kv_connector_stats(self) -> HybridPrefixStats | None:
        """Once per step, on both sides (`vllm_hpc.glue.metrics`): the cache's counters and
        levels from the scheduler, the copies' timing from the workers; vLLM merges the two."""
        return (self.scheduler or self.worker).stats()

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

    # -- scheduler side ---------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        return self.scheduler.build_connector_meta()

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # nothing is handed off: a cache

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, StepMetadata)
        self.worker.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.worker.clear_connector_metadata()

    def build_connector_worker_meta(self) -> WritesLanded | None:
        return self.worker.build_connector_worker_meta()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        """After the forward pass is launched: the step's write-through batches go now."""
        self.worker.issue_writes()
