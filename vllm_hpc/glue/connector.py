"""The KV connector that carries each step's state copies from the scheduler to the workers.

vLLM's KV-connector interface is its supported per-step channel between the scheduler and the
model runners (V1 on CPU, V2 on CUDA). The hybrid prefix cache uses it for one thing: the
state-slot copies of a step (captures into snapshot slots, restores into active slots), which
the workers run in order before the step's forward pass (`bind_connector_metadata` runs before
the forward on both runners, also on steps without tokens). Attention page copies travel in
vLLM's own `kv_cache_block_copies`. It moves no KV to or from anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from vllm_hpc.glue.metrics import HybridPrefixPromMetrics, HybridPrefixStats, TelemetryReader
from vllm_hpc.runtime.plan import StateCopy


@dataclass
class StateCopyMetadata(KVConnectorMetadata):
    state_copies: list[StateCopy] = field(default_factory=list)


class HybridPrefixConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._manager: Any = None
        self._telemetry = TelemetryReader()
        self._pool: Any = None

    # -- scheduler side ---------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._manager = kv_cache_manager  # vllm_hpc's manager: it has no vLLM block pool

    def get_kv_connector_stats(self) -> HybridPrefixStats | None:
        """The cache's counters and levels, once per step (`vllm_hpc.glue.metrics`). vLLM asks
        both sides; only the scheduler side has a cache."""
        if self._manager is None:
            return None
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

    def build_connector_meta(self, scheduler_output: Any) -> StateCopyMetadata:
        return StateCopyMetadata(self._manager.take_state_copies())

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # nothing is handed off: a cache

    # -- worker side ------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, StateCopyMetadata)
        if connector_metadata.state_copies:
            self._state_pool().copy(connector_metadata.state_copies)

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
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
